"""A resume continues the run it resumes (train/rundir.py, NOTE [What a resume continues]): a run of `--steps 6`
in a graph whose train.steps is 8, stopped by Ctrl-C at step 3 and resumed without --steps, trains to step 6 with
the uninterrupted run's per-step losses, lr, progress lines (smoothed loss and tau), held-out evaluations and
closing summary; a resume of a finished run changes nothing; --steps below the steps done is refused, above them
extends the run at the lr its schedule ends at; --allow-change train.lr changes the lr; and what a resume writes
(run.json, memory.json, metrics.jsonl in another --out) keeps what the run had."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from dflash_graph.cli.main import main
from dflash_graph.train import checkpoint
from dflash_graph.train import trainer as trainer_mod
from dflash_graph.train.metrics import RunStats

ROOT = Path(__file__).resolve().parent.parent
# small and fast; warmup 2 so the cosine part of the schedule moves the lr at every step; a held-out evaluation
# at steps 3 and 6; train.steps = 8 differs from the runs' --steps 6, as in the issue's report
SETS = ["dims.seq=64", "dims.anchors=4", "train.warmup_steps=2", "train.log_every=1", "train.threads=1",
        "train.steps=8", "train.eval_every=3", "train.eval_batches=2", "train.checkpoint_every=0"]
TRAINING_FIELDS = ("step", "loss", "slot_acc", "acc", "tau", "slot_accept", "lr", "grad_norm", "heldout")


def run(*argv: str, interrupt_at: int | None = None, nan_at=()) -> tuple[int, str, str]:
    """`dflash-graph run graphs/tiny.toml` in this process: (exit status, stdout, stderr). interrupt_at: Ctrl-C
    (a SIGINT to this process) while that step runs; nan_at: steps whose loss is NaN."""
    orig = trainer_mod.Trainer.step

    def step(self, s):
        if s + 1 == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
        if s + 1 not in nan_at:
            return orig(self, s)
        run_replica = self.interp.run_replica

        def poisoned(*a, **k):
            res = run_replica(*a, **k)
            if self.loss_node in res:
                res[self.loss_node]["loss"] = res[self.loss_node]["loss"] * float("nan")
            return res

        self.interp.run_replica = poisoned
        try:
            return orig(self, s)
        finally:
            del self.interp.run_replica

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.chdir(ROOT)
        mp.setattr(trainer_mod.Trainer, "step", step)
        code = main(["run", "graphs/tiny.toml", "--no-progress", *(x for s in SETS for x in ("--set", s)), *argv])
    return code, out.getvalue(), err.getvalue()


def records(d: Path) -> list[dict]:
    return [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]


def training(recs: list[dict]) -> list[dict]:
    return [{k: r.get(k) for k in TRAINING_FIELDS} for r in recs]


def shown(stdout: str) -> dict[str, str]:
    """What the console said about training: each step's line without its timing and memory fields, the held-out
    lines, and the summary's loss and held-out lines."""
    out = {}
    for ln in stdout.splitlines():
        if m := re.match(r"step (\d+)/\d+ \| (loss \S+ \| tau \S+)", ln):
            out[f"step {m.group(1)}"] = m.group(2)
        elif ln.startswith("held-out @ step") or ln.lstrip().startswith(("loss (smoothed)", "held-out tau")):
            out[ln.split(":")[0].strip()] = ln.strip()
    return out


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """a: 6 steps uninterrupted; b: the same, Ctrl-C in step 3 (a copy of it then kept as b3), resumed without
    --steps."""
    d = tmp_path_factory.mktemp("resume")
    a, b, b3 = d / "a", d / "b", d / "b3"
    res = {"a_run": run("--steps", "6", "--out", str(a))}
    res["b_stop"] = run("--steps", "6", "--out", str(b), interrupt_at=3)
    shutil.copytree(b, b3, symlinks=True)
    res["b_resume"] = run("--resume", str(b))
    return {"dir": d, "a": a, "b": b, "b3": b3, **res}


