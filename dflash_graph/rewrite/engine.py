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
# matches and does not raise a device's peak. Re-inference is incremental (NOTE [Incremental inference]) and the
# scan's matches are cheap. A candidate rejected on one graph can be accepted on a later one (another rewrite
# lowered the live bytes where it raised them), so the driver must consider it again after every accepted
# rewrite; pricing it again each time made rewriting grow with the cube of the node count (24 CPU s at 300
# nodes). A rejection certificate (NOTE [Rejection certificates]) re-rejects it without pricing while the
# rewrites since cannot have changed the verdict, so the driver prices about one candidate per rewrite applied.
# Pricing reads each device's peak off its live curve, updated where the rewrite changed it (analysis/memory.py,
# NOTE [Live curve]), instead of replaying each device's allocations over the whole graph (NOTE [Rewrite
# pricing]); what is left per rewrite is linear in the graph with small constants (building the new Graph,
# incremental inference's pass over the nodes, the scan from the first node, the fingerprint, the curve's sum
# and max), so rewriting still grows faster than the node count (exponent about 1.5 from 50 to 300 nodes).
# benchmarks/check_scaling.py, CPU s on the shared 2-core machine (quiet to loaded): 0.2 to 0.3 at 100 nodes,
# 0.4 to 0.8 at 150, 0.8 to 1.4 at 200, 1.4 to 2.0 at 250, 2.0 to 2.4 at 300, against 0.4 to 0.7, 1.1 to 1.6,
# 1.9 to 2.9, 3.1 to 4.6 and 4.6 to 6.9 with a full replay per candidate. At 300 nodes (1.6 s) incremental
# inference takes 39% (building Refs and types for the nodes it keeps), pricing 18%, Graph.replace 17%.
# Training graphs have 10 to 40 nodes; a graph over the bound (under 2 s with a margin for the shared machine)
# is refused with the bound named, and checks as written (--no-rewrite: linear, ~1.6 s at the 5,000-node
# bound). Linear rewriting needs the rest to be incremental too (a Graph updated in place of rebuilt, the scan
# resumed where the rewrite was, the fingerprint and the curve kept in trees).
MAX_REWRITE_NODES = 200

Tables = Sequence[tuple[str, Sequence[Rule]]]
Costs = Callable[[Typed], tuple[Mapping[str, int], Mapping[str, int]]]   # typed -> (peak per device, flops per device)


def rewrite(typed: Typed, tables: Tables, costs: Costs, max_steps: int | None = None,
            verify: bool = False, certificates: bool = True, curves: bool = True) -> tuple[Typed, list[Applied]]:
    """Run the tables to a fixpoint (NOTE [Fixpoint over all passes]). `verify` checks every step's incremental
    re-inference against inference from scratch, prices every certified candidate anyway, and checks every
    price read off the live curves against a full replay; `certificates=False` prices every candidate every
    time, `curves=False` prices every candidate by a full replay (the same rewrites, slower: for tests)."""
    applied: list[Applied] = []
    if len(typed.graph) > MAX_REWRITE_NODES:
        raise GraphError(Problem(f"the graph has {len(typed.graph):,} nodes, over the bound of {MAX_REWRITE_NODES} "
                                 "for rewriting (its time grows faster than the node count)",
                                 typed.ctx.spec.loc("nodes"),
                                 hint="check or run it as written with --no-rewrite (linear in the node count)"))
    if max_steps is None:   # a rule applies a bounded number of times per node: the guard grows with the graph
        max_steps = 500 + 10 * len(typed.graph)
    peaks, flops = costs(typed)
    steps = 0
    certs: dict[tuple[str, str], _Cert] = {}     # NOTE [Rejection certificates]
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
                        cert = certs.get((rule.name, node.id))
                        sure = cert is not None and cert.rep == _rep_key(rep) and \
                            peaks.get(cert.device, 0) <= cert.bound
                        if sure and not verify:
                            rejected.add(key)      # rejected again, without pricing (NOTE [Rejection certificates])
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
                        # NOTE [Live curve]: given the graph it was rewritten from, pricing updates each device's
                        # live curve where the rewrite changed it instead of replaying the whole graph
                        kw = {"prev": typed} if curves and getattr(costs, "incremental", False) else {}
                        if not rep.always and getattr(costs, "bounded", False):
                            priced = costs(new, bound=peaks, **kw)     # None: some device's peak rises
                            if verify and kw:
                                _check_pricing(new, costs, priced, peaks)
                            if priced is None:
                                cert = _certificate(typed, new, rep, peaks) if certificates else None
                                if cert is not None:
                                    certs[(rule.name, node.id)] = cert
                                rejected.add(key)
                                continue
                        else:
                            priced = costs(new, **kw)
                            if verify and kw:
                                _check_pricing(new, costs, priced, None)
                        new_peaks, new_flops = priced
                        if not rep.always and any(new_peaks.get(d, 0) > peaks.get(d, 0) for d in peaks):
                            rejected.add(key)
                            continue
                        if sure:
                            raise ContractBroken(f"rule {rule.name} at '{node.id}': a rejection certificate held for a "
                                                 "candidate that pricing accepts (NOTE [Rejection certificates])")
                        steps += 1
                        if steps > max_steps:
                            raise RewriteLoopError(f"infinite loop in rewrite pass '{pass_name}': more than {max_steps} "
                                                   f"rewrites (last: {rule.name} at '{node.id}')")
                        applied.append(Applied(pass_name, rule.name, rule.trait, rep.touched or (node.id,),
                                               {d: peaks.get(d, 0) - new_peaks.get(d, 0) for d in peaks},
                                               {d: flops.get(d, 0) - new_flops.get(d, 0) for d in flops}))
                        if certs:
                            certs = _still_certain(certs, typed, new)
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


