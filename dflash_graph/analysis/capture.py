"""The hidden-state cache, without torch: where a graph is cut (its transfers), what crosses the cut per sample and
in bytes, the storage bill for each way of storing it, the cache's signature and manifest, and the comparison of
two signatures that names each difference. `check --capture` reads this module; `dflash-graph capture` and
`run --hidden-states` (train/hidden_cache.py) write and read what it describes. docs/offline.md.

NOTE [The cut]: a cache holds, per sample (one packed sequence of one replica), exactly the tensors that cross the
graph's transfers (ops with `Traits.movement`), as the target side's nodes produce them: reading them back is
the drafter side's receive, so what it computes from them is what it computes online. The target side is every
device a transfer reads from, the drafter side every device a transfer writes to; a graph whose sides share a
device has no cut (refused). A transfer whose value depends on a node that is not deterministic (anchor
sampling: `Traits.deterministic = False`) is *anchored*: the cache fixes those draws at capture time.

NOTE [Storage choices]: "anchored" stores what the checked graph's transfers carry (after the rewrites: the
verifier's rows only at the anchors, `gather_through_positionwise` applied to the disk), with the anchors fixed
at capture, K draws per sample (NOTE [Anchor draws]); "all" stores the transfers that do not depend on the anchors and the inputs of
the target-side nodes that make the anchored ones (`redraw`: the anchor sampler and what derives from it; its
frontier is the whole last hidden state, the loss mask, the positions), and those nodes run again when the cache
is read, so that anchors are drawn again every epoch; "anchored-fp8" is "anchored" with floating tensors as
float8_e4m3fn and a float32 scale per row. The bytes are exact products of the checked shapes and dtype widths (ir/types.py
TensorType.nbytes), plus the safetensors header that names each tensor (a JSON object: 8 bytes of length, then
the names, dtypes, shapes and offsets, padded to 8 bytes; https://github.com/huggingface/safetensors#format),
estimated per tensor entry as written by `safetensors.torch.save_file`.

NOTE [Anchor draws]: with `[capture] anchor_draws = K` the anchored storages hold K draws of the anchored
crossings per sample, and the crossings that do not depend on the anchors once. Draw e of sample i is what the
online run draws for training sample e * N + i (N: the cache's samples), with the generator the trainer seeds for
that sample (train/trainer.micro_generator), on sample i's data: the target forward runs once per sample, and the
nodes that make the anchored crossings (`redraw`: the anchor sampler, the verifier rows' gather) run again on its
outputs for draws 1..K-1. A run from the cache reads draw p mod K in its pass p over the cache: passes 0..K-1 train
on exactly the anchors the online run draws for those training samples, and pass K reuses draw 0. Draw 0 is stored
under the crossing's name (a cache of one draw is what it was before K existed), draw e under `NODE#draw{e}`
(`draw_name`). Rows that two draws share are stored in each: the crossing is what the drafter side receives,
and storing a union of rows with an index per draw would make the reader a gather of its own."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..errors import GraphError, Location, Problem
from ..ir.graph import Ref
from ..ops import registry
from ..units import fmt_bytes, fmt_seconds
from .infer import Typed
from .launch import analyze_launch, replicas

FORMAT = "dflash-graph hidden-state cache"
VERSION = 1
MANIFEST = "manifest.json"
STORAGES = ("anchored", "all", "anchored-fp8")     # NOTE [Storage choices]; the bill lists the default first
FLOATS = ("float64", "float32", "bfloat16", "float16")
FP8_MAX = 448.0     # the largest finite float8_e4m3fn (OCP 8-bit floating point spec, E4M3)


@attrs.frozen
class Crossing:
    """One tensor that crosses the cut, per sample."""
    node: str                 # the transfer node (its output is what the drafter side reads)
    source: str               # `node.output` the transfer reads on the target side
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    anchored: bool            # depends on a non-deterministic node (the anchors): fixed at capture


@attrs.frozen
class Cut:
    target_devices: tuple[str, ...]
    drafter_devices: tuple[str, ...]
    crossings: tuple[Crossing, ...]

    @property
    def bytes_per_sample(self) -> int:
        return sum(c.nbytes for c in self.crossings)


def _random_descendants(typed: Typed) -> set[str]:
    """Nodes whose value depends on a node that is not deterministic (anchor sampling), by trait."""
    out: set[str] = set()
    for n in typed.graph.nodes:   # topological order
        if not registry.get(n.op).traits.deterministic or any(r.node in out for _, r in n.inputs):
            out.add(n.id)
    return out


def find_cut(typed: Typed) -> Cut:
    """The graph's cut at its transfers (NOTE [The cut]); a graph without one is refused, with the reason."""
    g = typed.graph
    spec = typed.ctx.spec
    moves = [n for n in g.nodes if registry.get(n.op).traits.movement]
    if not moves:
        raise GraphError(Problem("the graph has no transfer node, so there is nothing to capture: the cache holds what "
                                 "crosses the transfers from the target's devices to the drafter's",
                                 spec.loc("nodes"), hint="place the target's nodes and the drafter's on different "
                                 "devices, joined by transfer nodes (graphs/tiny.toml)"))
    random = _random_descendants(typed)
    src_devs: list[str] = []
    dst_devs: list[str] = []
    crossings = []
    for n in moves:
        (_, src), = n.inputs
        for d in typed.ctx.devices_of(g[src.node].device):
            if d not in src_devs:
                src_devs.append(d)
        for d in typed.ctx.devices_of(n.device):
            if d not in dst_devs:
                dst_devs.append(d)
        t = typed.types[Ref(n.id, "out")]
        crossings.append(Crossing(n.id, str(src), tuple(t.sizes), t.dtype, t.nbytes, src.node in random))
    both = sorted(set(src_devs) & set(dst_devs))
    if both:
        raise GraphError(Problem(f"device(s) {', '.join(both)} hold both sides of a transfer: the graph has no cut "
                                 "between a target side and a drafter side", spec.loc("nodes"),
                                 hint="the cache needs every transfer to go from a target device to a drafter device"))
    trainable_src = [n for n in g.nodes if n.model and typed.ctx.models[n.model].spec.trainable
                     and set(typed.ctx.devices_of(n.device)) & set(src_devs)]
    if trainable_src:
        raise GraphError(Problem(f"node '{trainable_src[0].id}' uses a trainable model on the target side of the cut: "
                                 "a cache would freeze what it computes", typed.ctx.loc(trainable_src[0]),
                                 hint="move the trainable model's nodes behind the transfers"))
    return Cut(tuple(src_devs), tuple(dst_devs), tuple(crossings))


