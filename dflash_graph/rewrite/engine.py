"""Rules as data and the fixpoint driver.

A rule is a name, the trait that makes it legal, and a pure function `(typed, node) -> Replacement | None`
that matches at one node and builds the replacement. The driver runs named tables of rules to a fixpoint, with
a loop guard, re-infers every contract after each rewrite (a rewrite that breaks a contract is a bug, raised at
once), and logs what each rewrite saved on each device. A rewrite is taken only when no device's predicted peak
rises: legality comes from the traits, profitability from the cost model.
"""

from __future__ import annotations

import contextlib
import gc
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from ..errors import GraphError, Problem
from ..ir.graph import Change, Graph, Node, Ref
from ..analysis.infer import Typed, infer
from ..ops import registry


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
    # what the match at a node reads beyond its neighbourhood (NOTE [Resumed scan]): (old, new, what the rewrite
    # changed) -> the ids of the nodes whose matches that rewrite may have changed
    touches: Callable[[Typed, Typed, Change], Iterable[str]] | None = None


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
# matches and does not raise a device's peak. A candidate rejected on one graph can be accepted on a later one,
# so the driver must consider it again after every accepted rewrite; a rejection certificate (NOTE [Rejection
# certificates]) re-rejects it without pricing while the rewrites since cannot have changed the verdict, and
# pricing reads each device's peak off its live curve (analysis/memory.py, NOTE [Live curve]). What a rewrite
# costs is what it changed, times at most log N:
#   - the graph is patched, its tables persistent maps shared with the graph before (ir/graph.py, NOTE
#     [Incremental replace], NOTE [Persistent tables]); so are inference's tables, and inference visits the
#     changed nodes and their readers (analysis/infer.py, NOTE [Inference of a change]);
#   - the scan resumes where the rewrite was (NOTE [Resumed scan]), and merge_duplicates examines a node's twins
#     again only when the first of them changed (rules._cse_touches);
#   - an accepted rewrite tests only the certificates it can void (NOTE [Certificate index]), and a certificate
#     reads the device's nodes through groups kept across rewrites (Graph.groups);
#   - pricing updates a persistent tree of the live curve (analysis/curve_tree.py, NOTE [Curve tree]), and
#     autograd's saved tensors are handed on with the curve, not found by scanning a tensor's readers;
#   - the cycle collector is paused while rewriting (NOTE [No cycle collection while rewriting]).
# So check time grows linearly with the nodes. benchmarks/check_scaling.py (widened graphs, about 1.5 rewrites
# per node), compile_graph on the 2-core machine: instructions counted by valgrind (deterministic, whatever the
# load) less a 25-node run's, 2.2 G at 250 nodes and 10.1 G at 1,000 (4.6x for 4x; before: 2.6 G and 17.0 G,
# 6.4x). The bound is set by the time of the whole `check` process on this machine with another program busy
# on one core, which ran up to 2.35 CPU s at 500 nodes and 1.96 at 400, but 1.23 to 1.66 at 300 (imports alone
# take 0.5: sympy's 0.3): so the bound is 300 nodes. A graph over it is refused with the bound named, and
# checks as written (--no-rewrite: linear, ~1.6 s at the 5,000-node bound). benchmarks/README.md has the tables.
MAX_REWRITE_NODES = 300
# NOTE [Replay budget]: the times above hold where a rewrite is priced off the live curves. A rewrite that changes
# a node on autograd's path, one reading hooked layers, a sink with outputs or a device's weights is priced by a
# full replay of the device (analysis/memory.py, NOTE [Live curve]), linear in the graph, so a graph of hundreds
# of such rewrites is quadratic: fuzzed graphs of 400 to 420 nodes (400 unread drafter norms, on autograd's path)
# took 6 to 15 CPU s. Up to SMALL_REWRITE_NODES nodes every graph is rewritten; above it, the nodes the full
# replays go through are counted, and past REPLAY_BUDGET the graph is refused with both bounds named (check it
# as written, --no-rewrite). The count is of work done, not of time: the same graph is always answered the same
# way, and the budget is the graph's as written (rewriting it below SMALL_REWRITE_NODES does not lift it).
# Measured on the 2-core machine with graphs/tiny.toml and N unread drafter norms: with a budget of 25,000 above
# 200 nodes, a 260-node graph was rewritten in 2.5 CPU s (compile_graph) and a 356-node one refused after 1.8
# (2.2 in a fuzz run). With these bounds the whole `check` process, with another program busy on one core:
# 1.06 to 1.49 CPU s at 100 nodes (all rewritten), 1.12 to 1.52 at 101 and 1.0 to 1.2 at 500 (refused);
# tests/test_rewrite_rules.py::test_replay_budget_refuses.
SMALL_REWRITE_NODES = 100
REPLAY_BUDGET = 6_000