# NOTE [Rejection certificates]: a candidate rejected on one graph must be considered again on every later
# graph the scan meets it on (NOTE [Rewrite bound]). Pricing (analysis/memory.live_peaks) rejects a candidate as
# soon as one device's live bytes pass that device's current peak P, and notes where: in the load phase, or in
# the forward of node w in iteration i of the step. There the live bytes are L_i + D: L_i, those at the start of
# iteration i, and D, what the forward has added since, which depends only on the nodes up to w in order (their
# types, costs and hooks) and on how many readers the tensors they make have (every iteration runs the same
# forward; a tensor's readers matter where it is made, on its producer's devices). L_0 is the device's load
# (memory.load_signature); a later L_i is at least L_0 plus the weight gradients made in iteration 0, which the
# trainable models' seed nodes on the device decide (memory.grad_seed): a certificate is only made when L_i was
# exactly that, every backward node with a trainable model has a seed of its model on the device, and the
# candidate's graph kept its written order. An accepted rewrite then leaves the certificate valid when
#   - every node it removes, rewires or adds, and every producer (on the device) of a tensor whose readers it
#     changes, comes after w in order; where it changes the readers of a ref the candidate redirects, the
#     ref's new source comes after w too;
#   - the device's load signature is the same, and it changes no seed, no node the candidate removes, no node
#     that keeps one placed directly on the device or that keeps the replica count, and makes no node on a
#     wider group (how often a step runs the device's nodes is unchanged).
# The candidate, proposing the same replacement, then has at least the live bytes it had there, above P, and P
# is still at least the device's current peak: it is rejected again without being priced. The verdicts, hence
# the rewrites applied, are the driver's without certificates, except that a candidate whose graph would now
# be ill-typed is skipped instead of raising ContractBroken (a rule bug; it was well-typed when first priced).
# rewrite(verify=True) prices every certified candidate anyway and raises if pricing would accept it;
# tests/test_rewrite_properties.py (property g: the same rewrites as certificates=False, on random graphs) and
# tests/test_rewrite_rules.py (the widened graphs of benchmarks/check_scaling.py) check both.

@attrs.frozen
class _Cert:
    rep: tuple                 # the replacement that was rejected (_rep_key)
    device: str                # where its live bytes passed the peak
    bound: int                 # that device's peak then
    witness: str               # the node in whose forward they passed it; "" in the load phase
    seeds: frozenset[str]      # the seed nodes on the device whose weight gradients L_i counts
    redirect: tuple[tuple[str, str], ...] = ()   # (producer of a ref it redirects, producer of its new source)
    removes: frozenset[str] = frozenset()         # the nodes it removes
    direct: str | None = None  # a node placed on the device itself that it keeps (None: it leaves none)
    replicas: int = 1          # the replica count it leaves (NOTE [Replicas]) ...
    widest: str | None = None  # ... and a node on a group that wide that it keeps (None: replicas is 1)


def _rep_key(rep: Replacement) -> tuple:
    return (tuple(rep.remove),
            tuple((n.id, n.op, n.inputs, tuple(sorted((k, repr(v)) for k, v in n.params.items())), n.device, n.model,
                   n.spec_index, n.note) for n in rep.add),
            tuple(sorted(rep.redirect.items())), rep.always)