# NOTE [Header bytes]: safetensors.torch.save_file writes, per tensor, a JSON entry
# "NAME":{"dtype":"F32","shape":[A,B],"data_offsets":[BEGIN,END]} joined by commas in one object, then pads the
# header to a multiple of 8 bytes (safetensors 0.4+). The estimate writes that entry with offsets of the shard's
# size: exact up to the digits of the offsets and the padding, a few bytes per tensor.
_ST_DTYPE = {"float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
             "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3"}


def draw_name(node: str, draw: int) -> str:
    """The name draw `draw` of an anchored crossing is stored under (NOTE [Anchor draws]): draw 0 under the
    crossing's own."""
    return node if draw == 0 else f"{node}#draw{draw}"


def anchor_draws(typed: Typed) -> int:
    """K, the anchor draws a cache stores per sample (`[capture] anchor_draws`, NOTE [Anchor draws]); refused with
    the 'all' storage, which draws new anchors every pass."""
    cap = typed.ctx.spec.capture
    k = int(cap.get("anchor_draws") or 1)
    if k > 1 and storage_of(cap) == "all":
        raise GraphError(Problem(f"[capture] anchor_draws = {k} with storage = \"all\": the 'all' storage keeps the "
                                 "whole last hidden state and draws new anchors every pass, so it stores no draw",
                                 typed.ctx.spec.loc("capture", "anchor_draws"),
                                 hint="drop anchor_draws, or use storage = \"anchored\" to store K draws per sample"))
    if k > 1:
        redraw(typed, f"[capture] anchor_draws = {k}")    # the anchored crossings can be drawn again (else refused)
    return k


