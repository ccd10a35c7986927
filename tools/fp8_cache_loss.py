"""The effect of the fp8 storage ([capture] dtype = "fp8") on training: capture the same samples twice, as the
transfers carry them and as fp8 with a scale per row, train the drafter from each for the same steps, and compare
the per-step losses (and the bytes on disk).

    python tools/fp8_cache_loss.py                 # tiny, 40 steps
    python tools/fp8_cache_loss.py --steps 100 --json runs/fp8_cache_loss.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph", default=str(ROOT / "graphs" / "tiny.toml"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    from dflash_graph.analysis.capture import samples_per_step
    from dflash_graph.cli.main import main as cli
    from dflash_graph.rewrite.pipeline import compile_graph

    per_step = samples_per_step(compile_graph(args.graph).typed)
    common = ["--set", f"capture.samples={args.steps * per_step}", "--set", "capture.shard_samples=16",
              "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0"]
    losses, sizes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for dtype in ("native", "fp8"):
            sets = [*common, "--set", f"capture.dtype={dtype}"]
            with contextlib.redirect_stdout(io.StringIO()):
                assert cli(["capture", args.graph, "--out", str(tmp / dtype), "--no-progress", *sets]) == 0
                assert cli(["run", args.graph, "--steps", str(args.steps), "--out", str(tmp / f"run-{dtype}"),
                            "--no-progress", "--hidden-states", str(tmp / dtype), *sets]) == 0
            sizes[dtype] = sum(p.stat().st_size for p in (tmp / dtype).glob("shard-*.safetensors"))
            losses[dtype] = [json.loads(ln)["loss"] for ln in open(tmp / f"run-{dtype}" / "metrics.jsonl")]
    a, b = losses["native"], losses["fp8"]
    diff = [abs(x - y) for x, y in zip(a, b)]
    tail = max(1, len(a) // 4)
    r = {"graph": args.graph, "steps": args.steps, "bytes": sizes, "bytes_ratio_fp8_to_native": sizes["fp8"] / sizes["native"],
         "loss_native": a, "loss_fp8": b, "max_abs_loss_diff": max(diff),
         "max_rel_loss_diff": max(d / abs(x) for d, x in zip(diff, a)),
         f"mean_loss_last_{tail}_native": sum(a[-tail:]) / tail, f"mean_loss_last_{tail}_fp8": sum(b[-tail:]) / tail}
    print(f"{args.graph}: {args.steps} steps from each cache")
    print(f"  bytes on disk: native {sizes['native']:,}, fp8 {sizes['fp8']:,} (ratio {r['bytes_ratio_fp8_to_native']:.3f})")
    print(f"  per-step loss, fp8 against native: max |difference| {r['max_abs_loss_diff']:.4g}, "
          f"max relative {r['max_rel_loss_diff']:.3%}")
    print(f"  mean loss of the last {tail} steps: native {r[f'mean_loss_last_{tail}_native']:.4f}, "
          f"fp8 {r[f'mean_loss_last_{tail}_fp8']:.4f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main()
