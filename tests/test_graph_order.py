"""Graph's own topological sort gives the order networkx's lexicographical_topological_sort gives (NOTE [Graph
order]) on random graphs written out of order, and the same CycleError on cyclic ones."""

import random

import networkx as nx
import pytest

from dflash_graph.ir.graph import CycleError, Graph, Node, Ref, _nx_of


def _random_nodes(rng: random.Random, n: int, cyclic: bool) -> list[Node]:
    ids = [f"n{i}" for i in range(n)]
    nodes = []
    for i, nid in enumerate(ids):
        pool = ids[:i] if not cyclic else ids
        k = rng.randint(0, min(3, len(pool)))
        srcs = [rng.choice(pool) for _ in range(k)] if pool else []
        ins = tuple((f"x{j}", Ref(s, rng.choice(["out", "aux"]))) for j, s in enumerate(srcs))
        if rng.random() < 0.1:
            ins += (("ext", Ref("elsewhere", "out")),)     # not a node of this graph: no edge
        nodes.append(Node(id=nid, op="identity", inputs=ins))
    rng.shuffle(nodes)
    return nodes


@pytest.mark.parametrize("seed", range(200))
def test_order_matches_networkx(seed):
    rng = random.Random(seed)
    nodes = _random_nodes(rng, rng.randint(1, 30), cyclic=seed % 4 == 3)
    by_id = {n.id: n for n in nodes}
    g = _nx_of(nodes, by_id)
    written = {n.id: i for i, n in enumerate(nodes)}
    try:
        want = list(nx.lexicographical_topological_sort(g, key=lambda i: (written[i], i)))
    except nx.NetworkXUnfeasible:
        cyc = nx.find_cycle(g)
        with pytest.raises(CycleError) as e:
            Graph(nodes)
        assert e.value.args == CycleError([a for a, _ in cyc] + [cyc[0][0]]).args
        return
    assert [n.id for n in Graph(nodes).nodes] == want


def test_patched_replace_is_the_rebuild(tmp_path):
    """NOTE [Incremental replace]: at every step of rewriting a widened graph (benchmarks/check_scaling.py, whose
    gathers move through positionwise nodes and make the graph sort again around them), Graph.replace's patched
    graph is the full rebuild's: the same nodes in the same order, readers, read outputs and resort flag, with
    order keys that increase along the nodes; its node groups (Graph.groups), updated from the parent's, are the
    groups built from scratch."""
    import importlib.util
    from pathlib import Path

    from dflash_graph.analysis.infer import build, infer
    from dflash_graph.analysis.memory import live_peaks
    from dflash_graph.ir import graph as G
    from dflash_graph.rewrite.engine import rewrite
    from dflash_graph.rewrite.rules import DEFAULT_TABLES
    from dflash_graph.spec.loader import load_graph

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("check_scaling", root / "benchmarks" / "check_scaling.py")
    cs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cs)
    typed = infer(*build(load_graph(str(cs.wide_graph(tmp_path, 90)))))
    seen = {"patched": 0, "sorted": 0}
    replace = G.Graph.replace

    keys = {"by_op": lambda n: (n.op, n.device), "by_source": lambda n: n.inputs[0][1] if n.inputs else None}

    def checked(self, remove=(), add=(), redirect=None):
        for name, key in keys.items():
            self.groups(name, key)          # the parent has them: the patched graph updates them (Graph.groups)
        a = replace(self, remove, add, redirect)
        b = self._rebuilt(set(remove), list(add), dict(redirect or {}))
        for name, key in keys.items():
            assert dict(a.groups(name, key)) == dict(b.groups(name, key))
        assert [n.id for n in a.nodes] == [n.id for n in b.nodes]
        assert all(x.same_as(y) for x, y in zip(a.nodes, b.nodes))
        assert a._consumers == b._consumers and a._read == b._read and a.resorted == b.resorted
        assert a._keys == sorted(set(a._keys)) and [a._key[n.id] for n in a.nodes] == a._keys
        seen["patched"] += a._change is not None
        seen["sorted"] += a.resorted
        return a

    G.Graph.replace = checked
    try:
        _, applied = rewrite(typed, DEFAULT_TABLES, live_peaks)
    finally:
        G.Graph.replace = replace
    assert len(applied) > 80 and seen["patched"] >= len(applied) and seen["sorted"] > 10
