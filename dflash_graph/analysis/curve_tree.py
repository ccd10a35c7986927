"""A persistent augmented treap of a device's forward blocks (NOTE [Curve tree]).

NOTE [Curve tree]: a live curve (analysis/memory.py, NOTE [Live curve]) reads, per device, the sum of its
forward blocks' deltas (P) and the maximum over blocks k of P_k + rise_k (P_k: the deltas before block k), and on
a bound, the first block k with base + P_k + rise_k > limit. Recomputing those over every node for every rewrite
candidate made pricing linear in the graph. Here the blocks sit in a treap keyed by the node's order key
(ir/graph.py, NOTE [Graph order keys]: increasing along the graph's nodes, kept by the nodes a rewrite keeps),
and every tree node holds the aggregates of its subtree, read from the subtree's own start:
    total = L.total + delta + R.total
    top   = max(L.top, L.total + rise, L.total + delta + R.top)      (an empty subtree: total 0, top -inf)
By induction on the subtree, `top` is the max over its blocks, in key order, of (the deltas before it in the
subtree) + its rise: a block of L sees what L sees, the node itself sees L's deltas, and a block of R sees L's
and the node's deltas before what R sees. So the root gives P and max_k(P_k + rise_k) at once, and the first
block over a threshold is a descent that goes left while the left subtree's top passes it (the first such
block is there), else takes the node if its own prefix + rise passes it, else goes right with the prefix grown
by the left subtree and the node: O(depth).
Persistence: a tree node is never changed once built; an update, an insert or a delete builds new nodes along
one root-to-node path (and the split/merge below it) and shares every other subtree with the version it came
from, so the curve of a rejected candidate costs its path and the curve before it stays valid.
Balance: the priority of a key is a fixed hash of it (splitmix64), so the tree's shape is the treap of its key
set whatever the order of updates (the same set, the same shape) and its expected depth is O(log N) for any
key set (1,000 keys spaced as a graph's: mean depth 11.6, deepest 22, measured). An update of an existing key meets the node on
its search path (its ancestors have higher priorities) and rebuilds that path; an insert descends until its
priority beats the node there and splits that subtree by the key; a delete merges the node's children.
tests/test_curve_tree.py checks random insert/update/delete sequences against a plain list.
"""

from __future__ import annotations

from typing import Iterator

_M64 = (1 << 64) - 1


