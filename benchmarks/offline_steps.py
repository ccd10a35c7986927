"""Step times of the three ways to feed the drafter, side by side in one process: online (the whole graph: target
side and drafter side), capture (the target side and the shard write: what `dflash-graph capture` does per step)
and from disk (the drafter side alone, reading the cache: `run --hidden-states`). Ratios to online.

    python benchmarks/offline_steps.py                      # tiny, 20 timed rounds after 2 untimed
    python benchmarks/offline_steps.py --steps 40 --json runs/offline_steps.json

Procedure: a cache of (warmup + steps) steps is captured first (untimed); then each round times one step of each
path in turn (capture, online, disk), each with time.perf_counter: capture = the target side of the step's
R x grad_accum samples plus the shard write (shards of one step's samples, fsync'd as capture writes them), online
= Trainer.step, disk = Trainer.step with the cache as the source (DataLoader workers as given). The online and
the from-disk trainers start from the same weights and see the same samples, so their losses must be equal at
every step (reported). Reported: medians per path and the median of the per-round ratios to online (the pair
ratio cancels slowly changing load on a shared machine)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph", default=str(ROOT / "graphs" / "tiny.toml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--loader-workers", type=int, default=1, help="DataLoader workers of the from-disk path")
    ap.add_argument("--json", metavar="PATH", help="write the result as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from dflash_graph.analysis.capture import find_cut
    from dflash_graph.analysis.launch import replicas
    from dflash_graph.rewrite.pipeline import compile_graph
    from dflash_graph.train.hidden_cache import CacheSource, CacheWriter, TargetSide, capture, graph_signature
    from dflash_graph.train.trainer import RunOptions, Trainer

    rounds = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plan0 = compile_graph(args.graph, args.overrides)
        per_step = int(plan0.typed.ctx.spec.train.get("grad_accum") or 1) * replicas(plan0.typed)
        sets = [*args.overrides, f"capture.shard_samples={per_step}", "train.eval_every=0",
                f"train.steps={rounds}", "train.checkpoint_every=0"]
        plan = compile_graph(args.graph, sets)
        capture(plan, tmp / "cache", samples=rounds * per_step, progress=False)
        torch.set_num_threads(args.threads)
        online = Trainer(plan, RunOptions(out=tmp / "online", track_memory=False, progress=False))
        source = CacheSource(plan, tmp / "cache", workers=args.loader_workers)
        disk = Trainer(plan, RunOptions(out=tmp / "disk", track_memory=False, progress=False, source=source))
        cut = find_cut(plan.typed)
        side = TargetSide(plan, cut)
        writer = CacheWriter(tmp / "timed-cache", graph_signature(plan), rounds * per_step, per_step, cut)
        times: dict[str, list[float]] = {"capture": [], "online": [], "disk": []}
        losses = []
        for s in range(rounds):
            t0 = time.perf_counter()
            for _ in range(per_step):
                writer.add(side.next, side.sample())
            t_cap = time.perf_counter() - t0
            t0 = time.perf_counter()
            mo = online.step(s)
            t_on = time.perf_counter() - t0
            t0 = time.perf_counter()
            md = disk.step(s)
            t_disk = time.perf_counter() - t0
            losses.append((mo["loss"], md["loss"]))
            if s >= args.warmup:
                times["capture"].append(t_cap)
                times["online"].append(t_on)
                times["disk"].append(t_disk)
        shard_bytes = sum(e["bytes"] for e in writer.kept.values()) / len(writer.kept)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(times[k], times["online"])) for k in ("capture", "disk")}
    r = {"graph": args.graph, "overrides": args.overrides, "rounds": args.steps, "warmup": args.warmup,
         "threads": args.threads, "loader_workers": args.loader_workers, "samples_per_step": per_step,
         "median_seconds": med, "median_ratio_to_online": ratio, "shard_bytes": shard_bytes,
         "losses_equal_steps": sum(a == b for a, b in losses), "steps_compared": len(losses),
         "max_abs_loss_diff": max(abs(a - b) for a, b in losses),
         "load_average": os.getloadavg()}
    print(f"{args.graph}: {args.steps} timed rounds ({args.warmup} untimed), {per_step} samples per step, "
          f"{args.threads} torch thread(s), {args.loader_workers} loader worker(s); load average {r['load_average'][0]:.2f}")
    for k in ("online", "capture", "disk"):
        extra = "" if k == "online" else f"   ratio to online {ratio[k]:.3f} (median of per-round ratios)"
        print(f"  {k:<8} median step {med[k] * 1e3:8.1f} ms{extra}")
    print(f"  losses online vs from disk: equal on {r['losses_equal_steps']} of {r['steps_compared']} steps "
          f"(max |difference| {r['max_abs_loss_diff']:.3g})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=2))
        print(f"wrote {args.json}")
    return r


if __name__ == "__main__":
    main()
