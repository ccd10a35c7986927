"""Hypothesis strategies for random, valid dflash-graph graphs, written as TOML text.

A drawn graph uses the built-in gather, roll, index_shift, concat, transfer, norm, lm_head (a tiny float64
qwen3_5 model declared inline), block_positions and output ops, plus two test-only ops declared here and
registered only while a test runs (`with registry.registered(RAND_INPUT): ...`):

- `rand_input`: a source of random float64 tensors, or of int64 index tensors with given values; it is impure
  (two of them with equal params are different tensors), seeded by node id and replica so that the original
  and the rewritten graph see the same data;
- `test_scale`: x * 2, position-wise on `*batch`, which the rules have never seen (property f).

Graphs are built as TOML text and go through `spec.loader.parse_graph`, so every example also exercises the
loader. Every drawn graph is valid by construction: a strategy that draws an invalid graph is a bug here.

Index tensors stay inside the axis they select from (the gather contract: the rules rewrite `gather(roll(x),
idx)` into `gather(x, (idx - k) mod n)`, which is equal only for 0 <= idx < n; torch_impl.gather clamps
out-of-range indices). Boundary (0, n-1) and repeated indices are drawn on purpose.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from hypothesis import strategies as st

from dflash_graph.ops import costs
from dflash_graph.ops.contract import BindContext, OpDef, Param, Port, Traits, dim_of
from dflash_graph.rewrite.emit import toml_value

MAX_RANK = 4
MAX_DIM = 5


# -- test-only ops ----------------------------------------------------------------------------------------------

def _rand_outputs(p: Mapping[str, Any]) -> tuple[Port, ...]:
    return (Port("out", "*out", p.get("dtype", "float64")),)


def _rand_shape(ctx: BindContext, types: Mapping[str, Any]):
    return {"out": tuple(dim_of(*ctx.params[f"d{i}"]) for i in range(ctx.params["rank"]))}


RAND_INPUT = OpDef(
    name="rand_input",
    doc="Test source: a random float64 tensor (seeded by node id and replica), or an int64 tensor holding "
        "`values` (or random ints in [0, high) when values is empty).",
    inputs=(),
    outputs=_rand_outputs,
    params=(Param("rank", "int", "Number of dims.", default=1),
            *(Param(f"d{i}", "dim", f"Size of dim {i}.", default="1") for i in range(MAX_RANK)),
            Param("dtype", "str", "float64 or int64.", default="float64", choices=("float64", "int64")),
            Param("values", "list[int]", "int64: the values, row-major.", default=[]),
            Param("high", "int", "int64 without values: exclusive upper bound.", default=1)),
    shape_fn=_rand_shape,
    traits=Traits(pure=False),    # not deterministic in its params: two equal rand_inputs are different tensors
    cost=costs.no_workspace,
    impl="strategies:rand_input",
)

TEST_SCALE = OpDef(
    name="test_scale",
    doc="Test op: x * 2, position-wise on *batch. No rule names it.",
    inputs=(Port("x", "*batch d", "like:x"),),
    outputs=(Port("out", "*batch d", "like:x"),),
    traits=Traits(positionwise="batch"),
    cost=costs.no_workspace,
    impl="strategies:test_scale",
)


# the same op without the trait: no rule may move a selection through it
TEST_SCALE_OPAQUE = attrs.evolve(TEST_SCALE, name="test_scale_opaque", traits=Traits(),
                                 doc="Test op: x * 2, declared without traits.")


def seed_of(node_id: str, replica: int) -> int:
    return zlib.crc32(f"{node_id}/{replica}".encode())


def rand_input(c) -> dict[str, torch.Tensor]:
    p = c.params
    shape = [int(p[f"d{i}"]) for i in range(p["rank"])]
    g = torch.Generator().manual_seed(seed_of(c.node.id, c.replica))
    if p["dtype"] == "float64":
        t = torch.randn(shape, generator=g, dtype=torch.float64)
    elif p["values"]:
        t = torch.tensor(list(p["values"]), dtype=torch.int64).reshape(shape)
    else:
        t = torch.randint(0, p["high"], shape, generator=g, dtype=torch.int64)
    return {"out": t.to(c.device)}


def test_scale(c, x) -> dict[str, torch.Tensor]:
    return {"out": x * 2}


test_scale.__test__ = False   # not a pytest test


# -- the graph being drawn --------------------------------------------------------------------------------------

@attrs.frozen
class Val:
    ref: str                                  # "node.output"
    shape: tuple[tuple[str, int], ...]        # (dim expression, value)
    dtype: str                                # float64 | int64
    device: str
    hi: int = 0                               # int64: every value lies in [0, hi)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(v for _, v in self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for v in self.sizes:
            n *= v
        return n


@attrs.frozen
class GraphCase:
    text: str                                 # the TOML
    n_nodes: int
    ops: frozenset[str]                       # op kinds used

    def __repr__(self) -> str:               # hypothesis prints the failing example: show the TOML
        return f"GraphCase(\n{self.text})"


class _Builder:
    def __init__(self, draw, dims: dict[str, int], hidden: int, vocab: int, places: list[str]):
        self.draw, self.dims, self.hidden, self.vocab, self.places = draw, dims, hidden, vocab, places
        self.nodes: list[dict[str, Any]] = []
        self.by_id: dict[str, dict[str, Any]] = {}
        self.pool: list[Val] = []

    def nid(self, base: str) -> str:
        return f"{base}{len(self.nodes)}"

    def add(self, node: dict[str, Any], outs: dict[str, Val]) -> dict[str, Val]:
        self.nodes.append(node)
        self.by_id[node["id"]] = node
        self.pool.extend(outs.values())
        return outs

    # dims ---------------------------------------------------------------------------------------------------
    def dim(self, max_value: int | None = None) -> tuple[str, int]:
        names = [k for k, v in self.dims.items() if max_value is None or v <= max_value]
        name = self.draw(st.sampled_from(names))
        return name, self.dims[name]

    def shape(self, rank: int) -> tuple[tuple[str, int], ...]:
        return tuple(self.dim() for _ in range(rank))

    # sources ------------------------------------------------------------------------------------------------
    def source(self, device: str, shape=None) -> Val:
        draw = self.draw
        if shape is None:
            rank = draw(st.integers(1, 3))
            shape = self.shape(rank - 1)
            shape += (("hidden", self.hidden),) if draw(st.booleans()) else self.shape(1)
        nid = self.nid("src")
        p = {"rank": len(shape), **{f"d{i}": s for i, (s, _) in enumerate(shape)}}
        v = Val(f"{nid}.out", shape, "float64", device)
        self.add({"id": nid, "op": "rand_input", "device": device, "params": p}, {"out": v})
        return v

    def int_source(self, device: str, high: int, rank: int, size: int | None = None) -> Val:
        """An int64 tensor of values in [0, high), with boundaries and repeats likely; `size`: rank 1 of that
        literal length instead of dims."""
        draw = self.draw
        shape = ((str(size), size),) if size is not None else self.shape(rank)
        n = 1
        for _, v in shape:
            n *= v
        value = st.one_of(st.sampled_from([0, high - 1]), st.integers(0, high - 1))
        values = draw(st.lists(value, min_size=n, max_size=n))
        nid = self.nid("idx")
        p = {"rank": len(shape), **{f"d{i}": (v if s == str(v) else s) for i, (s, v) in enumerate(shape)},
             "dtype": "int64", "values": values}
        v = Val(f"{nid}.out", shape, "int64", device, hi=high)
        self.add({"id": nid, "op": "rand_input", "device": device, "params": p}, {"out": v})
        return v

    # ops ----------------------------------------------------------------------------------------------------
    def transfer(self, x: Val, to: str | None = None) -> Val:
        draw = self.draw
        if to is None:
            others = [d for d in self.places if d != x.device] or self.places
            to = draw(st.sampled_from(others)) if draw(st.integers(0, 9)) else x.device
        nid = self.nid("tx")
        node = {"id": nid, "op": "transfer", "device": to, "inputs": {"x": x.ref}}
        q = draw(st.integers(1, 2))
        if q != 1:
            node["params"] = {"queue": q}
        return self.add(node, {"out": attrs.evolve(x, ref=f"{nid}.out", device=to)})["out"]

    def roll(self, x: Val) -> Val:
        draw = self.draw
        axis = draw(st.integers(0, len(x.shape) - 1))
        n = x.sizes[axis]
        shift = draw(st.one_of(st.integers(-3 * n - 1, 3 * n + 1), st.sampled_from([0, n, -n, n + 1, -n - 1, 1, -1])))
        nid = self.nid("roll")
        return self.add({"id": nid, "op": "roll", "device": x.device, "inputs": {"x": x.ref},
                         "params": {"shift": shift, "axis": axis}},
                        {"out": attrs.evolve(x, ref=f"{nid}.out")})["out"]

    def norm(self, x: Val) -> Val:
        nid = self.nid("norm")
        return self.add({"id": nid, "op": "norm", "device": x.device, "model": "target", "inputs": {"x": x.ref}},
                        {"out": attrs.evolve(x, ref=f"{nid}.out", shape=(*x.shape[:-1], ("hidden", self.hidden)))})["out"]

    def lm_head(self, x: Val) -> Val:
        nid = self.nid("head")
        return self.add({"id": nid, "op": "lm_head", "device": x.device, "model": "target", "inputs": {"x": x.ref}},
                        {"logits": Val(f"{nid}.logits", (*x.shape[:-1], ("vocab", self.vocab)), x.dtype, x.device)})["logits"]

    def op(self, op: str, x: Val) -> Val:
        """A shape-preserving test op (test_scale or a twin of it)."""
        nid = self.nid("scale")
        return self.add({"id": nid, "op": op, "device": x.device, "inputs": {"x": x.ref}},
                        {"out": attrs.evolve(x, ref=f"{nid}.out")})["out"]

    def concat(self, x: Val) -> Val:
        draw = self.draw
        same = [v for v in self.pool if v.device == x.device and v.dtype == x.dtype
                and v.sizes[:-1] == x.sizes[:-1] and len(v.shape) == len(x.shape)]
        parts = [x, *draw(st.lists(st.sampled_from(same), min_size=1, max_size=2))]
        nid = self.nid("cat")
        last = "+".join(p.shape[-1][0] for p in parts)
        out = Val(f"{nid}.out", (*x.shape[:-1], (last, sum(p.sizes[-1] for p in parts))), x.dtype, x.device,
                  hi=max(p.hi for p in parts))
        return self.add({"id": nid, "op": "concat", "device": x.device, "inputs": [p.ref for p in parts]}, {"out": out})["out"]

    def index_shift(self, idx: Val, modulo: int) -> Val:
        draw = self.draw
        shift = draw(st.one_of(st.integers(-3 * modulo - 1, 3 * modulo + 1), st.sampled_from([0, -1, modulo, -modulo])))
        nid = self.nid("ishift")
        return self.add({"id": nid, "op": "index_shift", "device": idx.device, "inputs": {"index": idx.ref},
                         "params": {"shift": shift, "modulo": modulo}},
                        {"out": attrs.evolve(idx, ref=f"{nid}.out", hi=modulo)})["out"]

    def block_positions(self, n: int, device: str) -> Val:
        """Blocks of `block` positions from anchors anywhere in [0, n): a block may run past the row's end, where
        the op clamps its indices to n - 1 (its `seq` param), so every index is in [0, n)."""
        block, b = self.dim(max_value=n)
        anchors = self.int_source(device, n, 1)
        nid = self.nid("blk")
        out = Val(f"{nid}.index", (*anchors.shape, (block, b)), "int64", device, hi=n)
        return self.add({"id": nid, "op": "block_positions", "device": device, "inputs": {"anchors": anchors.ref},
                         "params": {"block": block, "seq": n}}, {"index": out})["index"]

    def index_for(self, n: int, device: str, max_rank: int) -> Val:
        """An int64 tensor on `device` whose values index an axis of size n."""
        draw = self.draw
        ok = [v for v in self.pool if v.dtype == "int64" and 0 < v.hi <= n and len(v.shape) <= max_rank]
        ints = [v for v in self.pool if v.dtype == "int64" and len(v.shape) <= max_rank]
        kinds = ["values", "shift_new", "few", "few", "few"] + (["reuse"] if ok else []) + (["shift"] if ints else []) \
            + (["block"] if max_rank >= 2 and any(v <= n for v in self.dims.values()) else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "reuse":
            idx = draw(st.sampled_from(ok))
        elif kind == "shift":
            idx = self.index_shift(draw(st.sampled_from(ints)), n)
        elif kind == "block":
            idx = self.block_positions(n, draw(st.sampled_from([device, *self.places])))
        elif kind == "shift_new":
            src = self.int_source(draw(st.sampled_from([device, *self.places])), draw(st.integers(1, 2 * n + 3)),
                                  draw(st.integers(1, max_rank)))
            idx = self.index_shift(src, n)
        elif kind == "few":        # fewer indices than rows: what makes moving a selection up worth it
            idx = self.int_source(draw(st.sampled_from([device, device, *self.places])), n, 1, draw(st.integers(1, n)))
        else:
            idx = self.int_source(draw(st.sampled_from([device, *self.places])), n, draw(st.integers(1, max_rank)))
        if idx.device != device:
            idx = self.transfer(idx, device)
        return idx

    def gather(self, x: Val, batch_axis: bool = False) -> Val:
        draw = self.draw
        axis = draw(st.integers(0, len(x.shape) - (2 if batch_axis and len(x.shape) > 1 else 1)))
        prod = self.by_id[x.ref.split(".")[0]]
        if prod["op"] == "roll" and draw(st.booleans()):
            axis = prod["params"]["axis"]
        n = x.sizes[axis]
        idx = self.index_for(n, x.device, max(1, MAX_RANK - len(x.shape) + 1))
        nid = self.nid("gather")
        shape = (*x.shape[:axis], *idx.shape, *x.shape[axis + 1:])
        node = {"id": nid, "op": "gather", "device": x.device, "inputs": {"x": x.ref, "index": idx.ref}}
        if axis or draw(st.booleans()):
            node["params"] = {"axis": axis}
        return self.add(node, {"out": attrs.evolve(x, ref=f"{nid}.out", shape=shape)})["out"]

    def duplicate(self) -> Val | None:
        """A second node equal to an existing one but for its id (what merge_duplicates finds)."""
        cands = [n for n in self.nodes if n["op"] not in ("rand_input", "output")]
        if not cands:
            return None
        node = dict(self.draw(st.sampled_from(cands)))
        old = node["id"]
        node["id"] = self.nid("dup")
        outs = {v.ref.split(".")[1]: attrs.evolve(v, ref=f"{node['id']}.{v.ref.split('.')[1]}")
                for v in self.pool if v.ref.split(".")[0] == old}
        self.add(node, outs)
        return next(iter(outs.values()))

    def round_trip(self, x: Val) -> Val:
        """x sent to another device and back (what transfer_round_trip removes)."""
        there = self.transfer(x)
        return self.transfer(there, x.device)

    def pattern(self, x: Val, extra_ops: tuple[str, ...]) -> Val:
        """The DFlash verifier shape: a value through a few position-wise ops and rolls (maybe across devices),
        then a selection along a batch axis."""
        draw = self.draw
        for _ in range(draw(st.integers(1, 3))):
            kinds = ["roll", "transfer", *extra_ops] + (["norm", "lm_head", "lm_head"] if x.sizes[-1] == self.hidden else []) \
                + (["concat"] if x.sizes[-1] <= 16 else [])
            kind = draw(st.sampled_from(kinds))
            x = {"roll": self.roll, "transfer": self.transfer, "norm": self.norm, "lm_head": self.lm_head,
                 "concat": self.concat}[kind](x) if kind in ("roll", "transfer", "norm", "lm_head", "concat") \
                else self.op(kind, x)
        return self.gather(x, batch_axis=True)

    # pick ---------------------------------------------------------------------------------------------------
    def pick(self, pred=lambda v: True) -> Val | None:
        """A value of the pool, most often one of the latest (so chains form), sometimes any (so branches do)."""
        cands = [v for v in self.pool if pred(v)]
        if not cands:
            return None
        if self.draw(st.booleans()):
            return cands[-1 - self.draw(st.integers(0, min(2, len(cands) - 1)))]
        return self.draw(st.sampled_from(cands))


def _model_toml(hidden: int, vocab: int) -> str:
    cfg = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "linear_num_key_heads": 1,
           "linear_num_value_heads": 1, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
           "full_attention_interval": 1}
    return f'[models.target]\narch = "qwen3_5"\ndtype = "float64"\nconfig = {toml_value(cfg)}\n'


def _node_toml(n: dict[str, Any]) -> str:
    lines = ["[[nodes]]"]
    for k in ("id", "op", "device", "model", "inputs", "params"):
        if k in n:
            lines.append(f"{k} = {toml_value(n[k])}")
    return "\n".join(lines) + "\n"


ACTIONS = ("source", "gather", "gather", "roll", "roll", "transfer", "norm", "lm_head", "lm_head", "concat",
           "duplicate", "round_trip", "pattern", "pattern", "pattern")


@st.composite
def graphs(draw, extra_ops: tuple[str, ...] = (), max_steps: int = 8, groups: bool = True,
           torch_device: str = "cpu") -> GraphCase:
    """A random valid graph. `extra_ops`: test-only ops to use as well (currently "test_scale"). `torch_device`
    "cuda" declares the devices as cuda:N (for the memory model's caching-allocator replay; not executable)."""
    hidden = draw(st.sampled_from([4, 8]))
    vocab = draw(st.sampled_from([3, 9, 24]))
    n_dims = draw(st.integers(1, 3))
    dims = {f"n{i}": draw(st.integers(1, MAX_DIM)) for i in range(n_dims)}
    all_dims = dict(dims)
    text_dims = dict(dims)
    if draw(st.booleans()):
        all_dims["m"] = dims["n0"] + 1          # an expression dim
        text_dims["m"] = "n0 + 1"
    all_dims["hidden"] = hidden
    n_devices = draw(st.integers(1, 3))
    devices = [f"d{i}" for i in range(n_devices)]
    places = list(devices)
    group_toml = ""
    if groups and n_devices >= 2 and draw(st.integers(0, 3)) == 0:
        places.append("g")
        group_toml = f'[groups]\ng = {toml_value(devices[:2])}\n\n'
    b = _Builder(draw, all_dims, hidden, vocab, places)
    b.source(draw(st.sampled_from(places)))
    actions = ACTIONS + tuple(a for a in extra_ops for _ in range(2))
    for _ in range(draw(st.integers(1, max_steps))):
        act = draw(st.sampled_from(actions))
        floats = lambda v: v.dtype == "float64"    # noqa: E731
        if act == "source":
            b.source(draw(st.sampled_from(places)))
        elif act == "gather":
            x = b.pick(lambda v: floats(v))
            b.gather(x)
        elif act == "roll":
            b.roll(b.pick())
        elif act == "transfer":
            b.transfer(b.pick())
        elif act in ("norm", "lm_head"):
            x = b.pick(lambda v: floats(v) and v.sizes[-1] == hidden)
            if x is None:
                x = b.source(draw(st.sampled_from(places)), (*b.shape(draw(st.integers(0, 2))), ("hidden", hidden)))
            (b.norm if act == "norm" else b.lm_head)(x)
        elif act == "pattern":
            b.pattern(b.pick(floats), extra_ops)
        elif act == "duplicate":
            b.duplicate()
        elif act == "round_trip":
            b.round_trip(b.pick())
        elif act == "concat":
            b.concat(b.pick(lambda v: v.sizes[-1] <= 16))
        elif act == "test_scale":
            b.op("test_scale", b.pick(floats))
    # results: the latest value, and some others (sometimes twice)
    outs = [b.pool[-1], *draw(st.lists(st.sampled_from(b.pool), max_size=3))]
    for v in outs:
        nid = b.nid("out")
        b.nodes.append({"id": nid, "op": "output", "device": v.device, "inputs": {"x": v.ref}})
    text = "[graph]\nname = \"random\"\n\n[dims]\n"
    text += "".join(f"{k} = {toml_value(v)}\n" for k, v in text_dims.items())
    text += 'hidden = "target.hidden_size"\nvocab = "target.vocab_size"\n\n'
    torch_of = (lambda i: "cpu") if torch_device == "cpu" else (lambda i: f"cuda:{i}")
    text += "".join(f'[devices.{d}]\ntorch = "{torch_of(i)}"\ncapacity = "1 GiB"\n\n' for i, d in enumerate(devices))
    text += group_toml + _model_toml(hidden, vocab) + "\n"
    text += "\n".join(_node_toml(n) for n in b.nodes)
    return GraphCase(text, len(b.nodes), frozenset(n["op"] for n in b.nodes))


@st.composite
def pushdown_graphs(draw, op: str = "test_scale") -> GraphCase:
    """src -> a chain of `op` (and norm) -> gather along a batch axis selecting at most half the rows -> output,
    on one device: the shape gather_through_positionwise rewrites whenever `op` is position-wise (selecting at
    most half of [*, 8] float64 rows with an int64 index always lowers the peak)."""
    hidden = 8
    dims = {"n0": draw(st.integers(2, MAX_DIM)), "n1": draw(st.integers(2, 4)), "hidden": hidden}
    b = _Builder(draw, dims, hidden, 3, ["d0"])
    rank = draw(st.integers(1, 2))
    x = b.source("d0", (*(b.dim() for _ in range(rank)), ("hidden", hidden)))
    x = b.op(op, x)
    for _ in range(draw(st.integers(0, 2))):
        x = b.op(op, x) if draw(st.booleans()) else b.norm(x)
    axis = draw(st.integers(0, rank - 1))
    n = x.sizes[axis]
    k = draw(st.integers(1, max(1, n // 2)))
    values = draw(st.lists(st.one_of(st.sampled_from([0, n - 1]), st.integers(0, n - 1)), min_size=k, max_size=k))
    nid = b.nid("idx")
    b.add({"id": nid, "op": "rand_input", "device": "d0",
           "params": {"rank": 1, "d0": k, "dtype": "int64", "values": values}},
          {"out": Val(f"{nid}.out", ((str(k), k),), "int64", "d0", hi=n)})
    gid = b.nid("gather")
    b.nodes.append({"id": gid, "op": "gather", "device": "d0", "inputs": {"x": x.ref, "index": f"{nid}.out"},
                    "params": {"axis": axis}})
    b.nodes.append({"id": b.nid("out"), "op": "output", "device": "d0", "inputs": {"x": f"{gid}.out"}})
    text = "[dims]\n" + "".join(f"{name} = {dims[name]}\n" for name in ("n0", "n1"))
    text += 'hidden = "target.hidden_size"\n\n[devices.d0]\ntorch = "cpu"\ncapacity = "1 GiB"\n\n'
    text += _model_toml(hidden, 3) + "\n" + "\n".join(_node_toml(n) for n in b.nodes)
    return GraphCase(text, len(b.nodes), frozenset(n["op"] for n in b.nodes))
