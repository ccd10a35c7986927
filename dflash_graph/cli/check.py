"""`dflash-graph check` and `dflash-graph plan`."""

from __future__ import annotations

import json
import sys
import time

from ..analysis.memory import MemoryReport
from ..models.registry import ARCHS
from ..rewrite.pipeline import Plan
from .launch import launch_json, render_launch
from .options import plan_from_args
from .report import render_host, render_memory, render_nodes, render_ooms, render_rewrites


def nodes_json(typed) -> list[dict]:
    out = []
    for n in typed.graph.nodes:
        outs = typed.outputs_of(n.id)
        out.append({
            "id": n.id, "op": n.op, "device": n.device, "devices": list(typed.ctx.devices_of(n.device)),
            "model": n.model, "note": n.note,
            "outputs": {k: {"shape": [d.sym for d in t.shape], "sizes": list(t.sizes), "dtype": t.dtype,
                            "device": t.device, "bytes": t.nbytes} for k, t in outs.items()},
        })
    return out


def models_json(typed) -> dict:
    """Each model as check sees it, with what the prediction assumes about how it runs (the lines check prints
    under the dims: attention implementation, packing, kernels; each value with its source)."""
    import os

    out = {}
    base = typed.ctx.spec.base_dir
    for name, m in typed.ctx.models.items():
        weights = None if m.spec.weights is None else os.path.abspath(base / m.spec.weights)   # what run opens
        out[name] = {"arch": m.spec.arch, "dtype": m.spec.dtype, "trainable": m.spec.trainable,
                     "weights": weights, "shares": dict(m.spec.shares),
                     "assumptions": ARCHS[m.spec.arch].assumptions(m.dims, m.spec.forward)}
    return out


def assumption_lines(typed) -> list[str]:
    lines = []
    for name, m in typed.ctx.models.items():
        line = ARCHS[m.spec.arch].assumption_line(m.dims, m.spec.forward)
        if line:
            lines.append(f"model {name}: {line}")
    return lines


def memory_json(mem: MemoryReport) -> dict:
    return {
        "fits": mem.fits,
        "allocator": {"expandable_segments": mem.allocator.expandable_segments,
                      "max_split_size_bytes": mem.allocator.max_split_size_bytes},
        "devices": {name: {
            "torch": d.torch, "capacity_bytes": d.capacity_bytes, "usable_bytes": d.usable_bytes,
            "weight_bytes": d.weight_bytes, "optimizer_bytes": d.optimizer_bytes,
            "peak_bytes": d.peak_bytes, "live_peak_bytes": d.live_peak_bytes, "peak_node": d.peak_node,
            "reserved_peak_bytes": d.reserved_peak_bytes, "reserved_peak_node": d.reserved_peak_node,
            "headroom_bytes": d.headroom_bytes, "node_peak_bytes": dict(d.node_peaks),
        } for name, d in mem.devices.items()},
        "oom": [{"device": o.device, "node": o.node, "tensor": o.tensor, "requested_bytes": o.requested_bytes,
                 "free_bytes": o.free_bytes, "reserved_bytes": o.reserved_bytes, "allocated_bytes": o.allocated_bytes}
                for o in mem.ooms],
        "host": None if mem.host is None else {
            "devices": list(mem.host.devices), "need_bytes": mem.host.need_bytes,
            "available_bytes": mem.host.available_bytes, "source": mem.host.source, "fits": mem.host.fits},
    }


def plan_json(plan: Plan) -> dict:
    typed, mem = plan.typed, plan.memory
    spec = typed.ctx.spec
    return {
        "graph": spec.name, "file": spec.file, "valid": True, "rewritten": plan.rewritten,
        "dims": typed.ctx.env.bindings(), "models": models_json(typed), "nodes": nodes_json(typed),
        **memory_json(mem),
        "rewrites": [{"pass": a.pass_name, "rule": a.rule, "nodes": list(a.nodes), "trait": a.trait,
                      "saved_bytes": dict(a.saved_bytes), "saved_flops": dict(a.saved_flops)} for a in plan.applied],
        "before": memory_json(plan.memory_before) if plan.memory_before is not None else None,
        "launch": launch_json(typed),
    }


def _extras(args, plan: Plan) -> dict[str, tuple[object, str]]:
    """What the optional flags of check add: JSON key -> (JSON value, text for the console)."""
    out: dict[str, tuple[object, str]] = {}
    if getattr(args, "max", None):
        from .whatif import max_for_graph, render_max

        r = max_for_graph(args.graph, args.overrides, args.max, rewrite=plan.rewritten, base=plan)
        out["max"] = (r.to_json(), render_max(r))
    if getattr(args, "memory_snapshot", None):
        from .snapshot import write_snapshot

        out["memory_snapshot"] = write_snapshot(plan, args.memory_snapshot)
    if getattr(args, "layouts", False):
        from .layouts import layout_rows, render_layouts

        rows = layout_rows(plan)
        out["layouts"] = ([r.to_json() for r in rows], render_layouts(plan, rows))
    if getattr(args, "capture", None) is not None:
        from ..analysis.capture import capture_bill, render_bill

        bill = capture_bill(plan, args.capture or None)
        out["capture"] = (bill.to_json(), render_bill(bill))
    if getattr(args, "plot", None):
        from .plot import plot_plan

        out["plot"] = (args.plot, plot_plan(plan, args.plot))
    return out