Tables = Sequence[tuple[str, Sequence[Rule]]]
Costs = Callable[[Typed], tuple[Mapping[str, int], Mapping[str, int]]]   # typed -> (peak per device, flops per device)


def rewrite(typed: Typed, tables: Tables, costs: Costs, max_steps: int | None = None,
            verify: bool = False, certificates: bool = True, curves: bool = True) -> tuple[Typed, list[Applied]]:
    """Run the tables to a fixpoint (NOTE [Fixpoint over all passes]). `verify` checks every step's incremental
    re-inference against inference from scratch, checks every price read off the live curves against a full
    replay, and checks every step against a full scan that prices every candidate (NOTE [Resumed scan]);
    `certificates=False` prices every candidate every time, scanning from the first node after every rewrite,
    `curves=False` prices every candidate by a full replay (the same rewrites, slower: for tests)."""
    if len(typed.graph) > MAX_REWRITE_NODES:
        raise GraphError(Problem(f"the graph has {len(typed.graph):,} nodes, over the bound of {MAX_REWRITE_NODES:,} "
                                 "for rewriting", typed.ctx.spec.loc("nodes"),
                                 hint="check or run it as written with --no-rewrite"))
    if max_steps is None:   # a rule applies a bounded number of times per node: the guard grows with the graph
        max_steps = 500 + 10 * len(typed.graph)
    with _no_cycle_collection():
        return _run(typed, tables, costs, max_steps, verify, certificates, curves)


# NOTE [No cycle collection while rewriting]: the driver makes and drops a graph, its types and its live curves
# per candidate: persistent maps that share their parent's nodes (ir/graph.py, NOTE [Persistent tables]), linked
# to the parent by a weak reference. None of it forms a reference cycle, so reference counting frees all of it,
# and Python's cycle collector finds nothing, while each of its full collections walks every live object and
# the rewrites' allocations trigger more of them the larger the graph: a cost that grows faster than the graph.
# Measured: a whole compile_graph of a 400-node widened graph with the collector off leaves 153 objects in cycles
# to collect (the loader's); with it paused while rewriting, check time grows linearly (benchmarks/README.md).
# The collector's state is restored afterwards, also when the driver raises.

@contextlib.contextmanager
def _no_cycle_collection():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _run(typed: Typed, tables: Tables, costs: Costs, max_steps: int, verify: bool, certificates: bool,
         curves: bool) -> tuple[Typed, list[Applied]]:
    d = _Driver(typed, costs, max_steps, verify, certificates, curves)
    # NOTE [Fixpoint over all passes]: a later pass can enable an earlier one (merge_duplicates in `cleanup`
    # leaves a position-wise node with one reader, which `push_selections` then moves a gather through), so the
    # passes run again, in order, until a whole round applies nothing. The loop guard counts applied rewrites
    # only: a rejected candidate is never retried on the same graph, so rejections cannot loop.
    while True:
        round_start = len(d.applied)
        for pass_name, rules in tables:
            d.run_pass(pass_name, rules)
        if len(d.applied) == round_start:
            break
    return d.typed, d.applied


# NOTE [Resumed scan]: the driver applies, at every step, the first candidate in (node order, rule order) that
# matches and is accepted. Scanning again from the first node after every rewrite made each step linear in the
# graph; instead the scan resumes: nodes from the frontier on have not been examined on this graph, and a node
# before it is examined again only when the rewrite may have changed what it finds there:
#   - its match may differ: the node is within the rewrite's footprint (_affected): a node the rewrite made,
#     rewired, sorted again or gave other outputs, their producers, their readers and their readers' readers
#     (a rule reads a node's producers, their inputs' types and the readers of what it reads), the readers of a
#     tensor whose readers changed to or from one (a sole reader), what reads an integer tensor downstream of a
#     changed node (an index chain, which gather_through_positionwise follows upstream), and what a rule
#     declares it reads beyond that (`Rule.touches`: merge_duplicates' twins);
#   - its verdict may differ: a candidate it had rejected without a rejection certificate that still holds for
#     that replacement (NOTE [Rejection certificates]) is priced again, as the full scan would.
# A node examined again finds, for every rule, no match or a rejected candidate, exactly when the full scan
# would, so the rewrites applied and their order are the full scan's (a renamed fresh id can make the full scan
# price a certified candidate again: pricing does not read names, so its verdict is the certificate's).
# `certificates=False` is the full scan (every step from the first node); rewrite(verify=True) runs a full
# scan that prices every match at every step and raises if it finds another first candidate;
# tests/test_rewrite_properties.py and tests/test_rewrite_rules.py compare both on random and widened graphs.

