"""What a held-out evaluation costs, in training steps, in one process and under torchrun (train/heldout.py: one
rank evaluates beside a target replica while the others wait).

One run of each (graphs/tiny.toml; torchrun: 3 ranks, 2 of them targets), evaluating at every step. Measured from
the writer's console in the same run: the `held-out @ step k` lines are timestamped as they arrive (unbuffered), so
line k - 1 to line k is step k's training plus its evaluation; step k's training alone is its `step_seconds` in
metrics.jsonl. Reported per mode: the median evaluation and training step over steps 2..N (step 1 pays for
warm-up), and their ratio; then the torchrun ratio over the one-process ratio. Not a test: nothing is asserted,
and the figures depend on the machine's load.

    python benchmarks/heldout_cost.py                  # 8 steps, eval_batches 12 (tiny's own)
    python benchmarks/heldout_cost.py --steps 12 --eval-batches 4 --json runs/heldout_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(nproc: int, steps: int, eval_batches: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("WORLD_SIZE", None)
    run = ["run", "graphs/tiny.toml", "--steps", str(steps), "--out", str(out), "--no-progress",
           "--set", "train.eval_every=1", "--set", f"train.eval_batches={eval_batches}"]
    cmd = [sys.executable, "-m", "dflash_graph", *run] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
         "dflash_graph", *run]
    seen: dict[int, float] = {}
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        for line in p.stdout:
            if line.startswith("held-out @ step "):
                seen[int(line.split()[3].rstrip(":"))] = time.perf_counter()
        p.wait(timeout=900)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    if p.returncode != 0 or len(seen) != steps:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode} with {len(seen)} held-out lines")
    train = {r["step"]: r["step_seconds"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    ks = range(2, steps + 1)
    evals = [seen[k] - seen[k - 1] - train[k] for k in ks]
    step = statistics.median(train[k] for k in ks)
    ev = statistics.median(evals)
    return {"processes": nproc, "eval_s": round(ev, 4), "step_s": round(step, 4), "eval_over_step": round(ev / step, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=12)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rows = [measure(1, a.steps, a.eval_batches, Path(d) / "one"), measure(3, a.steps, a.eval_batches, Path(d) / "tr")]
    print(f"tiny.toml, {a.steps} steps, eval_batches {a.eval_batches} (x 2 replicas), evaluating at every step; "
          "medians over steps 2..N")
    print(f"  {'mode':<22} {'evaluation':>11} {'training step':>14} {'evaluation / step':>18}")
    for r in rows:
        mode = "one process" if r["processes"] == 1 else f"torchrun, {r['processes']} ranks"
        print(f"  {mode:<22} {r['eval_s']:>10.3f}s {r['step_s']:>13.3f}s {r['eval_over_step']:>18.2f}")
    ratio = rows[1]["eval_over_step"] / rows[0]["eval_over_step"]
    print(f"  torchrun's ratio over one process's: {ratio:.2f} (2 target ranks)")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "torchrun_over_one": round(ratio, 2)}, indent=2))


if __name__ == "__main__":
    main()
