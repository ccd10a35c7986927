"""The graph: immutable nodes wired by (node, output) references; networkx underneath for order and cycles
(imported where a graph needs it, not at start-up: 0.15 CPU s that a graph written in order never uses)."""

from __future__ import annotations

import weakref
from bisect import bisect_left, insort
from itertools import filterfalse
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import immutables

if TYPE_CHECKING:
    import networkx as nx


class Ref(NamedTuple):
    """A node's output, `node.output`. A named tuple: hashed and compared at C speed (the rewrite driver and the
    memory model look Refs up millions of times), ordered by node then output."""
    node: str
    output: str

    def __str__(self) -> str:
        return f"{self.node}.{self.output}"

    @classmethod
    def parse(cls, text: str) -> "Ref":
        node, _, out = text.partition(".")
        return cls(node, out)


def _freeze(params: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(params))


@attrs.frozen
class Node:
    id: str
    op: str
    inputs: tuple[tuple[str, Ref], ...]       # (port, producer output), in port order
    params: Mapping[str, Any] = attrs.field(factory=dict, converter=_freeze, eq=False)
    device: str = "cpu"
    model: str | None = None
    spec_index: int | None = None              # where it was written ([[nodes]] index), None if made by a rewrite
    note: str | None = None                    # why it exists, when a rewrite made it

    def input(self, port: str) -> Ref:
        for p, r in self.inputs:
            if p == port:
                return r
        raise KeyError(port)

    def evolve(self, **kw) -> "Node":
        return attrs.evolve(self, **kw)

    def same_as(self, other: "Node") -> bool:
        return (self.id, self.op, self.inputs, dict(self.params), self.device, self.model) == \
               (other.id, other.op, other.inputs, dict(other.params), other.device, other.model)


class CycleError(ValueError):
    def __init__(self, cycle: list[str]):
        super().__init__(" -> ".join(cycle))
        self.cycle = cycle


def _is_topological(nodes: list[Node], by_id: Mapping[str, Node]) -> bool:
    """Whether every input of every node is made by a node before it (or by no node: an unknown input)."""
    if len(by_id) != len(nodes):
        return False
    seen: set[str] = set()
    for n in nodes:
        for _, r in n.inputs:
            if r.node not in seen and r.node in by_id:
                return False
        seen.add(n.id)
    return True


def _nx_of(nodes, by_id: Mapping[str, Node]) -> nx.DiGraph:
    import networkx as nx

    g = nx.DiGraph()
    for n in nodes:
        g.add_node(n.id)
    for n in nodes:
        for _, r in n.inputs:
            if r.node in by_id:
                g.add_edge(r.node, n.id)
    return g


