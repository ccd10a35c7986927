"""`dflash-graph run` under torchrun on CPU (gloo): one process per rank gives the losses of one process, resumes
exactly, holds the receive queue check counts, and stops every rank when one is killed or frozen.

Every launch runs in its own session and is killed with its whole process group when the test ends, pass or fail.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from dflash_graph.cli.main import main

from test_run import SMALL_27B, read_metrics, sets

ROOT = Path(__file__).resolve().parent.parent


def as_torchrun_rank(monkeypatch, world: int, rank: int) -> list[int]:
    """This process as rank `rank` of a torchrun launch of `world` processes that has not made its process group
    yet (what the launch's verdict sees): its os._exit recorded (the codes, returned) and raised as SystemExit,
    no signal handlers installed, no wait for a verdict."""
    from dflash_graph.exec import distributed as D

    exits: list[int] = []

    def _exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(D.os, "_exit", _exit)
    monkeypatch.setattr(D.signal, "signal", lambda *a: None)
    monkeypatch.setattr(D, "VERDICT_WAIT", 0.0)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    return exits


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("WORLD_SIZE", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched(torchrun_args, run_args):
    """Start `torchrun ... -m dflash_graph run ...` in a new session; always kill the session at the end."""
    with session([sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "dflash_graph", "run",
                  *run_args, "--no-progress"]) as p:
        yield p


@contextmanager
def session(cmd):
    """Start `cmd` in a new session; always kill the session at the end, pass or fail."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        yield p
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def torchrun(nproc, run_args, timeout=300):
    with launched(["--standalone", "--nproc-per-node", str(nproc)], run_args) as p:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out


def ctrl_c_after_step_2(p, out) -> str:
    """Ctrl-C at a terminal (SIGINT to the whole process group) once the run in `out` has logged step 2; what the
    launch printed, after every process of it has gone."""
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2):
        assert p.poll() is None, p.stdout.read()
        assert time.monotonic() < deadline, "the run never reached step 2"
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)
    text, _ = p.communicate(timeout=120)
    assert session_gone(p.pid), "a process of the run is still alive"
    return text


def session_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_three_ranks_give_the_losses_of_one_process_and_resume_exactly(in_repo, tmp_path):
    one, dist_ = tmp_path / "one", tmp_path / "dist"
    assert main(["run", "graphs/tiny.toml", "--steps", "4", "--out", str(one), "--no-progress"]) == 0
    code, out = torchrun(3, ["graphs/tiny.toml", "--steps", "2", "--out", str(dist_)])
    assert code == 0, out
    code, out = torchrun(3, ["graphs/tiny.toml", "--steps", "4", "--out", str(dist_), "--resume", str(dist_)])
    assert code == 0, out
    a, b = read_metrics(one), read_metrics(dist_)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-5 * abs(ra["loss"]), (ra["loss"], rb["loss"])
        assert set(rb["ranks"]) == {"0", "1", "2"}
        assert all(v["busy_s"] > 0 and v["wait_s"] >= 0 for v in rb["ranks"].values())
    mem = json.loads((dist_ / "memory.json").read_text())
    assert mem["processes"] == 3
    assert {d: v["rank"] for d, v in mem["devices"].items()} == {"t0": 0, "t1": 1, "draft": 2}
    for name, d in mem["devices"].items():
        assert 0.9 <= d["measured_peak_bytes"] / d["predicted_peak_bytes"] <= 1.1, (name, d)
    assert {p.name for p in (dist_ / "ranks").iterdir()} == {"rank0.json", "rank1.json", "rank2.json"}
    assert json.loads((dist_ / "ranks" / "rank2.json").read_text())["writer"] is True
    # the held-out evaluation ran inside the job at each invocation's last step, as in one process at step 4
    assert [r["step"] for r in b if "heldout" in r] == [2, 4]
    ha, hb = a[3]["heldout"], b[3]["heldout"]
    assert abs(ha["loss"] - hb["loss"]) <= 1e-4 * ha["loss"] and abs(ha["tau"] - hb["tau"]) <= 0.01, (ha, hb)


EVAL_EVERY_STEP = sets(["train.eval_every=1", "train.eval_batches=2"])


