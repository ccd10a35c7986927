"""`dflash-graph draw`: DOT with devices as clusters, shapes on the edges, rewritten and removed nodes marked;
SVG/PNG through Graphviz's `dot` when it is installed, a clear message when it is not."""

import shutil

import pytest

from dflash_graph.cli.main import main


def test_dot_before_and_after(in_repo, tmp_path, capsys):
    f = tmp_path / "g.dot"
    assert main(["draw", "graphs/qwen27b.toml", "-o", str(f)]) == 0
    dot = f.read_text()
    assert dot.startswith("digraph") and dot.count("subgraph") == 2 + 2 + 2   # 2 graphs, each with 2 placements
    assert 'label="as written"' in dot and 'label="rewritten (11 rewrites)"' in dot
    assert "targets: gpu0..gpu6 (one replica each)" in dot and "gpu7 (cuda:7)" in dot
    # the edge into the roll as written: the 30 GiB logits, symbolic and concrete
    assert "logits: [seq, vocab]\\n[65,536, 248,320] bf16, 30.31 GiB" in dot
    assert "verifier_roll\\nroll\\nremoved by the rewrites\\nOOM here" in dot
    assert "verifier_norm\\nnorm (target)\\ngather_through_positionwise" in dot
    assert "loss\\nfused_head_loss (drafter)\\nfuse_heads_into_loss" in dot           # both heads inside the loss


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz not installed")
def test_svg_by_graphviz(in_repo, tmp_path, capsys):
    f = tmp_path / "g.svg"
    assert main(["draw", "graphs/tiny.toml", "-o", str(f)]) == 0
    svg = f.read_text()
    assert "<svg" in svg and "rewritten" in svg


def test_missing_dot_and_bad_suffix(in_repo, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["draw", "graphs/tiny.toml", "-o", str(tmp_path / "g.png")]) == 2
    err = capsys.readouterr().err
    assert "needs Graphviz's `dot` program" in err and "-o graph.dot" in err
    assert main(["draw", "graphs/tiny.toml", "-o", "g.jpeg"]) == 2
    assert "must end in .svg, .png, .pdf or .dot" in capsys.readouterr().err
