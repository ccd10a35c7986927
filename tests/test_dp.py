"""A data-parallel drafter (`[models.drafter] parallel = "ddp"`) under torchrun on CPU (gloo): graphs/tiny_dp.toml
(2 targets feeding 2 drafter ranks, 4 ranks) and graphs/tiny_colocated.toml (2 ranks, each target + drafter) give
the per-step losses and gradient norms of graphs/tiny.toml in one process, the same global batch, exactly: with 2
drafter replicas and grad_accum = 1 the gradient all-reduce adds two addends, whose sum does not depend on the
order, and every scale is a power of two (docs/distributed.md, "Data-parallel drafters"). A run saved on 2 drafter
ranks (a DCP checkpoint) resumes on 1, and the other way round; a killed drafter rank stops every rank, named.
With parallel = "fsdp" (FSDP2, the drafter sharded over its ranks) the same runs agree up to fp32 rounding.

Every launch runs in its own session and is killed with its whole process group when the test ends, pass or fail
(tests/test_distributed.py's `launched`).
"""

import contextlib
import json
import os
import signal
import sys
import time

import pytest

from dflash_graph.cli.main import main

from test_distributed import ROOT, ctrl_c_after_step_2, free_port, launched, session, session_gone, torchrun
from test_run import read_metrics


def _same(a, b, steps):
    """Per step: loss and gradient norm equal (the tolerance is 0: see the module docstring)."""
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):
        assert (ra["loss"], ra["grad_norm"]) == (rb["loss"], rb["grad_norm"]), (ra["step"], ra["loss"], rb["loss"])


@pytest.mark.slow     # about 40 s on the shared 2-core machine, most of it two processes importing torch
def test_tiny_colocated_on_two_ranks_equals_one_process(in_repo, tmp_path):
    one, co = tmp_path / "one", tmp_path / "co"
    small = ["--set", "dims.seq=128", "--set", "dims.anchors=8"]
    assert main(["run", "graphs/tiny.toml", "--steps", "2", "--out", str(one), "--no-progress", *small]) == 0
    code, out = torchrun(2, ["graphs/tiny_colocated.toml", "--steps", "2", "--out", str(co), *small], timeout=240)
    assert code == 0, out
    _same(read_metrics(one), read_metrics(co), 2)
    assert all(set(r["ranks"]) == {"0", "1"} and r["ranks"]["1"]["busy_s"] > 0 for r in read_metrics(co))
    ck = co / "checkpoint"
    assert (ck / "drafter.dcp" / ".metadata").is_file() and (ck / "drafter.safetensors").is_file()
    assert sorted(p.name for p in (ck / "drafter.dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (co / "export").is_dir()


@pytest.mark.slow
def test_tiny_dp_on_four_ranks_equals_one_process_and_resumes_on_one_drafter_rank(in_repo, tmp_path):
    """Steps 1-2 on 2 drafter ranks (tiny_dp, 4 ranks), steps 3-4 resumed from its DCP checkpoint on 1 drafter
    rank (tiny.toml, 3 ranks): the losses of 4 steps of tiny.toml in one process."""
    one, dp = tmp_path / "one", tmp_path / "dp"
    assert main(["run", "graphs/tiny.toml", "--steps", "4", "--out", str(one), "--no-progress"]) == 0
    code, out = torchrun(4, ["graphs/tiny_dp.toml", "--steps", "2", "--out", str(dp)])
    assert code == 0, out
    assert set(read_metrics(dp)[0]["ranks"]) == {"0", "1", "2", "3"}
    assert json.loads((dp / "ranks" / "rank2.json").read_text())["writer"] is True
    assert not json.loads((dp / "ranks" / "rank3.json").read_text())["writer"]
    code, out = torchrun(3, ["graphs/tiny.toml", "--steps", "4", "--out", str(dp), "--resume", str(dp)])
    assert code == 0, out
    assert "the layout changed" in out
    _same(read_metrics(one), read_metrics(dp), 4)


@pytest.mark.slow
def test_a_one_rank_checkpoint_resumes_on_two_drafter_ranks(in_repo, tmp_path):
    """The other way: a checkpoint of one drafter rank (the whole optimizer in trainer.pt) resumed in one process
    on tiny_dp's 2 drafter devices, then under torchrun on its 2 drafter ranks."""
    one, run = tmp_path / "one", tmp_path / "run"
    assert main(["run", "graphs/tiny.toml", "--steps", "3", "--out", str(one), "--no-progress"]) == 0
    assert main(["run", "graphs/tiny.toml", "--steps", "1", "--out", str(run), "--no-progress"]) == 0
    assert main(["run", "graphs/tiny_dp.toml", "--steps", "2", "--resume", str(run), "--no-progress"]) == 0
    code, out = torchrun(4, ["graphs/tiny_dp.toml", "--steps", "3", "--resume", str(run)])
    assert code == 0, out
    _same(read_metrics(one), read_metrics(run), 3)


def _close(a, b, steps):
    """Per step: loss and gradient norm equal up to fp32 rounding, as metrics.jsonl records them (6 and 4
    decimals): within one unit of the last recorded decimal, plus 1e-6 relative."""
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):
        for k, unit in (("loss", 1e-6), ("grad_norm", 1e-4)):
            assert abs(ra[k] - rb[k]) <= unit + 1e-6 * abs(ra[k]), (ra["step"], k, ra[k], rb[k])


def _weights_close(one, other, rel):
    """The drafter's weights of two checkpoints: the largest difference over each tensor's largest |w|."""
    from safetensors.torch import load_file

    a, b = (load_file(str(d / "checkpoint" / "drafter.safetensors")) for d in (one, other))
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a)
    assert worst <= rel, worst
    return worst


