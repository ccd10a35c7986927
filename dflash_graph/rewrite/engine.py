"""Rules as data and the fixpoint driver.

A rule is a name, the trait that makes it legal, and a pure function `(typed, node) -> Replacement | None`
that matches at one node and builds the replacement. The driver runs named tables of rules to a fixpoint, with
a loop guard, re-infers every contract after each rewrite (a rewrite that breaks a contract is a bug, raised at
once), and logs what each rewrite saved on each device. A rewrite is taken only when no device's predicted peak
rises: legality comes from the traits, profitability from the cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from ..errors import GraphError, Problem
from ..ir.graph import Graph, Node, Ref
from ..analysis.infer import Typed, infer


@attrs.frozen
class Replacement:
    remove: tuple[str, ...] = ()
    add: tuple[Node, ...] = ()
    redirect: Mapping[Ref, Ref] = attrs.field(factory=dict)
    touched: tuple[str, ...] = ()          # node ids to report
    always: bool = False                   # a canonicalisation: taken even if a peak rises (must not, in practice)


@attrs.frozen
class Rule:
    name: str
    trait: str                              # the declared property that makes it legal
    doc: str
    match: Callable[[Typed, Node], Replacement | None]


@attrs.frozen
class Applied:
    pass_name: str
    rule: str
    trait: str
    nodes: tuple[str, ...]
    saved_bytes: Mapping[str, int]        # per physical device: live peak before - after
    saved_flops: Mapping[str, int]


class RewriteLoopError(RuntimeError):
    pass


class ContractBroken(RuntimeError):
    pass


# NOTE [Rewrite bound]: the driver takes, at every step, the first candidate in (node order, rule order) that
# matches and does not raise a device's peak, and prices every candidate it tries with the memory model over the
# whole device (NOTE [Rewrite pricing]). Re-inference is incremental (NOTE [Incremental inference]) and the
# scan's matches are cheap, but a candidate rejected on one graph can be accepted on a later one (another rewrite
# lowered the live bytes where it raised them), so the driver must price it again after every accepted rewrite:
# on a graph of n nodes that is O(n) rewrites x O(n) candidates re-priced x O(n) per pricing, and rewriting time
# grows with the cube of the node count (benchmarks/check_scaling.py: 1.0 CPU s at 98 nodes, 2.5 s at 150,
# 6.2 s at 200, 24 s at 300 on the shared 2-core machine). Training graphs have 10 to 40 nodes; a larger graph is
# refused with this bound named, and checks as written (--no-rewrite: linear, ~0.5 s at 1,000 nodes). Lifting
# the bound needs pricing in time independent of the graph size (a live-byte curve updated where a rewrite
# changes it) or a driver that does not retry rejected candidates, whose results can differ from this one's.
MAX_REWRITE_NODES = 150

Tables = Sequence[tuple[str, Sequence[Rule]]]
Costs = Callable[[Typed], tuple[Mapping[str, int], Mapping[str, int]]]   # typed -> (peak per device, flops per device)


def rewrite(typed: Typed, tables: Tables, costs: Costs, max_steps: int | None = None,
            verify: bool = False) -> tuple[Typed, list[Applied]]:
    applied: list[Applied] = []
    if len(typed.graph) > MAX_REWRITE_NODES:
        raise GraphError(Problem(f"the graph has {len(typed.graph):,} nodes, over the bound of {MAX_REWRITE_NODES} "
                                 "for rewriting (its time grows with the cube of the node count)",
                                 typed.ctx.spec.loc("nodes"),
                                 hint="check or run it as written with --no-rewrite (linear in the node count)"))
    if max_steps is None:   # a rule applies a bounded number of times per node: the guard grows with the graph
        max_steps = 500 + 10 * len(typed.graph)
    peaks, flops = costs(typed)
    steps = 0
    # NOTE [Fixpoint over all passes]: a later pass can enable an earlier one (merge_duplicates in `cleanup`
    # leaves a position-wise node with one reader, which `push_selections` then moves a gather through), so the
    # passes run again, in order, until a whole round applies nothing. The loop guard counts applied rewrites
    # only: a rejected candidate is never retried on the same graph, so rejections cannot loop.
    while True:
        round_start = len(applied)
        for pass_name, rules in tables:
            rejected: set[tuple[str, str, int]] = set()
            changed = True
            while changed:
                changed = False
                fp = _fingerprint(typed.graph)
                for node in typed.graph.nodes:
                    for rule in rules:
                        key = (rule.name, node.id, fp)
                        if key in rejected:
                            continue
                        rep = rule.match(typed, node)
                        if rep is None:
                            continue
                        graph = typed.graph.replace(rep.remove, rep.add, rep.redirect)
                        try:
                            new = infer(graph, typed.ctx, prev=typed)   # NOTE [Incremental inference]
                        except GraphError as e:
                            raise ContractBroken(f"rule {rule.name} at '{node.id}' produced an ill-typed graph:\n{e}") from e
                        _check_outputs_kept(typed, new, rule)
                        if _replicas(new) != _replicas(typed):
                            rejected.add(key)      # NOTE [Replicas]
                            continue
                        # NOTE [Rewrite pricing]: a candidate is priced by replaying each device's allocations
                        # (analysis/memory.live_peaks); with the current peaks as a bound the replay stops at the
                        # first device whose live bytes pass its peak: the verdict is the same, reached sooner
                        if not rep.always and getattr(costs, "bounded", False):
                            priced = costs(new, bound=peaks)     # None: some device's peak rises
                            if priced is None:
                                rejected.add(key)
                                continue
                        else:
                            priced = costs(new)
                        new_peaks, new_flops = priced
                        if not rep.always and any(new_peaks.get(d, 0) > peaks.get(d, 0) for d in peaks):
                            rejected.add(key)
                            continue
                        steps += 1
                        if steps > max_steps:
                            raise RewriteLoopError(f"infinite loop in rewrite pass '{pass_name}': more than {max_steps} "
                                                   f"rewrites (last: {rule.name} at '{node.id}')")
                        applied.append(Applied(pass_name, rule.name, rule.trait, rep.touched or (node.id,),
                                               {d: peaks.get(d, 0) - new_peaks.get(d, 0) for d in peaks},
                                               {d: flops.get(d, 0) - new_flops.get(d, 0) for d in flops}))
                        typed, peaks, flops = new, new_peaks, new_flops
                        if verify:
                            _check_incremental(typed)
                        changed = True
                        break
                    if changed:
                        break
        if len(applied) == round_start:
            break
    return typed, applied


def _check_incremental(typed: Typed) -> None:
    """Incremental re-inference (NOTE [Incremental inference]) gives what inferring from scratch gives: the same
    types and params, in the same order."""
    full = infer(typed.graph, typed.ctx)
    if list(full.types.items()) != list(typed.types.items()) or \
            list(full.params.items()) != list(typed.params.items()):
        diff = sorted({str(r) for r in full.types.keys() ^ typed.types.keys()} |
                      {str(r) for r in full.types.keys() & typed.types.keys() if full.types[r] != typed.types[r]} |
                      {n for n in full.params.keys() & typed.params.keys() if full.params[n] != typed.params[n]})
        raise ContractBroken(f"incremental re-inference differs from inferring the graph from scratch: {diff or 'order'}")


def _replicas(typed: Typed) -> int:
    """NOTE [Replicas]: a step runs the graph once per replica of the widest group that has a node
    (exec/interpreter.py, analysis/memory.py), so a node on one device runs that many times per step. A rewrite
    that removed the last node of that group (a transfer round trip through it, say) would change how often
    every other node runs: it is not taken."""
    from ..analysis.launch import replicas

    return replicas(typed)


def _fingerprint(g: Graph) -> int:
    return hash(tuple((n.id, n.op, n.inputs, tuple(sorted((k, repr(v)) for k, v in n.params.items())), n.device)
                      for n in g.nodes))


def _check_outputs_kept(old: Typed, new: Typed, rule: Rule) -> None:
    """Every graph result keeps its type: a sink's outputs (the loss), or what an `output` sink reads (it has no
    outputs: its input is the result). Rewrites never change what the graph computes."""
    from ..ops import registry

    for n in old.graph.nodes:
        if registry.get(n.op).traits.sink:
            if n.id not in new.graph:
                raise ContractBroken(f"rule {rule.name} removed result {n.id}")
            for k, t in old.outputs_of(n.id).items():
                nt = new.types.get(Ref(n.id, k))
                if nt != t:
                    raise ContractBroken(f"rule {rule.name} changed result {n.id}.{k}: {t} -> {nt}")
            if old.outputs_of(n.id):
                continue   # a sink with outputs (the loss) is its outputs; a fused loss reads other tensors
            for port, t in old.inputs_of(n.id).items():
                nt = new.types.get(new.graph[n.id].input(port))
                if nt != t:
                    raise ContractBroken(f"rule {rule.name} changed what result {n.id} reads on '{port}': {t} -> {nt}")