@pytest.mark.slow     # 19-67 s (tiny) and 60 s (tiny_dp) on the shared 2-core machine, with its load
@pytest.mark.parametrize("graph, nproc, extra", [
    # the drafter on another torch device than the targets: the evaluator's replica dropped its lm_head, which the
    # writer sends with the drafter's weights
    ("graphs/tiny.toml", 3, ["devices.draft.torch=cpu:0"]),
    # a drafter sharded over two ranks: all-gathered before it is sent
    ("graphs/tiny_dp.toml", 4, ["models.drafter.parallel=fsdp"]),
], ids=["tiny-lm-head-dropped", "tiny_dp-fsdp"])
def test_a_plain_torchrun_run_evaluates_the_held_out_split_at_each_eval_step(in_repo, tmp_path, graph, nproc, extra):
    """`torchrun ... -m dflash_graph run` (not launch) runs the held-out evaluation inside the job at every
    eval_every step: printed, recorded in metrics.jsonl and in the summary, equal to the run in one process."""
    one, out = tmp_path / "one", tmp_path / "dist"
    assert main(["run", "graphs/tiny.toml", "--steps", "2", *EVAL_EVERY_STEP, "--out", str(one), "--no-progress"]) == 0
    code, text = torchrun(nproc, [graph, "--steps", "2", *EVAL_EVERY_STEP, *sets(extra), "--out", str(out)], 600)
    assert code == 0, text
    a, b = read_metrics(one), read_metrics(out)
    assert [r["step"] for r in b if "heldout" in r] == [1, 2]
    for ra, rb in zip(a, b):
        ha, hb = ra["heldout"], rb["heldout"]
        assert ha["anchors"] == hb["anchors"] and ha["sequences"] == hb["sequences"], (ha, hb)
        assert abs(ha["loss"] - hb["loss"]) <= 1e-4 * ha["loss"] and abs(ha["tau"] - hb["tau"]) <= 0.01, (ha, hb)
        assert f"held-out @ step {rb['step']}: loss {hb['loss']:.4f} | tau {hb['tau']}" in text, text
    assert f"held-out tau: {b[-1]['heldout']['tau']} (step 2, " in text and "not measured" not in text, text


@pytest.mark.slow     # 31-53 s on the shared 2-core machine
def test_a_rank_killed_during_the_held_out_evaluation_stops_every_rank_named(in_repo, tmp_path):
    """SIGKILL of rank 1 (t1) while rank 0 (t0) evaluates the held-out split of step 2 (a long evaluation: 900
    held-out documents, up to 400 sequences per replica) and the writer waits for it: both name it and exit, the writer saves step 2, no process
    is left. The evaluator's line says it was evaluating, so the kill did land inside the evaluation."""
    out = tmp_path / "run"
    with launched(["--standalone", "--nproc-per-node", "3"],
                  ["graphs/tiny.toml", "--steps", "4", "--out", str(out),
                   *sets(["data.holdout=900", "train.eval_every=2", "train.eval_batches=400"])]) as p:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 1):
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "the run never reached step 1"
            time.sleep(0.2)
        time.sleep(8)       # step 2 trains (well under a second here), then the evaluation runs for minutes
        pids = [json.loads((out / "ranks" / f"rank{k}.json").read_text())["pid"] for k in range(3)]
        assert p.poll() is None and len(read_metrics(out)) == 1, "the evaluation of step 2 ended before the kill"
        os.kill(pids[1], signal.SIGKILL)
        text, _ = p.communicate(timeout=120)
        gone = session_gone(p.pid)
    assert p.returncode != 0 and gone, text
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    reports = [ln for ln in text.splitlines() if ln.startswith("dflash-graph: rank")]
    print("\n" + "\n".join(reports))
    assert {ln.split()[2] for ln in reports} == {"0", "2"}, text
    for ln in reports:
        assert "lost rank 1 (t1; pid" in ln and "killed (SIGKILL" in ln, ln
    evaluator = next(ln for ln in reports if ln.startswith("dflash-graph: rank 0 (t0)"))
    assert "at step 2" in evaluator or "stops at step 2" in evaluator, evaluator
    assert "node 'held-out evaluation: " in evaluator, evaluator
    writer = next(ln for ln in reports if ln.startswith("dflash-graph: rank 2 (draft)"))
    assert "checkpoint of step 2 saved" in writer and "--resume" in writer, writer
    # the step the checkpoint holds is in metrics.jsonl too, without the evaluation that did not end
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and "heldout" not in read_metrics(out)[1]


def _kill_one_rank(tmp_path, sig, extra=()):
    """Start a long 3-rank run, wait for two steps, send `sig` to rank 1 (t1); return what happened."""
    out = tmp_path / "run"
    with launched(["--standalone", "--nproc-per-node", "3"],
                  ["graphs/tiny.toml", "--steps", "500", "--out", str(out), *extra]) as p:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2):
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "the run never reached step 2"
            time.sleep(0.2)
        pids = [json.loads((out / "ranks" / f"rank{k}.json").read_text())["pid"] for k in range(3)]
        os.kill(pids[1], sig)
        t0 = time.monotonic()
        text, _ = p.communicate(timeout=120)
        elapsed = time.monotonic() - t0
        code = p.returncode
        gone = session_gone(p.pid)
    print(f"\n{signal.Signals(sig).name} of rank 1: torchrun exited {code} after {elapsed:.1f} s")
    return code, text, elapsed, gone, pids, out


def _assert_stopped_cleanly(code, text, elapsed, gone, pids, out):
    assert code != 0
    assert elapsed < 60
    assert gone, "a process of the run is still alive"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    reports = [ln for ln in text.splitlines() if ln.startswith("dflash-graph: rank")]
    assert len(reports) == 2, text                       # rank 0 and rank 2 each say why they stop
    for ln in reports:
        assert "lost rank 1 (t1; pid" in ln and "at step" in ln and "node '" in ln, ln
    writer = next(ln for ln in reports if ln.startswith("dflash-graph: rank 2 (draft)"))
    assert "checkpoint of step" in writer and "--resume" in writer
    assert (out / "checkpoint" / "state.json").exists()
    return reports