def stored_crossings(cut: "Cut", draws: int) -> tuple["Crossing", ...]:
    """What an anchored storage holds per sample: every crossing, and draws 1..K-1 of the anchored ones, under
    their draw names (NOTE [Anchor draws])."""
    return (*cut.crossings, *(attrs.evolve(c, node=draw_name(c.node, e)) for e in range(1, draws)
                              for c in cut.crossings if c.anchored))


def tensor_key(sample: int, node: str) -> str:
    """The name of one crossing of one sample in a shard."""
    return f"{sample:012d}/{node}"


def stored_as(c: Crossing, dtype: str) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name suffix, shape, dtype, bytes) of what one crossing is stored as: itself, or under `dtype = "fp8"` a
    floating crossing as float8_e4m3fn values (1 byte each) and a float32 scale per row (the last axis)."""
    if dtype != "fp8" or c.dtype not in FLOATS or not c.shape:
        return [("", c.shape, c.dtype, c.nbytes)]
    rows = c.shape[:-1]
    n_rows = 1
    for d in rows:
        n_rows *= d
    return [("", c.shape, "float8_e4m3fn", c.nbytes // _WIDTH[c.dtype]), ("#scale", (*rows, 1), "float32", 4 * n_rows)]


_WIDTH = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def header_bytes(crossings: Sequence[Crossing], shard_bytes: int, dtype: str = "native") -> int:
    """Bytes of one sample's entries in a safetensors header (NOTE [Header bytes])."""
    n = 0
    for c in crossings:
        for suffix, shape, dt, _ in stored_as(c, dtype):
            entry = json.dumps({tensor_key(0, c.node) + suffix: {"dtype": _ST_DTYPE.get(dt, dt), "shape": list(shape),
                                                                 "data_offsets": [shard_bytes, shard_bytes]}},
                               separators=(",", ":"))
            n += len(entry) - 2 + 1     # the entry without the braces, and its comma
    return n


@attrs.frozen
class Storage:
    name: str
    what: str
    payload_per_sample: int      # the tensors' bytes
    per_sample: int              # with the safetensors header's share
    total: int
    capturable: bool             # `dflash-graph capture` writes it (else: predicted only)


@attrs.frozen
class Bill:
    samples: int
    samples_from: str
    samples_per_step: int
    storages: tuple[Storage, ...]
    as_written_per_sample: int           # the anchored storage of the graph as written (before the rewrites)
    disk_bytes: int | None
    disk_from: str
    drafter_step_seconds: float | None   # the drafter side's predicted busy time per optimizer step
    crossings: tuple[Crossing, ...]
    anchor_draws: int = 1                # K: the draws of the anchored crossings each anchored storage holds
    draw_bytes: Mapping[str, int] = attrs.field(factory=dict)   # per anchored storage: one more draw, per sample

    @property
    def default(self) -> Storage:
        return self.storages[0]

    @property
    def one_draw_payload(self) -> int:
        """The checked graph's transfers per sample, one draw (what the rewrites' savings compare)."""
        return sum(c.nbytes for c in self.crossings)

    @property
    def fits(self) -> bool:
        return self.disk_bytes is None or self.default.total <= self.disk_bytes

    def read_bandwidth(self, s: Storage) -> float | None:
        """Bytes per second the reader must deliver so the drafter never waits: a step's samples per predicted
        drafter step."""
        if not self.drafter_step_seconds:
            return None
        return s.per_sample * self.samples_per_step / self.drafter_step_seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "default": self.default.name, "samples": self.samples, "samples_from": self.samples_from,
            "samples_per_step": self.samples_per_step,
            "bytes_per_sample": {s.name: s.per_sample for s in self.storages},
            "bytes_total": {s.name: s.total for s in self.storages},
            "storages": [{"name": s.name, "what": s.what, "payload_bytes_per_sample": s.payload_per_sample,
                          "bytes_per_sample": s.per_sample, "bytes_total": s.total, "capture_writes": s.capturable,
                          "read_bytes_per_second": self.read_bandwidth(s)} for s in self.storages],
            "anchor_draws": self.anchor_draws,
            "bytes_per_sample_per_more_draw": dict(self.draw_bytes),
            "as_written_bytes_per_sample": self.as_written_per_sample,
            "rewrites_save_bytes_per_sample": self.as_written_per_sample - self.one_draw_payload,
            "disk_bytes": self.disk_bytes, "disk_from": self.disk_from, "fits": self.fits,
            "drafter_step_seconds": self.drafter_step_seconds,
            "crossings": [{"node": c.node, "source": c.source, "shape": list(c.shape), "dtype": c.dtype,
                           "bytes": c.nbytes, "anchored": c.anchored} for c in self.crossings],
        }


