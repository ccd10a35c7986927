"""`dflash-graph capture`: the graph's target side over the corpus, what crosses its transfers to a hidden-state
cache (train/hidden_cache.py; docs/offline.md)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import GraphError, Location, Problem
from ..rewrite.pipeline import compile_graph


def cmd_capture(args) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise GraphError(Problem("capture runs in one process for now (one writer per target rank under torchrun is "
                                 "not implemented)", Location(flag="capture"),
                                 hint="run `dflash-graph capture` without torchrun"))
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
    from ..train.hidden_cache import capture

    out = Path(args.out)
    r = capture(plan, out, samples=args.samples, overwrite=args.overwrite, progress=not args.no_progress,
                device_map=args.device_map)
    from ..units import fmt_bytes

    kept = f", {r['kept']} kept from before" if r["kept"] else ""
    print(f"captured {r['samples']} samples into {out}: {r['shards']} shards ({r['shards'] - r['kept']} written"
          f"{kept}), {fmt_bytes(r['bytes'])} on disk (predicted {fmt_bytes(r['predicted_bytes'])}), "
          f"{r['target_forwards']} target forwards in {r['seconds']:.1f} s")
    return 0
