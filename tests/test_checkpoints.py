"""Checkpoints survive crashes and corruption (train/checkpoint.py, NOTE [Atomic checkpoints]): the last K are
kept, a corrupted newest one is named and the previous good one used, trainer.pt is read with weights_only=True,
a writer SIGKILLed at 20 random moments always leaves a checkpoint that verifies and holds exactly the state
of the step it names, and whole `dflash-graph run` processes SIGKILLed inside their saves (at each point of a save,
through the test-only save hook, NOTE [Save hook], and at random moments) always resume from the newest complete
checkpoint and reproduce the uninterrupted run's losses exactly.

Every run the tests start is in its own session and is killed with its process group when the test ends."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_graph.errors import GraphError
from dflash_graph.train import checkpoint

ROOT = Path(__file__).resolve().parent.parent


def parts(fill: float = 0.0):
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return m, opt, sched, torch.Generator().manual_seed(1)


def save_step(d: Path, step: int, keep: int = 3) -> Path:
    m, opt, sched, gen = parts(float(step))
    return checkpoint.save(d, step, {"drafter": m}, opt, sched, {"pos": step}, gen, {"graph": "t"}, keep=keep)


def test_save_load_restore_and_keep(tmp_path):
    for s in (1, 2, 3, 4, 5):
        save_step(tmp_path, s, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004", "step-00000005"]
    assert (tmp_path / "checkpoint").resolve().name == "step-00000005"
    state, ck = checkpoint.load(tmp_path)
    assert state["step"] == 5 and state["data"] == {"pos": 5}
    m, opt, sched, gen = parts(0.0)
    checkpoint.restore(ck, {"drafter": m}, opt, sched, gen)
    assert torch.all(m.weight == 5.0)
    manifest = json.loads((ck / "manifest.json").read_text())
    assert set(manifest["files"]) == {"drafter.safetensors", "trainer.pt", "state.json"}


@pytest.mark.parametrize("damage", ["truncate", "flip", "state_json", "manifest", "missing"])
def test_corrupted_newest_falls_back_to_the_previous(tmp_path, damage, capsys):
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    ck = tmp_path / "checkpoints" / "step-00000002"
    w = ck / "drafter.safetensors"
    if damage == "truncate":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif damage == "flip":
        b = bytearray(w.read_bytes())
        b[len(b) - 3] ^= 0xFF
        w.write_bytes(bytes(b))
    elif damage == "state_json":
        (ck / "state.json").write_text("{ not json")
    elif damage == "manifest":
        (ck / "manifest.json").write_text("[")
    else:
        (ck / "trainer.pt").unlink()
    state, used = checkpoint.load(tmp_path)
    assert state["step"] == 1 and used.name == "step-00000001"
    err = capsys.readouterr().err
    assert "step-00000002 is unusable" in err and "resuming from" in err


def test_no_good_checkpoint_is_a_located_error(tmp_path):
    save_step(tmp_path, 1)
    (tmp_path / "checkpoints" / "step-00000001" / "state.json").write_text("")
    with pytest.raises(GraphError) as e:
        checkpoint.load(tmp_path)
    assert "step-00000001: error: unusable checkpoint" in str(e.value)
    with pytest.raises(GraphError, match="no such directory"):
        checkpoint.load(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GraphError, match="holds no checkpoint"):
        checkpoint.load(tmp_path / "empty")


def test_trainer_file_is_never_unpickled_as_code(tmp_path):
    """A trainer.pt holding an arbitrary object (with a manifest that matches it) is refused, not run."""
    save_step(tmp_path, 1)
    ck = tmp_path / "checkpoints" / "step-00000001"
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer": Evil()}, ck / "trainer.pt")
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["trainer.pt"] = {"bytes": (ck / "trainer.pt").stat().st_size,
                                       "sha256": checkpoint._sha256(ck / "trainer.pt")}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    _, used = checkpoint.load(tmp_path)
    m, opt, sched, gen = parts()
    with pytest.raises(GraphError, match="weights_only=True"):
        checkpoint.restore(used, {"drafter": m}, opt, sched, gen)
    assert not marker.exists()


def test_leftover_temporaries_are_cleaned(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-step-00000009-123").mkdir(parents=True)
    (tmp_path / ".checkpoint.tmp999").mkdir()
    save_step(tmp_path, 1)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")) and not list(tmp_path.glob(".checkpoint.tmp*"))


def test_the_older_layout_still_resumes(tmp_path):
    """A run directory written before checkpoints/ existed: `checkpoint/` is a directory without a manifest."""
    save_step(tmp_path, 3)
    legacy = tmp_path / "old"
    legacy.mkdir()
    src = tmp_path / "checkpoints" / "step-00000003"
    (legacy / "checkpoint").mkdir()
    for f in ("drafter.safetensors", "trainer.pt", "state.json"):
        (legacy / "checkpoint" / f).write_bytes((src / f).read_bytes())
    state, ck = checkpoint.load(legacy)
    assert state["step"] == 3 and ck == legacy / "checkpoint"
    save_step(legacy, 4)           # the old directory becomes a fallback, the link the newest
    assert checkpoint.load(legacy)[0]["step"] == 4 and (legacy / ".checkpoint.old" / "state.json").exists()


def test_resume_keeps_the_metrics_through_the_checkpoint(tmp_path, capsys):
    """A run killed after its last checkpoint (step 2) wrote records of steps 3 and 4, the last cut short: a resume
    keeps steps 1-2 (3 and 4 are computed again), says it dropped the partial line, and leaves no temporary."""
    from dflash_graph.train.trainer import _metrics_through

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    (tmp_path / ".metrics.jsonl.tmp123").write_text("left by a kill during an earlier rewrite")
    _metrics_through(path, 2)
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [1, 2]
    assert path.read_text().endswith("\n") and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    assert f"note: {path}: dropped 1 line(s) that are not complete JSON" in capsys.readouterr().err


def _writer(d: Path, start: int, ready_w: int) -> None:
    """The child: save steps start, start+1, ... until killed (each step's weights filled with the step)."""
    try:
        torch.set_num_threads(1)
        m = torch.nn.Linear(256, 256)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        gen = torch.Generator().manual_seed(0)
        os.write(ready_w, b"r")
        step = start
        while True:
            with torch.no_grad():
                for p in m.parameters():
                    p.fill_(float(step))
            checkpoint.save(d, step, {"drafter": m}, opt, sched, {"pos": step}, gen, {}, keep=2)
            step += 1
    finally:
        os._exit(1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_sigkill_during_saves_always_leaves_a_good_checkpoint(tmp_path):
    d = tmp_path / "run"
    rnd = random.Random(11)
    last = 0
    mid_save = 0
    for kill in range(20):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _writer(d, last + 1, w)
        os.close(w)
        assert os.read(r, 1) == b"r"
        os.close(r)
        if kill == 0:                # at least one complete save before the first kill
            while not checkpoint._steps(d):
                time.sleep(0.005)
        time.sleep(rnd.uniform(0.0, 0.15))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        mid_save += bool(list((d / "checkpoints").glob(".tmp-*")))   # killed while a save was in flight
        state, ck = checkpoint.load(d)
        assert checkpoint.verify(ck) is None
        assert state["step"] >= last, "a kill never loses a checkpoint that was complete"
        m = torch.nn.Linear(256, 256)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        checkpoint.restore(ck, {"drafter": m}, opt, sched, torch.Generator())
        assert torch.all(m.weight == float(state["step"])), "the checkpoint holds exactly its step's weights"
        last = state["step"]
    assert last >= 2
    assert mid_save >= 5, f"only {mid_save} of 20 kills landed inside a save"
    print(f"20 kills, {mid_save} inside a save; last step {last}")


# ---- whole `dflash-graph run` processes SIGKILLed inside their saves ----------------------------------------------

RUN_SETS = ["train.checkpoint_every=1", "train.eval_every=0", "train.threads=1", "train.keep_checkpoints=3"]
# what a step's record says about training (the rest is timing and memory, which differ from run to run)
TRAINING_FIELDS = ("step", "loss", "slot_acc", "acc", "tau", "slot_accept", "lr", "grad_norm")


def _run_cmd(out: Path, steps: int, resume: bool) -> list[str]:
    return [sys.executable, "-m", "dflash_graph", "run", "graphs/tiny.toml", "--steps", str(steps), "--out", str(out),
            "--no-progress", *(x for s in RUN_SETS for x in ("--set", s)), *(["--resume", str(out)] if resume else [])]


def _start(cmd: list[str], log: Path, hook: str | None = None, pass_fds=()) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(checkpoint.HOOK_ENV, None)
    env.pop("WORLD_SIZE", None)
    if hook is not None:
        env[checkpoint.HOOK_ENV] = hook
    with open(log, "w") as f:   # the child holds its own copy of the file
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, pass_fds=pass_fds,
                                start_new_session=True)


class _Points:
    """The save hook's reports (`STEP POINT TIME` lines) read from a pipe as they come."""

    def __init__(self, fd: int):
        self.fd, self.buf, self.seen = fd, b"", []

    def _take(self, data: bytes) -> None:
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for ln in lines:
            step, point, at = ln.decode().split()
            self.seen.append((int(step), point, float(at)))

    def wait_for(self, step: int, point: str, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not any(s == step and p == point for s, p, _ in self.seen):
            assert time.monotonic() < deadline, f"the run never reached '{point}' in the save of step {step}"
            ready, _, _ = select.select([self.fd], [], [], 0.5)
            if ready:
                data = os.read(self.fd, 65536)
                assert data or proc.poll() is None, f"the run ended before the save of step {step}:\n{log.read_text()}"
                self._take(data)
            else:
                assert proc.poll() is None, f"the run ended before the save of step {step}:\n{log.read_text()}"

    def drain(self) -> None:
        """After the kill: everything the process wrote before it died (the write end is closed by then)."""
        while data := os.read(self.fd, 65536):
            self._take(data)
        os.close(self.fd)


def _records(out: Path) -> list[dict]:
    """metrics.jsonl's records, a last line cut short left out (what resume also drops)."""
    recs = []
    for ln in (out / "metrics.jsonl").read_text().splitlines():
        try:
            recs.append(json.loads(ln))
        except ValueError:
            pass
    return recs


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _kill_runs_inside_saves(tmp_path: Path, kills: int, steps: int, seed: int) -> dict:
    """Run `dflash-graph run` (a checkpoint every step) and SIGKILL it `kills` times inside a save, each time at a
    random step: at a named point of the save (the hook stops it there and the test kills its process group) or at
    a random moment after the save began (the run kills itself, between two points, maybe in the middle of writing
    a file). With at least as many kills as points, each point once in a random order and then random moments;
    with fewer, a random point of each phase in turn (before the rename, between it and the link, after). After
    each kill, `--resume` must load the newest checkpoint that was renamed into place before the kill (no complete
    one lost, no incomplete one taken) and continue. An uninterrupted run of the same steps runs alongside; every
    record the killed runs ever wrote to metrics.jsonl, and the final file (each step once), must equal its records
    exactly, and the final checkpoints must hold the same weights and optimizer state."""
    rnd = random.Random(seed)
    out, ref = tmp_path / "killed", tmp_path / "ref"
    points = checkpoint.SAVE_POINTS
    if kills >= len(points):     # every point once, in a random order, then kills at random moments
        plan = rnd.sample(points, len(points)) + ["timed"] * (kills - len(points))
    else:                        # a random point of each phase in turn: before the rename, before the link, after
        phases = [points[:points.index("renamed")], points[points.index("renamed"):points.index("linked")],
                  points[points.index("linked"):]]
        plan = [rnd.choice(phases[k % 3]) for k in range(kills)]
    procs: list[subprocess.Popen] = []
    landed: list[tuple[int, str, bool]] = []     # (step, where the kill landed, inside a save)
    written: list[dict] = []                     # every record the killed runs wrote, before each resume
    durations = [0.05]                           # seconds a save took, from the hook's reports
    torn_at = rnd.randrange(kills)               # after this kill, a line cut short is appended (see below)
    try:
        procs.append(_start(_run_cmd(ref, steps, resume=False), tmp_path / "ref.log"))
        done = 0                                 # the newest checkpoint renamed into place
        for i, kind in enumerate(plan):
            # a kill in the first save would leave no checkpoint to resume from: the first one targets step 2 on;
            # each leaves steps for the kills after it and for the final resume (a resume of a finished run
            # changes nothing, train/rundir.py)
            target = rnd.randint(max(done + 1, 2), min(done + 3, steps - kills + i))
            r, w = os.pipe()
            # timed: the run SIGKILLs itself a random moment within the first quartile of the save durations seen
            # (most saves last longer, so most such kills land inside the save; the rest are reported as outside)
            delay = rnd.uniform(0, sorted(durations)[len(durations) // 4])
            hook = f"{w}:{target}:{f'+{delay:.4f}' if kind == 'timed' else kind}"
            log = tmp_path / f"kill{i}.log"
            p = _start(_run_cmd(out, steps, resume=i > 0), log, hook, pass_fds=(w,))
            procs.append(p)
            os.close(w)
            reports = _Points(r)
            reports.wait_for(target, "begin" if kind == "timed" else kind, p, log)
            if kind == "timed":
                p.wait(timeout=60)
            else:
                os.killpg(p.pid, signal.SIGKILL)
            assert p.wait() == -signal.SIGKILL
            reports.drain()
            for s in {s for s, _, _ in reports.seen}:
                t = {pt: at for st, pt, at in reports.seen if st == s}
                if "begin" in t and "pruned" in t:
                    durations.append(t["pruned"] - t["begin"])
            step, where = reports.seen[-1][:2]
            if kind == "timed":     # past the last point reached, before the next; after `pruned`: save() returned
                inside = where != "pruned"
                where = f"after {where} (timed)"
            else:                   # stopped at the point: inside save(), which has not returned
                assert (step, where) == (target, kind), reports.seen[-1]
                inside = True
            assert "Traceback" not in log.read_text(), log.read_text()
            # what a resume must find: exactly the newest step renamed into place, complete. A timed kill after
            # `manifest-written` and before `renamed` was reported may fall before or after the rename itself.
            expect = {max([done] + [s for s, pt, _ in reports.seen if pt == "renamed"])}
            if kind == "timed" and where.startswith("after manifest-written"):
                expect.add(step)
            state, ck = checkpoint.load(out)
            assert state["step"] in expect and checkpoint.verify(ck) is None, (i, kind, target, state["step"], expect)
            done = state["step"]
            if len(expect) > 1:
                where += ", after the rename" if done == step else ", before the rename"
            landed.append((step, where, inside))
            if i == torn_at + 1:
                assert "dropped 1 line(s) that are not complete JSON" in log.read_text(), log.read_text()
            written += _records(out)
            if i == torn_at:   # a kill while a record was being written leaves part of a line (simulated here)
                with open(out / "metrics.jsonl", "a") as f:
                    f.write('{"step": %d, "loss": 1.2' % (step + 1))
        log = tmp_path / "final.log"
        p = _start(_run_cmd(out, steps, resume=True), log)
        procs.append(p)
        assert p.wait(timeout=300) == 0, log.read_text()
        assert f"done: {steps} steps" in log.read_text()
        if torn_at == kills - 1:
            assert "dropped 1 line(s) that are not complete JSON" in log.read_text(), log.read_text()
        assert procs[0].wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    assert all(_gone(p.pid) for p in procs), "a process the test started is still alive"
    want = {r["step"]: {k: r[k] for k in TRAINING_FIELDS} for r in _records(ref)}
    final = _records(out)
    assert [r["step"] for r in final] == list(range(1, steps + 1))
    assert [{k: r[k] for k in TRAINING_FIELDS} for r in final] == [want[s] for s in range(1, steps + 1)]
    for r in written:
        assert {k: r[k] for k in TRAINING_FIELDS} == want[r["step"]], r["step"]
    a, b = checkpoint.load(ref)[1], checkpoint.load(out)[1]
    for name in ("drafter.safetensors",):
        wa, wb = load_file(str(a / name)), load_file(str(b / name))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ta, tb = (torch.load(ck / "trainer.pt", weights_only=True) for ck in (a, b))
    assert all(torch.equal(x, y) for x, y in zip(ta["masters"], tb["masters"]))
    sa, sb = ta["optimizer"]["state"], tb["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k][f], sb[k][f]) for k in sa for f in sa[k])
    inside = sum(x[2] for x in landed)
    ms = sorted(round(1000 * d) for d in durations[1:]) or [0]
    print(f"\n{kills} kills, {inside} inside a save; {steps} steps compared ({len(written)} records before resumes); "
          f"a complete save took {ms[0]}-{ms[-1]} ms (median {ms[len(ms) // 2]}):")
    for step, where, _ in landed:
        print(f"  step {step}: {where}")
    return {"landed": landed, "inside": inside, "written": len(written)}


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="needs process groups")
def test_sigkilled_runs_resume_from_a_good_checkpoint_with_the_uninterrupted_losses(tmp_path):
    res = _kill_runs_inside_saves(tmp_path, kills=3, steps=6, seed=3)
    assert res["inside"] == 3


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "killpg"), reason="needs process groups")
def test_twenty_sigkills_of_runs_inside_saves(tmp_path):
    res = _kill_runs_inside_saves(tmp_path, kills=20, steps=30, seed=20)
    assert res["inside"] >= 15, res["landed"]