def test_an_interrupted_run_resumes_as_the_uninterrupted_one(runs):
    a, b = runs["a"], runs["b"]
    assert runs["a_run"][0] == 0, runs["a_run"][2]
    code, _, err = runs["b_stop"]
    assert code == 130 and "checkpoint of step 3 saved" in err, err
    code, stdout, err = runs["b_resume"]
    assert code == 0, err
    # the run's 6 steps (not train.steps = 8), each step's loss, lr and evaluation as the uninterrupted run's
    assert [r["step"] for r in records(b)] == [1, 2, 3, 4, 5, 6]
    assert training(records(b)) == training(records(a))
    assert len({r["lr"] for r in records(a)}) == 5          # the lr moved at each step past the warmup
    # the console: the smoothed loss and tau of steps 4-6, the evaluation at 6 and the summary as uninterrupted
    want = shown(runs["a_run"][1])
    got = shown(runs["b_stop"][1]) | shown(stdout)
    assert got == want and {"step 6", "loss (smoothed)", "held-out tau"} <= set(want), (got, want)
    # the smoothing state is in the checkpoint
    state = [json.loads((d / "checkpoint" / "state.json").read_text()) for d in (a, b)]
    assert state[0]["stats"] == state[1]["stats"] and state[0]["steps"] == state[1]["steps"] == 6
    # tokens/s names the steps it averages: this invocation's, after its first
    assert "tokens/s:" in stdout and "(mean over steps 5..6, since the resume at step 3)" in stdout, stdout


def test_the_resume_is_recorded_and_keeps_the_earlier_measurement(runs):
    b = runs["b"]
    rec = json.loads((b / "run.json").read_text())
    assert rec["steps"] == 6 and len(rec["resumes"]) == 1
    assert rec["resumes"][0]["steps"] == 6 and rec["resumes"][0]["from_step"] == 3
    assert rec["run_with"] == rec["resumes"][0]["run_with"] == {"rewrite": True, "without_rule": [], "device_map": []}
    mem = json.loads((b / "memory.json").read_text())
    assert mem["measured_steps"] == [4, 6]
    assert [e["measured_steps"] for e in mem["earlier"]] == [[1, 3]]
    assert mem["earlier"][0]["devices"]["draft"]["measured_peak_bytes"] > 0


def test_a_finished_run_is_left_as_it_is(runs):
    """A resume of a finished run says so and changes nothing (exit 0), also with --steps equal to the steps
    done; --steps below them is refused (exit 2), naming the flag and the steps done."""
    a = runs["a"]
    before = files(a)
    for extra in ((), ("--steps", "6")):
        code, stdout, err = run("--resume", str(a), *extra)
        assert code == 0, err
        assert f"{a}: the run is finished (6 of 6 steps" in stdout and "nothing was changed" in stdout, stdout
        assert f"--resume {a} --steps N, with N above 6" in stdout
        assert "held-out tau" not in stdout and "memory peak" not in stdout
    code, stdout, err = run("--resume", str(a), "--steps", "4")
    assert code == 2 and "Traceback" not in err
    assert "--steps 4 is below the 6 steps" in err and "hint:" in err, err
    assert files(a) == before


def test_steps_above_the_run_extend_it_at_the_lr_its_schedule_ends_at(runs, tmp_path):
    """--steps 8 on a finished 6-step run trains steps 7 and 8 at the lr the schedule reached (no jump), says so,
    and records it; a changed train.steps is refused, pointing to --steps; a changed train.eval_every is not."""
    a = tmp_path / "a"
    shutil.copytree(runs["a"], a, symlinks=True)
    code, _, err = run("--resume", str(a), "--set", "train.steps=400")
    assert code == 2 and "train.steps was 8 in the run, is 400 now" in err and "--steps 400" in err, err
    code, _, err = run("--resume", str(a), "--steps", "8", "--set", "train.eval_every=4")   # (no step's result)
    assert code == 0, err
    recs = records(a)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert training(recs[:6]) == training(records(runs["a"]))
    lr6 = recs[5]["lr"]
    assert math.isclose(lr6, 0.1 * 3e-3) and recs[6]["lr"] == recs[7]["lr"] == lr6
    assert "--steps 8: the run was to train 6 steps and now trains 8" in err, err
    run_json = json.loads((a / "run.json").read_text())
    assert run_json["steps"] == 6 and run_json["resumes"][-1]["steps"] == 8
    assert json.loads((a / "checkpoint" / "state.json").read_text())["schedule_steps"] == 6


