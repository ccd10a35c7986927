"""`dflash-graph check` and `dflash-graph plan`."""

from __future__ import annotations

import json
import sys
import time


from ..analysis.memory import HostMemory, MemoryReport
from ..models.qwen3_5 import forward_lines
from ..ops import registry
from ..rewrite.pipeline import Plan, compile_graph
from ..units import fmt_bytes
from .launch import launch_json, render_launch


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
        "dims": typed.ctx.env.bindings(), "nodes": nodes_json(typed),
        **memory_json(mem),
        "rewrites": [{"pass": a.pass_name, "rule": a.rule, "nodes": list(a.nodes), "trait": a.trait,
                      "saved_bytes": dict(a.saved_bytes), "saved_flops": dict(a.saved_flops)} for a in plan.applied],
        "before": memory_json(plan.memory_before) if plan.memory_before is not None else None,
        "launch": launch_json(typed),
    }


def render_nodes(typed) -> str:
    lines = []
    w = max((len(n.id) for n in typed.graph.nodes), default=0) + 1
    for n in typed.graph.nodes:
        shown = "".join(f"  {p.name}={typed.params[n.id][p.name]}" for p in registry.get(n.op).params if p.shown)
        lines.append(f"  {n.id:<{w}} {n.op:<18} @{n.device}" + (f"  model={n.model}" if n.model else "") + shown)
        for k, t in typed.outputs_of(n.id).items():
            if t.dtype == "handle":
                lines.append(f"      .{k:<16} hook point (no memory): hook_capture nodes read it")
                continue
            lines.append(f"      .{k:<16} {t.dtype:<9} {t.sym_str():<28} = {t.concrete_str()}")
    return "\n".join(lines)


def render_memory(mem: MemoryReport, before: MemoryReport | None = None) -> str:
    hdr = f"  {'device':<8} {'torch':<7} {'capacity':>10} {'usable':>10} {'weights':>10} {'optim':>10} " \
          f"{'allocated':>10} {'reserved':>10} {'headroom':>10}  peak at"
    lines = [hdr]
    for name, d in mem.devices.items():
        row = (f"  {name:<8} {d.torch:<7} {fmt_bytes(d.capacity_bytes):>10} {fmt_bytes(d.usable_bytes):>10} "
               f"{fmt_bytes(d.weight_bytes):>10} {fmt_bytes(d.optimizer_bytes):>10} {fmt_bytes(d.peak_bytes):>10} "
               f"{fmt_bytes(d.reserved_peak_bytes):>10} {fmt_bytes(d.headroom_bytes):>10}  {d.peak_node}"
               + ("   OOM" if d.oom else ""))
        if before is not None and name in before.devices:
            b = before.devices[name]
            row += f"   (as written: {fmt_bytes(b.peak_bytes)} / {fmt_bytes(b.reserved_peak_bytes)})"
        lines.append(row)
    return "\n".join(lines)


def render_host(host: HostMemory) -> str:
    """One line under the memory table: the CPU devices' shared pool against the host's memory."""
    from .console import span

    return (f"host memory: the CPU devices {span(list(host.devices))} share it and need {fmt_bytes(host.need_bytes)} "
            f"together (the sum of their peaks); {_host_has(host)}" + ("" if host.fits else "   OOM"))


def _host_has(host: HostMemory) -> str:
    from ..analysis.memory import HOST_SOURCES

    if host.available_bytes is None:
        return "how much this host has cannot be read (declare it: --host-memory or [memory] host_memory)"
    return f"this host has {fmt_bytes(host.available_bytes)} ({HOST_SOURCES.get(host.source, host.source)})"


