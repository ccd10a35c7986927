"""Measure real GPU memory against check's prediction, in one prepared run (for sessions lent a GPU).

For graphs/gpu_check.toml (one GPU, the DFlash step as first written and as rewritten, default allocator and
expandable_segments) this runs `dflash-graph run` a few steps per variant, each in its own process so the peak
statistics start clean, and collects from each memory.json the predicted and measured allocated peak
(torch.cuda.max_memory_allocated), reserved peak (torch.cuda.max_memory_reserved) and the memory outside the
allocator (mem_get_info). It writes OUT/gpu_check.json and prints a table.

    python tools/gpu_check.py --out /tmp/gpu_check             # about 2-4 minutes on one H200
    python tools/gpu_check.py --out /tmp/g --device cpu --small  # exercise the script itself without a GPU
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
GRAPH = ROOT / "graphs" / "gpu_check.toml"
VARIANTS = [
    ("as_written", ["--no-rewrite"], {}),
    ("rewritten", [], {}),
    ("rewritten_expandable", ["--set", "memory.expandable_segments=true"], {}),
]
SMALL = ["dims.seq=512", "dims.anchors=8", "models.target.config.hidden_size=64", "models.target.config.vocab_size=768",
         "models.target.config.intermediate_size=128", "models.drafter.config.intermediate_size=128"]


def long_documents(seq: int, path: Path) -> Path:
    """Documents of at least `seq` tokens (the tiny corpus joined), so that each packed sequence is one document
    and the target's body runs over the whole sequence, as the prediction assumes."""
    texts = [json.loads(line)["text"] for line in open(ROOT / "graphs" / "tiny" / "corpus.jsonl")]
    joined, docs = "", []
    for t in texts:
        joined += t + "\n"
        if len(joined) > seq * 6:   # > 1 token per 6 characters in this corpus
            docs.append(joined)
            joined = ""
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny dims (to test the script)")
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sets = SMALL if args.small else []
    seq = int(next((s.split("=")[1] for s in sets if s.startswith("dims.seq=")), 32768))
    corpus = long_documents(seq, args.out / "long_docs.jsonl")
    common = ["--set", f"data.corpus={corpus}"]
    for s in sets:
        common += ["--set", s]
    env = dict(os.environ)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: use --device cpu --small to test the script", file=sys.stderr)
            return 2
        total = torch.cuda.mem_get_info(0)[1]
        common += ["--set", f"devices.gpu0.capacity={total}"]
        device_map = []
        info = {"gpu": torch.cuda.get_device_name(0), "total_bytes": total, "torch": torch.__version__}
    else:
        device_map = ["--device-map", "cuda:*=cpu"]
        info = {"gpu": None}
    results = {"machine": info, "graph": str(GRAPH.relative_to(ROOT)), "variants": {}}
    for name, extra, _ in VARIANTS:
        out = args.out / name
        cmd = [sys.executable, "-m", "dflash_graph", "run", str(GRAPH), "--steps", str(args.steps), "--out", str(out),
               "--no-progress", *device_map, *common, *extra]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        rec = {"command": " ".join(cmd[1:]), "exit": p.returncode, "seconds": round(time.perf_counter() - t0, 1)}
        if p.returncode == 0 and (out / "memory.json").exists():
            rec["memory"] = json.loads((out / "memory.json").read_text())["devices"]
        else:
            rec["stderr_tail"] = p.stderr[-3000:]
        results["variants"][name] = rec
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(f"{'variant':<22} {'pred alloc':>12} {'meas alloc':>12} {'ratio':>7} {'pred resv':>12} {'meas resv':>12} "
          f"{'ratio':>7} {'outside':>10}")
    g = 2**30
    for name, rec in results["variants"].items():
        m = (rec.get("memory") or {}).get("gpu0")
        if not m:
            print(f"{name:<22} failed (exit {rec['exit']}); see gpu_check.json")
            continue
        pr, mr = m.get("predicted_reserved_bytes"), m.get("measured_reserved_bytes")
        print(f"{name:<22} {m['predicted_peak_bytes'] / g:>10.2f}Gi {m.get('measured_peak_bytes', 0) / g:>10.2f}Gi "
              f"{m.get('ratio', 0):>7.3f} {(pr or 0) / g:>10.2f}Gi {(mr or 0) / g:>10.2f}Gi "
              f"{(mr / pr if pr and mr else 0):>7.3f} {m.get('measured_outside_allocator_bytes', 0) / g:>8.2f}Gi")
    print(f"wrote {args.out / 'gpu_check.json'}")
    return 0 if all(r["exit"] == 0 for r in results["variants"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
