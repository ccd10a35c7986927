"""`dflash-graph explain GRAPH NODE`: one node's contract, shapes, cost formulas and rewrites, in one place.

Everything shown is read from the declarations (ops/catalog.py), static inference and the rewrite log; the
formulas are the op's own cost function evaluated twice: on the inferred sizes, and on sympy symbols for the
dims (when the function is plain arithmetic over sizes; a function that branches on sizes, such as a
forward's per-layer replay, has no closed form and shows its value only).
"""

from __future__ import annotations

import inspect
import os

import sympy

from ..analysis.infer import Typed
from ..analysis.nodecost import cost_context, grad_nodes
from ..errors import GraphError, Location, Problem, did_you_mean
from ..ir.dims import is_symbolic, symbol
from ..ir.types import Dim, TensorType
from ..ops import registry
from ..ops.costs import program_peak, program_steps
from ..rewrite.pipeline import Plan
from ..rewrite.rules import ALL_RULES
from ..units import DTYPE_BYTES, fmt_bytes


def _sym_dim(d: Dim, names: dict[str, sympy.Symbol]) -> Dim:
    try:
        expr = sympy.sympify(d.sym, locals=names)
    except (sympy.SympifyError, TypeError, SyntaxError):
        expr = sympy.Integer(d.value)
    return Dim(d.sym, expr)


def _sym_type(t: TensorType, names) -> TensorType:
    return TensorType(tuple(_sym_dim(d, names) for d in t.shape), t.dtype, t.device)


def symbolic_cost(typed: Typed, nid: str):
    """The node's NodeCost with sympy expressions of the dims for sizes, or None when the cost function needs
    concrete sizes (it compares or rounds them)."""
    node = typed.graph[nid]
    op = registry.get(node.op)
    if op.cost is None:
        return None
    names = {n: symbol(n) for n in typed.ctx.env.names}
    ins = {k: _sym_type(t, names) for k, t in typed.inputs_of(nid).items()}
    outs = {k: _sym_type(t, names) for k, t in typed.outputs_of(nid).items()}
    try:
        return op.cost(cost_context(typed, node, nid in grad_nodes(typed), ins, outs))
    except (TypeError, ValueError, AttributeError, KeyError, IndexError):
        return None