class _Driver:
    def __init__(self, typed: Typed, costs: Costs, max_steps: int, verify: bool, certificates: bool, curves: bool):
        self.typed, self.costs, self.max_steps = typed, costs, max_steps
        self.verify, self.certificates, self.curves = verify, certificates, curves
        self.peaks, self.flops = costs(typed)
        self.replays = 0          # nodes replayed in full to price candidates (NOTE [Replay budget])
        self.written = len(typed.graph)
        _replicas(typed)
        self.applied: list[Applied] = []
        self.certs = _Certs()     # NOTE [Rejection certificates], NOTE [Certificate index]

    def run_pass(self, pass_name: str, rules: Sequence[Rule]) -> None:
        import heapq

        front = -1                     # nodes with an order key from here on are not examined on this graph
        heap: list[tuple[int, str]] = []   # examined nodes to examine again (keys below the front)
        queued: set[str] = set()
        rejected: dict[str, dict[str, tuple]] = {}   # node -> rule -> the replacement it rejected there
        unheld: set[str] = set()       # nodes in `rejected` with a rejection no certificate holds for
        while True:
            g = self.typed.graph
            while heap and (heap[0][1] not in g or g._key[heap[0][1]] != heap[0][0]):
                queued.discard(heapq.heappop(heap)[1])     # removed, or sorted again (queued again then)
            i = bisect_left(g._keys, front)
            if heap and (i == len(g.nodes) or heap[0][0] < g._keys[i]):
                nid = heapq.heappop(heap)[1]
                queued.discard(nid)
                node = g[nid]
            elif i < len(g.nodes):
                node = g.nodes[i]
                front = g._keys[i] + 1
            else:
                if self.verify:
                    self.check_scan(rules, None, None)
                return
            found = self.examine(node, rules, rejected)
            unheld.discard(node.id)
            if any(not self.holds(name, node.id, rk) for name, rk in rejected.get(node.id, {}).items()):
                unheld.add(node.id)
            if found is None:
                continue
            if self.verify:
                self.check_scan(rules, node, found)
            rule, rep, new, new_peaks, new_flops = found
            old, old_peaks = self.typed, self.peaks
            dropped = self.accept(pass_name, rule, rep, node, new, new_peaks, new_flops)
            aff = None if not self.certificates else _affected(old, new, rules)
            if aff is None:           # scan again from the first node
                front, heap, rejected = -1, [], {}
                unheld.clear()
                queued.clear()
                continue
            gk = new.graph._key
            # a rejection is examined again once no certificate holds for it (NOTE [Certificate index]): those
            # the rewrite voided, and those none held for; where a peak rose (a rule taken whatever the price),
            # every certificate's bound is read again
            if dropped is None or any(new_peaks.get(d, 0) > p for d, p in old_peaks.items()):
                for nid, reps in list(rejected.items()):
                    if nid not in gk:
                        del rejected[nid]
                        unheld.discard(nid)
                    elif any(not self.holds(name, nid, rk) for name, rk in reps.items()):
                        aff.add(nid)
            else:
                for name, nid in dropped:
                    if name in rejected.get(nid, ()):
                        unheld.add(nid)
                for nid in list(unheld):
                    if nid in gk:
                        aff.add(nid)
                    else:
                        unheld.discard(nid)
                        rejected.pop(nid, None)
            for nid in aff:
                k = gk.get(nid)
                if k is not None and k < front and nid not in queued:
                    queued.add(nid)
                    heapq.heappush(heap, (k, nid))

    def holds(self, rule_name: str, nid: str, rk: tuple) -> bool:
        cert = self.certs.get((rule_name, nid))
        return cert is not None and cert.rep == rk and self.peaks.get(cert.device, 0) <= cert.bound

    def examine(self, node: Node, rules: Sequence[Rule], rejected: dict):
        """The first rule whose candidate at `node` is accepted: (rule, rep, new, peaks, flops); None if none is.
        Notes in `rejected` what the node's rules proposed and had rejected."""
        mine = rejected[node.id] = {}
        for rule in rules:
            rep = rule.match(self.typed, node)
            if rep is None:
                continue
            got = self.attempt(node, rule, rep)
            if got is None:
                mine[rule.name] = _rep_key(rep)
                continue
            return (rule, rep, *got)
        if not mine:
            del rejected[node.id]
        return None

    def replayed(self, new: Typed) -> None:
        """Count the nodes the pricing of `new` replayed in full; past the budget, refuse (NOTE [Replay budget])."""
        self.replays += new.cache.get("_replayed_nodes", 0)
        n = self.written          # (the graph as written: rewriting it smaller does not lift the budget)
        if n > SMALL_REWRITE_NODES and self.replays > REPLAY_BUDGET and self.curves:
            raise GraphError(Problem(
                f"the graph has {n:,} nodes, and its rewrites change nodes that are priced by replaying a device in "
                f"full (on autograd's path, reading hooked layers, a sink with outputs or a device's weights): over "
                f"the budget of {REPLAY_BUDGET:,} node replays for rewriting a graph over {SMALL_REWRITE_NODES} "
                "nodes", self.typed.ctx.spec.loc("nodes"), hint="check or run it as written with --no-rewrite"))

    def attempt(self, node: Node, rule: Rule, rep: Replacement, trial: bool = False):
        """(new, peaks, flops) when the candidate is accepted, None when it is rejected. `trial`: price it
        whatever its certificate says, and note nothing (verify's full scan)."""
        typed, costs, peaks = self.typed, self.costs, self.peaks
        cert = self.certs.get((rule.name, node.id))
        sure = cert is not None and cert.rep == _rep_key(rep) and peaks.get(cert.device, 0) <= cert.bound
        if sure and not self.verify and not trial:
            return None          # rejected again, without pricing (NOTE [Rejection certificates])
        graph = typed.graph.replace(rep.remove, rep.add, rep.redirect)
        try:
            new = infer(graph, typed.ctx, prev=typed)   # NOTE [Incremental inference]
        except GraphError as e:
            raise ContractBroken(f"rule {rule.name} at '{node.id}' produced an ill-typed graph:\n{e}") from e
        _check_outputs_kept(typed, new, rule)
        if _replicas(new, typed) != _replicas(typed):
            return None          # NOTE [Replicas]
        # NOTE [Rewrite pricing]: a candidate is priced by replaying each device's allocations
        # (analysis/memory.live_peaks); with the current peaks as a bound the replay stops at the
        # first device whose live bytes pass its peak: the verdict is the same, reached sooner
        # NOTE [Live curve]: given the graph it was rewritten from, pricing updates each device's
        # live curve where the rewrite changed it instead of replaying the whole graph
        kw = {"prev": typed} if self.curves and getattr(costs, "incremental", False) else {}
        if not rep.always and getattr(costs, "bounded", False):
            priced = costs(new, bound=peaks, **kw)     # None: some device's peak rises
            self.replayed(new)
            if self.verify and kw and not trial:
                _check_pricing(new, costs, priced, peaks)
            if priced is None:
                if not trial:
                    cert = _certificate(typed, new, rep, peaks) if self.certificates else None
                    if cert is not None:
                        self.certs.add((rule.name, node.id), cert, typed.graph._key)
                return None
        else:
            priced = costs(new, **kw)
            self.replayed(new)
            if self.verify and kw and not trial:
                _check_pricing(new, costs, priced, None)
        new_peaks, new_flops = priced
        if not rep.always and any(new_peaks.get(d, 0) > peaks.get(d, 0) for d in peaks):
            return None
        if sure and not trial:
            raise ContractBroken(f"rule {rule.name} at '{node.id}': a rejection certificate held for a "
                                 "candidate that pricing accepts (NOTE [Rejection certificates])")
        return new, new_peaks, new_flops

    def accept(self, pass_name: str, rule: Rule, rep: Replacement, node: Node, new: Typed, new_peaks,
               new_flops) -> set[tuple[str, str]] | None:
        """Take the candidate; the keys of the certificates it voids (None: any may be void, all were read)."""
        if len(self.applied) >= self.max_steps:
            raise RewriteLoopError(f"infinite loop in rewrite pass '{pass_name}': more than {self.max_steps} "
                                   f"rewrites (last: {rule.name} at '{node.id}')")
        peaks, flops = self.peaks, self.flops
        self.applied.append(Applied(pass_name, rule.name, rule.trait, rep.touched or (node.id,),
                                    {d: peaks.get(d, 0) - new_peaks.get(d, 0) for d in peaks},
                                    {d: flops.get(d, 0) - new_flops.get(d, 0) for d in flops}))
        before = dict(self.certs.certs) if self.verify else None
        dropped = self.certs.after(self.typed, new) if self.certs else set()
        if before:
            _check_index(before, self.certs.certs, self.typed, new)
        new.graph.keep_derived()
        self.typed, self.peaks, self.flops = new, new_peaks, new_flops
        if self.verify:
            _check_incremental(new)
        return dropped

    def check_scan(self, rules: Sequence[Rule], node: Node | None, found) -> None:
        """verify: the full scan (every node from the first, every match priced) finds the candidate the resumed
        scan found first, or none where it found none up to here (NOTE [Resumed scan])."""
        for n in self.typed.graph.nodes:
            if node is not None and n.id == node.id:
                for rule in rules:
                    rep = rule.match(self.typed, n)
                    if rep is not None and self.attempt(n, rule, rep, trial=True) is not None:
                        if found is None or rule is not found[0]:
                            raise ContractBroken(f"the resumed scan missed rule {rule.name} at '{n.id}'")
                        return
                if found is not None:
                    raise ContractBroken(f"the resumed scan took rule {found[0].name} at '{n.id}', which a full "
                                         "scan rejects")
                return
            for rule in rules:
                rep = rule.match(self.typed, n)
                if rep is not None and self.attempt(n, rule, rep, trial=True) is not None:
                    raise ContractBroken(f"the resumed scan skipped rule {rule.name} at '{n.id}', which a full "
                                         "scan accepts (NOTE [Resumed scan])")