def test_a_killed_rank_stops_every_other_rank_with_the_cause(in_repo, tmp_path):
    """Whether a rank sees the broken connection first or torchrun's SIGTERM does, the killed rank is named as
    killed, by both other ranks alike."""
    reports = _assert_stopped_cleanly(*_kill_one_rank(tmp_path, signal.SIGKILL))
    for ln in reports:
        assert "killed (SIGKILL" in ln and "SIGTERM" not in ln, ln


@pytest.mark.slow
def test_a_frozen_rank_stops_every_other_rank_with_the_cause(in_repo, tmp_path):
    code, text, elapsed, gone, pids, out = _kill_one_rank(tmp_path, signal.SIGSTOP)
    _assert_stopped_cleanly(code, text, elapsed, gone, pids, out)
    assert "no heartbeat" in text


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_is_one_interrupt(in_repo, tmp_path):
    """Ctrl-C at a terminal: SIGINT to torchrun and every rank at once (torchrun forwards one more). One line says
    the run was interrupted and what was saved; no rank reports a lost peer; every rank exits 130 (each rank runs
    under this file's __main__, which records its status). torchrun itself, which got the SIGINT too, exits 1 on
    its own (docs/distributed.md)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(ROOT / "tests" / "test_distributed.py"), str(out), "graphs/tiny.toml", "--steps", "500", "--out",
           str(out), "--no-progress"]
    with session(cmd) as p:
        text = ctrl_c_after_step_2(p, out)
    said = [ln for ln in text.splitlines() if ln.startswith(("interrupted", "dflash-graph:"))]
    assert len(said) == 1 and said[0].startswith("interrupted: Ctrl-C (SIGINT, first seen by rank "), text
    assert "; checkpoint of step " in said[0] and f"continue with --resume {out}" in said[0], said
    assert "lost" not in text and "Connection closed" not in text, text
    step = json.loads((out / "checkpoint" / "state.json").read_text())["step"]
    assert f"checkpoint of step {step} saved" in said[0] and step >= 2
    assert {f.name: f.read_text() for f in out.glob("status.*")} == {f"status.{k}": "130" for k in range(3)}


RANK_MAP = ["--set", "devices.t0.rank=0", "--set", "devices.t1.rank=0", "--set", "devices.draft.rank=1"]


def test_two_nodes_on_localhost_with_a_c10d_rendezvous_and_a_rank_map(in_repo, tmp_path):
    """Two torchrun launches, --nnodes 2, meeting at a c10d rendezvous on 127.0.0.1. A declared rank map puts
    both target replicas in one process (node 0) and the drafter in another (node 1); the losses are still those
    of one process."""
    one, out = tmp_path / "one", tmp_path / "n"
    assert main(["run", "graphs/tiny.toml", "--steps", "2", "--out", str(one), "--no-progress"]) == 0
    port = free_port()
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "t"]
    args = ["graphs/tiny.toml", *RANK_MAP, "--steps", "2", "--out", str(out)]
    with launched([*rdzv, "--node-rank", "0"], args) as a, launched([*rdzv, "--node-rank", "1"], args) as b:
        ta, _ = a.communicate(timeout=300)
        tb, _ = b.communicate(timeout=300)
        assert a.returncode == 0 and b.returncode == 0, ta + tb
    for ra, rb in zip(read_metrics(one), read_metrics(out)):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-5 * abs(ra["loss"])
        assert set(rb["ranks"]) == {"0", "1"}
    mem = json.loads((out / "memory.json").read_text())
    assert mem["processes"] == 2
    assert {d: v["rank"] for d, v in mem["devices"].items()} == {"t0": 0, "t1": 0, "draft": 1}


@pytest.mark.slow
def test_the_27b_topology_holds_its_queue_under_torchrun(in_repo, tmp_path):
    """Eight ranks (seven targets, the drafter) at small dims: the drafter rank really holds the seven-deep
    receive queue that check counts, so every rank's measured peak is within 10% of its prediction."""
    out = tmp_path / "q"
    code, text = torchrun(8, ["graphs/qwen27b.toml", *sets(SMALL_27B), "--device-map", "cuda:*=cpu", "--steps", "2",
                              "--out", str(out)], timeout=600)
    assert code == 0, text
    mem = json.loads((out / "memory.json").read_text())
    assert set(mem["devices"]) == {f"gpu{i}" for i in range(8)}
    for name, d in mem["devices"].items():
        assert 0.9 <= d["measured_peak_bytes"] / d["predicted_peak_bytes"] <= 1.1, (name, d)