def _missing_paths(args, plan: Plan) -> list:
    """The files the graph names that do not exist: an error (exit 2) unless --memory-only, which predicts memory
    without them and reports them as warnings."""
    from ..spec.paths import missing_paths

    missing = missing_paths(plan.typed.ctx.spec)
    if missing and not getattr(args, "memory_only", False):
        import attrs

        from ..errors import GraphError

        raise GraphError([attrs.evolve(m.problem, hint=f"{m.problem.hint}; `check --memory-only` predicts memory "
                                                       "without it") for m in missing])
    return missing


def missing_json(missing) -> list[dict]:
    return [{"key": m.key, "path": m.path, "needed_by": m.needed_by, "file": m.problem.loc.file,
             "line": m.problem.loc.line, "message": m.problem.message} for m in missing]


def _outputs(args) -> None:
    """The files check's flags write, refused before the graph is checked when they cannot be written."""
    from .outputs import output_file

    if getattr(args, "plot", None):
        from .plot import plot_output

        plot_output(args.plot)
    if getattr(args, "memory_snapshot", None):
        output_file(args.memory_snapshot, "--memory-snapshot")


def cmd_check(args) -> int:
    t0 = time.perf_counter()
    _outputs(args)
    plan = plan_from_args(args)
    missing = _missing_paths(args, plan)
    code = 0 if plan.memory.fits else 1
    extras = _extras(args, plan)
    if args.json:
        out = plan_json(plan)
        out["missing_paths"] = missing_json(missing)
        out.update({k: v for k, (v, _) in extras.items()})
        out["check_seconds"] = round(time.perf_counter() - t0, 3)
        json.dump(out, sys.stdout, indent=2)
        print()
        return code
    typed, spec = plan.typed, plan.typed.ctx.spec
    print(f"{spec.file}: graph '{spec.name}': {len(typed.graph)} nodes on {len(spec.devices)} devices"
          + ("" if plan.rewritten else " (as written, --no-rewrite)"))
    print(typed.ctx.env.bindings_text())
    for line in assumption_lines(typed):   # how each model's forward is assumed to run
        print(line)
    print(render_nodes(typed))
    print()
    print(render_rewrites(plan))
    print()
    es = plan.memory.allocator.expandable_segments
    cuda = any(d.torch.startswith("cuda") for d in plan.memory.devices.values())
    alloc = ("CUDA caching allocator, " + ("expandable_segments" if es else "default settings")) if cuda else \
        "CPU devices: no caching allocator, reserved = allocated"
    print(f"memory per device (one training step, two simulated; {alloc}):")
    from .console import print_memory_table, use_rich

    if use_rich():
        sys.stdout.flush()
        print_memory_table(plan.memory, plan.memory_before)
    else:
        print(render_memory(plan.memory, plan.memory_before))
    if plan.memory.host is not None:
        print(render_host(plan.memory.host))
    print()
    print(render_launch(typed))
    print()
    for m in missing:
        print(m.problem.render("warning"))
    if missing:
        print()
    if plan.memory.fits:
        print("verdict: fits on every device" + (f"; `run` needs the {len(missing)} missing file(s) above"
                                                 if missing else ""))
    else:
        print(render_ooms(plan))
        where = [o.device for o in plan.memory.ooms]
        if plan.memory.host is not None and not plan.memory.host.fits:
            where.append("host memory")
        print(f"verdict: predicted OOM on {', '.join(where)}")
    for _, text in extras.values():
        print()
        print(text)
    print(f"checked in {time.perf_counter() - t0:.2f} s")
    return code


def cmd_plan(args) -> int:
    if args.emit:
        from .outputs import output_file

        output_file(args.emit, "--emit")
    plan = plan_from_args(args)
    if getattr(args, "layout", None):
        from .layouts import layout_plan

        plan = layout_plan(plan, args.layout)
    if args.emit:
        import os

        from ..errors import GraphError, Location, Problem
        from ..rewrite.emit import emit_toml

        if os.path.exists(args.emit) and os.path.samefile(args.emit, args.graph):
            stem = args.graph[:-5] if args.graph.endswith(".toml") else args.graph
            raise GraphError(Problem(f"--emit {args.emit} is the graph being read: plan never overwrites its input",
                                     Location(args.graph, None, "--emit"),
                                     hint=f"write the rewritten graph beside it: --emit {stem}.rewritten.toml"))
        text = emit_toml(plan, args.emit)
        with open(args.emit, "w") as f:
            f.write(text)
        print(f"wrote {args.emit}: {len(plan.typed.graph)} nodes, {len(plan.applied)} rewrites applied")
        return 0
    print(render_rewrites(plan))
    print(render_nodes(plan.typed))
    return 0