def storage_of(capture: Mapping[str, Any]) -> str:
    """The storage [capture] asks for: anchored (default), all, or anchored-fp8."""
    if capture.get("storage") == "all":
        return "all"
    return "anchored-fp8" if capture.get("dtype") == "fp8" else "anchored"


def default_samples(typed: Typed) -> tuple[int, str]:
    cap, train = typed.ctx.spec.capture, typed.ctx.spec.train
    if cap.get("samples"):
        return int(cap["samples"]), "[capture] samples"
    per_step = samples_per_step(typed)
    return int(train.get("steps") or 1) * per_step, f"train.steps x grad_accum x replicas = {int(train.get('steps') or 1)} x {per_step}"


def samples_per_step(typed: Typed) -> int:
    return int(typed.ctx.spec.train.get("grad_accum") or 1) * replicas(typed)


def free_disk(directory: str | os.PathLike) -> tuple[int, str]:
    """The free bytes of the filesystem that holds `directory` (or its nearest existing parent)."""
    p = Path(directory).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free, f"free space of the filesystem of {directory} (shutil.disk_usage)"


@attrs.frozen
class Redraw:
    """NOTE [Storage choices], "all": the target-side nodes that make the anchored crossings (the anchor sampler
    and what derives from it: the verifier rows' gather after the rewrites), in graph order, and their inputs
    from outside that set (the frontier: the loss mask, positions, the whole last hidden state). A cache that
    stores the frontier runs these nodes again when read, with the pass's own generator: new anchors each epoch."""
    nodes: tuple[str, ...]
    frontier: tuple[str, ...]          # `node.output` refs, in graph order
    frontier_bytes: tuple[int, ...]
    kept: tuple[Crossing, ...]         # the crossings stored as they are (anchor-independent)

    def stored_bytes(self) -> int:
        return sum(c.nbytes for c in self.kept) + sum(self.frontier_bytes)


def redraw(typed: Typed, what: str = "the 'all' storage") -> Redraw:
    """`what`: who runs the nodes again (named when a node uses a model and cannot be run again)."""
    cut = find_cut(typed)
    g = typed.graph
    random = _random_descendants(typed)
    target = set(cut.target_devices)
    need: set[str] = set()
    stack = [Ref.parse(c.source).node for c in cut.crossings if c.anchored]
    while stack:                                       # the anchored crossings' random ancestors on the target side
        nid = stack.pop()
        if nid in need or nid not in random:
            continue
        need.add(nid)
        stack.extend(r.node for _, r in g[nid].inputs)
    nodes = tuple(n.id for n in g.nodes if n.id in need)
    bad = [n for n in nodes if g[n].model or not set(typed.ctx.devices_of(g[n].device)) <= target]
    if bad:
        raise GraphError(Problem(f"node '{bad[0]}' makes an anchored crossing and uses a model: {what} cannot "
                                 "run it again without the target's forward", typed.ctx.loc(g[bad[0]]),
                                 hint="use the 'anchored' storage with one anchor draw per sample"))
    frontier: list[str] = []
    for n in nodes:
        for _, r in g[n].inputs:
            if r.node not in need and str(r) not in frontier:
                frontier.append(str(r))
    kept = tuple(c for c in cut.crossings if not c.anchored and c.source not in frontier)
    return Redraw(nodes, tuple(frontier), tuple(typed.types[Ref.parse(r)].nbytes for r in frontier), kept)


def _all_header(rd: Redraw, typed: Typed, shard_bytes: int) -> int:
    fake = [*rd.kept, *(Crossing("@" + r, r, tuple(typed.types[Ref.parse(r)].sizes), typed.types[Ref.parse(r)].dtype,
                                 b, False) for r, b in zip(rd.frontier, rd.frontier_bytes))]
    return header_bytes(fake, shard_bytes)


