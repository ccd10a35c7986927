"""The persistent curve tree (analysis/curve_tree.py, NOTE [Curve tree]) against a plain sorted list: random
insert/update/delete sequences, every version kept and checked again after later ones (persistence)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_graph.analysis import curve_tree as ct

KEYS = st.integers(0, 60).map(lambda k: k * (1 << 32) + 7)     # few keys: updates and deletes of present ones
BLOCK = st.tuples(st.integers(-50, 50), st.integers(0, 60))
OPS = st.lists(st.one_of(st.tuples(st.just("set"), KEYS, BLOCK), st.tuples(st.just("del"), KEYS, st.none())),
               max_size=80)


def _expect(ref: dict):
    """(total, max prefix + rise with default 0, prefixes + rises in key order) of a plain list."""
    acc, tops = 0, []
    for k in sorted(ref):
        d, r = ref[k]
        tops.append(acc + r)
        acc += d
    return acc, max(tops, default=0), tops


def _check(t, ref: dict, thresholds) -> None:
    assert [(k, d, r) for k, _, d, r in ct.items(t)] == [(k, *ref[k]) for k in sorted(ref)]
    assert all(nid == f"n{k}" for k, nid, _, _ in ct.items(t))
    total, top, tops = _expect(ref)
    assert ct.total(t) == total and ct.top(t) == top
    keys = sorted(ref)
    for thr in thresholds:
        first = next((keys[i] for i, v in enumerate(tops) if v > thr), None)
        hit = ct.first_over(t, thr)
        assert (hit.key if hit is not None else None) == first
    for k in keys:
        assert ct.get(t, k).delta == ref[k][0]


@settings(max_examples=300, deadline=None)
@given(start=st.dictionaries(KEYS, BLOCK, max_size=40), ops=OPS, thresholds=st.lists(st.integers(-200, 400),
                                                                                       max_size=6))
def test_tree_matches_list(start, ops, thresholds):
    t = ct.build((k, f"n{k}", *start[k]) for k in sorted(start))
    ref = dict(start)
    versions = [(t, dict(ref))]
    for op, key, block in ops:
        if op == "set":
            t = ct.assign(t, key, f"n{key}", *block)
            ref[key] = block
        elif key in ref:
            t = ct.delete(t, key)
            del ref[key]
        else:
            try:
                ct.delete(t, key)
                raise AssertionError("deleted a missing key")
            except KeyError:
                pass
        _check(t, ref, thresholds)
        versions.append((t, dict(ref)))
    for v, r in versions:          # every version is as it was: updates share, never change, tree nodes
        _check(v, r, thresholds)
    # the shape is the treap of the key set: built at once or by updates, the same depth
    assert ct.depth(t) == ct.depth(ct.build((k, f"n{k}", *ref[k]) for k in sorted(ref)))


def test_depth_logarithmic():
    """Order keys as a graph gives them (multiples of 2**32): depth about 2 ln N."""
    t = ct.build(((i + 1) << 32, f"n{i}", 1, 1) for i in range(1000))
    assert ct.depth(t) < 40
    assert ct.total(t) == 1000 and ct.top(t) == 1000
