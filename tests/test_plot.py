"""`check --plot`: a picture of each device's memory, as written and rewritten, with the OOM marked."""

import pytest

from dflash_graph.cli.main import main

pytest.importorskip("matplotlib")


def test_plot_svg_marks_the_oom_before_rewriting(in_repo, tmp_path, capsys):
    f = tmp_path / "mem.svg"
    assert main(["check", "graphs/qwen27b.toml", "--plot", str(f)]) == 0
    assert "wrote" in capsys.readouterr().out
    svg = f.read_text()
    # both columns, the replicas as one row, the OOM of the graph as written, every category in the legend
    for text in ("as written: gpu7", "rewritten: gpu7", "gpu0..gpu6 (7 replicas)", "OOM at 'verifier_roll'",
                 "30.31 GiB asked", "weights", "training state", "receive buffers", "activations", "workspace",
                 "reserved (caching allocator)", "usable (capacity - outside allocator)"):
        assert text in svg, text


def test_plot_png_no_rewrite(in_repo, tmp_path, capsys):
    f = tmp_path / "mem.png"
    assert main(["check", "graphs/tiny.toml", "--no-rewrite", "--plot", str(f)]) == 0
    assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_bad_suffix(in_repo, capsys):
    assert main(["check", "graphs/tiny.toml", "--plot", "mem.txt"]) == 2
    assert "must end in .png, .svg or .pdf" in capsys.readouterr().err
