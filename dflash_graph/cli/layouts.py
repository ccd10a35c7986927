"""`check --layouts` and `plan --layout NAME`: the graph's layouts (analysis/layouts.py), each variant checked
through the same pipeline as the graph itself (rewrites included), one row per layout."""

from __future__ import annotations

import attrs

from ..analysis.infer import build, infer
from ..analysis.launch import analyze_launch, replicas
from ..analysis.layouts import enumerate_layouts, find_layout, layout_spec
from ..errors import GraphError
from ..rewrite.pipeline import Plan, compile_typed
from ..units import fmt_bytes, fmt_seconds


@attrs.frozen
class LayoutRow:
    name: str
    verdict: str                  # "fits" | "OOM" | "refused"
    peak_bytes: int | None        # the largest reserved peak over the devices
    peak_device: str | None
    bottleneck: str | None        # "ranks 0-6 (gpu0..gpu6)"
    step_seconds: float | None
    samples_per_second: float | None
    note: str = ""                # a refusal's message; the OOM devices

    def to_json(self) -> dict:
        return attrs.asdict(self)


def layout_plan(plan: Plan, name: str) -> Plan:
    """The given plan's graph in layout `name`, checked like any graph (rewrites as the plan had them)."""
    spec = layout_spec(plan.original, find_layout(plan.original, name))
    return compile_typed(infer(*build(spec)), plan.rewritten)


def layout_rows(plan: Plan) -> list[LayoutRow]:
    rows = []
    for lay in enumerate_layouts(plan.original):
        try:
            p = compile_typed(infer(*build(layout_spec(plan.original, lay))), plan.rewritten)
        except GraphError as e:
            rows.append(LayoutRow(lay.name, "refused", None, None, None, None, None, e.problems[0].message))
            continue
        mem = p.memory
        top = max(mem.devices.values(), key=lambda d: d.reserved_peak_bytes)
        L = analyze_launch(p.typed)
        b = L.bottleneck()
        spec = p.typed.ctx.spec
        sequences = replicas(p.typed) * int(spec.train.get("grad_accum", 1) or 1)   # one optimizer step
        where = None
        if b is not None:
            ranks, secs = b
            devs = [d for k in ranks for d in L.rank_devices(k)]
            where = (f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}") + \
                f" ({devs[0]}" + (f"..{devs[-1]})" if len(devs) > 1 else ")")
        rows.append(LayoutRow(lay.name, "fits" if mem.fits else "OOM", top.reserved_peak_bytes, top.name, where,
                              b[1] if b else None, sequences / b[1] if b else None,
                              "" if mem.fits else "OOM on " + ", ".join(o.device for o in mem.ooms)))
    return rows


def render_layouts(plan: Plan, rows: list[LayoutRow]) -> str:
    spec = plan.original.ctx.spec
    out = [f"layouts of {spec.file}'s {len(spec.devices)} devices (each variant checked as a graph, "
           f"{'rewritten' if plan.rewritten else 'as written'}; `plan --layout NAME --emit FILE` writes one):",
           f"  {'layout':<16}{'verdict':<9}{'max peak':>12}  {'on':<8}{'bottleneck':<26}{'step':>10}{'samples/s':>11}"]
    for r in rows:
        if r.verdict == "refused":
            out.append(f"  {r.name:<16}{'refused':<9}  {r.note}")
            continue
        out.append(f"  {r.name:<16}{r.verdict:<9}{fmt_bytes(r.peak_bytes):>12}  {r.peak_device:<8}"
                   f"{r.bottleneck or '-':<26}{fmt_seconds(r.step_seconds) if r.step_seconds else '-':>10}"
                   f"{f'{r.samples_per_second:.2f}' if r.samples_per_second else '-':>11}")
    best = max((r for r in rows if r.verdict == "fits" and r.samples_per_second), default=None,
               key=lambda r: r.samples_per_second)
    if best is not None:
        out.append(f"  fastest that fits: {best.name}, {best.samples_per_second:.2f} samples/s (packed sequences "
                   "per optimizer step over the bottleneck rank's busy time with its collectives)")
    elif not any(r.samples_per_second for r in rows):
        out.append("  (no samples/s: the devices declare no throughput)")
    return "\n".join(out)
