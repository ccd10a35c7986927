"""How long a torchrun launch of graphs/tiny.toml (3 ranks, gloo on CPU) takes to stop, the figures in
docs/distributed.md ("When a rank fails", Ctrl-C).

    python tools/torchrun_stop_times.py SIGKILL rank1     # kill rank 1 (t1) once the run has done 2 steps
    python tools/torchrun_stop_times.py SIGINT group      # Ctrl-C: SIGINT to torchrun and every rank
    python tools/torchrun_stop_times.py SIGSTOP rank1     # freeze rank 1
    python tools/torchrun_stop_times.py SIGINT group launch   # the same under `dflash-graph launch`

Prints the lines the ranks printed, then: the seconds from the signal until every other rank had exited, until
torchrun had exited, torchrun's exit status, and the 1-minute load average. The launch runs in its own session and
is killed whole at the end, whatever happens.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    sig, target = getattr(signal, sys.argv[1]), sys.argv[2]
    launcher = (["-m", "dflash_graph", "launch"] if sys.argv[3:] == ["launch"] else ["-m", "torch.distributed.run"])
    program = [] if launcher[-1] == "launch" else ["-m", "dflash_graph"]
    out = Path(tempfile.mkdtemp(prefix="dflash-stop-")) / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, *launcher, "--standalone", "--nproc-per-node", "3", *program, "run", "graphs/tiny.toml", "--steps", "500", "--out", str(out),
                          "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
            if p.poll() is not None:
                print(p.stdout.read())
                return 1
            time.sleep(0.2)
        pids = [json.loads((out / "ranks" / f"rank{k}.json").read_text())["pid"] for k in range(3)]
        t0 = time.monotonic()
        if target == "rank1":
            os.kill(pids[1], sig)
        elif target == "group":
            os.killpg(p.pid, sig)
        else:
            os.kill(p.pid, sig)
        others = set(pids) - ({pids[1]} if target == "rank1" else set())
        stopped = None
        while p.poll() is None:
            for q in list(others):
                try:
                    os.kill(q, 0)
                except ProcessLookupError:
                    others.discard(q)
            if not others and stopped is None:
                stopped = time.monotonic() - t0
            time.sleep(0.05)
        exited = time.monotonic() - t0
        text = p.stdout.read()
        said = [ln for ln in text.splitlines() if ln.startswith(("dflash-graph", "interrupted"))]
        print("\n".join(said) + ("\n(and a Traceback)" if "Traceback" in text else ""))
        stopped_text = f"{stopped:.1f} s" if stopped is not None else "(not seen)"
        print(f"{sys.argv[1]} {target}: the other ranks had exited after {stopped_text}, {launcher[-1]} exited "
              f"{p.returncode} after {exited:.1f} s; load average {os.getloadavg()[0]:.1f}")
        return 0
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