def _affected(old: Typed, new: Typed, rules: Sequence[Rule]) -> set[str] | None:
    """The nodes whose matches the rewrite old -> new may have changed (NOTE [Resumed scan]); None where the
    graph was rebuilt (no record of what changed): scan it all again."""
    g0, g1 = old.graph, new.graph
    ch = g1._change
    if ch is None or g1.parent() is not g0:
        return None
    i0, i1 = old._outputs_index(), new._outputs_index()
    core = {n.id for n in ch.gone} | {n.id for n in ch.made} | set(ch.moved)
    core |= {nid for nid in new.cache.get("_reinferred", ()) if i0.get(nid) != i1.get(nid)
             or old.params.get(nid) != new.params.get(nid)}
    out = set(core)
    refs: set[Ref] = set()
    for nid in core:
        for g in (g0, g1):
            n = g._by_id.get(nid)
            if n is not None:
                for _, r in n.inputs:
                    out.add(r.node)
                    refs.add(r)
    c0, c1 = g0._consumers, g1._consumers

    def readers(nid: str) -> set[str]:
        return {c for k in {**i0.get(nid, {}), **i1.get(nid, {})} for c, _ in c1.get(Ref(nid, k), ())}

    hop = set()
    for nid in core:
        hop |= readers(nid)
    out |= hop
    for nid in hop:
        out |= readers(nid)
    for r in refs:     # a sole reader
        if min(len(c0.get(r, ())), len(c1.get(r, ()))) <= 1:
            out.update(c for c, _ in c1.get(r, ()))
    # index chains: what reads integer tensors downstream of a changed node
    ints = ("int64", "int32", "bool")
    stack, seen = list(core), set(core)
    while stack:
        nid = stack.pop()
        for t, idx in ((old, i0), (new, i1)):
            for k, ty in idx.get(nid, {}).items():
                if ty.dtype in ints:
                    for c, _ in c1.get(Ref(nid, k), ()):
                        out.add(c)
                        if c not in seen:
                            seen.add(c)
                            stack.append(c)
    for rule in rules:
        if rule.touches is not None:
            out.update(rule.touches(old, new, ch))
    return out


