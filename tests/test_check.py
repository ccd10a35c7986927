"""`dflash-graph check` on the shipped graphs: inference, JSON shape, --set, exit codes, no torch import."""

import json
import subprocess
import sys

import pytest

from dflash_graph.cli.main import main


def check_json(capsys, *args):
    code = main(["check", *args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_qwen27b_as_written_types(in_repo, capsys):
    code, js = check_json(capsys, "graphs/qwen27b.toml", "--no-rewrite")
    nodes = {n["id"]: n for n in js["nodes"]}
    assert nodes["target"]["op"] == "causal_lm_forward"
    assert nodes["target"]["outputs"]["logits"]["sizes"] == [65536, 248320]
    assert nodes["target"]["outputs"]["logits"]["shape"] == ["seq", "vocab"]
    assert nodes["target"]["devices"] == [f"gpu{i}" for i in range(7)]
    assert nodes["features"]["outputs"]["out"]["sizes"] == [65536, 5 * 5120]
    assert nodes["verifier_lm_head"]["outputs"]["logits"]["sizes"] == [65536, 248320]
    assert nodes["verifier_targets"]["outputs"]["out"]["sizes"] == [512, 16, 248320]
    assert nodes["verifier_targets"]["outputs"]["out"]["shape"] == ["anchors", "block", "vocab"]
    assert nodes["loss"]["outputs"]["loss"]["sizes"] == []
    assert js["rewrites"] == []
    assert js["dims"]["tokens"] == 8192


def test_set_overrides_a_dim(in_repo, capsys):
    _, js = check_json(capsys, "graphs/qwen27b.toml", "--no-rewrite", "--set", "dims.seq=4096",
                       "--set", "models.target.config.vocab_size=1000")
    nodes = {n["id"]: n for n in js["nodes"]}
    assert nodes["target"]["outputs"]["logits"]["sizes"] == [4096, 1000]


def test_set_errors_are_clean(in_repo, capsys):
    assert main(["check", "graphs/tiny.toml", "--set", "dims.seq"]) == 2
    assert "--set expects KEY=VALUE" in capsys.readouterr().err
    assert main(["check", "graphs/tiny.toml", "--set", "nodes.nope.params.x=1"]) == 2
    assert "no node with id 'nope'" in capsys.readouterr().err
    assert main(["check", "graphs/tiny.toml", "--set", "dims.seq=-5"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_tiny_is_valid_and_fits(in_repo, capsys):
    code, js = check_json(capsys, "graphs/tiny.toml")
    assert code == 0 and js["fits"] is True


def test_check_does_not_import_torch(in_repo):
    code = ("import sys; from dflash_graph.cli.main import main; rc = main(['check', 'graphs/qwen27b.toml', '--json']);"
            "assert 'torch' not in sys.modules, 'check imported torch'; assert 'transformers' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("check", "plan", "run"):
        assert cmd in out


def test_unwritable_output_is_a_clean_error(in_repo, capsys):
    assert main(["plan", "graphs/tiny.toml", "--emit", "/nonexistent/dir/out.toml"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/dir/out.toml" in err and "Traceback" not in err