def _prio(key: int) -> int:
    """splitmix64 of the key: a fixed, well-mixed priority (order keys are multiples of 2**32 and between)."""
    z = (key + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class Node:
    """One block (key, node id, delta, rise) and its subtree's aggregates; never changed once built."""

    __slots__ = ("key", "nid", "delta", "rise", "prio", "left", "right", "total", "top")

    def __init__(self, key: int, nid: str, delta: int, rise: int, prio: int,
                 left: Node | None, right: Node | None):
        self.key, self.nid, self.delta, self.rise, self.prio = key, nid, delta, rise, prio
        self.left, self.right = left, right
        # the aggregates (as _fix, inlined: a candidate builds tens of nodes per device)
        if left is not None:
            lt = left.total
            top = lt + rise
            if left.top > top:
                top = left.top
        else:
            lt = 0
            top = rise
        mid = lt + delta
        if right is not None:
            if mid + right.top > top:
                top = mid + right.top
            mid += right.total
        self.total, self.top = mid, top

    def _fix(self) -> None:
        left, right = self.left, self.right
        lt = left.total if left is not None else 0
        top = lt + self.rise
        if left is not None and left.top > top:
            top = left.top
        mid = lt + self.delta
        if right is not None:
            if mid + right.top > top:
                top = mid + right.top
            mid += right.total
        self.total, self.top = mid, top


def _with(t: Node, left: Node | None, right: Node | None) -> Node:
    return Node(t.key, t.nid, t.delta, t.rise, t.prio, left, right)


def build(items) -> Node | None:
    """The tree of (key, node id, delta, rise), given in increasing key order: O(N) (the Cartesian tree of the
    keys and their priorities, built with a stack, then the aggregates bottom-up)."""
    stack: list[Node] = []
    for key, nid, delta, rise in items:
        n = Node.__new__(Node)
        n.key, n.nid, n.delta, n.rise, n.prio, n.left, n.right = key, nid, delta, rise, _prio(key), None, None
        last = None
        while stack and stack[-1].prio < n.prio:
            last = stack.pop()
        n.left = last
        if stack:
            stack[-1].right = n
        stack.append(n)
    if not stack:
        return None
    root = stack[0]
    # aggregates in post-order (children first), without recursion
    order, todo = [], [root]
    while todo:
        t = todo.pop()
        order.append(t)
        if t.left is not None:
            todo.append(t.left)
        if t.right is not None:
            todo.append(t.right)
    for t in reversed(order):
        t._fix()
    return root


def get(t: Node | None, key: int) -> Node | None:
    while t is not None:
        if key == t.key:
            return t
        t = t.left if key < t.key else t.right
    return None


def _split(t: Node | None, key: int) -> tuple[Node | None, Node | None]:
    """(keys < key, keys > key) of a tree without `key`."""
    if t is None:
        return None, None
    if t.key < key:
        a, b = _split(t.right, key)
        return _with(t, t.left, a), b
    a, b = _split(t.left, key)
    return a, _with(t, b, t.right)


def _merge(a: Node | None, b: Node | None) -> Node | None:
    """The tree of a's keys then b's (every key of a below every key of b)."""
    if a is None:
        return b
    if b is None:
        return a
    if a.prio > b.prio:
        return _with(a, a.left, _merge(a.right, b))
    return _with(b, _merge(a, b.left), b.right)


def assign(t: Node | None, key: int, nid: str, delta: int, rise: int) -> Node:
    """A new version with the block at `key` set (updated or inserted)."""
    return _assign(t, key, nid, delta, rise, _prio(key))


def _assign(t, key, nid, delta, rise, p):
    if t is None:
        return Node(key, nid, delta, rise, p, None, None)
    if key == t.key:
        return Node(key, nid, delta, rise, p, t.left, t.right)
    if t.prio < p:           # every key below t has priority <= t.prio < p: `key` is not there
        a, b = _split(t, key)
        return Node(key, nid, delta, rise, p, a, b)
    if key < t.key:
        return _with(t, _assign(t.left, key, nid, delta, rise, p), t.right)
    return _with(t, t.left, _assign(t.right, key, nid, delta, rise, p))


def delete(t: Node | None, key: int) -> Node | None:
    """A new version without the block at `key` (KeyError if there is none)."""
    if t is None:
        raise KeyError(key)
    if key == t.key:
        return _merge(t.left, t.right)
    if key < t.key:
        return _with(t, delete(t.left, key), t.right)
    return _with(t, t.left, delete(t.right, key))


def total(t: Node | None) -> int:
    return t.total if t is not None else 0


def top(t: Node | None, default: int = 0) -> int:
    return t.top if t is not None else default


def first_over(t: Node | None, threshold: int) -> Node | None:
    """The first block (in key order) whose prefix + rise passes `threshold`, or None."""
    if t is None or t.top <= threshold:
        return None
    acc = 0
    while t is not None:
        left = t.left
        if left is not None and acc + left.top > threshold:
            t = left
            continue
        lt = acc + (left.total if left is not None else 0)
        if lt + t.rise > threshold:
            return t
        acc = lt + t.delta
        t = t.right
    return None     # not reached: the root's top passes the threshold


def items(t: Node | None) -> Iterator[tuple[int, str, int, int]]:
    """(key, node id, delta, rise) in key order."""
    stack: list[Node] = []
    while stack or t is not None:
        while t is not None:
            stack.append(t)
            t = t.left
        t = stack.pop()
        yield t.key, t.nid, t.delta, t.rise
        t = t.right


def depth(t: Node | None) -> int:
    if t is None:
        return 0
    return 1 + max(depth(t.left), depth(t.right))