@pytest.mark.slow     # about 100 s on the shared 2-core machine (3 launches, 4 steps in one process)
def test_tiny_dp_sharded_with_fsdp_equals_one_process_and_resumes_on_one_drafter_rank(in_repo, tmp_path):
    """parallel = "fsdp" (FSDP2 fully_shard, each drafter rank 1/2 of the weights, gradients and AdamW state):
    steps 1-2 on tiny_dp's 2 drafter ranks, steps 3-4 resumed from its DCP checkpoint on tiny.toml's one drafter
    rank, against 4 steps of tiny.toml in one process. The tolerance is fp32 rounding: the losses and gradient norms
    as metrics.jsonl records them (`_close`), and the weights after step 4 within 1e-5 of each tensor's largest |w|
    (measured: 2.2e-6 after 3 steps). Not bit for bit, unlike DDP: the clip's
    gradient norm is summed shard by shard and then over the ranks, another order than one process's."""
    one, dp = tmp_path / "one", tmp_path / "dp"
    assert main(["run", "graphs/tiny.toml", "--steps", "4", "--out", str(one), "--no-progress"]) == 0
    fsdp = ["--set", "models.drafter.parallel=fsdp"]
    # a checkpoint at step 1 too: saved mid-run, while the memory tracker watches every tensor made
    code, out = torchrun(4, ["graphs/tiny_dp.toml", *fsdp, "--set", "train.checkpoint_every=1", "--steps", "2",
                             "--out", str(dp)])
    assert code == 0, out
    _close(read_metrics(one)[:2], read_metrics(dp), 2)
    ck = dp / "checkpoint"
    # each drafter rank wrote its own shard of the masters and AdamW state; the writer the whole weights
    assert sorted(p.name for p in (ck / "drafter.dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (ck / "drafter.safetensors").is_file() and (dp / "export" / "model.safetensors").is_file()
    code, out = torchrun(3, ["graphs/tiny.toml", "--steps", "4", "--out", str(dp), "--resume", str(dp)])
    assert code == 0, out
    assert "the layout changed" in out
    _close(read_metrics(one), read_metrics(dp), 4)
    print(f"\nfsdp on 2 drafter ranks, resumed on 1: weights after step 4 within {_weights_close(one, dp, 1e-5):.2g} "
          "of one process's")


@pytest.mark.slow
def test_a_one_rank_checkpoint_resumes_sharded_on_two_drafter_ranks(in_repo, tmp_path):
    """The other way: one process's checkpoint (the whole optimizer in trainer.pt) resumed on tiny_dp's 2 drafter
    ranks with parallel = "fsdp", each rank taking its shard of the weights, masters and AdamW state."""
    one, run = tmp_path / "one", tmp_path / "run"
    assert main(["run", "graphs/tiny.toml", "--steps", "3", "--out", str(one), "--no-progress"]) == 0
    assert main(["run", "graphs/tiny.toml", "--steps", "1", "--out", str(run), "--no-progress"]) == 0
    code, out = torchrun(4, ["graphs/tiny_dp.toml", "--set", "models.drafter.parallel=fsdp", "--steps", "3",
                             "--resume", str(run)])
    assert code == 0, out
    _close(read_metrics(one), read_metrics(run), 3)
    _weights_close(one, run, 1e-5)


def test_a_trainable_model_on_two_ranks_without_parallel_is_refused_with_the_fix(in_repo, tmp_path, monkeypatch,
                                                                                  capsys):
    from dflash_graph.exec import distributed as D

    monkeypatch.setattr(D.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(D.signal, "signal", lambda *a: None)
    for k, v in {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    text = (in_repo / "graphs" / "tiny_dp.toml").read_text().replace('"tiny/', f'"{in_repo}/graphs/tiny/')
    graph = tmp_path / "no_parallel.toml"
    graph.write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith("parallel =")))
    with pytest.raises(SystemExit) as e:
        main(["run", str(graph), "--out", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    # check refuses it first, at the node that places the trainable model on a group (analysis/parallel.py);
    # run's launch check (exec/distributed.check_launch) would refuse it at the model otherwise
    assert "node 'drafter' trains model 'drafter' and is placed on group 'drafters'" in err, err
    assert 'declare parallel = "ddp" or "fsdp" in [models.drafter]' in err, err


@pytest.mark.slow
def test_a_killed_drafter_rank_stops_every_rank_named(in_repo, tmp_path):
    """SIGKILL of drafter rank 3 (d1) after step 2: every other rank (both targets and the other drafter
    replica, which waits in the gradient all-reduce or the step's gather) names it and exits, within 60 s, and no
    process of the launch is left."""
    out = tmp_path / "run"
    with launched(["--standalone", "--nproc-per-node", "4"],
                  ["graphs/tiny_dp.toml", "--steps", "500", "--out", str(out)]) as p:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2):
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "the run never reached step 2"
            time.sleep(0.2)
        pids = [json.loads((out / "ranks" / f"rank{k}.json").read_text())["pid"] for k in range(4)]
        os.kill(pids[3], signal.SIGKILL)
        t0 = time.monotonic()
        text, _ = p.communicate(timeout=120)
        elapsed = time.monotonic() - t0
        gone = session_gone(p.pid)
    print(f"\nSIGKILL of drafter rank 3: torchrun exited {p.returncode} after {elapsed:.1f} s")
    assert p.returncode != 0 and elapsed < 60
    assert gone, "a process of the run is still alive"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    reports = [ln for ln in text.splitlines() if ln.startswith("dflash-graph: rank")]
    assert {ln.split()[2] for ln in reports} == {"0", "1", "2"}, text
    for ln in reports:
        assert "lost rank 3 (d1; pid" in ln and "killed (SIGKILL" in ln, ln
    writer = next(ln for ln in reports if ln.startswith("dflash-graph: rank 2 (d0)"))
    assert "checkpoint of step" in writer and "--resume" in writer, writer


@pytest.mark.slow     # about 60 s on the shared 2-core machine
def test_tiny_dp_on_two_nodes_through_a_c10d_rendezvous(in_repo, tmp_path):
    """Two torchrun launches (--nnodes 2, 2 processes each) meeting at a c10d rendezvous on 127.0.0.1, with a rank
    map that puts a target and a drafter replica on each "node" (t0, d0 on node 0; t1, d1 on node 1): every batch
    stays on its node and the drafter's gradient all-reduce crosses them. The losses and gradient norms are those
    of tiny.toml in one process, exactly (2 addends, as on one machine)."""
    one, out = tmp_path / "one", tmp_path / "n"
    assert main(["run", "graphs/tiny.toml", "--steps", "2", "--out", str(one), "--no-progress"]) == 0
    port = free_port()
    rdzv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "dp"]
    ranks = [x for d, k in (("t0", 0), ("d0", 1), ("t1", 2), ("d1", 3)) for x in ("--set", f"devices.{d}.rank={k}")]
    args = ["graphs/tiny_dp.toml", *ranks, "--steps", "2", "--out", str(out)]
    with launched([*rdzv, "--node-rank", "0"], args) as a, launched([*rdzv, "--node-rank", "1"], args) as b:
        ta, _ = a.communicate(timeout=300)
        tb, _ = b.communicate(timeout=300)
        assert a.returncode == 0 and b.returncode == 0, ta + tb
    _same(read_metrics(one), read_metrics(out), 2)
    mem = json.loads((out / "memory.json").read_text())
    assert {d: v["rank"] for d, v in mem["devices"].items()} == {"t0": 0, "d0": 1, "t1": 2, "d1": 3}
    assert json.loads((out / "ranks" / "rank1.json").read_text())["writer"] is True



@contextlib.contextmanager
def tiny_dp_drafter(typed, engine: str, tmp_path):
    """tiny_dp's drafter wrapped as the trainer wraps it, on a process group of its own for the with-block: DDP's
    on a 1-process gloo group, FSDP2's (train/trainer.py _shard_fsdp) on torch's fake group of 2 ranks."""
    import types

    import torch
    import torch.distributed as dist

    from dflash_graph.models.nn.dflash import DFlashDrafter
    from dflash_graph.train.trainer import Trainer

    dims = typed.ctx.models["drafter"].dims
    if engine == "fsdp":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        drafter = DFlashDrafter(dims, torch.nn.Embedding(dims.vocab_size, dims.hidden_size), own_norm=False)
        if engine == "fsdp":
            Trainer._shard_fsdp(types.SimpleNamespace(store=types.SimpleNamespace(drafters={"drafter": drafter}),
                                                      dp_group=dist.group.WORLD))
        yield drafter
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_the_tracker_measures_what_check_counts_for_a_data_parallel_drafter(in_repo, tmp_path, engine):
    """tiny_dp's drafter wrapped as the trainer wraps it (DistributedDataParallel on a 1-process gloo group; FSDP2's
    fully_shard per layer and at the root on torch's fake process group of tiny_dp's 2 drafter ranks, where no
    collective runs), one AdamW step, gradients dropped: the live bytes the tracker (exec/memtrack.py) measures on
    d0 equal the drafter's resident bytes that check counts there (analysis/memory.py NOTE [Data-parallel memory]:
    weights or their 1/M shards, AdamW's two moments, DDP's gradient buckets) byte for byte, plus AdamW's step
    counters (a float32 scalar per parameter, torch/optim/adam.py _init_group; check does not count them: on CUDA
    they stay on the host). Sharded, the moments are DTensors whose local tensors are made inside DTensor's own
    dispatch, which a dispatch mode does not see: before the tracker counted a wrapper's inner tensors it measured
    the weights' shards alone here."""
    import torch

    from dflash_graph.analysis.memory import device_events
    from dflash_graph.exec.memtrack import LiveTracker
    from dflash_graph.rewrite.pipeline import compile_graph

    typed = compile_graph("graphs/tiny_dp.toml", [f"models.drafter.parallel={engine}"]).typed
    events, _ = device_events(typed, "d0")
    predicted = sum(e.size for e in events if e.op == "alloc" and e.label.startswith(
        ("load/weights drafter.", "load/AdamW", "load/DDP")))
    with tiny_dp_drafter(typed, engine, tmp_path) as drafter:
        params = [p for p in drafter.parameters() if p.requires_grad]
        tr = LiveTracker()
        for p in params:    # as the interpreter charges them (ModelStore.resident): a shard's local tensor
            tr.adopt(p.to_local() if hasattr(p, "to_local") else p, "d0")
        with tr:
            tr.charge("d0")
            wrapped = torch.nn.parallel.DistributedDataParallel(drafter) if engine == "ddp" else drafter  # buckets
            opt = torch.optim.AdamW(params, lr=1e-3)
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            measured = tr.live["d0"]
        del wrapped
    assert measured == predicted + 4 * len(params), (measured, predicted, len(params))


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_the_drafters_backward_in_check_bounds_the_tracker_layer_by_layer(in_repo, tmp_path, engine):
    """tiny_dp's drafter wrapped as the trainer wraps it (DDP on a 1-process gloo group; FSDP2 on torch's fake
    group of 2 ranks), a forward and a backward from a gradient of its output on d0's shapes, under the tracker:
    what the backward adds above the live bytes at its start is at most what check's replay of the drafter
    node's backward adds on d0 (ops/costs.py NOTE [Layered backward]: the layers in reverse, each one's weight
    gradients and activation gradients on top of its saved tensors; FSDP2's unsharded parameters, prefetched
    all-gather and reduce-scatter buffers per unit, analysis/memory.py NOTE [Data-parallel memory]), and check's
    excess is under 7% of its peak for the device (493,568 B on both engines: the layer's bound). Before, check put every weight gradient at the first backward
    node and held FSDP2's buffers through the whole backward."""
    import torch

    from dflash_graph.analysis.memory import device_events
    from dflash_graph.exec.memtrack import LiveTracker
    from dflash_graph.rewrite.pipeline import compile_graph

    typed = compile_graph("graphs/tiny_dp.toml", [f"models.drafter.parallel={engine}"]).typed
    events, _ = device_events(typed, "d0")
    live = peak = 0
    start = rise = None
    for e in events:
        if start is None and e.label.startswith("drafter/backward"):
            start = rise = live
        live += e.size if e.op == "alloc" else -e.size
        peak = max(peak, live)
        if start is not None and e.label.startswith("drafter/backward"):
            rise = max(rise, live)
        elif start is not None:
            break
    predicted = rise - start
    shapes = {k: typed.types[r].sizes for k, r in
              dict(next(n for n in typed.graph.nodes if n.id == "drafter").inputs).items()}
    dims = typed.ctx.models["drafter"].dims
    with tiny_dp_drafter(typed, engine, tmp_path) as drafter:
        ctx = torch.randn(*shapes["context"])
        seq = shapes["input_ids"][0]
        ids, pos = torch.randint(0, dims.vocab_size, (seq,)), torch.arange(seq)
        anchors = torch.arange(shapes["anchors"][0]) * (seq // shapes["anchors"][0] // 2) + 1
        tr = LiveTracker()
        with tr:
            tr.charge("d0")
            wrapped = torch.nn.parallel.DistributedDataParallel(drafter) if engine == "ddp" else drafter
            for _ in range(2):       # the second step: DDP's buckets rebuilt, FSDP2 initialised
                h = wrapped(ctx, ids, pos, anchors)
                g = torch.randn_like(h)
                before = tr.live["d0"]
                tr.peak["d0"] = before
                h.backward(g)
                measured = tr.peak["d0"] - before
                del h, g
                for p in drafter.parameters():
                    p.grad = None
        del wrapped
    print(f"\n{engine}: the drafter's backward adds {measured:,} B measured, {predicted:,} B in check "
          f"({(predicted - measured) / peak:.2%} of check's d0 peak, {peak:,} B)")
    assert 0 <= predicted - measured <= 0.07 * peak, (predicted, measured, peak)


def test_check_requests_what_autograd_and_adamw_request(in_repo):
    """The granularity the caching allocator sees (ops/costs.py NOTE [Layered backward]): in check's replay of
    tiny_dp's d0, each drafter layer's backward makes one weight gradient per parameter of the module the trainer
    builds (AccumulateGrad's .grad, same bytes), and the optimizer one fp32 gradient and one foreach temporary
    per trainable parameter; the forward's saved tensors sum to what the drafter's cost saves."""
    from collections import Counter

    import torch

    from dflash_graph.analysis.memory import device_events
    from dflash_graph.analysis.nodecost import node_cost
    from dflash_graph.models.nn.dflash import DFlashDrafter
    from dflash_graph.rewrite.pipeline import compile_graph
    from dflash_graph.units import DTYPE_BYTES

    typed = compile_graph("graphs/tiny_dp.toml", []).typed
    events, _ = device_events(typed, "d0")
    m = typed.ctx.models["drafter"]
    width = DTYPE_BYTES[m.spec.dtype]
    drafter = DFlashDrafter(m.dims, torch.nn.Embedding(m.dims.vocab_size, m.dims.hidden_size), own_norm=False)
    step1 = events[:next(i for i, e in enumerate(events) if e.label.startswith("zero_grad")) + 1]
    for i, layer in enumerate(drafter.layers):
        made = Counter(e.size for e in step1
                       if e.op == "alloc" and e.label.startswith(f"drafter/backward layer {i} weight grad"))
        assert made == Counter(p.numel() * width for p in layer.parameters()), (i, made)
    params = Counter(p.numel() * 4 for p in drafter.parameters() if p.requires_grad)
    temps = Counter(e.size for e in step1 if e.op == "alloc" and e.label == "optimizer/foreach temporaries")
    assert temps == params, (temps, params)
    if width != 4:
        assert Counter(e.size for e in step1 if e.op == "alloc" and e.label == "optimizer/fp32 grads") == params
    node = next(n for n in typed.graph.nodes if n.id == "drafter")
    cost = node_cost(typed, node, True)
    saved = [e.size for e in step1 if e.op == "alloc" and e.label == "drafter/saved for backward"]
    assert len(saved) > 2 * len(drafter.layers) and sum(saved) == cost.saved_bytes, (saved, cost.saved_bytes)


# a learning rate that depends on the step alone (warmup longer than any run here: train/trainer.py _lr_lambda), so
# that a run interrupted and resumed for fewer steps follows the same schedule as one that trains them in one go
WARMUP = ["--set", "train.warmup_steps=1000"]


@pytest.mark.slow     # 97 s on the shared 2-core machine at load average 7-8
def test_ctrl_c_during_a_data_parallel_run_stops_every_rank_and_its_checkpoint_resumes_exactly(in_repo, tmp_path):
    """Ctrl-C at a terminal (SIGINT to torchrun and every rank) during tiny_dp on 4 ranks, once step 2 is logged:
    every rank exits 130, one line (the writer's) says what was saved, and no process of the launch is left. The
    checkpoint is the writer's alone (its replica holds the whole drafter and optimizer: trainer.pt), and tiny_dp
    resumed from it on 4 ranks gives the losses and gradient norms of one process exactly, through 2 steps past
    the interrupt."""
    out, one = tmp_path / "run", tmp_path / "one"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "tests" / "test_distributed.py"), str(out), "graphs/tiny_dp.toml", *WARMUP, "--steps", "500",
           "--out", str(out), "--no-progress"]
    with session(cmd) as p:
        text = ctrl_c_after_step_2(p, out)          # asserts that every process of the launch is gone
    said = [ln for ln in text.splitlines() if ln.startswith(("interrupted", "dflash-graph:"))]
    assert len(said) == 1 and said[0].startswith("interrupted: Ctrl-C (SIGINT, first seen by rank "), text
    assert "lost" not in text, text
    step = json.loads((out / "checkpoint" / "state.json").read_text())["step"]
    assert f"checkpoint of step {step} saved" in said[0] and f"--resume {out}" in said[0] and step >= 2, said
    assert {f.name: f.read_text() for f in out.glob("status.*")} == {f"status.{k}": "130" for k in range(4)}
    code, res = torchrun(4, ["graphs/tiny_dp.toml", *WARMUP, "--steps", str(step + 2), "--out", str(out),
                             "--resume", str(out)])
    assert code == 0, res
    assert main(["run", "graphs/tiny.toml", *WARMUP, "--steps", str(step + 2), "--out", str(one),
                 "--no-progress"]) == 0
    _same(read_metrics(one), read_metrics(out), step + 2)


def _worst(a, b, keys=("loss", "grad_norm")) -> dict[str, float]:
    """Per key, the largest relative difference over the steps of two runs' metrics."""
    return {k: max(abs(x[k] - y[k]) / abs(x[k]) for x, y in zip(a, b)) for k in keys}


@pytest.mark.slow     # 62 s on the shared 2-core machine at load average 7-8
def test_fsdp_with_grad_accum_2_equals_one_process_up_to_fp32_rounding(in_repo, tmp_path):
    """tiny_dp sharded (fsdp) with grad_accum = 2 on 4 ranks against tiny.toml in one process, the same global
    batch (2 replicas x 2 micro-batches): each drafter rank accumulates its 2 micro-batches into its unsharded
    gradients before the reduce-scatter at the step's last backward, one process sums them replica by replica, so
    the additions run in another order: fp32 rounding (the recorded losses and gradient norms to their last
    decimal, the weights within 1e-5 of each tensor's largest |w|)."""
    one, dp = tmp_path / "one", tmp_path / "dp"
    accum = ["--set", "train.grad_accum=2"]
    assert main(["run", "graphs/tiny.toml", *accum, "--steps", "3", "--out", str(one), "--no-progress"]) == 0
    code, out = torchrun(4, ["graphs/tiny_dp.toml", "--set", "models.drafter.parallel=fsdp", *accum, "--steps", "3",
                             "--out", str(dp)])
    assert code == 0, out
    _close(read_metrics(one), read_metrics(dp), 3)
    w = _weights_close(one, dp, 1e-5)
    print(f"\nfsdp, grad_accum 2, 2 drafter ranks vs one process, 3 steps: {_worst(read_metrics(one), read_metrics(dp))}"
          f" relative; weights within {w:.2g}")


def _four_colocated(in_repo, tmp_path):
    """graphs/tiny_colocated.toml with 4 devices in its group: 4 ranks, each a target and a drafter replica, so
    the gradient all-reduce adds 4 addends."""
    text = (in_repo / "graphs" / "tiny_colocated.toml").read_text().replace('"tiny/', f'"{in_repo}/graphs/tiny/')
    extra = "".join(f'[devices.c{k}]\ntorch = "cpu"\ncapacity = "4 GiB"\nthroughput = "5 GFLOP/s"\n\n' for k in (2, 3))
    text = text.replace("[groups]", extra + "[groups]").replace('pair = ["c0", "c1"]', 'pair = ["c0", "c1", "c2", "c3"]')
    assert 'pair = ["c0", "c1", "c2", "c3"]' in text
    path = tmp_path / "tiny_colocated4.toml"
    path.write_text(text)
    return path


@pytest.mark.slow     # 73 s on the shared 2-core machine at load average 7-8
def test_four_drafter_replicas_per_all_reduce_equal_one_process_up_to_fp32_rounding(in_repo, tmp_path):
    """tiny_colocated on 4 ranks (4 drafter replicas) against the same graph in one process (its 4 replicas
    share one drafter, gradients summed replica by replica): gloo's all-reduce of 4 addends sums in its own order,
    so the tolerance is fp32 rounding. The measured differences are printed (-s)."""
    graph = _four_colocated(in_repo, tmp_path)
    one, dp = tmp_path / "one", tmp_path / "dp"
    assert main(["run", str(graph), "--steps", "3", "--out", str(one), "--no-progress"]) == 0
    code, out = torchrun(4, [str(graph), "--steps", "3", "--out", str(dp)])
    assert code == 0, out
    assert set(read_metrics(dp)[0]["ranks"]) == {"0", "1", "2", "3"}
    _close(read_metrics(one), read_metrics(dp), 3)
    w = _weights_close(one, dp, 1e-5)
    print(f"\n4 drafter replicas (ddp) vs one process, 3 steps: {_worst(read_metrics(one), read_metrics(dp))} "
          f"relative; weights within {w:.2g}")


def test_the_tracker_sees_fsdp2_free_and_reallocate_unsharded_parameters(tmp_path):
    """FSDP2 frees a unit's unsharded parameters with storage.resize_(0) and allocates them again with resize_(size)
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py free_storage, alloc_storage), which no dispatch mode sees:
    the tracker follows torch.UntypedStorage.resize_ as torch's MemTracker does. After a forward and backward of 3
    sharded layers on a fake group of 2 ranks, what it counts as live is exactly the gradients' shards (the
    reduce-scatter outputs); it counted every unit's unsharded parameters as well, and the reduce-scatter inputs
    FSDP2 holds until the backward ends, when it missed the resizes (108,416 B instead of 24,960 here)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dflash_graph.exec.memtrack import LiveTracker

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        for layer in m:
            fully_shard(layer)
        fully_shard(m)
        x = torch.randn(8, 64)
        tr = LiveTracker()
        with tr:
            tr.charge("d")
            m(x).sum().backward()
            live, peak = tr.live["d"], tr.peak["d"]
        shards = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                  for g in (p.grad.to_local() for p in m.parameters())}
        assert torch.UntypedStorage.resize_ is tr._orig_resize     # put back on exit
    finally:
        dist.destroy_process_group()
    assert live == sum(shards.values()) == 3 * (64 * 64 + 64) * 4 // 2, (live, shards)
    assert peak > live
