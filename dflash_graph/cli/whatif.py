"""`check --max DIM`: the search of analysis/whatif.py wired to a graph file, and its report."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..analysis.infer import Typed, build, infer
from ..analysis.memory import MemoryReport, analyze_memory, live_peaks
from ..analysis.whatif import MaxResult, check_dim, max_dim
from ..ir.graph import Graph
from ..rewrite.engine import rewrite as rewrite_graph
from ..rewrite.pipeline import Plan, compile_graph
from ..rewrite.rules import DEFAULT_TABLES
from ..spec.loader import load_graph
from ..units import fmt_bytes


def max_for_graph(path: str, overrides: Sequence[str], dim: str, rewrite: bool = True,
                  expandable_segments: bool | None = None, base=None) -> MaxResult:
    """`check --max`: `base` is the Plan at the current dims when the caller has it already."""
    t0 = time.perf_counter()
    spec = load_graph(path, overrides)
    name = check_dim(spec, dim)
    plan0 = base if base is not None else compile_graph(path, overrides, rewrite, expandable_segments)
    graph: Graph = plan0.typed.graph
    alloc = plan0.memory.allocator

    def typed_at(v: int, full: bool) -> Typed:
        g, ctx = build(load_graph(path, [*overrides, f"dims.{name}={v}"]))
        if not full:
            return infer(graph, ctx)
        typed = infer(g, ctx)
        return rewrite_graph(typed, DEFAULT_TABLES, live_peaks)[0] if rewrite else typed

    return max_dim(typed_at, plan0.typed, name, alloc, t0, confirm=rewrite)


def readable(expr, name: str) -> str:
    """'406.75 KiB * seq + 57.78 GiB': a live-peak polynomial with its coefficients in binary units."""
    import sympy

    from ..ir.dims import symbol

    poly = sympy.Poly(expr, symbol(name))
    parts = []
    for (k,), c in sorted(poly.terms(), reverse=True):
        coef = fmt_bytes(float(c))
        parts.append(coef if k == 0 else f"{coef} * {name}" + (f"^{k}" if k > 1 else ""))
    return " + ".join(parts) or "0 B"


def render_max(r: MaxResult) -> str:
    n = r.dim
    if r.value is None:
        lines = [f"max dims.{n}: none (now {r.current:,}): {r.note}"]
        if r.binding is not None:
            lines.append(f"  live bytes at '{r.binding.node}' on {r.binding.device}: {readable(r.binding.expression, n)}")
        return "\n".join(lines)
    lines = [f"max dims.{n}: {r.value:,} (now {r.current:,}): every device fits at {n}={r.value:,}, not at "
             f"{n}={r.value + 1:,}"]
    if r.binding is not None:
        b = r.binding
        lines.append(f"  live bytes, solved: {b.device} at '{b.node}' binds first: {readable(b.expression, n)} "
                     f"fits the usable memory up to {n}={r.live_bound:,}")
    shown = ", ".join(f"{v:,} {'fits' if ok else 'OOM'}" for v, ok in r.replays[:8])
    more = f", ... ({len(r.replays)} in all)" if len(r.replays) > 8 else ""
    lines.append(f"  allocator, replayed: {shown}{more}")
    if r.next_oom is not None:
        o = r.next_oom
        from .console import describe_tensor

        lines.append(f"  at {n}={r.value + 1:,}: OOM on {o.device} at node '{o.node}', allocating {describe_tensor(o)} "
                     f"({fmt_bytes(o.requested_bytes)} requested, {fmt_bytes(o.free_bytes)} free)")
    if r.next_host is not None:
        h = r.next_host
        lines.append(f"  at {n}={r.value + 1:,}: OOM on host memory: the CPU devices need {fmt_bytes(h.need_bytes)} "
                     f"together, the host has {fmt_bytes(h.available_bytes)}")
    if not r.confirmed:
        lines.append("  not confirmed by the whole pipeline at these dims: rerun check with --set to see it")
    if r.non_polynomial:
        lines.append(f"  not polynomial in {n}, left to the replays: {', '.join(r.non_polynomial)}")
    if r.note:
        lines.append(f"  note: {r.note}")
    return "\n".join(lines)
