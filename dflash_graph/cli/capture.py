"""`dflash-graph capture`: the graph's target side over the corpus, what crosses its transfers to a hidden-state
cache (train/hidden_cache.py; docs/offline.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import GraphError, Location, Problem
from ..rewrite.pipeline import compile_graph


def cmd_capture(args) -> int:
    """Under torchrun (`dflash-graph launch --nproc-per-node N capture ...`) every rank runs this: until the process
    group exists every rank reaches the same verdict, printed once per machine (exec.distributed.shared_verdict);
    then each target rank writes its own shards and the writer rank the manifest (train/hidden_cache.capture_ranks)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return _cmd_capture(args, {})
    from ..exec import distributed

    try:
        return distributed.under_verdicts(lambda stage: _cmd_capture(args, stage), "the capture started")
    except distributed.RankLost as e:      # a rank was lost while this one captured or waited: every rank says so
        print(f"dflash-graph: {e}; the finished shards are kept: the same command again resumes the capture",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(distributed.EXIT_LOST)    # a gather still pending on a dead peer would keep the process alive
    except distributed.Interrupted as e:   # Ctrl-C: the lowest rank says so, once
        if os.environ.get("RANK") == "0":
            print(f"interrupted: {e}; the finished shards are kept: the same command again resumes the capture",
                  file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(distributed.EXIT_INTERRUPTED)


def _cmd_capture(args, stage: dict) -> int:
    if args.samples is not None and args.samples < 1:
        raise GraphError(Problem(f"--samples must be a positive number of packed sequences, got {args.samples}",
                                 Location(flag=f"--samples {args.samples}"), hint="e.g. --samples 400"))
    try:
        import torch  # noqa: F401
    except ImportError:
        raise GraphError(Problem("`capture` needs torch, which is not installed (check --capture works without it)",
                                 Location(flag="capture"), hint='pip install torch && pip install -e ".[run]"')) from None
    from ..spec.paths import require_paths

    plan = compile_graph(args.graph, args.overrides, rewrite=not args.no_rewrite, rules_off=args.rules_off)
    require_paths(plan.typed.ctx.spec, "run")
    out = Path(args.out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from ..analysis.launch import analyze_launch

        launch = analyze_launch(plan.typed)
        if world != launch.world_size:
            ranks = ", ".join(f"{d}={launch.devices[d].rank}" for d in launch.devices)
            raise GraphError(Problem(f"torchrun started {world} processes, but the graph's devices map to "
                                     f"{launch.world_size} rank(s) ({ranks})", plan.typed.ctx.spec.loc("devices"),
                                     hint=f"launch with --nproc-per-node {launch.world_size}: dflash-graph launch "
                                          f"--nproc-per-node {launch.world_size} capture GRAPH --out DIR"))
        from ..train.hidden_cache import capture_ranks

        r = capture_ranks(plan, out, samples=args.samples, overwrite=args.overwrite, progress=not args.no_progress,
                          device_map=args.device_map, stage=stage)
        if r is None:         # not the writer rank: it has said nothing
            return 0
        who = f" by target ranks {', '.join(map(str, r['ranks']))}"
    else:
        from ..train.hidden_cache import capture

        r = capture(plan, out, samples=args.samples, overwrite=args.overwrite, progress=not args.no_progress,
                    device_map=args.device_map)
        who = ""
    from ..units import fmt_bytes

    kept = f", {r['kept']} kept from before" if r["kept"] else ""
    print(f"captured {r['samples']} samples into {out}{who}: {r['shards']} shards ({r['shards'] - r['kept']} written"
          f"{kept}), {fmt_bytes(r['bytes'])} on disk (predicted {fmt_bytes(r['predicted_bytes'])}), "
          f"{r['target_forwards']} target forwards in {r['seconds']:.1f} s", flush=True)
    return 0