def _certificate(typed: Typed, new: Typed, rep: Replacement, peaks: Mapping[str, int]) -> "_Cert | None":
    """The certificate of a candidate (typed -> new) that pricing rejected, when its witness allows one."""
    from ..analysis.memory import grad_nodes, grad_seed

    over = new.cache.get("_over")
    if over is None:
        return None
    device, at, it, start0, start_i = over
    if at is None or (at and at not in typed.graph) or new.graph.resorted:
        return None       # (a candidate whose nodes had to be sorted may pull later nodes before w)
    seeds: frozenset[str] = frozenset()
    if at and it > 0:
        if start0 is None or start_i is None or start_i[0] - start0[0] != start_i[1] - start0[1]:
            return None              # L_i is not the load plus weight gradients
        on = [n for n in new.graph.nodes if device in new.ctx.devices_of(n.device)]
        grads = grad_nodes(new)
        trainable = {m for m, info in new.ctx.models.items() if info.spec.trainable}
        seed_nodes = [n for n in on if grad_seed(new, n)]
        if {n.model for n in on if n.id in grads and n.model in trainable} - {n.model for n in seed_nodes}:
            return None
        seeds = frozenset(n.id for n in seed_nodes if n.id in typed.graph)
    # how often a step runs the device's nodes depends on whether one is placed on it directly: a witness
    direct = [n.id for n in new.graph.nodes if n.device == device]
    kept = [i for i in direct if i in typed.graph and i not in rep.remove]
    if direct and not kept:
        return None
    width = _replicas(new)
    widest = next((n.id for n in new.graph.nodes if len(new.ctx.devices_of(n.device)) == width
                   and n.id in typed.graph and n.id not in rep.remove), None) if width > 1 else None
    if width > 1 and widest is None:
        return None
    return _Cert(_rep_key(rep), device, peaks.get(device, 0), at, seeds,
                 tuple(sorted({(k.node, v.node) for k, v in rep.redirect.items()})), frozenset(rep.remove),
                 kept[0] if kept else None, width, widest)


def _still_certain(certs: dict, old: Typed, new: Typed) -> dict:
    """The certificates an accepted rewrite (old -> new) leaves valid: their witness comes before every node
    the rewrite affects, in the old graph's order, no seed of theirs is affected, and their device's load is
    the same."""
    from ..analysis.memory import load_signature

    g, g2 = old.graph, new.graph
    pos = {n.id: i for i, n in enumerate(g.nodes)}
    kept_objs = {id(n) for n in g2.nodes}
    old_objs = {id(n) for n in g.nodes}
    gone = [n for n in g.nodes if id(n) not in kept_objs]
    made = [n for n in g2.nodes if id(n) not in old_objs]
    # a tensor's readers matter to a device's replay where it is made: on the devices its producer runs on
    first_gone = min((pos[n.id] for n in gone), default=len(pos))
    producers = {r.node for n in gone + made for _, r in n.inputs if r.node in pos}
    gone_ids = {n.id for n in gone}
    first: dict[str, int] = {}
    for d in {c.device for c in certs.values()}:
        if load_signature(old, d) != load_signature(new, d):
            first[d] = -1
            continue
        first[d] = min([first_gone] + [pos[p] for p in producers if d in old.ctx.devices_of(g[p].device)])

    def valid(c: _Cert) -> bool:
        if first[c.device] < 0 or c.seeds & gone_ids or c.removes & gone_ids:
            return False
        if c.direct in gone_ids or (c.direct is None and any(n.device == c.device for n in made)):
            return False
        if c.widest in gone_ids or any(len(old.ctx.devices_of(n.device)) > c.replicas for n in made):
            return False
        if c.witness == "":
            return True
        if c.witness not in pos:
            return False
        # the candidate moves the readers of the refs it redirects to their new sources: where the rewrite
        # changed those readers, the new sources' reader counts change too
        at = min([first[c.device]] + [pos[v] for k, v in c.redirect if k in producers and v in pos
                                      and c.device in old.ctx.devices_of(g[v].device)])
        return pos[c.witness] < at

    return {k: c for k, c in certs.items() if valid(c)}


def _check_pricing(new: Typed, costs: Costs, priced, bound) -> None:
    """A price read off the live curves (NOTE [Live curve]) is a full replay's: the same peaks, or the same
    rejection at the same place."""
    fresh = infer(new.graph, new.ctx)
    full = costs(fresh, bound=bound) if bound is not None else costs(fresh)
    def items(p):
        return p if p is None else (list(p[0].items()), list(p[1].items()))

    if items(full) != items(priced) or (priced is None and fresh.cache.get("_over") != new.cache.get("_over")):
        raise ContractBroken(f"pricing from the live curves differs from a full replay: {priced} != {full} "
                             f"({new.cache.get('_over')} != {fresh.cache.get('_over')})")


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
    return hash(tuple(_node_print(n) for n in g.nodes))


_PRINTS: dict[int, tuple[Node, tuple]] = {}


def _node_print(n: Node) -> tuple:
    """A node's part of the graph's fingerprint, kept per node object (a rewrite keeps most of them)."""
    hit = _PRINTS.get(id(n))
    if hit is not None and hit[0] is n:
        return hit[1]
    if len(_PRINTS) > 200_000:
        _PRINTS.clear()
    part = (n.id, n.op, n.inputs, tuple(sorted((k, repr(v)) for k, v in n.params.items())), n.device)
    _PRINTS[id(n)] = (n, part)
    return part


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
