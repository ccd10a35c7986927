"""Predicted against measured: each rank's busy time per step for graphs/tiny_dp.toml (N:M, 2 targets feeding 2
data-parallel drafter ranks, 4 ranks) and graphs/tiny_colocated.toml (2 ranks, each target + drafter), check's
launch table beside a torchrun run of each, and whether check's ranking of the two layouts (by the step time its
bottleneck rank sets; both train the same global batch of 2 packed sequences) is the measured ranking.

Measured: metrics.jsonl's `ranks` (each rank's busy and waiting seconds per step: exec/distributed.py), the median
over steps 2..N (step 1 pays for warm-up), and the median step time. Busy time on a drafter rank of a
data-parallel drafter includes the gradient all-reduce inside backward. check adds that all-reduce to the drafter
ranks' busy time at the declared [launch] intra_node_bandwidth (NOTE [Collective time] in analysis/launch.py; the
tiny graphs declare none, so NVLink's 450 GB/s, far above gloo over loopback TCP): the `collective` column is that
part of the prediction. Not a test: nothing is asserted, and the figures depend on the machine's load (printed).

    python benchmarks/dp_layouts.py                 # 12 steps of each layout
    python benchmarks/dp_layouts.py --steps 20 --json runs/dp_layouts.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"tiny_dp": ("graphs/tiny_dp.toml", 4), "tiny_colocated": ("graphs/tiny_colocated.toml", 2)}


def predicted(graph: str) -> dict:
    from dflash_graph.analysis.launch import analyze_launch
    from dflash_graph.rewrite.pipeline import compile_graph

    plan = compile_graph(str(ROOT / graph))
    launch = analyze_launch(plan.typed)
    busy = launch.rank_busy()
    coll = {k: sum(launch.devices[d].collective_seconds for d in launch.rank_devices(k)) for k in busy}
    ranks, top = launch.bottleneck()
    return {"busy_s": {str(k): v for k, v in sorted(busy.items())},
            "collective_s": {str(k): v for k, v in sorted(coll.items())}, "step_s": top, "bottleneck": ranks}


def measured(graph: str, nproc: int, steps: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "dflash_graph", "run", graph, "--steps", str(steps), "--out", str(out), "--no-progress"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        text, _ = p.communicate(timeout=900)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)     # whatever is left of the launch
        except ProcessLookupError:
            pass
    if p.returncode != 0:
        raise SystemExit(f"{graph} under torchrun exited {p.returncode}:\n{text[-3000:]}")
    recs = [json.loads(ln) for ln in open(out / "metrics.jsonl")][1:]
    ranks = sorted({k for r in recs for k in r["ranks"]}, key=int)
    return {"busy_s": {k: statistics.median(r["ranks"][k]["busy_s"] for r in recs) for k in ranks},
            "wait_s": {k: statistics.median(r["ranks"][k]["wait_s"] for r in recs) for k in ranks},
            "step_s": statistics.median(r["step_seconds"] for r in recs), "steps": len(recs)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    res = {}
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (graph, nproc) in LAYOUTS.items():
            res[name] = {"graph": graph, "ranks": nproc, "predicted": predicted(graph),
                         "measured": measured(graph, nproc, args.steps, Path(tmp) / name)}
    for name, r in res.items():
        pr, me = r["predicted"], r["measured"]
        print(f"{name} ({r['graph']}, {r['ranks']} ranks; measured: median of steps 2..{me['steps'] + 1})")
        print("  rank  predicted busy/step (collective)  measured busy/step  measured wait/step  measured/predicted")
        for k in me["busy_s"]:
            print(f"  {k:>4}  {pr['busy_s'][k] * 1e3:15.1f} ms ({pr['collective_s'][k] * 1e3:6.3f} ms)  "
                  f"{me['busy_s'][k] * 1e3:15.1f} ms  {me['wait_s'][k] * 1e3:15.1f} ms  "
                  f"{me['busy_s'][k] / pr['busy_s'][k]:17.2f}x")
        print(f"  step: predicted {pr['step_s'] * 1e3:.1f} ms (bottleneck ranks {pr['bottleneck']}), measured "
              f"{me['step_s'] * 1e3:.1f} ms")
    by_pred = sorted(res, key=lambda n: res[n]["predicted"]["step_s"])
    by_meas = sorted(res, key=lambda n: res[n]["measured"]["step_s"])
    agree = by_pred == by_meas
    print(f"ranking (fastest step first): check {' < '.join(by_pred)}; measured {' < '.join(by_meas)}: "
          f"{'agrees' if agree else 'DISAGREES'}")
    after = os.getloadavg()
    print(f"load average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    out = {"layouts": res, "ranking": {"predicted": by_pred, "measured": by_meas, "agrees": agree},
           "load_average": {"before": list(load), "after": list(after)}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
