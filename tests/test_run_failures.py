"""Nothing lost, nothing hung (train/trainer.py, NOTE [Non-finite steps] and NOTE [Write failures]): a step with a
NaN or infinite loss or gradient is skipped and recorded as strict JSON, K of them in a row stop the run with the
last good checkpoint intact; a full disk or an unwritable directory mid-run, and a checkpoint of another drafter
shape on --resume, are exit 2 with what was saved and what was lost, never a traceback."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_graph.cli.main import main
from dflash_graph.train import checkpoint
from dflash_graph.train.trainer import Trainer


def strict_records(d: Path) -> list[dict]:
    """metrics.jsonl read by a parser that rejects NaN and Infinity (as jq, JavaScript and most tools do)."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(ln, parse_constant=refuse) for ln in (d / "metrics.jsonl").read_text().splitlines()]


def run(out: Path, steps: int, *sets: str) -> int:
    argv = ["run", "graphs/tiny.toml", "--steps", str(steps), "--out", str(out), "--no-progress"]
    for s in sets:
        argv += ["--set", s]
    return main(argv)


def poison(monkeypatch, loss_at=(), grad_at=()):
    """Make the loss NaN at the steps `loss_at`, and the gradient (not the loss) infinite at `grad_at` (1-based)."""
    orig = Trainer.step

    def step(self, i):
        if i + 1 not in loss_at and i + 1 not in grad_at:
            return orig(self, i)
        run_replica = self.interp.run_replica

        def poisoned(*a, **k):
            res = run_replica(*a, **k)
            out = res.get(self.loss_node)
            if out is not None:
                if i + 1 in loss_at:
                    out["loss"] = out["loss"] * float("nan")
                else:
                    out["loss"].register_hook(lambda g: g * float("inf"))
            return res

        self.interp.run_replica = poisoned
        try:
            return orig(self, i)
        finally:
            del self.interp.run_replica

    monkeypatch.setattr(Trainer, "step", step)


def weights(ck: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ck / "drafter.safetensors"))


