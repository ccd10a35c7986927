"""`dflash-graph check` and `dflash-graph plan`."""

from __future__ import annotations

import json
import sys
import time

from ..analysis.infer import Typed, build, infer
from ..spec.loader import load_graph


def analyze(path: str, overrides=(), rewrite: bool = True) -> Typed:
    spec = load_graph(path, overrides)
    graph, ctx = build(spec)
    return infer(graph, ctx)


def nodes_json(typed: Typed) -> list[dict]:
    out = []
    for n in typed.graph.nodes:
        outs = typed.outputs_of(n.id)
        out.append({
            "id": n.id, "op": n.op, "device": n.device,
            "devices": list(typed.ctx.devices_of(n.device)),
            "model": n.model,
            "outputs": {k: {"shape": [d.sym for d in t.shape], "sizes": list(t.sizes), "dtype": t.dtype,
                            "device": t.device, "bytes": t.nbytes} for k, t in outs.items()},
        })
    return out


def render_nodes(typed: Typed) -> str:
    lines = []
    for n in typed.graph.nodes:
        lines.append(f"  {n.id:<22} {n.op:<18} @{n.device}" + (f"  model={n.model}" if n.model else ""))
        for k, t in typed.outputs_of(n.id).items():
            lines.append(f"      .{k:<16} {t.dtype:<9} {t.sym_str():<28} = {t.concrete_str()}")
    return "\n".join(lines)


def cmd_check(args) -> int:
    t0 = time.perf_counter()
    typed = analyze(args.graph, args.overrides, rewrite=not args.no_rewrite)
    spec = typed.ctx.spec
    if args.json:
        json.dump({"graph": spec.name, "file": spec.file, "valid": True, "dims": typed.ctx.env.bindings(),
                   "nodes": nodes_json(typed), "rewrites": []}, sys.stdout, indent=2)
        print()
        return 0
    print(f"{spec.file}: graph '{spec.name}' is valid: {len(typed.graph)} nodes, {len(spec.devices)} devices")
    print(typed.ctx.env.bindings_text())
    print(render_nodes(typed))
    print(f"checked in {time.perf_counter() - t0:.2f} s")
    return 0


def cmd_plan(args) -> int:
    typed = analyze(args.graph, args.overrides)
    print(render_nodes(typed))
    return 0