def test_nonfinite_steps_in_a_row_stop_every_rank_with_the_writers_cause(in_repo, tmp_path):
    """The writer alone decides to skip (it holds the loss and the optimizer); when K skipped steps in a row stop
    the run, it exits 2 and every other rank stops at its next wait naming its cause (exit 4), none hangs."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(ROOT / "tests" / "test_run_failures.py"), "3,4,5", "graphs/tiny.toml", "--steps", "8", "--out", str(out),
           "--no-progress", "--set", "train.checkpoint_every=2"]
    with session(cmd) as p:
        text, _ = p.communicate(timeout=240)
    assert p.returncode != 0
    writer = [ln for ln in text.splitlines() if ln.startswith("dflash-graph: rank 2 (draft): ")]
    assert len(writer) == 1 and "steps 3-5: the loss or gradient norm was not finite" in writer[0], text
    assert "exitcode  : 2" in text
    others = [ln for ln in text.splitlines() if ln.startswith(("dflash-graph: rank 0 (t0) stops",
                                                                "dflash-graph: rank 1 (t1) stops"))]
    assert len(others) == 2, text
    assert all("rank 2 (draft) stopped the run: " in ln and "steps 3-5: the loss" in ln for ln in others), others
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 4


def test_a_checkpoint_the_writer_cannot_resume_stops_every_rank_with_its_error(in_repo, tmp_path):
    """The writer refuses a checkpoint of another drafter shape (exit 2); the ranks waiting for the step to resume
    from stop naming that error (exit 4), not with a broken connection or an internal error."""
    out = tmp_path / "run"
    assert main(["run", "graphs/tiny.toml", "--steps", "1", "--out", str(out), "--no-progress"]) == 0
    (out / "run.json").unlink()          # no record to compare the graph with: the checkpoint itself refuses
    code, text = torchrun(3, ["graphs/tiny.toml", "--steps", "2", "--resume", str(out),
                              "--set", "models.drafter.config.intermediate_size=128"], timeout=240)
    assert code != 0
    assert "internal error" not in text and "exitcode  : 3" not in text, text
    writer = [ln for ln in text.splitlines() if ln.startswith("dflash-graph: rank 2 (draft): ")]
    assert len(writer) == 1 and "this checkpoint does not fit the drafter 'drafter'" in writer[0], text
    others = [ln for ln in text.splitlines() if ln.startswith(("dflash-graph: rank 0 (t0) stops",
                                                                "dflash-graph: rank 1 (t1) stops"))]
    assert len(others) == 2 and all("rank 2 (draft) cannot resume: " in ln for ln in others), text


# -- what a rank reports when another one stops: the fault logic of exec/distributed.Comm on an in-memory store,
# -- with real processes as the peers (fast: no process group, no torchrun) -----------------------------------

def _comm(peers: dict[int, subprocess.Popen]):
    """Rank 2 (draft) of a 3-rank launch whose ranks 0 and 1 are `peers`' processes, each having published one
    heartbeat as a running rank, as Comm.__init__ sets them up (no process group: only the store is used)."""
    import torch.distributed as dist

    from dflash_graph.exec import distributed as D

    store = dist.HashStore()
    c = object.__new__(D.Comm)
    c.rank, c.world = 2, 3
    c.devices_of_rank = {0: ["t0"], 1: ["t1"], 2: ["draft"]}
    c.stall, c.where, c.store, c.me = 30.0, D.Where(step=3, node="loss", replica=0), store, D._identity()
    c._terminated, c.interrupted, c._seen, c._last_check = False, None, {}, 0.0
    c.beat = D._Beat(store, 2, c.where, {**c.me, "devices": ["draft"]})
    for k, p in peers.items():
        stat = D._proc_stat(p.pid)
        peer = D._Beat(store, k, D.Where(step=3, node="target", replica=k), {
            **c.me, "pid": p.pid, "start": stat[1], "devices": c.devices_of_rank[k]})
        peer.publish()
    return c


@contextmanager
def _peers(n=2):
    ps = {k: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for k in range(n)}
    try:
        yield ps
    finally:
        for p in ps.values():
            p.kill()
            p.wait()


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_the_launchers_sigterm_after_a_sigkill_names_the_killed_rank(reaped):
    """torchrun sees a SIGKILLed rank die and sends SIGTERM to the others, often before they noticed anything:
    the report names the killed rank as killed, not 'the launcher stopped this rank (SIGTERM)'. A zombie (killed,
    not yet reaped by torchrun) is gone too."""
    with _peers() as ps:
        c = _comm(ps)
        ps[1].kill()
        if reaped:
            ps[1].wait()
        else:
            while _state(ps[1].pid) != "Z":
                time.sleep(0.01)
        c._terminated = True
        from dflash_graph.exec.distributed import RankLost

        with pytest.raises(RankLost) as e:
            c.set_where(3, "loss", 0)
    msg = str(e.value)
    assert msg.startswith("rank 2 (draft) stops at step 3, node 'loss', replica 0: lost rank 1 (t1; pid "), msg
    assert "killed (SIGKILL" in msg and "SIGTERM" not in msg, msg
    assert c.store.get("fault").decode() in msg            # every other rank reports the same cause


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_the_launchers_sigterm_while_every_rank_runs_says_torchrun_was_stopped():
    with _peers() as ps:
        c = _comm(ps)
        c._terminated = True
        from dflash_graph.exec.distributed import RankLost

        with pytest.raises(RankLost) as e:
            c.set_where(3, "loss", 0)
    assert "while every rank was running: torchrun itself was told to stop" in str(e.value)
    assert "lost rank" not in str(e.value)


def test_a_failed_receive_from_a_killed_rank_says_killed():
    with _peers() as ps:
        c = _comm(ps)
        ps[0].kill()
        ps[0].wait()
        e = c._failed(0, "posting the receive of 'features_tx' failed on rank 2 (Connection closed by peer)")
    assert type(e).__name__ == "RankLost"
    assert "lost rank 0 (t0; pid" in str(e) and "killed (SIGKILL" in str(e) and "Connection closed by peer" in str(e)


def test_a_peer_that_stopped_for_ctrl_c_is_an_interrupt_not_a_lost_rank():
    """Ctrl-C to the process group: a rank whose peer stopped first sees its receive fail ('Connection closed by
    peer'); the interrupt the peer recorded makes it an interrupt on this rank too."""
    from dflash_graph.exec.distributed import INTERRUPT, Interrupted

    with _peers() as ps:
        c = _comm(ps)
        c.store.set("fault", f"{INTERRUPT}Ctrl-C (SIGINT, first seen by rank 0 (t0))")
        ps[0].kill()
        ps[0].wait()
        e = c._failed(0, "posting the receive of 'features_tx' failed on rank 2 (Connection closed by peer)")
    assert isinstance(e, Interrupted) and str(e) == "Ctrl-C (SIGINT, first seen by rank 0 (t0))"
    assert json.loads(c.store.get("beat/2"))["state"] == "interrupted"


def test_ctrl_c_on_this_rank_wins_over_the_peers_closed_connection():
    import signal as signal_

    from dflash_graph.exec.distributed import Interrupted

    with _peers() as ps:
        c = _comm(ps)
        c._on_sigint(signal_.SIGINT, None)
        c._on_sigint(signal_.SIGINT, None)     # torchrun forwards a second one: the same request
        e = c._failed(0, "posting the receive failed (Connection closed by peer)")
        assert isinstance(e, Interrupted) and "first seen by rank 2 (draft)" in str(e)
        with pytest.raises(Interrupted):
            c.set_where(4, "hooks", 1)
    assert c.store.get("fault").decode() == "interrupted: Ctrl-C (SIGINT, first seen by rank 2 (draft))"


def test_a_fault_recorded_before_the_interrupt_stays_the_cause():
    from dflash_graph.exec.distributed import RankLost

    with _peers() as ps:
        c = _comm(ps)
        c.store.set("fault", "rank 0 (t0) stopped the run: graphs/tiny.toml: error at data.corpus: no such file")
        c._on_sigint(2, None)
        with pytest.raises(RankLost) as e:
            c.set_where(3, "loss", 0)
    assert "rank 0 (t0) stopped the run: graphs/tiny.toml" in str(e.value)


# -- a verdict every rank reaches before the process group exists is printed once per machine ------------------

@pytest.mark.parametrize("local_rank", [0, 1])
def test_a_launch_of_the_wrong_size_is_refused_by_local_rank_0_alone(in_repo, tmp_path, monkeypatch, capsys,
                                                                     local_rank):
    """Every rank of `torchrun --nproc-per-node 2` on a 3-rank graph reaches the same verdict: local rank 0
    prints it, before the memory report, and exits 2; another rank prints nothing and waits for the launcher to
    stop it (torchrun stops the rest when one exits nonzero), then exits 2 too."""
    exits = as_torchrun_rank(monkeypatch, 2, local_rank)
    with pytest.raises(SystemExit):
        main(["run", "graphs/tiny.toml", "--out", str(tmp_path / "run"), "--no-progress"])
    out = capsys.readouterr()
    assert exits == [2]
    said = "torchrun started 2 processes, but the graph's devices map to 3 rank(s)"
    if local_rank == 0:
        assert out.err.count(said) == 1 and "--nproc-per-node 3" in out.err, out.err
        assert out.out == "", out.out          # the refusal comes first, not after the report
        doc = Path("docs/distributed.md").read_text().split("$ torchrun --nproc-per-node 2 ", 1)[1]
        example = doc.split("\n", 1)[1].split("```", 1)[0]     # what docs/distributed.md shows it prints
        assert " ".join(example.split()) == " ".join(out.err.split()), (example, out.err)
    else:
        assert out.err == "" and out.out == "", out
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_torchrun_of_the_wrong_size_prints_the_refusal_once(in_repo, tmp_path):
    code, out = torchrun(2, ["graphs/tiny.toml", "--out", str(tmp_path / "run")], timeout=240)
    assert code != 0
    assert out.count("torchrun started 2 processes, but the graph's devices map to 3 rank(s)") == 1, out
    assert "exitcode  : 2" in out.split("Root Cause")[1], out   # the verdict's status (the other rank may have
                                                                  # been stopped by torchrun before it had one)
    assert "internal error" not in out and "launch (this run)" not in out, out


if __name__ == "__main__":
    # `python tests/test_distributed.py DIR RUN_ARGS...` as a torchrun rank: `python -m dflash_graph run RUN_ARGS` in
    # a child, its exit status written to DIR/status.RANK. This process waits through Ctrl-C (its child gets it).
    signal.signal(signal.SIGINT, lambda *_: None)
    status_dir, *args = sys.argv[1:]
    code = subprocess.call([sys.executable, "-m", "dflash_graph", "run", *args])
    Path(status_dir).mkdir(parents=True, exist_ok=True)
    (Path(status_dir) / f"status.{os.environ['RANK']}").write_text(str(code))
    sys.exit(code)


def test_the_docs_torchrun_commands_run_after_the_quick_start(in_repo):
    """The README's quick start writes runs/<graph name> (runs/tiny); a documented torchrun or `dflash-graph launch`
    command without its own --out would be refused right after it ('runs/tiny already holds a run')."""
    import re

    seen = 0
    for doc in ("docs/distributed.md", "docs/guide.md", "README.md"):
        for block in re.findall(r"```(?:bash|console)\n(.*?)```", Path(doc).read_text(), re.S):
            lines = block.splitlines()
            for i, ln in enumerate(lines):
                if "-m dflash_graph run graphs/tiny.toml" in ln or re.search(r"dflash-graph launch .* run graphs/tiny", ln):
                    seen += 1
                    command = ln + (lines[i + 1] if ln.rstrip().endswith("\\") and i + 1 < len(lines) else "")
                    out = re.findall(r"--out (\S+)", command)
                    assert out and all(o.rstrip("/") != "runs/tiny" for o in out), (doc, ln)
    assert seen >= 3


def test_two_ranks_stopping_on_the_same_error_print_it_once():
    """Both target ranks read the same bad corpus after the process group exists: the first records its error,
    the second finds the very same error recorded and need not print it; a different error is its own."""
    from dflash_graph.exec import distributed as D

    with _peers() as ps:
        a = _comm(ps)
        a.rank, a.devices_of_rank = 0, {0: ["t0"], 1: ["t1"], 2: ["draft"]}
        b = _comm(ps)
        b.store, b.rank, b.beat.store = a.store, 1, a.store
        err = "/tmp/bad.jsonl:301: error: not valid JSON (Expecting ',' delimiter at column 1)"
        D.Comm.active = a
        try:
            assert D.record_exit(err) is False
            D.Comm.active = b
            assert D.record_exit(err) is True
            assert a.store.get("fault").decode() == f"rank 0 (t0) stopped the run: {err}"
            c = _comm(ps)
            D.Comm.active = c
            c.store.set("fault", f"rank 0 (t0) stopped the run: {err}")
            assert D.record_exit("graphs/tiny.toml: error at data.tokenizer: no such file") is False
        finally:
            D.Comm.active = None


@pytest.mark.slow
def test_a_bad_corpus_under_torchrun_is_one_error_and_no_internal_error(in_repo, tmp_path):
    """The target ranks find a bad corpus line after the process group exists (the writer is then waiting in a
    setup broadcast as its source): the error is printed once, the writer names it (exit 4), nothing is exit 3."""
    lines = Path("graphs/tiny/corpus.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:300], '{"text": 3', *lines[300:]]) + "\n")
    code, out = torchrun(3, ["graphs/tiny.toml", "--out", str(tmp_path / "run"), "--set", f"data.corpus={bad}"],
                         timeout=240)
    assert code != 0
    assert out.count(f"{bad}:301: error: not valid JSON") == 2, out   # printed once, named once by the writer
    writer = [ln for ln in out.splitlines() if ln.startswith("dflash-graph: rank 2 (draft) stops")]
    assert len(writer) == 1 and f"stopped the run: {bad}:301: error: not valid JSON" in writer[0], out
    assert "internal error" not in out and "exitcode  : 3" not in out, out


# -- dflash-graph launch: torchrun in this process, ending with the ranks' status and one line, never a traceback ---

def test_launch_gives_torchruns_flags_to_torchrun_and_the_rest_to_run():
    """torchrun's own parser splits the command line, so a flag value that reads like a command (`--rdzv-id run`)
    stays torchrun's; what follows the command goes to every rank unchanged, as `python -m dflash_graph run ...`."""
    from dflash_graph.cli.torchrun import split

    args, command = split(["--nnodes", "2", "--rdzv-id", "run", "--nproc-per-node=3", "run", "graphs/tiny.toml",
                           "--out", "runs/x", "--set", "dims.seq=64"])
    assert (args.nnodes, args.rdzv_id, args.nproc_per_node) == ("2", "run", "3")
    assert command == ["run", "graphs/tiny.toml", "--out", "runs/x", "--set", "dims.seq=64"]
    assert (args.module, args.no_python, args.training_script) == (True, False, "dflash_graph")
    assert args.training_script_args == command


@pytest.mark.parametrize("argv, said", [
    (["--nproc-per-node", "3", "check", "graphs/tiny.toml"], "not `check` (`check` runs in one process"),
    (["--nproc-per-node", "3", "-m", "run", "graphs/tiny.toml"], "-m is not a flag of launch"),
    (["--nproc-per-node", "3", "run", "graphs/tiny.toml", "--stpes", "3"], "(did you mean --steps?)"),
    (["--nproc-per-node", "3", "--no-such-flag", "run", "graphs/tiny.toml"], "unrecognized arguments: --no-such-flag"),
])
def test_a_launch_that_cannot_start_is_refused_once_before_any_rank(monkeypatch, capsys, argv, said):
    import torch.distributed.run as torchrun

    monkeypatch.setattr(torchrun, "run", lambda args: pytest.fail("a rank was started"))
    try:
        code = main(["launch", *argv])
    except SystemExit as e:          # a bad torchrun flag: torchrun's own parser says so (argparse, exit 2)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count(said) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_exits_128_plus_it_with_one_line(in_repo, monkeypatch, capsys, sig):
    """torchrun raises SignalException once it has passed the signal on to the ranks and waited for them; launch
    turns it into the shell's status for that signal (130 for Ctrl-C), with one line and no traceback."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(args):
        assert args.training_script_args[:2] == ["run", "graphs/tiny.toml"]
        raise SignalException(f"Process {os.getpid()} got signal: {int(sig)}", sigval=sig)

    monkeypatch.setattr(torchrun, "run", stopped)
    assert main(["launch", "--nproc-per-node", "3", "run", "graphs/tiny.toml"]) == 128 + int(sig)
    err = capsys.readouterr().err
    assert err.splitlines() == [f"dflash-graph launch: stopped by {sig.name}; every rank has exited "
                                f"(exit {128 + int(sig)})"], err


def _failure(rank, exitcode, at):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")
    f.timestamp = at
    return f


@pytest.mark.parametrize("codes, status, said", [
    ({0: 2, 1: 2}, 2, "rank 0 (pid 1000) exited 2"),                   # a refusal every rank reached
    ({0: 4, 1: 2, 2: 4}, 2, "rank 1 (pid 1001) exited 2"),             # rank 1's own error, the others stopped
    ({0: 4, 1: -9, 2: 4}, 4, "lost rank 1 (pid 1001): killed by SIGKILL"),
    ({1: -9}, 4, "lost rank 1 (pid 1001): killed by SIGKILL"),          # seen before the others had stopped
    ({0: 130, 1: 130, 2: 130}, 130, "rank 0 (pid 1000) exited 130"),   # kill -INT to one rank
    ({0: 4, 2: 4}, 4, "rank 0 (pid 1000) stopped because another rank was lost"),
])
def test_a_failed_launch_exits_with_the_ranks_own_status_and_one_line(in_repo, monkeypatch, capsys, codes, status,
                                                                      said):
    """torchrun's ChildFailedError (its traceback and table) becomes the status of the rank that caused the stop;
    the ranks finish in the same whole second, where torchrun's own root cause is simply the lowest rank."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def failed(args):
        raise ChildFailedError("dflash_graph", {k: _failure(k, c, at=100) for k, c in codes.items()})

    monkeypatch.setattr(torchrun, "run", failed)
    assert main(["launch", "--nproc-per-node", "3", "run", "graphs/tiny.toml"]) == status
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("dflash-graph launch: ") and said in err, err


def test_a_rendezvous_that_fails_is_a_usage_error_not_a_traceback(in_repo, monkeypatch, capsys):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    def unreachable(args):
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(torchrun, "run", unreachable)
    assert main(["launch", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.9:29400", "run", "graphs/tiny.toml"]) == 2
    err = capsys.readouterr().err
    assert "torchrun could not start the ranks: RendezvousConnectionError" in err and "--rdzv-endpoint" in err, err
    assert "Traceback" not in err and "internal error" not in err


def test_run_help_under_launch_is_printed_once_and_starts_no_rank(monkeypatch, capsys):
    import torch.distributed.run as torchrun

    monkeypatch.setattr(torchrun, "run", lambda args: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as e:
        main(["launch", "--nproc-per-node", "3", "run", "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.count("usage: dflash-graph run") == 1


@contextmanager
def launch_session(launch_args, run_args):
    with session([sys.executable, "-m", "dflash_graph", "launch", *launch_args, "run", *run_args,
                  "--no-progress"]) as p:
        yield p


@pytest.mark.slow
def test_ctrl_c_to_a_launch_exits_130_with_no_traceback(in_repo, tmp_path):
    """Ctrl-C at a terminal under `dflash-graph launch`: SIGINT to the launcher and every rank. The writer's one
    line says what was kept, the launcher's one line that every rank has exited; the status is 130."""
    out = tmp_path / "run"
    with launch_session(["--standalone", "--nproc-per-node", "3"], ["graphs/tiny.toml", "--steps", "500", "--out",
                                                                     str(out)]) as p:
        text = ctrl_c_after_step_2(p, out)
    assert p.returncode == 130, text
    assert "Traceback" not in text and "SignalException" not in text, text
    said = [ln for ln in text.splitlines() if ln.startswith(("interrupted", "dflash-graph"))]
    assert len(said) == 2, text
    assert said[0].startswith("interrupted: Ctrl-C (SIGINT, first seen by rank ") and "--resume" in said[0], text
    assert said[1] == "dflash-graph launch: stopped by SIGINT; every rank has exited (exit 130)", text


def test_a_launch_of_the_wrong_size_exits_2_with_the_refusal_once(in_repo, tmp_path):
    with launch_session(["--standalone", "--nproc-per-node", "2"], ["graphs/tiny.toml", "--out",
                                                                     str(tmp_path / "run")]) as p:
        text, _ = p.communicate(timeout=240)
    assert p.returncode == 2, text
    assert text.count("torchrun started 2 processes, but the graph's devices map to 3 rank(s)") == 1, text
    assert "Traceback" not in text and "ChildFailedError" not in text and "internal error" not in text, text
    assert text.splitlines()[-1].startswith("dflash-graph launch: rank 0 (pid "), text
    assert not (tmp_path / "run").exists()


# -- the end of a rank that finished: nothing of the launch is left to interpreter finalization (NOTE [Teardown]) ---

def _os_threads() -> list[str]:
    """The names of this process's threads as the kernel knows them (C++ threads too: pt_gloo_runloop, ...)."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{t}/comm").read_text().strip())
        except OSError:
            pass
    return names


GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


class _SlowStore:
    """A store whose writes take `delay` seconds, the GIL released meanwhile (as TCPStore.set on a loaded machine)."""

    def __init__(self, store, delay):
        self.store, self.delay = store, delay

    def set(self, key, value):
        time.sleep(self.delay)
        self.store.set(key, value)


def test_close_joins_its_threads_gives_the_signals_back_and_destroys_every_group(monkeypatch):
    """A one-rank launch in this process: the Comm, a replica group that ran an all-reduce (on gloo's worker
    threads) and a gather, and the heartbeat slowed down to be inside a store write when close() is called. close() returns only once the heartbeat and the helper threads have
    ended, gives the signal handlers back, destroys every group and lets go of them. Before, close() returned
    with the heartbeat still inside its write: a rank that then reached interpreter finalization could abort
    ('terminate called without an active exception', NOTE [Teardown])."""
    import threading
    import types

    import torch
    import torch.distributed as dist

    from dflash_graph.exec import distributed as D

    monkeypatch.setattr(D.Comm, "started", False)
    monkeypatch.setattr(D, "BEAT_SECONDS", 0.01)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    gloo_before = sum(n in GLOO_THREADS for n in _os_threads())
    comm = D.Comm(types.SimpleNamespace(backend="gloo", transfers=[]), {0: ["d0"]}, 30.0, str)
    try:
        assert D.Comm.started and D.Comm.active is comm
        group = D.replica_group(comm, [0])
        assert comm.groups == [group]
        x = torch.ones(4)
        dist.all_reduce(x, group=group)      # on gloo's worker threads, as DDP's gradient all-reduce
        assert D.gather_among(comm, "x", group, [0], "a gather") == ["x"]
        assert sum(n in GLOO_THREADS for n in _os_threads()) > gloo_before
        comm.beat.store = _SlowStore(comm.beat.store, 0.3)
        time.sleep(0.05)                     # the heartbeat is now inside a write
        comm.close()
        assert not comm.beat.is_alive()
        assert not [t.name for t in threading.enumerate() if t.name.startswith("dflash")]
        assert {sig: signal.getsignal(sig) for sig in before} == before
        assert not dist.is_initialized() and D.Comm.active is None
        assert comm.groups == [] and comm.ctrl is None
        comm.close()                         # idempotent
    finally:
        D.Comm.active = None
        if dist.is_initialized():
            dist.destroy_process_group()
        for sig, h in before.items():
            signal.signal(sig, h)


def test_a_rank_ends_by_os_exit_and_a_finished_one_closes_first(monkeypatch):
    """python -m dflash_graph under torchrun ends by os._exit, output flushed (NOTE [Teardown]): exit 0 closes a
    Comm that a path left open (a resume of a finished run) and records nothing; a nonzero exit records its cause
    for the other ranks and does not close; a process that started no launch is left alone."""
    import types

    from dflash_graph.exec import distributed as D

    done = []

    def _exit(code):
        done.append(("exit", code))

    monkeypatch.setattr(D.os, "_exit", _exit)
    monkeypatch.setattr(D.Comm, "started", False)
    D.end_rank(0)
    assert done == []
    monkeypatch.setattr(D.Comm, "started", True)
    fake = types.SimpleNamespace(beat=types.SimpleNamespace(state="running"), close=lambda: done.append("close"),
                                 fail=lambda why: done.append(("fail", why)) or why, _name=lambda: "rank 1 (t1)")
    monkeypatch.setattr(D.Comm, "active", fake)
    D.end_rank(0)
    assert done == ["close", ("exit", 0)]
    done.clear()
    D.end_rank(3)
    assert done == [("fail", "rank 1 (t1) stopped the run: it exited with status 3 (its own message says why)"),
                    ("exit", 3)]
