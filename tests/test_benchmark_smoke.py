"""benchmarks/engine_overhead.py runs end to end and its two paths (engine, hand-written PyTorch) compute the same
loss; benchmarks/reference_peers.py (under -m slow) runs and its peers compute the project's loss. Not timing tests:
the ratios are reported by the benchmarks, never asserted here."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load_benchmark():
    spec = importlib.util.spec_from_file_location("engine_overhead", ROOT / "benchmarks" / "engine_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_engine_overhead_benchmark_runs_and_paths_agree(in_repo, tmp_path, capsys):
    bench = load_benchmark()
    out = tmp_path / "engine_overhead.json"
    threads = torch.get_num_threads()
    try:
        # one torch thread: quick even on a busy machine (several threads spin-wait when the cores are shared)
        r = bench.main(["--steps", "2", "--warmup", "1", "--threads", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "time ratio engine/hand" in printed and "peak live bytes" in printed

    assert json.loads(out.read_text())["loss_check"] == r["loss_check"]
    lc = r["loss_check"]
    assert math.isfinite(lc["engine_loss"]) and lc["engine_loss"] > 0
    # the same modules, data and anchors: the same loss on the first step and on every later one
    assert abs(lc["engine_loss"] - lc["hand_loss"]) <= 1e-5 * max(1.0, abs(lc["engine_loss"])), lc
    assert lc["max_abs_diff_all_steps"] <= 1e-4, lc
    assert lc["steps_compared"] == 1 + 1 + 2 + 1
    assert lc["engine_slot_acc"] == lc["hand_slot_acc"]
    assert math.isclose(lc["engine_grad_norm"], lc["hand_grad_norm"], rel_tol=1e-4)

    t, m = r["time"], r["memory"]
    assert len(t["engine_steps_s"]) == len(t["hand_steps_s"]) == 2
    assert t["ratio_of_medians"] > 0 and m["engine_step_peak_bytes"] > 0 and m["hand_step_peak_bytes"] > 0


@pytest.mark.slow   # ~25 s on 2 shared cores, most of it importing and building both references
def test_reference_peers_benchmark_runs_and_peers_agree(in_repo, capsys):
    """benchmarks/reference_peers.py at the tiny size, one round: every way runs, and each peer (speculators' and
    SpecForge's own step) gives the project's loss and gradients for its objective. Never asserts on time."""
    pytest.importorskip("speculators.models.dflash.core", reason="speculators not installed (the `references` extra)")
    pytest.importorskip("specforge.algorithms.common.dflash_family_model",
                        reason="specforge not installed (the `references` extra)")
    spec = importlib.util.spec_from_file_location("reference_peers", ROOT / "benchmarks" / "reference_peers.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        r = bench.main(["--sizes", "tiny", "--repeats", "1", "--warmup", "0"])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "| size | loss kind | project way | peer | CPU time / peer |" in printed
    kinds = r["sizes"]["tiny"]["kinds"]
    assert set(kinds) == {"verifier", "data"}
    for kind, peer in (("verifier", "speculators"), ("data", "specforge")):
        ways = kinds[kind]["ways"]
        assert set(ways) == {"project loss", "project fused", peer}
        for w in ways.values():
            assert math.isfinite(w["loss"]) and w["loss"] > 0 and w["peak_bytes"] > 0 and len(w["cpu_s"]) == 1
            assert w["loss_rel_diff"] <= 1e-5 and w["grad_rel_diff"] <= 1e-5, (kind, w)
    assert len(r["summary"]) == 4
