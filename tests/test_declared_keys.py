"""Every key a graph may write is acted on or refused, never ignored; the files a graph names are verified by
check (issue 21, points 5 and 7)."""

from __future__ import annotations

import json

import pytest

from dflash_graph.cli.main import main
from dflash_graph.models.registry import ARCHS
from dflash_graph.spec import schema

MISSING = "tests/graphs/bad/missing_data_paths.toml"


def test_missing_files_are_errors_with_their_line(in_repo, capsys):
    assert main(["check", MISSING]) == 2
    err = capsys.readouterr().err
    lines = in_repo.joinpath(MISSING).read_text().splitlines()
    for key, toml in (("data.corpus", "corpus = "), ("data.tokenizer", "tokenizer = ")):
        line = next(i + 1 for i, text in enumerate(lines) if text.startswith(toml))
        assert f"{MISSING}:{line}: error at {key}: " in err
    assert "check --memory-only" in err


def test_memory_only_makes_them_warnings_and_says_which(in_repo, capsys):
    assert main(["check", MISSING, "--memory-only"]) == 0
    out = capsys.readouterr().out
    assert "warning at data.corpus" in out and "warning at data.tokenizer" in out
    assert "verdict: fits on every device; `run` needs the 2 missing file(s) above" in out
    assert main(["check", MISSING, "--memory-only", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(m["key"], m["needed_by"]) for m in doc["missing_paths"]] == [("data.corpus", "run"),
                                                                           ("data.tokenizer", "run")]
    assert all(m["file"] == MISSING and isinstance(m["line"], int) for m in doc["missing_paths"])


def test_json_lists_no_missing_path_for_a_complete_graph(in_repo, capsys):
    assert main(["check", "graphs/tiny.toml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_paths"] == []


def _path_keys():
    """Every key declared as a path, with a --set that reaches it on graphs/tiny.toml."""
    out = []
    for sec in schema.SECTIONS:
        for k in sec.keys:
            if k.path:
                prefix = {"models.<name>": "models.target", "data": "data"}[sec.name]
                out.append(f"{prefix}.{k.name}")
    return out


@pytest.mark.parametrize("key", _path_keys())
def test_every_declared_path_is_verified(key, in_repo, capsys):
    assert main(["check", "graphs/tiny.toml", "--set", f"{key}=no/such/file"]) == 2
    err = capsys.readouterr().err
    assert f"error at {key}: " in err and "no such file or directory" in err


def test_run_refuses_a_missing_corpus_naming_the_graph_line(in_repo, tmp_path, capsys):
    assert main(["run", MISSING, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{MISSING}:" in err and "error at data.corpus" in err
    assert "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_drafter_weights_refused(in_repo, capsys):
    """`weights` on a dflash drafter would be ignored by run (it trains from scratch): refused, naming the flag."""
    code = main(["check", "graphs/tiny.toml", "--set", "models.drafter.weights=/nonexistent/x.safetensors"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--set models.drafter.weights=/nonexistent/x.safetensors: error at models.drafter.weights" in err
    assert "cannot load weights" in err


def test_arch_declarations_match_what_run_does():
    """The arch registry's declarations are what the run-time store does: only qwen3_5 loads weights (ModelStore
    .full), only dflash trains (ModelStore.trainable_parameters holds the drafters)."""
    assert {a for a, x in ARCHS.items() if x.loads_weights} == {"qwen3_5"}
    assert {a for a, x in ARCHS.items() if x.trains} == {"dflash"}
