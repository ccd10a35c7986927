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