def capture_bill(plan, disk_dir: str | os.PathLike | None = None) -> Bill:
    """The storage bill of a checked plan (rewrite/pipeline.Plan: `original` as written, `typed` as run)."""
    typed, original = plan.typed, plan.original
    cut = find_cut(typed)
    samples, samples_from = default_samples(typed)
    shard = int(typed.ctx.spec.capture.get("shard_samples") or 64)
    K = anchor_draws(typed)
    held = stored_crossings(cut, K)          # NOTE [Anchor draws]
    pay = sum(c.nbytes for c in held)
    head = header_bytes(held, pay * shard)
    draws = "one draw per sample" if K == 1 else f"{K} draws per sample"
    anchored = Storage("anchored", "the checked graph's transfers: " + ", ".join(c.node for c in cut.crossings)
                       + f" (anchors fixed at capture, {draws})", pay, pay + head, (pay + head) * samples, True)
    pay8 = sum(b for c in held for *_, b in stored_as(c, "fp8"))
    head8 = header_bytes(held, pay8 * shard, "fp8")
    fp8 = Storage("anchored-fp8", "as 'anchored', floating tensors as float8_e4m3fn with a float32 scale per row",
                  pay8, pay8 + head8, (pay8 + head8) * samples, True)
    one = [c for c in cut.crossings if c.anchored]      # what one more draw adds per sample, with its header share
    extra = {"anchored": sum(c.nbytes for c in one) + header_bytes(one, pay * shard),
             "anchored-fp8": sum(b for c in one for *_, b in stored_as(c, "fp8")) + header_bytes(one, pay8 * shard,
                                                                                                 "fp8")}
    rd = redraw(typed)
    all_pay = rd.stored_bytes()
    all_head = _all_header(rd, typed, all_pay * shard)
    every = Storage("all", ", ".join([*(c.node for c in rd.kept), *rd.frontier]) + " (anchors drawn again each "
                    f"epoch by {', '.join(rd.nodes)})", all_pay, all_pay + all_head, (all_pay + all_head) * samples,
                    True)
    as_written = find_cut(original).bytes_per_sample      # one draw of the graph as written
    disk = typed.ctx.spec.capture.get("disk")
    if disk is not None:
        disk_bytes, disk_from = int(disk), "[capture] disk"
    elif disk_dir is not None:
        disk_bytes, disk_from = free_disk(disk_dir)
    else:
        disk_bytes, disk_from = None, "not declared ([capture] disk) and no directory given (check --capture DIR)"
    launch = analyze_launch(typed)
    busy = [launch.devices[d].busy_seconds for d in cut.drafter_devices if d in launch.devices]
    # one process runs every drafter device's nodes of a step one after another: their busy times add
    step = sum(busy) if busy and all(b is not None for b in busy) else None
    first = {"fp8": fp8, "all": every}.get(storage_of(typed.ctx.spec.capture).replace("anchored-", ""), anchored)
    storages = (first, *(s for s in (anchored, every, fp8) if s is not first))
    return Bill(samples, samples_from, samples_per_step(typed), storages, as_written, disk_bytes, disk_from,
                step, cut.crossings, K, extra)


def _rate(bps: float) -> str:
    for unit, k in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= k:
            return f"{bps / k:.3g} {unit}"
    return f"{bps:.3g} B/s"


def _tb(n: int) -> str:
    """Decimal terabytes, as disks and DeepSpec's "38 TB" are counted."""
    return f"{n / 1e12:,.1f} TB" if n >= 1e11 else fmt_bytes(n)