# NOTE [Rejection certificates]: a candidate rejected on one graph must be considered again on every later
# graph the scan meets it on (NOTE [Rewrite bound]). Pricing (analysis/memory.live_peaks) rejects a candidate as
# soon as one device's live bytes pass that device's current peak P, and notes where: in the load phase, or in
# the forward of node w in iteration i of the step. There the live bytes are L_i + D: L_i, those at the start of
# iteration i, and D, what the forward has added since, which depends only on the nodes up to w in order (their
# types, costs and hooks) and on how many readers the tensors they make have (every iteration runs the same
# forward; a tensor's readers matter where it is made, on its producer's devices). L_0 is the device's load
# (memory.load_signature); a later L_i is at least L_0 plus the weight gradients made in iteration 0, which the
# trainable models' seed nodes on the device decide (nodecost.grad_seed): a certificate is only made when L_i was
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
    from ..analysis.nodecost import grad_nodes, grad_seed

    over = new.cache.get("_over")
    if over is None:
        return None
    device, at, it, start0, start_i = over
    if at is None or (at and at not in typed.graph) or new.graph.resorted:
        return None       # (a candidate whose nodes had to be sorted may pull later nodes before w)
    # the nodes by placement, and those with a model by (placement, model): kept across rewrites (Graph.groups),
    # so that a certificate costs the device's nodes of trainable models, not a pass over the graph
    g1, ctx = new.graph, new.ctx
    typed.graph.groups("placed", _placement)           # (the candidate's are updated from the graph's)
    typed.graph.groups("modelled", _placement_model)
    placed = g1.groups("placed", _placement)
    seeds: frozenset[str] = frozenset()
    if at and it > 0:
        if start0 is None or start_i is None or start_i[0] - start0[0] != start_i[1] - start0[1]:
            return None              # L_i is not the load plus weight gradients
        grads = grad_nodes(new)
        trainable = {m for m, info in ctx.models.items() if info.spec.trainable}
        seed_ids: list[str] = []
        grad_models: set[str] = set()
        for (p, m), ids in g1.groups("modelled", _placement_model).items():
            if m in trainable and device in ctx.devices_of(p):
                for i in ids:
                    if grad_seed(new, g1[i]):
                        seed_ids.append(i)
                    if i in grads:
                        grad_models.add(m)
        if grad_models - {g1[i].model for i in seed_ids}:
            return None
        seeds = frozenset(i for i in seed_ids if i in typed.graph)
    # how often a step runs the device's nodes depends on whether one is placed on it directly: a witness

    def first_kept(ids) -> str | None:
        return next((i for i in ids if i in typed.graph and i not in rep.remove), None)

    direct = placed.get(device, ())
    kept = first_kept(direct)
    if direct and kept is None:
        return None
    width = _replicas(new)
    widest = None
    if width > 1:
        firsts = [first_kept(ids) for p, ids in placed.items() if len(ctx.devices_of(p)) == width]
        widest = min((i for i in firsts if i is not None), key=g1._key.__getitem__, default=None)
        if widest is None:
            return None
    return _Cert(_rep_key(rep), device, peaks.get(device, 0), at, seeds,
                 tuple(sorted({(k.node, v.node) for k, v in rep.redirect.items()})), frozenset(rep.remove),
                 kept, width, widest)


