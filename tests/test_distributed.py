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


def test_a_killed_rank_stops_every_other_rank_with_the_cause(in_repo, tmp_path):
    _assert_stopped_cleanly(*_kill_one_rank(tmp_path, signal.SIGKILL))


@pytest.mark.slow
def test_a_frozen_rank_stops_every_other_rank_with_the_cause(in_repo, tmp_path):
    code, text, elapsed, gone, pids, out = _kill_one_rank(tmp_path, signal.SIGSTOP)
    _assert_stopped_cleanly(code, text, elapsed, gone, pids, out)
    assert "no heartbeat" in text


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
