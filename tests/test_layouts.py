"""Data-parallel drafters and the layout choice (issue 24, check's side): the `parallel` declaration, the
routing of N target replicas into M drafter replicas, and what check and run refuse about them
(docs/distributed.md, "Layouts")."""

from pathlib import Path

import pytest

from dflash_graph.analysis.launch import analyze_launch, device_for
from dflash_graph.analysis.parallel import data_parallel
from dflash_graph.cli.main import main
from dflash_graph.errors import GraphError
from dflash_graph.analysis.infer import build, infer
from dflash_graph.rewrite.pipeline import compile_graph, compile_typed
from dflash_graph.spec.loader import parse_graph
from dflash_graph.units import parse_bandwidth


def tiny_dp_text() -> str:
    return Path("graphs/tiny_dp.toml").read_text()


def typed_of(text: str):
    """A variant of a shipped graph, checked as if it were in graphs/."""
    return compile_typed(infer(*build(parse_graph(text, "graphs/variant.toml", Path("graphs")))), False).typed


def test_a_data_parallel_drafter_is_declared_and_routed_r_mod_m(in_repo):
    typed = compile_graph("graphs/tiny_dp.toml", rewrite=False).typed
    dp = data_parallel(typed)
    assert (dp.model, dp.engine, dp.placement, dp.devices) == ("drafter", "ddp", "drafters", ("d0", "d1"))
    L = analyze_launch(typed)
    # replica r of the targets feeds drafter replica r mod M: t0 -> d0, t1 -> d1, and nothing else crosses
    assert {(t.src_device, t.dst_device) for t in L.transfers} == {("t0", "d0"), ("t1", "d1")}
    four = typed_of(tiny_dp_text().replace('targets = ["t0", "t1"]', 'targets = ["t0", "t1", "t2", "t3"]')
                    .replace("[devices.d0]", '[devices.t2]\ntorch = "cpu"\ncapacity = "4 GiB"\n\n'
                                             '[devices.t3]\ntorch = "cpu"\ncapacity = "4 GiB"\n\n[devices.d0]'))
    assert [device_for(four, "drafters", r) for r in range(4)] == ["d0", "d1", "d0", "d1"]
    assert {(t.src_device, t.dst_device) for t in analyze_launch(four).transfers} == {
        ("t0", "d0"), ("t1", "d1"), ("t2", "d0"), ("t3", "d1")}


def test_colocated_has_no_transfer(in_repo):
    typed = compile_graph("graphs/tiny_colocated.toml", rewrite=False).typed
    assert data_parallel(typed).devices == ("c0", "c1")
    L = analyze_launch(typed)
    assert L.world_size == 2 and L.transfers == ()


def test_check_launch_accepts_a_parallel_model_on_several_ranks(in_repo, monkeypatch):
    from dflash_graph.exec.distributed import check_launch, writer_ranks

    typed = compile_graph("graphs/tiny_dp.toml").typed
    L = analyze_launch(typed)
    assert writer_ranks(typed, L) == {2, 3}
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_launch(typed, L)     # one rank per replica: no refusal


def test_run_refuses_a_parallel_model_until_it_trains_one(in_repo, capsys, tmp_path):
    assert main(["run", "graphs/tiny_dp.toml", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphs/tiny_dp.toml:")
    assert "error at models.drafter.parallel" in err
    assert "data-parallel training runs under torchrun: not yet" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_bandwidths_are_declared_and_parsed(in_repo):
    assert parse_bandwidth("450 GB/s") == 450e9 and parse_bandwidth("1 GiB/s") == 2**30
    with pytest.raises(ValueError):
        parse_bandwidth("400 Gb/s")
    spec = compile_graph("graphs/tiny_dp.toml", ["launch.inter_node_bandwidth=25 GB/s"], rewrite=False).typed.ctx.spec
    assert spec.launch.intra_node_bandwidth == 450e9 and spec.launch.inter_node_bandwidth == 25e9
