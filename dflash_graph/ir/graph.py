"""The graph: immutable nodes wired by (node, output) references; networkx underneath for order and cycles
(imported where a graph needs it, not at start-up: 0.15 CPU s that a graph written in order never uses)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import networkx as nx


@attrs.frozen(order=True, cache_hash=True)
class Ref:
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


class Graph:
    """Nodes in a deterministic topological order. Value semantics: every change returns a new Graph."""

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
        self._consumers: dict[Ref, list[tuple[str, str]]] = {}
        self._read: dict[str, set[str]] = {}
        for n in self.nodes:
            for port, r in n.inputs:
                self._consumers.setdefault(r, []).append((n.id, port))
                self._read.setdefault(r.node, set()).add(r.output)

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
        """A new graph without `remove`, with `add`, and every input reading a key of `redirect` reading its value."""
        remove = set(remove)
        added = list(add)
        redirect = dict(redirect or {})
        # added nodes take the place of the first removed node, so the schedule keeps the written order
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

    def fresh_id(self, base: str) -> str:
        if base not in self._by_id:
            return base
        i = 2
        while f"{base}_{i}" in self._by_id:
            i += 1
        return f"{base}_{i}"

    def same_as(self, other: "Graph") -> bool:
        return len(self) == len(other) and all(n.id in other and n.same_as(other[n.id]) for n in self.nodes)
