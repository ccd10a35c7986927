"""What `check` says about a torchrun launch: ranks, what distribution adds to each device's memory, busy time and
the bottleneck (analysis/launch.py), and what `run` refuses before any process group exists."""

import json

import pytest

from dflash_graph.analysis.launch import analyze_launch, step_flops
from dflash_graph.analysis.nodecost import grad_nodes, node_cost
from dflash_graph.cli.main import main
from dflash_graph.errors import GraphError
from dflash_graph.rewrite.pipeline import compile_graph
from dflash_graph.units import parse_bytes, parse_rate

RANK_MAP = ["devices.t0.rank=0", "devices.t1.rank=0", "devices.draft.rank=1"]


def check_json(capsys, *args):
    code = main(["check", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_one_rank_per_device_in_the_order_of_devices(in_repo, capsys):
    code, out = check_json(capsys, "graphs/tiny.toml")
    assert code == 0
    launch = out["launch"]
    assert launch["world_size"] == 3 and launch["backend"] == "gloo"
    assert {d: v["rank"] for d, v in launch["devices"].items()} == {"t0": 0, "t1": 1, "draft": 2}
    assert launch["devices"]["draft"]["peers"] == [0, 1]
    # 6 transfers per replica cross from a target rank to the drafter rank
    assert launch["send_recv"] == 12


def test_a_declared_rank_map_shares_a_process(in_repo):
    plan = compile_graph("graphs/tiny.toml", RANK_MAP)
    L = analyze_launch(plan.typed)
    assert L.world_size == 2
    assert L.rank_devices(0) == ["t0", "t1"]
    assert {(t.src_rank, t.dst_rank) for t in L.transfers} == {(0, 1)}
    assert L.rank_busy()[0] == pytest.approx(L.devices["t0"].busy_seconds + L.devices["t1"].busy_seconds)


@pytest.mark.parametrize("sets, message", [
    (["devices.t0.rank=0"], "device 't1' has no rank, but t0 declares one"),
    (["devices.t0.rank=0", "devices.t1.rank=2", "devices.draft.rank=2"], "rank 1 owns no device"),
    (["devices.t0.throughput=fast"], "expected a positive compute rate such as '400 TFLOP/s'"),
    (["launch.stall_timeout=0"], "stall_timeout must be between 0 and 86400 seconds"),
])
def test_bad_launch_declarations_are_located(in_repo, capsys, sets, message):
    code = main(["check", "graphs/tiny.toml", *[x for s in sets for x in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_nccl_memory_is_outside_the_allocator_per_peer(in_repo):
    plan = compile_graph("graphs/qwen27b.toml")
    L = analyze_launch(plan.typed)
    spec = plan.typed.ctx.spec
    per_peer = spec.launch.nccl_memory_per_peer
    assert L.devices["gpu7"].peers == tuple(range(7)) and L.devices["gpu7"].nccl_bytes == 7 * per_peer
    assert L.devices["gpu0"].nccl_bytes == per_peer
    for name, d in plan.memory.devices.items():
        dev = spec.devices[name]
        assert d.usable_bytes == dev.capacity - dev.outside_allocator - L.devices[name].nccl_bytes
    more = compile_graph("graphs/qwen27b.toml", ["launch.nccl_memory_per_peer=1 GiB"])
    assert more.memory.devices["gpu7"].usable_bytes == plan.memory.devices["gpu7"].usable_bytes - 7 * (2**30 - per_peer)


def test_cpu_devices_have_no_nccl_memory(in_repo):
    L = analyze_launch(compile_graph("graphs/tiny.toml").typed)
    assert all(d.nccl_bytes == 0 for d in L.devices.values())


def test_the_receive_queue_is_q_buffers_per_incoming_transfer(in_repo):
    typed = compile_graph("graphs/qwen27b.toml").typed
    L = analyze_launch(typed)
    from dflash_graph.ir.graph import Ref

    incoming = {t.node for t in L.transfers if t.dst_device == "gpu7"}
    expected = sum(7 * typed.types[Ref(n, "out")].nbytes for n in incoming)
    assert L.devices["gpu7"].receive_queue_bytes == expected


def test_busy_time_counts_forward_and_backward_flops_per_execution(in_repo):
    """The drafter device runs its nodes once per replica; a node with trainable weights costs 3x its forward
    (forward + 2x backward), another node on the gradient path 2x, the rest 1x."""
    typed = compile_graph("graphs/tiny.toml").typed
    grads = grad_nodes(typed)
    expected = {"t0": 0, "t1": 0, "draft": 0}
    for n in typed.graph.nodes:
        f = node_cost(typed, n, n.id in grads).flops
        if n.id in grads:
            f *= 3 if n.model == "drafter" and n.op == "drafter_forward" else 2
        if n.device == "targets":
            expected["t0"] += f
            expected["t1"] += f
        else:
            expected[n.device] += 2 * f          # two replicas
    assert step_flops(typed) == expected
    L = analyze_launch(typed)
    assert L.devices["draft"].busy_seconds == pytest.approx(expected["draft"] / parse_rate("5 GFLOP/s"))


def test_check_names_the_27b_bottleneck(in_repo, capsys):
    """With the same throughput everywhere, each target's forward over 65,536 tokens outweighs the drafter's
    seven forward + backward passes over 8,192 anchored positions: the seven targets bound the step."""
    code = main(["check", "graphs/qwen27b.toml"])
    text = capsys.readouterr().out
    assert code == 0
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("bottleneck:"))
    assert line.strip().startswith("bottleneck: ranks 0-6 (gpu0..gpu6)") and "rank 7 (gpu7)" in line
    L = analyze_launch(compile_graph("graphs/qwen27b.toml").typed)
    ranks, t = L.bottleneck()
    assert ranks == list(range(7)) and L.rank_busy()[7] < t
    assert "NCCL" in text and "rank" in text.split("launch:")[1].splitlines()[1]


def test_without_a_throughput_busy_time_is_not_guessed(in_repo, capsys):
    from pathlib import Path

    from dflash_graph.analysis.infer import build, infer
    from dflash_graph.spec.loader import parse_graph

    text = Path("graphs/tiny.toml").read_text().replace('throughput = "5 GFLOP/s"\n', "")
    L = analyze_launch(infer(*build(parse_graph(text, "graphs/tiny.toml", Path("graphs")))))
    assert L.bottleneck() is None and all(d.busy_seconds is None for d in L.devices.values())


def test_run_refuses_a_launch_it_cannot_run(in_repo, monkeypatch):
    from dflash_graph.exec.distributed import check_launch

    typed = compile_graph("graphs/tiny.toml").typed
    L = analyze_launch(typed)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(GraphError) as e:
        check_launch(typed, L, {2})
    assert "torchrun started 2 processes, but the graph's devices map to 3 rank(s)" in str(e.value)
    assert "--nproc-per-node 3" in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "3")
    check_launch(typed, L, {2})
    odd = compile_graph("graphs/tiny.toml", ["nodes.ids_tx.params.queue=2"]).typed
    with pytest.raises(GraphError) as e:
        check_launch(odd, analyze_launch(odd), {2})
    assert "different queue depths [1, 2]" in str(e.value)
    with pytest.raises(GraphError) as e:
        check_launch(typed, L, {0, 2})
    assert "one rank must own all of them" in str(e.value)


def test_units():
    assert parse_rate("400 TFLOP/s") == 4e14 and parse_rate("5 GFLOP/s") == 5e9
    assert parse_bytes("256 MiB") == 256 * 2**20
    with pytest.raises(ValueError):
        parse_rate("-1 TFLOP/s")