def render_bill(b: Bill) -> str:
    lines = [f"capture: the hidden-state cache (docs/offline.md): {b.samples:,} samples ({b.samples_from}), "
             f"{b.samples_per_step} per optimizer step"]
    lines.append(f"  {'storage':<14}{'per sample':>12}{'total':>14}{'read rate':>14}  what")
    for s in b.storages:
        bw = b.read_bandwidth(s)
        tag = "" if s.capturable else " [predicted only: capture does not write it yet]"
        lines.append(f"  {s.name:<14}{fmt_bytes(s.per_sample):>12}{_tb(s.total):>14}"
                     f"{(_rate(bw) if bw else '-'):>14}  {s.what}{tag}")
    saved = b.as_written_per_sample - b.one_draw_payload
    lines.append(f"  the rewrites save {fmt_bytes(saved)} per sample ({_tb(saved * b.samples)} in all): the graph "
                 f"as written sends {fmt_bytes(b.as_written_per_sample)} per sample, the checked graph "
                 f"{fmt_bytes(b.one_draw_payload)}")
    more = b.draw_bytes.get("anchored")
    if more is not None:
        reads = "" if b.anchor_draws == 1 else f"; pass p over the cache reads draw p mod {b.anchor_draws}"
        lines.append(f"  anchor draws: {b.anchor_draws} per sample ([capture] anchor_draws{reads}); one more costs "
                     f"{fmt_bytes(more)} per sample ({_tb(more * b.samples)} in all; anchored-fp8: "
                     f"{fmt_bytes(b.draw_bytes['anchored-fp8'])})")
    if b.drafter_step_seconds:
        per_step = "1 sample" if b.samples_per_step == 1 else f"{b.samples_per_step} samples"
        lines.append(f"  read rate: a step's {per_step} within the drafter's predicted busy time "
                     f"of {fmt_seconds(b.drafter_step_seconds)} per step")
    if b.disk_bytes is None:
        lines.append(f"  disk: {b.disk_from}")
    else:
        verdict = "fits" if b.fits else f"does NOT fit: {fmt_bytes(b.default.total - b.disk_bytes)} short"
        lines.append(f"  disk: {fmt_bytes(b.disk_bytes)} ({b.disk_from}); the '{b.default.name}' cache {verdict}")
    return "\n".join(lines)


def refuse_unless_fits(b: Bill, where: Location) -> None:
    if b.fits:
        return
    s = b.default
    raise GraphError(Problem(f"the cache would not fit: {b.samples:,} samples x {fmt_bytes(s.per_sample)} = "
                             f"{fmt_bytes(s.total)}, and {fmt_bytes(b.disk_bytes)} is available ({b.disk_from})",
                             where, expected=f"at most {fmt_bytes(b.disk_bytes)}", actual=fmt_bytes(s.total),
                             hint="capture fewer samples (--set capture.samples=N), write to a larger disk, or "
                                  "declare [capture] disk if the free space read here is not what the cache may use"))


# -- the signature ---------------------------------------------------------------------------------------------

def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def weights_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix == ".safetensors")
    return [path]


def signature(typed: Typed, rewritten: bool, weights_hash: Mapping[str, str | None]) -> dict[str, Any]:
    """What a cache depends on: any difference makes the cached tensors differ from what this graph computes.
    `weights_hash`: model name -> sha256 of the target's weights (file_sha256 over its files), None for random
    initialisation."""
    spec = typed.ctx.spec
    cut = find_cut(typed)
    target_models = sorted({n.model for n in typed.graph.nodes if n.model and
                            set(typed.ctx.devices_of(n.device)) & set(cut.target_devices)})
    models = {}
    for m in target_models:
        info = typed.ctx.models[m]
        cfg = json.dumps(dict(info.config), sort_keys=True, default=str)
        models[m] = {"arch": info.spec.arch, "dtype": info.spec.dtype,
                     "config_sha256": hashlib.sha256(cfg.encode()).hexdigest(), "weights_sha256": weights_hash.get(m)}
    layer_ids = {m: list(info.config.get("target_layer_ids", ())) for m, info in typed.ctx.models.items()
                 if "target_layer_ids" in info.config}
    random = sorted(_random_descendants(typed) & {n.id for n in typed.graph.nodes
                                                  if not registry.get(n.op).traits.deterministic})
    data = {k: v for k, v in spec.data.items() if not k.startswith("_")}
    return {
        "graph": spec.name,
        "dims": {k: int(v) if isinstance(v, int) else v for k, v in typed.ctx.env.bindings().items()},
        "rewritten": rewritten,
        "crossings": {c.node: {"source": c.source, "shape": list(c.shape), "dtype": c.dtype, "anchored": c.anchored}
                      for c in cut.crossings},
        "target_models": models,
        "target_layer_ids": layer_ids,
        "anchors": {"nodes": {n: dict(sorted((k, v) for k, v in typed.params[n].items() if not k.startswith("_")))
                              for n in random},
                    "seed": int(spec.train.get("seed", 0)), "grad_accum": int(spec.train.get("grad_accum") or 1),
                    "replicas": replicas(typed), "draws": anchor_draws(typed),
                    "policy": "drawn again when read" if storage_of(spec.capture) == "all" else
                    "fixed at capture: draw e of sample i is training sample e * samples + i's; pass p reads draw p mod draws"},
        "data": data,
        "storage": storage_of(spec.capture),
    }


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, Mapping):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    return {prefix: d}