def _placement(n: Node) -> str:
    return n.device


def _placement_model(n: Node) -> tuple[str, str] | None:
    return (n.device, n.model) if n.model else None


def _still_certain(certs: dict, old: Typed, new: Typed) -> dict:
    """The certificates an accepted rewrite (old -> new) leaves valid: their witness comes before every node
    the rewrite affects, in the old graph's order, no seed of theirs is affected, and their device's load is
    the same. (The test of every certificate; the driver reads it through _Certs, NOTE [Certificate index].)"""
    frame = _Frame.of(old, new, {c.device for c in certs.values()})
    return {k: c for k, c in certs.items() if _valid(c, old, frame)}


@attrs.frozen
class _Frame:
    """What a certificate's validity reads of an accepted rewrite old -> new (_still_certain, _Certs.after)."""
    change: Change | None     # what replace changed (None: the graph was rebuilt)
    pos: Mapping[str, int]    # the old graph's order positions
    gone_ids: set[str]
    made: list[Node]
    producers: set[str]       # producers of a tensor whose readers the rewrite changed
    first: dict[str, int]     # per device: the position of the first node the rewrite affects (-1: load changed)

    @classmethod
    def of(cls, old: Typed, new: Typed, devices: Iterable[str]) -> "_Frame":
        from ..analysis.memory import load_signature

        g, g2 = old.graph, new.graph
        ch = g2._change if g2.parent() is g else None
        if ch is None:
            pos = {n.id: i for i, n in enumerate(g.nodes)}
            kept_objs = {id(n) for n in g2.nodes}
            old_objs = {id(n) for n in g.nodes}
            gone = [n for n in g.nodes if id(n) not in kept_objs]
            made = [n for n in g2.nodes if id(n) not in old_objs]
            end = len(pos)
        else:      # positions compared only: the old graph's order keys (NOTE [Graph order keys])
            pos, gone, made, end = g._key, list(ch.gone), list(ch.made), g._keys[-1] + 1 if g._keys else 0
        # a tensor's readers matter to a device's replay where it is made: on the devices its producer runs on
        first_gone = min((pos[n.id] for n in gone), default=end)
        producers = {r.node for n in gone + made for _, r in n.inputs if r.node in pos}
        first: dict[str, int] = {}
        for d in devices:
            if (load_signature(old, d) != load_signature(new, d)) if ch is None else _load_changed(old, new, ch, d):
                first[d] = -1
            else:
                first[d] = min([first_gone] + [pos[p] for p in producers if d in old.ctx.devices_of(g[p].device)])
        return cls(ch, pos, {n.id for n in gone}, made, producers, first)


