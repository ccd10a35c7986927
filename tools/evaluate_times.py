"""Time programs.evaluate on Qwen3.5-27B (graphs/qwen27b/target_config.json, 64 layers: 3 linear attention then 1
full, repeated) at seq 32,768: the replay of every event (expand=True, how evaluate worked before) beside the fast
walk (the default), in one process, and the peaks they give; then a whole fresh interpreter that loads the program
and evaluates it (what check pays). docs/memory-programs.md quotes the output.

    python tools/evaluate_times.py [--seq 32768] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_graph.models import programs  # noqa: E402

CONFIG = ROOT / "graphs" / "qwen27b" / "target_config.json"


def best(fn, repeat: int) -> tuple[float, float, object]:
    """(CPU s, wall s, result) of the fastest of `repeat` calls."""
    runs = []
    for _ in range(repeat):
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        runs.append((time.process_time() - c, time.perf_counter() - w, out))
    return min(runs, key=lambda r: r[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = json.loads(CONFIG.read_text())
    types = (["linear_attention"] * 3 + ["full_attention"]) * (cfg["num_hidden_layers"] // 4)
    print(f"Qwen3.5-27B, {len(types)} layers, seq {args.seq}, best of {args.repeat}, load {os.getloadavg()[0]:.1f}")
    print("| packing | events | replay CPU s | fast CPU s | replay wall s | fast wall s | peak (B) | same peaks |")
    print("|---|---|---|---|---|---|---|---|")
    for packing in ("documents", "mask"):
        prog = programs.load("qwen3_5", packing=packing)
        dims = {k: cfg[v] for k, v in prog["dims"].items() if k != "seq"}
        rc, rw, full = best(lambda: programs.evaluate(prog, dims, args.seq, types, expand=True), args.repeat)
        fc, fw, fast = best(lambda: programs.evaluate(prog, dims, args.seq, types), args.repeat)
        same = (fast.peak, fast.piece_peak, fast.peak_event) == (full.peak, full.piece_peak, full.peak_event)
        print(f"| {packing} | {len(full.events):,} | {rc:.3f} | {fc:.4f} | {rw:.3f} | {fw:.4f} | {fast.peak:,} | "
              f"{same} |")
    code = ("import json; from dflash_graph.models import programs; "
            f"cfg = json.load(open({str(CONFIG)!r})); p = programs.load('qwen3_5'); "
            "d = {k: cfg[v] for k, v in p['dims'].items() if k != 'seq'}; "
            f"print(programs.evaluate(p, d, {args.seq}, {types!r}).peak)")
    w = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    print(f"\nwhole process (python -c: import, load, evaluate): {time.perf_counter() - w:.2f} s wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
