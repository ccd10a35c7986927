"""`dflash-graph run`: check (refusing a predicted OOM unless --force), then train."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..rewrite.pipeline import compile_graph
from .check import render_memory, render_ooms, render_rewrites


def _allocator_env(plan) -> None:
    """Run under the allocator settings check assumed: [memory] becomes PYTORCH_CUDA_ALLOC_CONF (before torch
    initialises CUDA). A setting already in the environment wins, and check is told so."""
    mem = plan.typed.ctx.spec.memory
    conf = []
    if mem.expandable_segments:
        conf.append("expandable_segments:True")
    if mem.max_split_size:
        conf.append(f"max_split_size_mb:{mem.max_split_size // 2**20}")
    if conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf)
    elif os.environ.get("PYTORCH_CUDA_ALLOC_CONF") and not conf:
        print(f"note: PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']} is set, but the graph's "
              "[memory] assumes the default allocator", file=sys.stderr)


def _mapped_overrides(args) -> list[str]:
    """--device-map rewrites the devices' torch names before check runs, so the prediction is for the devices the
    run will use (a CUDA graph mapped to CPU is predicted without the caching allocator)."""
    import fnmatch

    from ..exec.devices import parse_device_map
    from ..spec.loader import load_graph

    mapping = parse_device_map(args.device_map)
    if not mapping:
        return []
    spec = load_graph(args.graph, args.overrides)
    out = []
    for name, dev in spec.devices.items():
        for pat, dst in mapping:
            if fnmatch.fnmatch(dev.torch, pat):
                out.append(f"devices.{name}.torch={dst}")
                break
    return out


def cmd_run(args) -> int:
    plan = compile_graph(args.graph, [*args.overrides, *_mapped_overrides(args)], rewrite=not args.no_rewrite,
                         rules_off=args.rules_off)
    spec = plan.typed.ctx.spec
    print(f"{spec.file}: graph '{spec.name}', {len(plan.typed.graph)} nodes; {render_rewrites(plan).splitlines()[0]}")
    print(render_memory(plan.memory, plan.memory_before))
    if not plan.memory.fits:
        print(render_ooms(plan), file=sys.stderr)
        if not args.force:
            print("refusing to run: check predicts an OOM (use --force to run anyway)", file=sys.stderr)
            return 1
    _allocator_env(plan)
    from ..exec.devices import parse_device_map
    from ..train.trainer import RunOptions, Trainer

    out = Path(args.out) if args.out else Path("runs") / spec.name
    opts = RunOptions(out=out, steps=args.steps, resume=Path(args.resume) if args.resume else None,
                      device_map=parse_device_map(args.device_map), strict=args.strict,
                      progress=not args.no_progress)
    return Trainer(plan, opts).run()