def test_an_isolated_nonfinite_step_is_skipped_and_recorded(in_repo, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    poison(monkeypatch, loss_at={2}, grad_at={4})
    assert run(out, 5, "train.checkpoint_every=1", "train.keep_checkpoints=10") == 0
    got = capsys.readouterr()
    err = got.err
    assert "skipped: 2 step(s) with a non-finite loss or gradient norm (2, 4)" in got.out
    assert "step 2: skipped, non-finite loss (loss nan" in err and "stay those of step 1" in err
    assert "step 4: skipped, non-finite gradient norm" in err
    recs = strict_records(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[1]["skipped"] == "non-finite loss" and recs[1]["loss"] is None and recs[1]["grad_norm"] is None
    assert recs[3]["skipped"] == "non-finite gradient norm" and recs[3]["loss"] > 0 and recs[3]["grad_norm"] is None
    assert all("skipped" not in recs[i] and recs[i]["loss"] > 0 for i in (0, 2, 4))
    # the lr schedule advances through a skipped step: the same lrs as a run without one
    clean = tmp_path / "clean"
    monkeypatch.undo()
    assert run(clean, 5) == 0
    assert [r["lr"] for r in recs] == [r["lr"] for r in strict_records(clean)]
    cks = out / "checkpoints"
    w = {s: weights(cks / f"step-{s:08d}") for s in range(1, 6)}
    for k in w[1]:
        assert torch.equal(w[1][k], w[2][k]), f"{k} changed in the skipped step 2"
        assert torch.equal(w[3][k], w[4][k]), f"{k} changed in the skipped step 4"
    assert any(not torch.equal(w[2][k], w[3][k]) for k in w[1]), "training went on after the skipped step"
    opt = {s: torch.load(cks / f"step-{s:08d}" / "trainer.pt", weights_only=True)["optimizer"]["state"] for s in (1, 2)}
    for p in opt[1]:
        for name, v in opt[1][p].items():
            assert torch.equal(v, opt[2][p][name]), f"AdamW {name} of parameter {p} changed in the skipped step"


def test_nonfinite_steps_in_a_row_stop_the_run_with_the_checkpoint_intact(in_repo, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    poison(monkeypatch, loss_at={5, 6, 7})
    code = run(out, 12, "train.checkpoint_every=4", "train.max_nonfinite_steps=3")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err
    assert "steps 5-7: the loss or gradient norm was not finite in 3 steps in a row" in err
    assert "step 5: loss nan" in err and "the weights are those of step 4" in err
    assert f"the last good checkpoint is intact: {out / 'checkpoints' / 'step-00000004'} (step 4)" in err
    assert "hint: lower train.lr" in err and f"--resume {out}" in err
    assert [r["step"] for r in strict_records(out)] == [1, 2, 3, 4, 5, 6, 7]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000004"]
    state, ck = checkpoint.load(out)
    assert state["step"] == 4
    assert all(torch.isfinite(v).all() for v in weights(ck).values())
    print("\n" + err.strip().splitlines()[-2] + "\n" + err.strip().splitlines()[-1])


def test_a_checkpoint_of_nonfinite_weights_is_refused(tmp_path):
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    gen = torch.Generator()
    checkpoint.save(tmp_path, 1, {"drafter": m}, opt, sched, {}, gen, {})
    with torch.no_grad():
        m.weight[0, 0] = float("nan")
    with pytest.raises(checkpoint.NonFiniteWeights, match="drafter.weight"):
        checkpoint.save(tmp_path, 2, {"drafter": m}, opt, sched, {}, gen, {})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]
    assert checkpoint.load(tmp_path)[0]["step"] == 1


def full_disk_at(monkeypatch, step: int, code: int = errno.ENOSPC):
    """The checkpoint of `step` fails part-way: one file written, then the OS error."""
    orig = checkpoint._write_step

    def write_step(tmp, s, *a, **k):
        if s != step:
            return orig(tmp, s, *a, **k)
        (tmp / "drafter.safetensors").write_bytes(b"\0" * 100)
        raise OSError(code, os.strerror(code), str(tmp / "trainer.pt"))

    monkeypatch.setattr(checkpoint, "_write_step", write_step)


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(in_repo, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    full_disk_at(monkeypatch, 4)
    code = run(out, 6, "train.checkpoint_every=2")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err
    assert "trainer.pt: error: cannot write the checkpoint of step 4: No space left on device (ENOSPC)" in err
    assert f"saved: the checkpoint of step 2 is complete on disk ({out / 'checkpoints' / 'step-00000002'})" in err
    assert "metrics.jsonl holds steps 1-4" in err and "lost: steps 3-4 trained but in no checkpoint" in err
    assert f"hint: free space on the filesystem of {out}" in err and f"--resume {out}" in err
    assert not list((out / "checkpoints").glob(".tmp-*")), "the failed save's temporary is removed"
    assert checkpoint.load(out)[0]["step"] == 2
    print("\n" + err.strip())
    monkeypatch.undo()      # space again: the run continues from step 2, and the metrics stay one line per step
    assert run(out, 6, "train.checkpoint_every=2") == 2   # --out holds a run: refused without --resume
    capsys.readouterr()
    assert main(["run", "graphs/tiny.toml", "--steps", "6", "--out", str(out), "--resume", str(out), "--no-progress",
                 "--set", "train.checkpoint_every=2"]) == 0
    assert [r["step"] for r in strict_records(out)] == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_at_the_export_keeps_the_trained_run(in_repo, tmp_path, monkeypatch, capsys):
    """Training finished and is in the checkpoint; the export at the end fails: exit 2 naming what is kept and the
    command that writes the export again from the checkpoint, which then works."""
    out = tmp_path / "run"
    orig = checkpoint.save_tensors

    def save_tensors(tensors, path, metadata):
        if path.name == "model.safetensors":     # the export's file; the checkpoints' are <drafter>.safetensors
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        orig(tensors, path, metadata)

    monkeypatch.setattr(checkpoint, "save_tensors", save_tensors)
    code = run(out, 2, "train.checkpoint_every=1")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err
    export = out / "export"
    assert f"{export / 'model.safetensors'}: error: cannot write the drafter's export: No space left on device " \
           "(ENOSPC)" in err, err
    assert "saved: training is complete, the checkpoint of step 2 is complete on disk" in err
    assert "metrics.jsonl holds steps 1-2" in err and f"lost: only the export in {export}" in err
    assert f"dflash-graph export {out} --out {export}" in err
    print("\n" + err.strip())
    monkeypatch.undo()
    assert main(["export", str(out), "--out", str(export), "--overwrite"]) == 0     # the hint's command
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()


def test_a_full_disk_while_writing_metrics_leaves_whole_lines(in_repo, tmp_path, monkeypatch, capsys):
    from dflash_graph.train import trainer

    out = tmp_path / "run"
    orig = trainer._append
    calls = {"n": 0}

    def append(fd, data):
        calls["n"] += 1
        if calls["n"] == 3:                       # step 3: half the line reaches the disk, then it is full
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        orig(fd, data)

    monkeypatch.setattr(trainer, "_append", append)
    code = run(out, 5, "train.checkpoint_every=1")
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{out / 'metrics.jsonl'}: error: cannot write the metrics of step 3: No space left on device" in err
    assert "metrics.jsonl holds steps 1-2" in err and "the checkpoint of step 2 is complete" in err
    assert "lost: step 3 trained but in no checkpoint" in err
    assert [r["step"] for r in strict_records(out)] == [1, 2]


@pytest.mark.parametrize("target", ["checkpoint", "run.json", "memory.json"])
def test_an_unwritable_run_directory_is_a_located_error(in_repo, tmp_path, monkeypatch, capsys, target):
    """EACCES (a directory made read-only mid-run, simulated: chmod does not stop root) at each file the run
    writes: exit 2 naming the path and what is on disk."""
    out = tmp_path / "run"
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES))
    if target == "checkpoint":
        full_disk_at(monkeypatch, 2, errno.EACCES)
    elif target == "run.json":
        from dflash_graph.train import rundir

        monkeypatch.setattr(rundir, "write_json", lambda path, obj: (_ for _ in ()).throw(
            OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))))
    else:
        orig = Path.write_text

        def write_text(self, *a, **k):
            if self.name.startswith(".memory.json"):
                raise OSError(denied.errno, denied.strerror, str(self))
            return orig(self, *a, **k)

        monkeypatch.setattr(Path, "write_text", write_text)
    code = run(out, 2, "train.checkpoint_every=1")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err
    assert "Permission denied (EACCES)" in err and "writable" in err
    if target == "checkpoint":
        assert "cannot write the checkpoint of step 2" in err and "the checkpoint of step 1 is complete" in err
        assert f"make {out / 'checkpoints'} writable" in err
        assert checkpoint.load(out)[0]["step"] == 1
    elif target == "run.json":
        assert f"{out / 'run.json'}: error: cannot write run.json" in err and "no checkpoint is complete" in err
        assert "lost: nothing (no step was trained)" in err and f"make {out} writable" in err
        assert not list(out.glob(".run.json.tmp*"))
    else:
        assert f"{out / 'memory.json'}: error: cannot write memory.json" in err
        assert "the checkpoint of step 2 is complete" in err and "lost: nothing (every trained step" in err
        assert not list(out.glob(".memory.json.tmp*"))
    print("\n" + err.strip())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_run_directory_mid_run(in_repo, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    orig = Trainer._save

    def save(self, step):
        orig(self, step)
        if step == 1:
            os.chmod(out / "checkpoints", 0o555)

    monkeypatch.setattr(Trainer, "_save", save)
    try:
        code = run(out, 3, "train.checkpoint_every=1")
    finally:
        os.chmod(out / "checkpoints", 0o755)
    err = capsys.readouterr().err
    assert code == 2 and "Permission denied" in err and "the checkpoint of step 1 is complete" in err


def test_resuming_a_checkpoint_of_another_drafter_shape_names_the_tensors(in_repo, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(out, 1) == 0
    (out / "run.json").unlink()      # no record to compare the graph with: the checkpoint itself must refuse
    capsys.readouterr()
    code = main(["run", "graphs/tiny.toml", "--steps", "2", "--resume", str(out), "--no-progress",
                 "--set", "models.drafter.config.intermediate_size=128"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err
    ck = out / "checkpoints" / "step-00000001"
    assert f"{ck / 'drafter.safetensors'}: error: this checkpoint does not fit the drafter 'drafter'" in err
    assert "of another shape" in err and "[256, " in err and "[128, " in err and "in the checkpoint" in err
    assert "hint: the graph's drafter changed" in err
    print("\n" + err.strip().splitlines()[-2] + "\n" + err.strip().splitlines()[-1])


def test_metrics_lines_are_strict_json():
    from dflash_graph.train.metrics import json_line

    line = json_line({"loss": float("nan"), "heldout": {"loss": float("inf")}, "slot_accept": [0.5, float("-inf")],
                      "step": 3})
    assert "NaN" not in line and "Infinity" not in line and line.endswith("\n")
    assert json.loads(line) == {"loss": None, "heldout": {"loss": None}, "slot_accept": [0.5, None], "step": 3}


if __name__ == "__main__":
    # `python tests/test_run_failures.py LOSS_STEPS RUN_ARGS...`: `dflash-graph run RUN_ARGS` with the loss made NaN at
    # the comma-separated steps, for a run under torchrun (tests/test_distributed.py)
    import sys

    bad, *args = sys.argv[1:]
    poison(pytest.MonkeyPatch(), loss_at={int(s) for s in bad.split(",")})
    sys.exit(main(["run", *args]))
