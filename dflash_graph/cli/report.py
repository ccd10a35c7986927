"""The plan as the console shows it, for every command that prints one (check, plan, run, explain): the nodes,
the rewrites applied, the memory table, the host's shared memory and the predicted OOMs with hints."""

from __future__ import annotations

from ..analysis.memory import HOST_SOURCES, HostMemory, MemoryReport
from ..ops import registry
from ..rewrite.pipeline import Plan
from ..units import fmt_bytes


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


def by_amount(per_device: dict[str, int]) -> str:
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
        saved = by_amount(a.saved_bytes) or "no peak change"
        lines.append(f"  {a.rule:<28} {', '.join(a.nodes):<44} peak saved: {saved}")
    return "\n".join(lines)