def test_allow_change_lr_changes_the_lr(runs, tmp_path):
    """--allow-change train.lr: the steps after the resume run on the new lr (the saved optimizer and scheduler
    state would otherwise bring the old one back), on the same schedule."""
    b3 = tmp_path / "b3"
    shutil.copytree(runs["b3"], b3, symlinks=True)
    code, _, err = run("--resume", str(b3), "--set", "train.lr=1e-3", "--allow-change", "train.lr")
    assert code == 0, err
    recs, ref = records(b3), records(runs["a"])
    for r, w in zip(recs[3:], ref[3:]):          # the same point of the schedule, a third of the peak lr
        assert math.isclose(r["lr"], w["lr"] / 3, rel_tol=1e-12), (r["step"], r["lr"], w["lr"])
    assert json.loads((b3 / "run.json").read_text())["resumes"][-1]["resolved"]["train"]["lr"] == 1e-3


def test_a_resume_into_another_out_carries_the_run(runs, tmp_path):
    """--resume DIR --out NEW: NEW gets the steps before the checkpoint in metrics.jsonl and the run's record,
    and ends as the uninterrupted run; DIR is left as it was."""
    b3, c = runs["b3"], tmp_path / "c"
    before = files(b3)
    code, _, err = run("--resume", str(b3), "--out", str(c))
    assert code == 0, err
    assert training(records(c)) == training(records(runs["a"]))
    rec = json.loads((c / "run.json").read_text())
    assert rec["steps"] == 6 and rec["resumes"][-1]["from_dir"] == str(b3) and rec["resumes"][-1]["from_step"] == 3
    assert files(b3) == before


def test_run_stats_round_trip_exactly_with_non_finite_steps():
    """The state a checkpoint keeps (RunStats): smoothed values exactly, and the streak of non-finite steps (NaN
    and infinite losses), which train.max_nonfinite_steps counts across a resume, through strict JSON."""
    st = RunStats()
    for i, loss in enumerate([3.1, 2.7, 2.9], 1):
        st.update({"step": i, "loss": loss, "slot_acc": [0.0, 0.3 + i / 10, 0.2], "tau": 1.2})
    st.update({"step": 4, "skipped": "non-finite loss", "loss": None})
    st.streak = [(4, "non-finite loss", float("nan"), float("inf"))]
    text = json.dumps(st.state_dict(), allow_nan=False)
    back = RunStats()
    back.load_state_dict(json.loads(text))
    assert back.loss.value == st.loss.value and back.tau == st.tau and back.skipped == [4]
    (step, why, loss, gnorm), = back.streak
    assert (step, why) == (4, "non-finite loss") and math.isnan(loss) and gnorm == math.inf
    for x in (back, st):                        # and they go on the same
        x.update({"step": 5, "loss": 1.0, "slot_acc": [0.0, 0.5, 0.5]})
    assert back.loss.value == st.loss.value and back.tau == st.tau


def test_held_out_tau_says_why_it_was_not_measured():
    """The summary's held-out line names what is missing, not both settings when both are set."""
    from types import SimpleNamespace as NS

    from dflash_graph.train.summary import RunSummary

    def summary(holdout, eval_every, comm=None, skipped=None):
        spec = NS(data={"holdout": holdout})
        t = NS(plan=NS(typed=NS(ctx=NS(spec=spec))), comm=comm, opts=NS(out=Path("runs/t"), source=None), start_step=0)
        s = RunSummary(t, RunStats(), eval_every, 4, 0)
        s.skipped = skipped
        return s.render(5, Path("runs/t"), {})

    assert "not measured (set [data] holdout and [train] eval_every)" in summary(0, 0)
    assert "not measured (set [train] eval_every)" in summary(50, 0)
    assert "not measured (set [data] holdout: the held-out split is empty)" in summary(0, 10)
    # under torchrun: the evaluator's reason when the evaluation did not fit beside its target (train/heldout.py)
    why = "the held-out evaluation of step 5 would need at least 9.00 GiB on rank 0 (t0, cuda:0) beside its target"
    assert f"not measured ({why})" in summary(50, 10, comm=object(), skipped=why)