def _valid(c: "_Cert", old: Typed, f: _Frame) -> bool:
    """Whether certificate `c` holds after the rewrite of `old` that `f` describes (_still_certain)."""
    first, pos, gone_ids, made, producers = f.first, f.pos, f.gone_ids, f.made, f.producers
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
    g = old.graph
    at = min([first[c.device]] + [pos[v] for k, v in c.redirect if k in producers and v in pos
                                  and c.device in old.ctx.devices_of(g[v].device)])
    return pos[c.witness] < at


# NOTE [Certificate index]: after every accepted rewrite, _still_certain's conditions are read only for the
# certificates the rewrite can void, found through indexes of what each certificate depends on: its device (a
# changed load voids all of them), the nodes it names (seeds, the nodes it removes, the node placed on the
# device, the widest group's node, the witness: a rewrite that removes one of them, or sorts it again, voids
# it), the devices where it keeps no node of its own and the replica counts it keeps, the producers of the refs
# it redirects, and, per device, the witnesses' order keys (a max-heap: the rewrite voids those at or after the
# first node it affects on the device). Voiding a certificate where the full test would keep it only means its
# candidate is priced again (the same verdict: certificates skip pricing, they never decide), and it happens
# only for a witness sorted again; the rest is _still_certain's test exactly. So an accepted rewrite costs what
# it voids, not a pass over every certificate (at 1,000 nodes, about 27 per rewrite, growing with the graph).

class _Certs:
    """The rejection certificates that hold, by (rule, node) (NOTE [Certificate index])."""

    def __init__(self):
        self.certs: dict[tuple[str, str], _Cert] = {}
        self._clear_index()

    def _clear_index(self) -> None:
        self.by_device: dict[str, set] = {}
        self.by_node: dict[str, set] = {}
        self.undirected: dict[str, set] = {}        # device -> certificates that keep no node placed on it
        self.by_replicas: dict[int, set] = {}
        self.by_source: dict[str, set] = {}         # producer of a redirected ref -> certificates
        self.witnesses: dict[str, list] = {}        # device -> max-heap of (-witness order key, n, key, cert)
        self._pushed = 0                             # (n: a tie-break, so that certificates are never compared)

    def __bool__(self) -> bool:
        return bool(self.certs)

    def get(self, key: tuple[str, str]) -> "_Cert | None":
        return self.certs.get(key)

    def add(self, key: tuple[str, str], cert: "_Cert", order: Mapping[str, int]) -> None:
        """Hold `cert` for `key`; `order`: the order keys of the graph it was made on."""
        import heapq

        self.certs[key] = cert          # an earlier certificate of the key stays in the indexes: looked up, skipped
        self.by_device.setdefault(cert.device, set()).add(key)
        for nid in (*cert.seeds, *cert.removes, cert.direct, cert.widest, cert.witness):
            if nid:
                self.by_node.setdefault(nid, set()).add(key)
        if cert.direct is None:
            self.undirected.setdefault(cert.device, set()).add(key)
        self.by_replicas.setdefault(cert.replicas, set()).add(key)
        for src, _ in cert.redirect:
            self.by_source.setdefault(src, set()).add(key)
        if cert.witness:
            self._pushed += 1
            heapq.heappush(self.witnesses.setdefault(cert.device, []), (-order[cert.witness], self._pushed, key, cert))

    def after(self, old: Typed, new: Typed) -> set[tuple[str, str]] | None:
        """Drop the certificates the accepted rewrite old -> new voids; their keys (None: a rebuilt graph, every
        certificate was tested and the indexes made again)."""
        import heapq

        devices = [d for d, keys in self.by_device.items() if keys]
        f = _Frame.of(old, new, devices)
        ch = f.change
        if ch is None:
            kept = {k: c for k, c in self.certs.items() if _valid(c, old, f)}
            self.certs = {}
            self._clear_index()
            for k, c in kept.items():
                self.add(k, c, new.graph._key)
            return None
        suspects: set = set()
        for nid in (*f.gone_ids, *ch.moved):
            suspects |= self.by_node.get(nid, set())
        for n in f.made:
            suspects |= self.undirected.get(n.device, set())
        width = max((len(old.ctx.devices_of(n.device)) for n in f.made), default=0)
        for r, keys in self.by_replicas.items():
            if r < width:
                suspects |= keys
        for p in f.producers:
            suspects |= self.by_source.get(p, set())
        for d in devices:
            if f.first[d] < 0:
                suspects |= self.by_device[d]
                continue
            heap = self.witnesses.get(d, [])
            while heap and -heap[0][0] >= f.first[d]:
                *_, key, cert = heapq.heappop(heap)
                if self.certs.get(key) is cert:       # (not a certificate since dropped or replaced)
                    suspects.add(key)
        dropped = set()
        for key in suspects:
            c = self.certs.get(key)
            if c is not None and (c.witness in ch.moved or not _valid(c, old, f)):
                dropped.add(key)
        for key in dropped:
            self._forget(key, self.certs.pop(key))
        return dropped

    def _forget(self, key, c: "_Cert") -> None:
        """Take a dropped certificate's key out of the indexes (its heap entry is skipped when popped)."""
        for table, names in ((self.by_device, (c.device,)),
                             (self.by_node, (*c.seeds, *c.removes, c.direct, c.widest, c.witness)),
                             (self.undirected, (c.device,) if c.direct is None else ()),
                             (self.by_replicas, (c.replicas,)), (self.by_source, [s for s, _ in c.redirect])):
            for name in names:
                if name and name in table:
                    table[name].discard(key)