def compare_signatures(cached: Mapping[str, Any], graph: Mapping[str, Any]) -> list[str]:
    """Each difference as 'KEY: cache has A, the graph has B' (absent on one side: 'absent')."""
    a, b = _flat(cached), _flat(graph)
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k, "absent") != b.get(k, "absent"):
            out.append(f"{k}: the cache has {json.dumps(a.get(k, 'absent'))}, the graph has {json.dumps(b.get(k, 'absent'))}")
    return out


def json_safe(d: Any) -> Any:
    return json.loads(json.dumps(d, default=str))


# -- the manifest ----------------------------------------------------------------------------------------------

def new_manifest(sig: Mapping[str, Any], samples: int, shard_samples: int) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "signature": json_safe(sig), "samples": samples,
            "shard_samples": shard_samples, "shards": []}


def shard_name(index: int, rank: int | None = None) -> str:
    """A shard's file: `shard-000012.safetensors` from one process, `shard-r1-00012.safetensors` from target rank 1
    of a launch (NOTE [One writer per target rank])."""
    return f"shard-{index:06d}.safetensors" if rank is None else f"shard-r{rank}-{index:05d}.safetensors"


def part_name(rank: int) -> str:
    """Target rank `rank`'s own record of the shards it has written, until the writer rank merges them."""
    return f"manifest-r{rank}.json"


# NOTE [One writer per target rank]: under torchrun each target rank runs its own replicas' samples (sample i is
# replica i % R: the sample -> rank assignment of the online run, NOTE [Sample order]) and writes them to its own
# shards, `shard-r{rank}-{k}`: its k-th group of `shard_samples` samples, i.e. samples first, first + R, ...
# (the entry's `stride` is R). A rank records its shards in its own part, `manifest-r{rank}.json` (replaced
# atomically after each shard, as manifest.json is in one process), so a killed launch resumes per rank. When
# every rank is done, the writer rank gathers each rank's entries and writes manifest.json once, atomically
# (merge_parts), then removes the parts. A reader orders the shards by their first sample and takes the samples
# in sample order across them (train/hidden_cache.CacheSource).

def entry_samples(entry: Mapping[str, Any]) -> range:
    """The samples a manifest entry's shard holds (NOTE [One writer per target rank]): `samples` of them from
    `first`, every `stride`-th (1 when one process wrote the cache)."""
    stride = int(entry.get("stride", 1))
    return range(int(entry["first"]), int(entry["first"]) + int(entry["samples"]) * stride, stride)


def samples_text(entry: Mapping[str, Any]) -> str:
    s = entry_samples(entry)
    if s.step == 1:
        return f"samples {s.start}..{s[-1]}"
    return f"samples {s.start}..{s[-1]}, every {s.step}th"


def rank_samples(samples: int, replica: int, replicas: int) -> range:
    """The samples of one replica (and so of the target rank that runs it): replica r of every micro-batch."""
    return range(replica, samples, replicas)