def _lexicographical_topological_sort(nodes, by_id: Mapping[str, Node]) -> list[str] | None:
    """networkx.lexicographical_topological_sort of _nx_of(nodes) keyed by written position (NOTE [Graph
    order]), without networkx: Kahn's algorithm, the ready node written first going first. The keys are unique,
    so the order is the one networkx gives. None if the graph has a cycle."""
    import heapq

    written = {n.id: i for i, n in enumerate(nodes)}
    preds: dict[str, set[str]] = {nid: set() for nid in written}     # a DiGraph's edges: no parallel ones
    for n in nodes:
        preds[n.id].update(r.node for _, r in n.inputs if r.node in by_id)
    children: dict[str, list[str]] = {nid: [] for nid in written}
    indegree: dict[str, int] = {}
    for nid, ps in preds.items():
        indegree[nid] = len(ps)
        for p in ps:
            children[p].append(nid)
    ready = [(written[nid], nid) for nid, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, nid = heapq.heappop(ready)
        order.append(nid)
        for c in children[nid]:
            indegree[c] -= 1
            if indegree[c] == 0:
                heapq.heappush(ready, (written[c], c))
    return order if len(order) == len(written) else None


@attrs.frozen
class Change:
    """What `Graph.replace` changed (NOTE [Incremental replace])."""
    gone: tuple[Node, ...]      # nodes of the old graph not in the new one: removed, or the old selves of rewired ones
    made: tuple[Node, ...]      # nodes of the new graph not in the old one: added, or rewired
    moved: frozenset[str]       # kept nodes that sorting again gave another key
    window: tuple[str, ...]     # the nodes sorting again placed (made or kept), in their new order
    reordered: bool             # kept nodes changed their relative order


def _kahn(nodes: list[Node]) -> list[Node] | None:
    """_lexicographical_topological_sort of a window of nodes, keyed by position in it; inputs from outside the
    window are ready. None if the window has a cycle."""
    import heapq

    pos = {n.id: i for i, n in enumerate(nodes)}
    indegree = [0] * len(nodes)
    children: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        preds = {pos[r.node] for _, r in n.inputs if r.node in pos}
        indegree[i] = len(preds)
        for j in preds:
            children[j].append(i)
    ready = [i for i, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(nodes[i])
        for c in children[i]:
            indegree[c] -= 1
            if indegree[c] == 0:
                heapq.heappush(ready, c)
    return out if len(out) == len(nodes) else None


_SPACING = 1 << 32      # order keys of a graph built from a list: a rewrite's nodes take keys between them


class Graph:
    """Nodes in a deterministic topological order. Value semantics: every change returns a new Graph.

    NOTE [Graph order keys]: every node has an order key (`_key`, increasing along `nodes`), so that the order
    of two nodes, and a node's index (a bisection of `_keys`), cost no pass over the graph. `replace` builds the
    new graph from the old one where the rewrite changed it (NOTE [Incremental replace]) and notes what it
    changed (`_change`) for incremental inference, the live curves and the rewrite driver."""

    def __init__(self, nodes: Iterable[Node]):
        nodes = list(nodes)
        self._by_id: dict[str, Node] = {n.id: n for n in nodes}
        self._nx_graph: nx.DiGraph | None = None
        if _is_topological(nodes, self._by_id):
            # NOTE [Graph order]: the order is the lexicographical topological sort keyed by written position;
            # when the written order already is topological, that sort returns it unchanged (at every step the
            # next written node is ready and has the least key), so it is kept without sorting
            self.nodes: tuple[Node, ...] = tuple(nodes)
            self.resorted = False
        else:
            self.resorted = True           # the order differs from the written one
            order = _lexicographical_topological_sort(nodes, self._by_id)
            if order is None:
                import networkx as nx

                cyc = nx.find_cycle(_nx_of(nodes, self._by_id))
                raise CycleError([a for a, _ in cyc] + [cyc[0][0]]) from None
            self.nodes = tuple(self._by_id[i] for i in order)
        consumers: dict[Ref, list[tuple[str, str]]] = {}
        read: dict[str, set[str]] = {}
        for n in self.nodes:
            for port, r in n.inputs:
                consumers.setdefault(r, []).append((n.id, port))
                read.setdefault(r.node, set()).add(r.output)
        # NOTE [Persistent tables]: the node, key and reader tables are immutables.Map (a HAMT, as CPython's
        # contextvars use): a patched graph shares them with the graph it came from, so `replace` costs what the
        # rewrite changed times log N instead of a copy of every table (NOTE [Incremental replace])
        self._by_id: immutables.Map = immutables.Map(self._by_id)
        self._consumers: immutables.Map = immutables.Map({r: tuple(c) for r, c in consumers.items()})
        self._read: immutables.Map = immutables.Map({k: frozenset(v) for k, v in read.items()})
        self._keys: list[int] = [(i + 1) * _SPACING for i in range(len(self.nodes))]
        self._key: immutables.Map = immutables.Map({n.id: k for n, k in zip(self.nodes, self._keys)})
        self._from = None                  # weakref to the graph `replace` made this one from
        self._change: "Change | None" = None
        self._derived: dict = {}           # values derived from the nodes alone, kept across rewrites (derived)

    def index(self, nid: str) -> int:
        """The position of a node in `nodes` (a bisection of the order keys)."""
        return bisect_left(self._keys, self._key[nid])

    def before(self, a: str, b: str) -> bool:
        """Whether node a comes before node b."""
        return self._key[a] < self._key[b]

    def parent(self) -> "Graph | None":
        """The graph `replace` made this one from, while it is alive."""
        return self._from() if self._from is not None else None

    def derived(self, name: str, build: Callable[["Graph"], Any], update: Callable[[Any, "Graph", "Change"], Any]):
        """A value computed from the nodes alone, built once per graph: from the parent graph's value and what
        `replace` changed (`update`, which must not mutate the parent's value) when the parent has it, else
        from scratch (`build`)."""
        hit = self._derived.get(name)
        if hit is None:
            parent = self.parent()
            base = parent._derived.get(name) if parent is not None and self._change is not None else None
            value = build(self) if base is None else update(base[0], self, self._change)
            hit = self._derived[name] = (value, build, update)
        return hit[0]

    def keep_derived(self) -> None:
        """Update every value the parent graph derived (`derived`) for this one now, so that the graphs made
        from this one update theirs in turn instead of building them (a rewrite driver calls it on the graph
        it goes on from: a value that only candidates ask for would otherwise be built again for each)."""
        parent = self.parent()
        if parent is not None and self._change is not None:
            for name, (_, build, update) in list(parent._derived.items()):
                self.derived(name, build, update)

    def groups(self, name: str, key: Callable[[Node], Any]) -> immutables.Map:
        """The nodes grouped by `key(node)` (None: in no group), each group a tuple of ids in order. Built once
        per graph (`derived`), and for a graph `replace` made from the groups of its parent, changing only the
        groups of the nodes it removed, made or sorted again: a persistent map, so a rewrite costs the groups
        it changed (their ids filtered at C speed), not the graph."""
        def build(g: Graph) -> immutables.Map:
            out: dict[Any, list[str]] = {}
            for n in g.nodes:
                k = key(n)
                if k is not None:
                    out.setdefault(k, []).append(n.id)
            return immutables.Map({k: tuple(v) for k, v in out.items()})

        def update(base: immutables.Map, g: Graph, ch: Change) -> immutables.Map:
            out = base.mutate()
            gone = {n.id for n in ch.gone}
            order = g._key.__getitem__
            made: dict[Any, list[str]] = {}
            for n in ch.made:
                k = key(n)
                if k is not None:
                    made.setdefault(k, []).append(n.id)
            changed = {key(n) for n in ch.gone} | made.keys() | {key(g[i]) for i in ch.moved}
            changed.discard(None)
            for k in changed:
                ids = list(filterfalse(gone.__contains__, base.get(k, ())))
                for i in made.get(k, ()):
                    insort(ids, i, key=order)
                if not ch.moved.isdisjoint(ids):
                    ids.sort(key=order)
                if ids:
                    out[k] = tuple(ids)
                elif k in out:
                    del out[k]
            return out.finish()

        return self.derived(name, build, update)

    @property
    def _nx(self) -> nx.DiGraph:
        if self._nx_graph is None:
            self._nx_graph = _nx_of(self.nodes, self._by_id)
        return self._nx_graph

    def __getitem__(self, nid: str) -> Node:
        return self._by_id[nid]

    def __contains__(self, nid: str) -> bool:
        return nid in self._by_id

    def __len__(self) -> int:
        return len(self.nodes)

    def consumers(self, ref: Ref) -> list[tuple[str, str]]:
        """(node id, port) pairs that read `ref`."""
        return list(self._consumers.get(ref, ()))

    def read_outputs(self, nid: str) -> set[str]:
        return set(self._read.get(nid, ()))

    def ancestors(self, nid: str) -> set[str]:
        import networkx as nx

        return nx.ancestors(self._nx, nid)

    def replace(self, remove: Iterable[str] = (), add: Iterable[Node] = (), redirect: Mapping[Ref, Ref] | None = None) -> "Graph":
        """A new graph without `remove`, with `add`, and every input reading a key of `redirect` reading its value.
        Added nodes take the place of the first removed node, so the schedule keeps the written order; where that
        order is not topological the graph is sorted again (NOTE [Graph order])."""
        remove = set(remove)
        added = list(add)
        redirect = dict(redirect or {})
        new = self._patched(remove, added, redirect)
        if new is None:
            new = self._rebuilt(remove, added, redirect)
        return new

    def _rebuilt(self, remove: set, added: list, redirect: dict) -> "Graph":
        """`replace` by a pass over every node (what _patched falls back to)."""
        ordered: list[Node] = []
        placed = False
        for n in self.nodes:
            if n.id in remove:
                if not placed:
                    ordered.extend(added)
                    placed = True
                continue
            ordered.append(n)
        if not placed:
            ordered.extend(added)
        seen: dict[str, Node] = {}
        for n in ordered:
            if redirect and any(r in redirect for _, r in n.inputs):
                n = n.evolve(inputs=tuple((p, redirect.get(r, r)) for p, r in n.inputs))
            seen.setdefault(n.id, n)
        return Graph(seen.values())

    # NOTE [Incremental replace]: a rewrite changes a few nodes, so the new graph is the old one patched: the
    # node tuple and order keys are copied (C-level copies, a few microseconds at 1,000 nodes) and the indexes
    # are persistent maps changed where the rewrite changed them (NOTE [Persistent tables]), without a Python
    # pass over the nodes. Added nodes take keys between their neighbours'. The order is the
    # one the full rebuild gives (NOTE [Graph order]): only an added or rewired node can read a node after it;
    # around each such node, the window from it to the last node it (transitively, through other such nodes)
    # waits for is sorted by Kahn's algorithm keyed by position, and the rest keeps its order (before the
    # window every node is ready in turn; inside it, a node of the window is always ready before any later
    # node). The window's nodes take the window's keys in their new order. Odd cases (an added id that a kept
    # node has, two added nodes with one id, a cycle, keys too close to split) fall back to the full rebuild
    # (`_rebuilt`, no `_change`). tests/test_graph_order.py checks it against the rebuild on random rewrites.

    def _patched(self, remove: set, added: list, redirect: dict) -> "Graph | None":
        by_id, key = self._by_id, self._key
        add_ids = [n.id for n in added]
        if len(set(add_ids)) != len(add_ids) or any(i in by_id and i not in remove for i in add_ids):
            return None
        rewired: dict[str, Node] = {}
        for r in redirect:
            for nid, _ in self._consumers.get(r, ()):
                if nid not in remove and nid not in rewired:
                    n = by_id[nid]
                    rewired[nid] = n.evolve(inputs=tuple((p, redirect.get(x, x)) for p, x in n.inputs))
        if redirect:
            added = [n.evolve(inputs=tuple((p, redirect.get(r, r)) for p, r in n.inputs))
                     if any(r in redirect for _, r in n.inputs) else n for n in added]
        lst, klst = list(self.nodes), list(self._keys)
        for nid, n in rewired.items():
            lst[bisect_left(klst, key[nid])] = n
        gone_ids = [i for i in remove if i in by_id]
        rm = sorted(bisect_left(klst, key[i]) for i in gone_ids)
        p = rm[0] if rm else len(lst)
        for i in reversed(rm):
            del lst[i]
            del klst[i]
        key2 = key.mutate()
        by2 = by_id.mutate()
        for i in gone_ids:
            del key2[i]
            del by2[i]
        if added:
            lo = klst[p - 1] if p > 0 else 0
            hi = klst[p] if p < len(klst) else lo + (len(added) + 1) * _SPACING
            step = (hi - lo) // (len(added) + 1)
            if step == 0:
                return None               # no room between the neighbours' keys: rebuild (new keys)
            new_keys = [lo + step * (j + 1) for j in range(len(added))]
            lst[p:p] = added
            klst[p:p] = new_keys
            for n, k in zip(added, new_keys):
                key2[n.id] = k
                by2[n.id] = n
        for nid, n in rewired.items():
            by2[nid] = n
        made = added + list(rewired.values())
        late = []                         # nodes that read a node after them
        for m in made:
            km = key2[m.id]
            if any(r.node in key2 and key2[r.node] >= km for _, r in m.inputs):
                late.append(m.id)
        moved: set[str] = set()
        window: list[str] = []
        reordered = False
        if late:
            made_ids = {m.id for m in made}
            late_set = set(late)
            starts = sorted(bisect_left(klst, key2[i]) for i in late)
            s = 0
            while s < len(starts):
                a = e = starts[s]
                j = a
                while j <= e:
                    n = lst[j]
                    if n.id in late_set:
                        for _, r in n.inputs:
                            if r.node in key2:
                                e = max(e, bisect_left(klst, key2[r.node]))
                    j += 1
                while s < len(starts) and starts[s] <= e:
                    s += 1
                order = _kahn(lst[a:e + 1])
                if order is None:
                    return None           # a cycle: the rebuild raises CycleError
                before = [n.id for n in lst[a:e + 1] if n.id not in made_ids]
                if [n.id for n in order if n.id not in made_ids] != before:
                    reordered = True
                for n, k in zip(order, klst[a:e + 1]):
                    if key2[n.id] != k:
                        key2[n.id] = k
                        if n.id not in made_ids:
                            moved.add(n.id)
                    window.append(n.id)
                lst[a:e + 1] = order
        key2, by2 = key2.finish(), by2.finish()
        g = Graph.__new__(Graph)
        g.nodes = tuple(lst)
        g._keys = klst
        g._key = key2
        g._by_id = by2
        g.resorted = bool(late)
        g._nx_graph = None
        cons, read = self._consumers.mutate(), self._read.mutate()
        gone = [by_id[i] for i in gone_ids] + [by_id[i] for i in rewired]
        touched: dict[Ref, list] = {}      # the reader lists this rewrite changes, copied once

        def readers(r: Ref) -> list:
            got = touched.get(r)
            if got is None:
                got = touched[r] = list(cons.get(r, ()))
            return got

        # readers are kept in order: the old entries of removed, rewired and moved nodes leave first, so that
        # what is left is in the new order, then the new entries are inserted by bisection (O(log readers) key
        # look-ups each, not a sort of a widely read tensor's readers)
        by_key = key2.__getitem__
        moved_nodes = [by2[i] for i in moved]
        for n in gone:
            for port, r in n.inputs:
                readers(r).remove((n.id, port))
        for n in moved_nodes:
            for port, r in n.inputs:
                readers(r).remove((n.id, port))
        for n in (*made, *moved_nodes):
            for port, r in n.inputs:
                insort(readers(r), (n.id, port), key=lambda c: by_key(c[0]))
        for r, lst_r in touched.items():
            if lst_r:
                cons[r] = tuple(lst_r)
                if r.output not in read.get(r.node, ()):
                    read[r.node] = read.get(r.node, frozenset()) | {r.output}
            else:
                if r in cons:
                    del cons[r]
                if r.output in read.get(r.node, ()):
                    rest = read[r.node] - {r.output}
                    if rest:
                        read[r.node] = rest
                    else:
                        del read[r.node]
        g._consumers, g._read = cons.finish(), read.finish()
        g._from = weakref.ref(self)
        g._change = Change(tuple(n for n in gone if by2.get(n.id) is not n),
                           tuple(n for n in made if by_id.get(n.id) is not n), frozenset(moved), tuple(window), reordered)
        g._derived = {}
        return g

    def fresh_id(self, base: str) -> str:
        if base not in self._by_id:
            return base
        i = 2
        while f"{base}_{i}" in self._by_id:
            i += 1
        return f"{base}_{i}"

    def same_as(self, other: "Graph") -> bool:
        return len(self) == len(other) and all(n.id in other and n.same_as(other[n.id]) for n in self.nodes)
