"""benchmarks/verifier_path.py runs end to end at tiny sizes, and its three engine ways (as written, pushdown,
fused) give the same loss and the same gradient with respect to the drafter's rows. Not a timing test: the
benchmark reports time and memory ratios, never asserted here."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load():
    spec = importlib.util.spec_from_file_location("verifier_path", ROOT / "benchmarks" / "verifier_path.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kind", ["kl", "ce", "tv"])
def test_verifier_path_benchmark_runs_and_ways_agree(tmp_path, capsys, kind):
    bench = load()
    threads = torch.get_num_threads()
    out = tmp_path / "vp.json"
    try:
        r = bench.main(["--seq", "256", "--anchors", "4", "--block", "8", "--vocab", "700", "--hidden", "32",
                        "--kind", kind, "--chunk", "8", "--repeats", "1", "--warmup", "0", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "peer:" in printed and "fused vs pushdown" in printed
    assert json.loads(out.read_text())["ways"].keys() == r["ways"].keys()
    ways = r["ways"]
    for w in ("as_written", "pushdown", "fused"):
        assert ways[w]["loss_rel_diff"] < 1e-5 and ways[w]["grad_rel_diff"] < 1e-4, (w, ways[w])
        assert ways[w]["peak_bytes"] > 0 and ways[w]["median_s"] > 0
    assert ways["fused"]["peak_bytes"] < ways["pushdown"]["peak_bytes"] < ways["as_written"]["peak_bytes"]
    assert ("peer" in ways) == r["peer"]["ran"]
