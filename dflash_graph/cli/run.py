"""`dflash-graph run`: check (refusing a predicted OOM unless --force), then train."""

from __future__ import annotations

import sys
from pathlib import Path

from ..rewrite.pipeline import compile_graph
from .check import render_memory, render_ooms, render_rewrites


def cmd_run(args) -> int:
    plan = compile_graph(args.graph, args.overrides, rewrite=not args.no_rewrite)
    spec = plan.typed.ctx.spec
    print(f"{spec.file}: graph '{spec.name}', {len(plan.typed.graph)} nodes; {render_rewrites(plan).splitlines()[0]}")
    print(render_memory(plan.memory, plan.memory_before))
    if not plan.memory.fits:
        print(render_ooms(plan), file=sys.stderr)
        if not args.force:
            print("refusing to run: check predicts an OOM (use --force to run anyway)", file=sys.stderr)
            return 1
    from ..exec.devices import parse_device_map
    from ..train.trainer import RunOptions, Trainer

    out = Path(args.out) if args.out else Path("runs") / spec.name
    opts = RunOptions(out=out, steps=args.steps, resume=Path(args.resume) if args.resume else None,
                      device_map=parse_device_map(args.device_map), strict=args.strict,
                      progress=not args.no_progress)
    return Trainer(plan, opts).run()