def test_non_finite_steps_in_a_row_are_counted_across_a_resume(tmp_path):
    """train.max_nonfinite_steps = 3 and NaN losses at steps 2-4: the uninterrupted run stops at step 4; stopped
    by Ctrl-C at step 3 (two skips in a row in its checkpoint) and resumed, it stops at step 4 too, naming the
    same steps and the same weights."""
    sets = ["--steps", "6", "--set", "train.max_nonfinite_steps=3", "--set", "train.checkpoint_every=1"]
    code, _, want = run(*sets, "--out", str(tmp_path / "a"), nan_at={2, 3, 4})
    assert code == 2 and "steps 2-4: the loss or gradient norm was not finite in 3 steps in a row" in want, want
    b = tmp_path / "b"
    code, _, err = run(*sets, "--out", str(b), nan_at={2, 3, 4}, interrupt_at=3)
    assert code == 130, err
    code, _, err = run("--resume", str(b), nan_at={4})
    assert code == 2 and "Traceback" not in err, err
    assert "steps 2-4: the loss or gradient norm was not finite in 3 steps in a row" in err, err
    assert "the weights are those of step 1" in err and "the weights are those of step 1" in want
    assert training(records(b)) == training(records(tmp_path / "a"))


def test_a_checkpoint_that_does_not_record_its_steps(runs, tmp_path):
    """A checkpoint written before runs recorded their steps: the resume trains to train.steps and says so;
    --steps equal to its step finds it finished."""
    a = tmp_path / "a"
    shutil.copytree(runs["a"], a, symlinks=True)
    ck = (a / "checkpoint").resolve()
    state = json.loads((ck / "state.json").read_text())
    for k in ("steps", "schedule_steps", "stats"):
        del state[k]
    (ck / "state.json").write_text(json.dumps(state))
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["state.json"] = {"bytes": (ck / "state.json").stat().st_size,
                                       "sha256": checkpoint._sha256(ck / "state.json")}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    code, stdout, _ = run("--resume", str(a), "--steps", "6")
    assert code == 0 and "the run is finished (6 of 6 steps" in stdout
    code, _, err = run("--resume", str(a))
    assert code == 0, err
    assert "does not record its run's steps (an older version wrote it): training to step 8 (train.steps)" in err
    assert [r["step"] for r in records(a)] == list(range(1, 9))


def test_a_resume_under_torchrun_trains_to_the_runs_steps(runs, tmp_path):
    """Every rank trains to the run's steps, which only the writer reads from the checkpoint (it tells the others):
    the one-process run stopped at step 3 of 6, resumed under torchrun without --steps, ends at step 6 with the
    uninterrupted run's losses (to float rounding across processes) and its lr."""
    from test_distributed import torchrun

    b3 = tmp_path / "b3"
    shutil.copytree(runs["b3"], b3, symlinks=True)
    code, text = torchrun(3, ["graphs/tiny.toml", "--resume", str(b3), *(x for s in SETS for x in ("--set", s))])
    assert code == 0, text
    got, want = records(b3), records(runs["a"])
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]) and g["lr"] == w["lr"], (g, w)


def test_a_resume_run_otherwise_says_its_losses_may_differ(tmp_path):
    """--no-rewrite, --without-rule or --device-map other than the invocation before: allowed (the same
    computation), with a note that the losses may differ in the last digits; the same flags: no note."""
    from dflash_graph.train import rundir

    before = rundir.how_run(False, [], [])
    (tmp_path / "run.json").write_text(json.dumps({"run_with": before, "resumes": [{"run_with": before}]}))
    assert rundir.changed_flags(tmp_path, before) == []
    notes = rundir.changed_flags(tmp_path, rundir.how_run(True, ["fuse_head_loss"], ["cuda:*=cpu"]))
    assert len(notes) == 3 and all("may differ from an uninterrupted run's in the last digits" in n for n in notes)
    assert "the run ran rewritten, this resume as written (--no-rewrite)" in notes[0]
    assert "this resume --without-rule fuse_head_loss" in notes[1] and "--device-map cuda:*=cpu" in notes[2]