def merge_parts(sig: Mapping[str, Any], samples: int, shard_samples: int, replica_ranks: Sequence[int],
                parts: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """manifest.json from each target rank's entries (NOTE [One writer per target rank]): the shards ordered by
    their first sample, refused unless together they hold every sample exactly once."""
    entries = sorted((dict(e) for es in parts.values() for e in es), key=lambda e: e["first"])
    seen: dict[int, str] = {}
    for e in entries:
        for i in entry_samples(e):
            if i in seen:
                raise GraphError(Problem(f"sample {i} is in two shards, {seen[i]} and {e['file']}",
                                         Location(MANIFEST), hint="capture again with --overwrite"))
            seen[i] = e["file"]
    missing = [i for i in range(samples) if i not in seen]
    if missing or len(seen) != samples:
        raise GraphError(Problem(f"the target ranks' shards hold {len(seen)} of {samples} samples (first missing: "
                                 f"{missing[0] if missing else '-'})", Location(MANIFEST),
                                 hint="run the capture again (finished shards are kept)"))
    m = new_manifest(sig, samples, shard_samples)
    m["replica_ranks"] = list(replica_ranks)
    m["shards"] = entries
    return m


def replica_ranks(typed: Typed, cut: Cut) -> list[int]:
    """The torchrun rank that runs each replica's target side (NOTE [One writer per target rank]); refused when a
    replica's target side spans ranks (its cache would need sends inside the target side) or a rank runs the
    target side of several replicas (its shards would not be every R-th sample)."""
    from .launch import device_for

    spec = typed.ctx.spec
    g = typed.graph
    targets = set(cut.target_devices)
    nodes = [n for n in g.nodes if set(typed.ctx.devices_of(n.device)) & targets]
    out: list[int] = []
    for q in range(replicas(typed)):
        ranks = sorted({spec.rank_of(device_for(typed, n.device, q)) for n in nodes})
        if len(ranks) != 1:
            raise GraphError(Problem(f"replica {q}'s target side runs on ranks {ranks}: capture under torchrun writes "
                                     "each replica's samples from the one rank that runs its target side",
                                     spec.loc("devices"), expected="one rank per replica's target devices",
                                     actual=f"{len(ranks)} ranks", hint="run `dflash-graph capture` in one process, "
                                     "or give each replica's target devices one rank"))
        if ranks[0] in out:
            raise GraphError(Problem(f"rank {ranks[0]} runs the target side of replicas {out.index(ranks[0])} and {q}: "
                                     "capture under torchrun needs one replica per target rank", spec.loc("devices"),
                                     hint="run `dflash-graph capture` in one process, or give each replica's "
                                          "target devices their own rank"))
        out.append(ranks[0])
    return out


def missing_samples(m: Mapping[str, Any]) -> list[int]:
    """The samples of a manifest that no recorded shard holds (a capture that did not finish)."""
    held = set()
    for e in m["shards"]:
        held.update(entry_samples(e))
    return [i for i in range(int(m["samples"])) if i not in held]


def shard_of(m: Mapping[str, Any], i: int) -> str:
    """The file that holds (or would hold) sample i of a manifest."""
    ranks = m.get("replica_ranks")
    if not ranks:
        return shard_name(i // int(m["shard_samples"]))
    R = len(ranks)
    return shard_name((i // R) // int(m["shard_samples"]), ranks[i % R])


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    loc = Location(str(path))
    if not path.exists():
        raise GraphError(Problem(f"{directory} is not a hidden-state cache: it has no {MANIFEST}", loc,
                                 hint=f"write one with: dflash-graph capture GRAPH --out {directory}"))
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        raise GraphError(Problem(f"{path} is not JSON: {e}", loc, hint="capture again into an empty directory")) from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        raise GraphError(Problem(f"{path} is not a manifest this dflash-graph reads", loc,
                                 expected=f"format {FORMAT!r}, version {VERSION}",
                                 actual=f"format {m.get('format') if isinstance(m, dict) else None!r}, version "
                                        f"{m.get('version') if isinstance(m, dict) else None}",
                                 hint="capture again with this version"))
    return m


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header, read as JSON without torch (8 bytes of little-endian length, then JSON)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def shard_problem(directory: Path, entry: Mapping[str, Any]) -> str | None:
    """Why a shard of the manifest is not as recorded (missing, other size, other sha256), or None."""
    path = directory / entry["file"]
    if not path.exists():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{path}: {size:,} bytes, the manifest records {entry['bytes']:,}"
    digest = file_sha256(path)
    if digest != entry["sha256"]:
        return f"{path}: sha256 {digest[:16]}..., the manifest records {entry['sha256'][:16]}..."
    return None