def _source(fn) -> tuple[str, list[str]]:
    """'dflash_graph/ops/costs.py:87 lm_head' and the comment lines of the function (its citations)."""
    try:
        lines, start = inspect.getsourcelines(fn)
        path = os.path.relpath(inspect.getsourcefile(fn), os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", str(fn)), []
    comments = [ln.strip()[1:].strip() for ln in lines if ln.strip().startswith("#")]
    doc = inspect.getdoc(fn)
    if doc:
        comments = [*doc.splitlines()[:3], *comments]
    return f"{path}:{start} {fn.__qualname__}", comments


def _expr_text(expr, bindings: dict[str, int], unit: str) -> str | None:
    if not isinstance(expr, sympy.Expr) or expr.is_number:
        return None
    value = int(expr.subs({symbol(k): v for k, v in bindings.items()}))
    shown = fmt_bytes(value) if unit == "bytes" else f"{value:.3g}"
    # the symbolic form, then the same with the values written in: 2*anchors*block*hidden*vocab = 2*512*16*...
    nums = str(expr.subs({symbol(k): sympy.Symbol(f"{v:,}") for k, v in bindings.items()}))
    return f"{expr} = {nums} = {shown}"


def find_node(plan: Plan, nid: str) -> tuple[Typed, bool]:
    """(typed graph holding the node, whether the rewritten graph still has it)."""
    if nid in plan.typed.graph:
        return plan.typed, True
    if nid in plan.original.graph:
        return plan.original, False
    ids = sorted({n.id for n in plan.typed.graph.nodes} | {n.id for n in plan.original.graph.nodes})
    spec = plan.typed.ctx.spec
    raise GraphError(Problem(f"no node '{nid}' in the graph{did_you_mean(nid, ids)}", Location(spec.file, None, "NODE"),
                             hint="nodes: " + ", ".join(ids)))


def explain(plan: Plan, nid: str) -> str:
    typed, kept = find_node(plan, nid)
    node = typed.graph[nid]
    op = registry.get(node.op)
    ctx = typed.ctx
    loc = ctx.loc(node)
    bindings = ctx.env.bindings()
    out = [f"node '{nid}': op {op.name} @{node.device}" + (f" ({', '.join(ctx.devices_of(node.device))})"
                                                              if node.device in ctx.spec.groups else "")
           + (f", model {node.model}" if node.model else "")]
    out.append(f"  defined at {loc.render()}" + (f" ({loc.path})" if loc.path else ""))
    if node.note:
        out.append(f"  note: {node.note}")
    if not kept:
        out.append("  removed by the rewrites (shown as written): see 'rewrites' below")
    # contract
    out.append("")
    out.append(f"contract (ops/catalog.py, op '{op.name}'): {op.doc}")
    params = typed.params[nid]
    for p in op.input_ports(params, len(node.inputs)):
        src = dict(node.inputs).get(p.name)
        out.append(f"  in  {p.name:<14} [{p.dims}] {p.dtype}" + (f"  <- {src}" if src else "")
                   + (f"  ({p.doc})" if p.doc else ""))
    for p in op.output_ports(params):
        out.append(f"  out {p.name:<14} [{p.dims}] {p.dtype}" + (f"  ({p.doc})" if p.doc else ""))
    for p in op.params:
        v = params.get(p.name)
        v = v[1] if isinstance(v, tuple) and len(v) == 2 and is_symbolic(v[0]) else v
        raw = node.params.get(p.name, p.default)
        out.append(f"  param {p.name} = {raw!r}" + (f" = {v}" if str(v) != str(raw) else "") + f"  ({p.doc})")
    traits = [f"{k}={v!r}" for k, v in (("positionwise", op.traits.positionwise), ("remap", op.traits.remap),
                                       ("selection", op.traits.selection), ("movement", op.traits.movement),
                                       ("sink", op.traits.sink)) if v]
    flags = [k for k in ("pure", "deterministic") if getattr(op.traits, k)]
    out.append(f"  traits: {', '.join(traits + flags) or 'none'}")
    if op.impl:
        out.append(f"  torch implementation: {op.impl}")
    # shapes
    out.append("")
    out.append("inferred types (symbolic = concrete):")
    for k, t in typed.outputs_of(nid).items():
        if t.dtype == "handle":
            out.append(f"  .{k:<14} hook point (no memory)")
            continue
        names = {n: symbol(n) for n in bindings}
        nbytes = sympy.Integer(DTYPE_BYTES[t.dtype])
        for d in t.shape:
            nbytes *= _sym_dim(d, names).value
        out.append(f"  .{k:<14} {t.dtype} {t.sym_str()} = {t.concrete_str()}: {fmt_bytes(t.nbytes)}"
                   + (f" ({nbytes} bytes)" if isinstance(nbytes, sympy.Expr) and not nbytes.is_number else ""))
    # costs
    out.append("")
    grad = nid in grad_nodes(typed)
    from ..analysis.nodecost import node_cost

    cost = node_cost(typed, node, grad)
    sym = symbolic_cost(typed, nid)
    where, notes = _source(op.cost) if op.cost else ("(no cost function)", [])
    out.append(f"cost ({where}){'; autograd records it (trainable path)' if grad else ''}:")
    peak = program_peak(cost.program) if cost.program else None
    rows = [("workspace", cost.workspace_bytes, sym.workspace_bytes if sym else None, "bytes"),
            ("saved for backward", cost.saved_bytes, sym.saved_bytes if sym else None, "bytes"),
            ("FLOPs", cost.flops, sym.flops if sym else None, "flops")]
    for label, val, s, unit in rows:
        text = _expr_text(s, bindings, unit) if s is not None else None
        shown = fmt_bytes(val) if unit == "bytes" else f"{val:.3g}"
        out.append(f"  {label:<19} {text or shown}")
    if peak is not None:
        steps = program_steps(cost.program)
        folded = sum(st[1].times * st[1].layers for st in cost.program if st[0] == "repeat")
        how = (f"; {folded:,} of the layers repeat a period, replayed until the allocator's state repeats (NOTE "
               "[Layer folding])" if folded else "")
        out.append(f"  {'program':<19} {steps:,} allocations in order, peak {fmt_bytes(peak)} above the inputs "
                   f"(a per-layer replay: no closed form{how})")
    if cost.saved_inputs:
        out.append(f"  saved inputs        {', '.join(cost.saved_inputs)} (kept alive until backward)")
    for ln in notes:
        out.append(f"    # {ln}")
    mem = plan.memory if kept else plan.memory_before
    if mem is not None:
        peaks = {dev: d.node_peaks[nid] for dev, d in mem.devices.items() if nid in d.node_peaks}
        if peaks:
            groups: dict[int, list[str]] = {}
            for dev, b in peaks.items():
                groups.setdefault(b, []).append(dev)
            out.append("  live bytes on the device at this node's peak: "
                       + ", ".join(f"{', '.join(v) if len(v) < 3 else f'{v[0]}..{v[-1]}'} {fmt_bytes(b)}"
                                   for b, v in groups.items()))
    # rewrites
    out.append("")
    touched = [a for a in plan.applied if nid in a.nodes]
    if not plan.rewritten:
        out.append("rewrites: off (--no-rewrite)")
    elif not touched:
        out.append("rewrites: none touched this node")
    else:
        out.append("rewrites that touched it:")
        for a in touched:
            rule = ALL_RULES.get(a.rule)
            from .report import by_amount

            saved = by_amount(a.saved_bytes) or "no peak change"
            out.append(f"  {a.pass_name}/{a.rule} on {', '.join(a.nodes)}: peak saved {saved}")
            if rule is not None:
                out.append(f"    legal by {rule.trait}: {rule.doc}")
    return "\n".join(out)


def cmd_explain(args) -> int:
    from .options import plan_from_args

    plan = plan_from_args(args)
    print(explain(plan, args.node))
    return 0