def render_ooms(plan: Plan) -> str:
    import attrs

    from .console import describe_tensor, grouped_ooms, span

    lines = []
    host = plan.memory.host
    if host is not None and not host.fits:
        lines.append(f"OOM on host memory: the CPU devices {span(list(host.devices))} need {fmt_bytes(host.need_bytes)} "
                     f"together (the sum of their peaks); {_host_has(host)}")
    for devices, o in grouped_ooms(plan.memory):      # one block per distinct failure (replicas fail alike)
        torch_dev = plan.typed.ctx.spec.devices[o.device].torch
        alike = f" (each of {span(devices)} the same way)" if len(devices) > 1 else ""
        lines.append(f"OOM on {span(devices)} at node '{o.node}':")
        named = attrs.evolve(o, tensor=describe_tensor(o, plan.typed))
        lines.append("  torch.OutOfMemoryError: " + named.message(torch_dev) + alike)
    if lines:
        hints = []
        if not plan.rewritten:
            hints.append("run without --no-rewrite: the scheduler moves selections before expensive nodes and drops "
                         "outputs no one reads")
        cuda_oom = any(plan.typed.ctx.spec.devices[o.device].torch.startswith("cuda") for o in plan.memory.ooms)
        if not plan.memory.allocator.expandable_segments and cuda_oom:
            hints.append("try --expandable-segments on (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) if the "
                         "reserved peak is far above the allocated one")
        hints.append("lower a dim with --set (e.g. --set dims.seq=32768) or move nodes to another device")
        if host is not None and not host.fits:
            hints.append("the CPU devices share the host: put fewer devices on the CPU (e.g. --device-map cuda:0=cpu "
                         "maps one), or, for a run on another host, declare its memory: --host-memory 512GiB or "
                         "[memory] host_memory")
        lines.append("hint: " + "\n      ".join(hints))
    return "\n".join(lines)


def _by_amount(per_device: dict[str, int]) -> str:
    """'gpu0..gpu6 (7) 13.96 GiB, gpu7 3.28 GiB': devices with the same saving listed once."""
    groups: dict[int, list[str]] = {}
    for dev, b in per_device.items():
        if b:
            groups.setdefault(b, []).append(dev)
    parts = []
    for b, devs in groups.items():
        who = f"{devs[0]}..{devs[-1]} ({len(devs)})" if len(devs) > 2 else ", ".join(devs)
        parts.append(f"{who} {fmt_bytes(b)}")
    return ", ".join(parts)


def render_rewrites(plan: Plan) -> str:
    if not plan.applied:
        return "rewrites: none applied" if plan.rewritten else "rewrites: off (--no-rewrite)"
    lines = [f"rewrites: {len(plan.applied)} applied"]
    for a in plan.applied:
        saved = _by_amount(a.saved_bytes) or "no peak change"
        lines.append(f"  {a.rule:<28} {', '.join(a.nodes):<44} peak saved: {saved}")
    return "\n".join(lines)


def _plan(args) -> Plan:
    es = None if getattr(args, "expandable_segments", None) is None else args.expandable_segments == "on"
    from .run import _host_overrides, _mapped_overrides

    args.overrides = [*args.overrides, *_host_overrides(args)]
    if getattr(args, "device_map", None):
        args.overrides = [*args.overrides, *_mapped_overrides(args)]
    return compile_graph(args.graph, args.overrides, rewrite=not getattr(args, "no_rewrite", False),
                         expandable_segments=es, verify=getattr(args, "verify", False),
                         rules_off=getattr(args, "rules_off", ()))


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
    if getattr(args, "plot", None):
        from .plot import plot_plan

        out["plot"] = (args.plot, plot_plan(plan, args.plot))
    return out


def cmd_check(args) -> int:
    t0 = time.perf_counter()
    plan = _plan(args)
    code = 0 if plan.memory.fits else 1
    extras = _extras(args, plan)
    if args.json:
        out = plan_json(plan)
        out.update({k: v for k, (v, _) in extras.items()})
        out["check_seconds"] = round(time.perf_counter() - t0, 3)
        json.dump(out, sys.stdout, indent=2)
        print()
        return code
    typed, spec = plan.typed, plan.typed.ctx.spec
    print(f"{spec.file}: graph '{spec.name}': {len(typed.graph)} nodes on {len(spec.devices)} devices"
          + ("" if plan.rewritten else " (as written, --no-rewrite)"))
    print(typed.ctx.env.bindings_text())
    for line in forward_lines(typed.ctx.models):   # how each model's forward is assumed to run
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
    if plan.memory.fits:
        print("verdict: fits on every device")
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
    plan = _plan(args)
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
