"""Run directories (train/rundir.py): a rerun never overwrites a run silently, --resume DIR continues in DIR,
--steps must be positive, run.json records the command and the resolved graph, and a resume with a changed
graph is refused naming each difference unless --allow-change names a safe one."""

from __future__ import annotations

import json

from dflash_graph.cli.main import main
from dflash_graph.train import rundir


def run(*argv: str) -> int:
    return main(["run", "graphs/tiny.toml", "--no-progress", *argv])


def test_steps_must_be_positive(in_repo, tmp_path, capsys):
    assert run("--steps", "-3", "--out", str(tmp_path / "r")) == 2
    err = capsys.readouterr().err
    assert "--steps -3" in err and "positive" in err
    assert not (tmp_path / "r").exists()


def test_refuses_overwrite_resumes_in_place_and_records(in_repo, tmp_path, capsys):
    out = tmp_path / "r"
    assert run("--steps", "2", "--out", str(out), "--set", "train.seed=3") == 0
    rec = json.loads((out / "run.json").read_text())
    assert rec["overrides"] == ["train.seed=3"] and rec["resolved"]["train"]["seed"] == 3
    assert rec["resolved"]["models"]["target"]["config"]["hidden_size"]   # the config.json, read in
    before = (out / "metrics.jsonl").read_text()

    capsys.readouterr()
    assert run("--steps", "1", "--out", str(out)) == 2                    # a rerun is refused ...
    err = capsys.readouterr().err
    assert "already holds a run (2 steps in metrics.jsonl)" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_text() == before                  # ... and nothing is touched

    # --resume DIR without --out continues in DIR; a changed dim or seed is refused, naming each difference
    assert run("--steps", "3", "--resume", str(out), "--set", "dims.anchors=8") == 2
    err = capsys.readouterr().err
    assert "dims.anchors was 16 in the run, is 8 now" in err and "train.seed was 3 in the run, is 0 now" in err
    assert run("--steps", "3", "--resume", str(out), "--set", "train.seed=3", "--set", "train.lr=1e-4") == 2
    assert "--allow-change train.lr" in capsys.readouterr().err
    assert run("--steps", "3", "--resume", str(out), "--set", "train.seed=3", "--set", "train.lr=1e-4",
               "--allow-change", "train.lr") == 0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert len(json.loads((out / "run.json").read_text())["resumes"]) == 1
    assert not (tmp_path / "runs").exists()

    assert run("--steps", "1", "--out", str(out), "--overwrite") == 0    # --overwrite replaces it
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_flatten_names_nodes_by_id():
    flat = rundir.flatten({"nodes": [{"id": "loss", "params": {"gamma": 7.0}}], "train": {"lr": 1}})
    assert flat == {"nodes.loss.id": "loss", "nodes.loss.params.gamma": 7.0, "train.lr": 1}


def test_overwrite_that_cannot_remove_says_what_is_left(tmp_path, monkeypatch):
    """--overwrite that fails part way (a read-only file system, a file held by another user) is exit 2 naming what
    was removed, what is left and that nothing new was written, not a bare OSError."""
    import shutil

    import pytest

    from dflash_graph.errors import GraphError

    out = tmp_path / "run"
    (out / "checkpoints" / "step-00000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')

    def refuse(path, *a, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with pytest.raises(GraphError) as e:
        rundir.prepare(out, None, overwrite=True)
    msg = str(e.value)
    assert "--overwrite could not remove" in msg and "checkpoints: Permission denied" in msg
    assert "removed: metrics.jsonl" in msg and "left (maybe in part): checkpoints" in msg
    assert "nothing of the new run was written" in msg and "--overwrite" in e.value.problems[0].hint
    assert (out / "checkpoints").is_dir() and not (out / "metrics.jsonl").exists()