def _load_changed(old: Typed, new: Typed, ch: Change, device: str) -> bool:
    """Whether the rewrite old -> new may change the device's load signature (memory.load_signature): which
    components its nodes use, as counts, and its queued transfers. Read off what the rewrite changed, without a
    pass over the graph; True where it may (a certificate is then dropped and its candidate priced again)."""
    from ..analysis.memory import _owners

    counts: dict[str, int] = {}
    for t, nodes, sign in ((old, ch.gone, -1), (new, ch.made, 1)):
        for n in nodes:
            if device in t.ctx.devices_of(n.device):
                for o in _owners(t, n):
                    counts[o] = counts.get(o, 0) + sign
    if any(counts.values()):
        return True
    again = new.cache.get("_reinferred", frozenset())
    for t, ids in ((old, [n.id for n in ch.gone]), (new, [*(n.id for n in ch.made), *ch.moved, *again])):
        for nid in ids:
            n = t.graph._by_id.get(nid)
            if n is not None and device in t.ctx.devices_of(n.device) and registry.get(n.op).traits.movement \
                    and int(t.params[nid].get("queue", 1)) > 1:
                return True
    return False


def _check_index(before: dict, kept: dict, old: Typed, new: Typed) -> None:
    """The certificates the index keeps after a rewrite (NOTE [Certificate index]) are those _still_certain
    keeps, less only some whose witness the rewrite sorted again."""
    full = _still_certain(before, old, new)
    ch = new.graph._change if new.graph.parent() is old.graph else None
    moved = ch.moved if ch is not None else frozenset()
    if kept.keys() - full.keys() or any(full[k].witness not in moved for k in full.keys() - kept.keys()):
        raise ContractBroken(f"the certificate index kept {sorted(kept.keys() - full.keys())} and dropped "
                             f"{sorted(full.keys() - kept.keys())}, where _still_certain keeps {sorted(full)}")


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


def _replicas(typed: Typed, prev: Typed | None = None) -> int:
    """NOTE [Replicas]: a step runs the graph once per replica of the widest group that has a node
    (exec/interpreter.py, analysis/memory.py), so a node on one device runs that many times per step. A rewrite
    that removed the last node of that group (a transfer round trip through it, say) would change how often
    every other node runs: it is not taken. Given `prev`, the graph `typed` was patched from, the count of
    nodes per placement is prev's patched (NOTE [Incremental replace]); it is cached as analysis.launch.replicas
    caches it."""
    if "_replicas" in typed.cache:
        return typed.cache["_replicas"]
    g = typed.graph
    ch = g._change if prev is not None and g.parent() is prev.graph else None
    if ch is not None and "_placed" in prev.cache:
        placed = dict(prev.cache["_placed"])
        for n in ch.gone:
            placed[n.device] -= 1
        for n in ch.made:
            placed[n.device] = placed.get(n.device, 0) + 1
    else:
        placed = {}
        for n in g.nodes:
            placed[n.device] = placed.get(n.device, 0) + 1
    typed.cache["_placed"] = placed
    typed.cache["_replicas"] = max((len(typed.ctx.devices_of(p)) for p, c in placed.items() if c), default=1)
    return typed.cache["_replicas"]


def _check_outputs_kept(old: Typed, new: Typed, rule: Rule) -> None:
    """Every graph result keeps its type: a sink's outputs (the loss), or what an `output` sink reads (it has no
    outputs: its input is the result). Rewrites never change what the graph computes."""
    g0, g1 = old.graph, new.graph
    ch = g1._change if g1.parent() is g0 else None
    nodes = g0.nodes
    if ch is not None:   # a result no node the rewrite changed or inferred again reads what it read, typed alike
        ids = {n.id for n in ch.gone} | {i for i in new.cache.get("_reinferred", ()) if i in g0._by_id}
        nodes = sorted((g0[i] for i in ids), key=lambda n: g0._key[n.id])
    for n in nodes:
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
