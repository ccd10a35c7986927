"""Per-device memory over the schedule, and the OOM verdict.

For every physical device this builds the allocation sequence of two training steps (the second shows the
allocator's steady state) from the graph and the op costs:

  load       resident weights per model component used on the device (a component shared by two models counts
             once), transfer queue buffers; for trainable models fp32 master weights and AdamW's two fp32
             moments (see NOTE [Trainable memory])
  forward    nodes in topological order: each node's program (temporaries, outputs), then inputs are freed after
             their last consumer, unless autograd saved them for backward
  backward   trainable-path nodes in reverse: parameter gradients on first touch, input gradients, saved tensors
             freed (a node with backward units layer by layer, one request per parameter's gradient and per
             saved tensor: ops/costs.py NOTE [Layered backward])
  optimizer  each gradient to fp32 for its master (one request each), AdamW's foreach temporaries (one per
             parameter), then gradients freed (zero_grad(set_to_none=True))

The allocated peak is the live bytes (torch.cuda.max_memory_allocated); the reserved peak comes from replaying
the same sequence through a model of PyTorch's caching allocator (analysis/allocator.py). The verdict compares
what the allocator must reserve with the device's capacity less what lies outside the allocator.

NOTE [Trainable memory]: a trainable model computes in its dtype: its weights and gradients are in that dtype.
AdamW works on fp32: when the dtype is not float32 the trainer keeps fp32 master weights (4 B/param), turns the
gradients into fp32 copies before the step (4 B, transient), and copies the updated masters back. AdamW's
exp_avg and exp_avg_sq are fp32 (8 B) and its foreach step makes fp32 temporaries the size of the parameters
(4 B, transient). bf16: 2 + 4 + 8 resident, 2 + 4 + 4 transient; fp32: 4 + 8 resident, 4 + 4 transient.
(train/trainer.py implements exactly this.)

NOTE [Data-parallel memory]: a model declared `parallel` (analysis/parallel.py) on a group of M devices.
- ddp: every replica holds the whole model, its gradients, masters and AdamW state as above, plus the Reducer's
  gradient buckets: torch/nn/parallel/distributed.py builds buckets of bucket_cap_mb = 25 MiB
  (_DEFAULT_BUCKET_CAP_MB; the first one dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB) over the parameters that need
  gradients, and with gradient_as_bucket_view=False (its default) the Reducer allocates each bucket's flat
  gradient tensor at construction: together exactly the trainable parameters' bytes in their dtype, resident
  (tests/test_layouts.py reads the buckets' sizes from a DDP on a 1-process gloo group).
- fsdp: fully_shard (torch/distributed/fsdp/_fully_shard/) per decoder layer and once at the root (train/trainer.py
  _shard_fsdp; the root's own parameters, fc and the norms, counted as one unit R). Each replica holds its shard of every parameter (_fsdp_param.py: dim 0
  chunked into M, padded to M equal chunks), so 1/M of the parameters, their gradients, masters and AdamW state.
  What FSDP2 (torch 2.13, torch/distributed/fsdp/_fully_shard/) holds besides, U a layer unit's unsharded bytes,
  R the root's, for a model whose node declares a layered backward (ops/costs.py NOTE [Layered backward]; the
  DFlash drafter), replayed at the times torch holds them (_layered_backward):
  - forward: R from the root's all-gather to its post-backward (the root is not resharded after forward:
    _fsdp_state.py _lazy_init sets post_forward_mesh_info = None); through the node's forward a unit's unsharded
    parameters and its all-gather output, 2U (_fsdp_param_group.py wait_for_unshard keeps the output in
    comm_ctx.all_gather_state until the next unit's wait; _fsdp_state.py _post_forward frees the last one);
  - backward, per layer unit in reverse: pre_backward's copy-out into its unsharded parameters (U; the all-gather
    output, made by the previous unit's _backward_prefetch or the root's for the last layer, freed at once in
    backward, wait_for_unshard) and the next layer's all-gather output prefetched (U, to its own wait); the
    layer's unsharded gradients and activation gradients (the unit's bound, NOTE [Layered backward]); then
    post_backward: reshard (its parameters freed), the previous unit's reduce-scatter input released
    (reduce_scatter_max_input_buffers = 1, _fsdp_param_group.py post_backward), a reduce-scatter input made
    (U, padded to M chunks) and the unsharded gradients dropped into it, the 1/M output kept as the sharded
    gradient (_fsdp_collectives.py foreach_reduce); the last input is released at the end
    (_fsdp_state.py _root_post_backward_final_callback). The root unit the same, its R already unsharded.
  A model without a layered backward keeps the bound: R + 2U from its first trainable node to the end of the
  backward, and 2U + U/M through the backward.
What is exact and what is a bound, measured on CPU (the live tracker): the DDP buckets and the resident bytes of
both engines are exact (tests/test_dp.py, default suite); the FSDP2 buffers are placed as torch's source places
them; each layer's backward is an upper bound (NOTE [Layered backward]): on tiny_dp's drafter check's backward
adds 951,552 B (DDP) and 2,133,760 B (FSDP2, 2 ranks) where the tracker measures 457,984 and 1,640,192 B (one
process, tests/test_dp.py), the same 493,568 B above on both. tiny_dp on 4 ranks (CPU/gloo): DDP's peak is
9,658,916 B in check against 9,483,220 B measured (1.9% above; check's peak is the first layer's backward, the
measured one the loss's forward, where check has 9,482,272 B, 948 B under: the loss's small temporaries); FSDP2's
is 7,688,228 B against 7,162,080 to 7,423,072 B over three runs and ranks (3.6-7.3% above; before, 9,002,660 B:
21-26%). check errs above on both. The drafter's context input, which autograd keeps as fc's input, is counted
(ops/costs.py drafter_forward saved_inputs: 262,144 B on tiny's drafter, in one process too; tests/test_run.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import immutables

from ..ir.graph import Node, Ref
from ..models.registry import ARCHS
from ..ops import registry
from ..ops.costs import NodeCost, program_peak
from ..units import DTYPE_BYTES, fmt_bytes
from . import curve_tree
from .allocator import AllocatorConfig, Event, Folded, Repeat, expand_events, round_size, simulate_pair
from .infer import Typed
from .launch import nccl_outside_bytes, replicas
from .nodecost import grad_nodes, grad_seed, hook_refs, node_cost
from .parallel import data_parallel, fsdp_shard

STEPS_SIMULATED = 2


@attrs.frozen
class Oom:
    device: str
    node: str
    tensor: str              # what was being allocated: "logits [65,536, 248,320] bfloat16"
    requested_bytes: int
    free_bytes: int          # usable - reserved at the failure
    capacity_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    outside_allocator_bytes: int

    def message(self, torch_device: str) -> str:
        # Worded like PyTorch's torch.OutOfMemoryError (c10/cuda/CUDACachingAllocator.cpp)
        unalloc = self.reserved_bytes - self.allocated_bytes
        return (f"Tried to allocate {fmt_bytes(self.requested_bytes)}. Device {self.device} ({torch_device}) has a total "
                f"capacity of {fmt_bytes(self.capacity_bytes)} of which {fmt_bytes(self.free_bytes)} is free. Of the "
                f"allocated memory {fmt_bytes(self.allocated_bytes)} is allocated by PyTorch, and {fmt_bytes(unalloc)} "
                f"is reserved by PyTorch but unallocated; {fmt_bytes(self.outside_allocator_bytes)} is outside the "
                f"allocator. At node '{self.node}', allocating {self.tensor}.")


@attrs.frozen
class DeviceMemory:
    name: str
    torch: str
    capacity_bytes: int
    usable_bytes: int
    weight_bytes: int
    optimizer_bytes: int
    peak_bytes: int              # allocated peak (rounded blocks, as torch.cuda.max_memory_allocated)
    live_peak_bytes: int         # the same without the allocator's 512 B rounding
    peak_node: str
    reserved_peak_bytes: int
    reserved_peak_node: str
    node_peaks: Mapping[str, int]   # live bytes at each node's own peak (its forward; "backward": every backward)
    oom: Oom | None
    # (allocated, reserved) after each event of the replay; a Folded sequence where layers were folded
    timeline: Sequence[tuple[int, int]] = attrs.field(repr=False, eq=False)

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.reserved_peak_bytes


@attrs.frozen
class HostMemory:
    """The CPU devices' shared pool: every device whose torch is `cpu` allocates from the host's memory, so their
    peaks are added up (a safe bound: the devices' schedules are not aligned in time, so the peak of the sum is not
    known, and it is at most the sum of the peaks)."""
    devices: tuple[str, ...]
    need_bytes: int              # the sum of the CPU devices' peaks (reserved; on a CPU what they allocate)
    available_bytes: int | None  # None: neither declared nor readable on this host
    source: str                  # where available_bytes comes from: "declared", "MemAvailable", "sysconf", "unknown"

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.need_bytes <= self.available_bytes


@functools.cache
def host_available_bytes() -> tuple[int | None, str]:
    """What this host has available to a new process, read once per process (every figure of one check agrees):
    MemAvailable in /proc/meminfo (Linux), else the free physical pages (os.sysconf); (None, "unknown") when
    neither can be read."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "sysconf"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def host_memory_bytes(spec) -> tuple[int | None, str]:
    """The host figure check uses: [memory] host_memory (or --host-memory) when declared, else this host's."""
    if spec.memory.host_memory is not None:
        return spec.memory.host_memory, "declared"
    return host_available_bytes()


HOST_SOURCES = {"declared": "declared: --host-memory or [memory] host_memory",
                "MemAvailable": "available: MemAvailable in /proc/meminfo",
                "sysconf": "available: free physical memory, os.sysconf", "unknown": "not readable on this host"}


def is_cpu(torch_device: str) -> bool:
    return torch_device == "cpu" or torch_device.startswith("cpu:")


@attrs.frozen
class MemoryReport:
    devices: Mapping[str, DeviceMemory]
    allocator: AllocatorConfig
    host: HostMemory | None = None   # the CPU devices' shared pool (None: no device is a CPU)

    @property
    def fits(self) -> bool:
        return all(d.oom is None for d in self.devices.values()) and (self.host is None or self.host.fits)

    @property
    def ooms(self) -> list[Oom]:
        return [d.oom for d in self.devices.values() if d.oom is not None]


# -- costs --------------------------------------------------------------------------------------------------

def _cached_cost(typed: Typed, node: Node, grad: bool) -> NodeCost:
    # costs depend on the node and its types, not on the device: compute once per node, kept across rewrites
    # that leave the node as it was (infer: NOTE [Incremental inference])
    # (a forward's cost also depends on which layers its hook nodes capture: keyed by them)
    cache = typed.node_cache.setdefault(node.id, {})
    key = (grad, tuple(sorted(hook_refs(typed, node.id).items()))) if node.id in typed.params and \
        Ref(node.id, "taps") in typed.types else grad
    if key not in cache:
        cache[key] = node_cost(typed, node, grad)
    return cache[key]


def component_bytes(typed: Typed) -> dict[str, dict[str, int]]:
    """Per physical device: owner component ('target.lm_head') -> parameter count."""
    if "_component_bytes" not in typed.cache:
        typed.cache["_component_bytes"] = _component_bytes(typed)
    return {d: dict(c) for d, c in typed.cache["_component_bytes"].items()}


def _component_bytes(typed: Typed) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for n in typed.graph.nodes:
        op = registry.get(n.op)
        if not n.model or not op.components:
            continue
        m = typed.ctx.models[n.model]
        for comp in op.components:
            owner = m.component_owner(comp)
            oname, ocomp = owner.split(".")
            om = typed.ctx.models[oname]
            params = ARCHS[om.spec.arch].component_params(om.dims).get(ocomp, 0)
            for dev in typed.ctx.devices_of(n.device):
                out.setdefault(dev, {})[owner] = params
    return out


# -- events -------------------------------------------------------------------------------------------------

class _Ev(NamedTuple):
    """An allocator event (the fields of allocator.Event), as a plain tuple: hundreds of thousands are built."""
    op: str
    tensor: int
    size: int
    label: str


_new_ev = tuple.__new__     # _Ev(...) without the namedtuple's Python-level __new__: the same tuple


class _Seq:
    labels = True
    at: str | None = ""

    def start(self, it: int) -> None:
        pass

    def __init__(self):
        self.events: list[Event] = []
        self.ids: dict[Any, int] = {}
        self.sizes: dict[int, int] = {}
        self._next = 0

    def alloc(self, key: Any, size: int, label: str) -> None:
        if size <= 0:
            return
        tid = self._next
        self._next += 1
        self.ids[key] = tid
        self.sizes[tid] = size
        self.events.append(_new_ev(_Ev, ("alloc", tid, size, label)))

    def free(self, key: Any, label: str) -> None:
        tid = self.ids.pop(key, None)
        if tid is not None:
            self.events.append(_new_ev(_Ev, ("free", tid, self.sizes[tid], label)))

    def live(self, key: Any) -> bool:
        return key in self.ids

    live_ = live


class _OverLimit(Exception):
    pass


class _PeakSeq:
    """The live-byte peak of an allocation sequence without building it (labels ignored): what `live_peaks`
    prices every rewrite candidate with. The same as events_peak over the events a _Seq would record. It also
    notes where the replay is (`at`: the node whose forward it is in, "" in the load phase, None in a backward)
    and, at the start of each iteration of the first step, the live bytes and the weight gradients' bytes among
    them (`starts`): what a rejection certificate needs (rewrite/engine.py)."""
    labels = False
    at: str | None = ""

    def __init__(self, rounded: bool, limit: int | None = None):
        self.sizes: dict[Any, int] = {}
        self.live = self.peak = 0
        self.rounded = rounded
        self.limit = limit
        self.starts: list[tuple[int, int]] = []
        self.it = -1

    def start(self, it: int) -> None:
        grads = sum(v for k, v in self.sizes.items() if type(k) is tuple and k and k[0] == "grad")
        self.starts.append((self.live, grads))
        self.it = it

    def alloc(self, key: Any, size: int, label: str = "") -> None:
        if size <= 0:
            return
        if self.rounded:
            size = round_size(size)
        self.sizes[key] = size          # a key allocated twice: its first block is never freed, as in _Seq
        self.live += size
        if self.live > self.peak:
            self.peak = self.live
            if self.limit is not None and self.peak > self.limit:
                raise _OverLimit

    def free(self, key: Any, label: str = "") -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.live -= size

    def alloc_blocks(self, key: Any, size: int, n: int) -> None:
        """`n` blocks of `size` bytes, never freed (a model's layers' weights), as one: the live bytes rise
        monotonically through them, so their peak is the one after the last."""
        if size > 0 and n > 0:
            self.alloc(key, n * (round_size(size) if self.rounded else size))

    def live_(self, key: Any) -> bool:
        return key in self.sizes


def _tensor_desc(typed: Typed, ref: Ref) -> str:
    t = typed.types.get(ref)
    return f"{ref.output} {t.concrete_str()} {t.dtype}" if t else ref.output


def _signature(typed: Typed, device: str) -> tuple:
    """Devices with the same nodes placed the same way have the same allocation sequence (the replicas of a
    group): build it once."""
    ctx = typed.ctx
    return tuple((n.id, n.device == device) for n in typed.graph.nodes if device in ctx.devices_of(n.device))


def device_events(typed: Typed, device: str, steps: int = STEPS_SIMULATED,
                  compress: bool = False) -> tuple[list[Event], dict[str, int]]:
    """The allocation sequence of `steps` training steps on one physical device, every event written out, and
    weight/optimizer bytes. `compress` replaces each node's internal temporaries by one block of their peak: the
    same live-byte curve at every node boundary and the same peak, in far fewer events (for live peaks, not for
    the allocator)."""
    key = ("events", _signature(typed, device), steps, compress)
    if key not in typed.cache:
        events, resident = folded_events(typed, device, steps, compress)
        typed.cache[key] = (expand_events(events) if any(type(e) is Repeat for e in events) else events, resident)
    return typed.cache[key]


def folded_events(typed: Typed, device: str, steps: int = STEPS_SIMULATED,
                  compress: bool = False) -> tuple[list, dict[str, int]]:
    """device_events with each stretch of identical layers as its first repetition and an allocator.Repeat
    marker (NOTE [Folded replay]): what analyze_memory replays, in time that does not grow with the layers."""
    key = ("folded", _signature(typed, device), steps, compress)
    if key not in typed.cache:
        typed.cache[key] = _device_events(typed, device, steps, compress)
    return typed.cache[key]


@functools.lru_cache(maxsize=512)
def _compressed(program: tuple[tuple[str, str, int], ...]) -> tuple[tuple[str, str, int], ...]:
    """One temporary block of the program's peak excursion above its outputs, then the outputs."""
    peak = program_peak(program)
    outs = sum(size for kind, key, size in program if kind == "alloc" and key.startswith(("out:", "tap:")))
    out_steps = tuple(st for st in program if st[0] == "alloc" and st[1].startswith(("out:", "tap:")))
    extra = peak - outs
    return (("alloc", "peak", extra), *out_steps, ("free", "peak", 0))


def _node_actions(typed: Typed, n: Node, cost: NodeCost, outs, compress: bool, desc) -> list:
    """A node's forward program as the allocator calls it makes, (is_alloc, key, size, label) each: what every
    step and iteration of a replay repeats (the program's tap and output frees are no calls)."""
    program = cost.program
    if program is not None and compress:
        program = _compressed(program)
    if program is None:
        program = (("alloc", "ws", cost.workspace_bytes),
                   *(("alloc", f"out:{k}", t.nbytes) for k, t in outs.items()), ("free", "ws", 0))
    taps = hook_refs(typed, n.id) if "taps" in outs else {}
    acts = []
    for kind, key, size in program:
        if kind == "repeat":    # layers folded (ops/costs.py, NOTE [Layer folding]): (None, Repeat, node id, 0)
            acts.append((None, key, n.id, 0))
            continue
        if key.startswith("tap:"):
            ref = taps[int(key[4:])]
            if kind == "alloc":
                acts.append((True, ref, size, f"{n.id}/{desc(typed, ref)} (hooked by {ref.node})"))
        elif key.startswith("out:"):
            ref = Ref(n.id, key[4:])
            if kind == "alloc" and ref in typed.types:
                acts.append((True, ref, size, f"{n.id}/{desc(typed, ref)}"))
        elif kind == "alloc":
            acts.append((True, (n.id, key), size, f"{n.id}/{key}"))
        else:
            acts.append((False, (n.id, key), 0, f"{n.id}/{key}"))
    return acts


def _write_out(seq, rep, nid: str, reps) -> None:
    """Repetitions `reps` of a body forward's folded layers (ops/costs.Repeat), each step as its own call."""
    for j in reps:
        for kind, tpl, size in rep.steps:
            key = (nid, rep.key(tpl, j))
            if kind == "alloc":
                seq.alloc(key, size, f"{nid}/{key[1]}")
            else:
                seq.free(key, f"{nid}/{key[1]}")


def _repeat(seq: "_Seq", rep, nid: str) -> None:
    """A body forward's folded layers (ops/costs.Repeat) in a _Seq: the first repetition's events, then one
    allocator.Repeat marker for the others (NOTE [Folded replay]); the tensors the last repetition leaves alive
    get its keys and ids. Written out instead where the first repetition frees a tensor older than the
    repetition before it (the marker's ids could not name it)."""
    ids, sizes, events = seq.ids, seq.sizes, seq.events
    lo, start = seq._next, len(events)
    made: list = []             # the templates of the tensors the first repetition allocates
    tpls: list = []             # the template of each event it records
    for kind, tpl, size in rep.steps:
        key = (nid, rep.key(tpl, 0))
        if kind == "alloc":
            if size > 0:
                tpls.append(tpl)
                made.append(tpl)
            seq.alloc(key, size, f"{nid}/{key[1]}")
        elif key in ids:
            tpls.append(tpl)
            seq.free(key, f"{nid}/{key[1]}")
    stride = seq._next - lo
    more = rep.times - 1
    if more <= 0:
        return
    if any(ev.op == "free" and ev.tensor < lo - stride for ev in events[start:]):
        _write_out(seq, rep, nid, range(1, rep.times))
        return

    def label(k: int, i: int) -> str:
        return f"{nid}/{rep.key(tpls[i], k)}"

    events.append(Repeat(len(events) - start, more, stride, lo, label))
    seq._next += more * stride
    for tpl in made:
        tid = ids.pop((nid, rep.key(tpl, 0)), None)
        if tid is not None:
            ids[(nid, rep.key(tpl, more))] = tid + more * stride
            sizes[tid + more * stride] = sizes.pop(tid)


def _forward_node(seq, typed: Typed, n: Node, here: bool, cost: NodeCost, left: dict, saved_refs: dict,
                  grads, compress: bool, desc, actions: dict | None = None) -> None:
    """One node's forward in a device's allocation sequence: its program (saved-for-backward bytes, temporaries,
    outputs; an output nobody reads is freed at once), then each input whose last reader it is (in `left`'s
    count) is freed unless autograd saved it. The replay (_device_events, which passes `actions` to build each
    node's allocator calls once per replay) and the live curve (NOTE [Live curve]) both run it."""
    if here:
        outs = typed.outputs_of(n.id)
        if cost.saved_bytes:
            # a layered backward frees each unit's share (ops/costs.py NOTE [Layered backward]): one block each
            # (tensor by tensor where the cost lists them: each its own request, NOTE [Layered backward])
            rest = cost.saved_bytes - sum(u.saved_bytes for u in cost.backward)
            if cost.saved_tensors and sum(cost.saved_tensors) == rest:
                for j, b in enumerate(cost.saved_tensors):
                    seq.alloc(("saved", n.id, "s", j), b, f"{n.id}/saved for backward")
            else:
                seq.alloc(("saved", n.id), rest, f"{n.id}/saved for backward")
            for k, u in enumerate(cost.backward):
                for j, b in enumerate(_unit_saved(u)):
                    seq.alloc(("saved", n.id, k, j), b, f"{n.id}/saved for backward")
        acts = None if actions is None else actions.get(n.id)
        if acts is None:    # the same for every step and iteration
            acts = _node_actions(typed, n, cost, outs, compress, desc)
            if actions is not None:
                actions[n.id] = acts
        if type(seq) is _Seq:    # _Seq.alloc / _Seq.free inlined: the bulk of a replay's events
            ids, sizes, append, nxt = seq.ids, seq.sizes, seq.events.append, seq._next
            for is_alloc, key, size, lab in acts:
                if is_alloc is None:
                    seq._next = nxt
                    _repeat(seq, key, size)
                    nxt = seq._next
                elif is_alloc:
                    if size > 0:
                        ids[key] = nxt
                        sizes[nxt] = size
                        append(_new_ev(_Ev, ("alloc", nxt, size, lab)))
                        nxt += 1
                else:
                    tid = ids.pop(key, None)
                    if tid is not None:
                        append(_new_ev(_Ev, ("free", tid, sizes[tid], lab)))
            seq._next = nxt
        else:
            for is_alloc, key, size, lab in acts:
                if is_alloc is None:    # a Repeat, written out
                    _write_out(seq, key, size, range(key.times))
                elif is_alloc:
                    seq.alloc(key, size, lab)
                else:
                    seq.free(key, lab)
        for k in outs:
            ref = Ref(n.id, k)
            if left.get(ref, 0) == 0 and not registry.get(n.op).traits.sink:
                seq.free(ref, f"{n.id}/unread {k}")
    # inputs: free after last consumer (the consumer may be on another device: a transfer's sender side)
    for port, r in n.inputs:
        left[r] -= 1
        if here and n.id in grads and port in cost.saved_inputs:
            saved_refs[r] = saved_refs.get(r, 0) + 1
        if left[r] == 0 and r not in saved_refs:
            seq.free(r, f"{n.id}/last use of {r}")


def _device_events(typed: Typed, device: str, steps: int, compress: bool,
                   seq: "_Seq | _PeakSeq | None" = None) -> tuple[list[Event], dict[str, int]]:
    g, ctx = typed.graph, typed.ctx
    on = [n for n in g.nodes if device in ctx.devices_of(n.device)]
    on_ids = {n.id for n in on}
    grads = grad_nodes(typed)
    costs = {n.id: _cached_cost(typed, n, n.id in grads) for n in on}
    seq = _Seq() if seq is None else seq
    desc = _tensor_desc if seq.labels else (lambda typed, ref: "")
    # load: weights (a model's decoder layers as one tensor block per layer), optimizer state, queue buffers
    weight_bytes = opt_bytes = 0
    trainable_params: dict[str, int] = {}
    trainable_width: dict[str, int] = {}
    dp = data_parallel(typed)
    dp = dp if dp is not None and device in dp.devices else None
    units: list[int] = []        # FSDP2: the parameter bytes of each layer's fully_shard unit, unsharded
    root_bytes = 0               # and of the root unit: what no layer holds
    whole: dict[str, int] = {}   # a trainable owner's parameters, unsharded
    for owner, params in sorted(component_bytes(typed).get(device, {}).items()):
        mname, comp = owner.split(".")
        m = ctx.models[mname]
        width = DTYPE_BYTES[m.spec.dtype]
        whole[owner] = params
        if dp is not None and dp.engine == "fsdp" and mname == dp.model:
            # NOTE [Data-parallel memory]: each replica holds 1/M of the parameters (and so of their gradients,
            # masters and AdamW state)
            if comp == "layers":
                units += [params * width // m.dims.num_hidden_layers] * m.dims.num_hidden_layers
            else:                   # fc, the norms: the root unit's (train/trainer.py _shard_fsdp)
                root_bytes += params * width
            params = fsdp_shard(params, len(dp.devices))
        nblocks = getattr(m.dims, "num_hidden_layers", 1) if comp == "layers" else 1
        if type(seq) is _Seq and nblocks > 2 and params * width // nblocks > 0:
            # the layers' blocks: two written, the rest one Repeat marker (NOTE [Folded replay]: a repetition
            # that only makes new, wholly allocated segments is skipped in closed form)
            seq.alloc(("w", owner, 0), params * width // nblocks, f"load/weights {owner}")
            seq.alloc(("w", owner, 1), params * width // nblocks, f"load/weights {owner}")
            label = f"load/weights {owner}"
            seq.events.append(Repeat(1, nblocks - 2, 1, seq._next - 1, lambda k, i, label=label: label))
            seq._next += nblocks - 2
        elif seq.labels:
            for b in range(nblocks):
                seq.alloc(("w", owner, b), params * width // nblocks, f"load/weights {owner}")
        else:   # a peak alone: the blocks (each rounded) as one, the same live bytes after them
            seq.alloc_blocks(("w", owner), params * width // nblocks, nblocks)
        weight_bytes += params * width
        if m.spec.trainable:
            trainable_params[owner] = params
            trainable_width[owner] = width
            if width != 4:
                seq.alloc(("master", owner), params * 4, f"load/fp32 master weights {owner}")
                opt_bytes += params * 4
            for k in ("exp_avg", "exp_avg_sq"):
                seq.alloc(("opt", owner, k), params * 4, f"load/AdamW {k} {owner}")
                opt_bytes += params * 4
    if dp is not None and dp.engine == "ddp" and trainable_params:
        seq.alloc(("ddp_buckets",), sum(p * trainable_width[o] for o, p in trainable_params.items()),
                  "load/DDP gradient buckets (Reducer, gradient_as_bucket_view=False)")
    fsdp_unit = fsdp_root = 0
    if dp is not None and dp.engine == "fsdp" and (units or root_bytes):
        fsdp_root = root_bytes
        fsdp_unit = max(units + [root_bytes])
    first_grad = next((n.id for n in on if n.id in grads), None)
    # owners whose weight gradients a layered backward makes (ops/costs.py NOTE [Layered backward])
    layered: dict[str, str] = {}     # owner -> the node whose backward units make its gradients
    for n in on:
        if n.id in grads and n.model:
            for u in costs[n.id].backward:
                for comp in u.components:
                    owner = ctx.models[n.model].component_owner(comp)
                    if owner in trainable_params:
                        layered[owner] = n.id
    fsdp_layered = bool(fsdp_unit) and any(o.startswith(dp.model + ".") for o in layered)
    grad_keys: dict[str, list] = {o: [] for o in trainable_params}
    for n in on:
        op = registry.get(n.op)
        if op.traits.movement and n.device == device or (op.traits.movement and device in ctx.devices_of(n.device)):
            q = int(typed.params[n.id].get("queue", 1))
            for k in range(max(q - 1, 0)):
                seq.alloc(("queue", n.id, k), typed.types[Ref(n.id, "out")].nbytes, f"load/{n.id} queue buffer {k + 1}")
    # A device that hosts nodes of its own (not only a group's) runs them once per replica of the widest group:
    # the drafter device trains on each target's batch in turn, and gradients accumulate across them.
    replicas = max((len(ctx.devices_of(n.device)) for n in g.nodes), default=1)
    direct = any(n.device == device for n in on)
    iters = int(ctx.spec.train.get("grad_accum", 1) or 1) * (replicas if direct else 1)
    consumers_left_init: dict[Ref, int] = {}
    for n in g.nodes:
        for _, r in n.inputs:
            consumers_left_init[r] = consumers_left_init.get(r, 0) + 1
    actions: dict[str, list] = {}
    for step in range(steps):
        for it in range(iters):
            left = dict(consumers_left_init)
            saved_refs: dict[Ref, int] = {}     # ref -> backward nodes still holding it
            if step == 0:
                seq.start(it)
            for n in g.nodes:
                seq.at = n.id if step == 0 else None   # where the replay is (NOTE [Rejection certificates])
                here = n.id in on_ids
                cost = costs.get(n.id, NodeCost())
                fsdp_fwd = fsdp_layered and here and n.model == dp.model and n.id in grads and bool(cost.backward)
                if fsdp_fwd:        # NOTE [Data-parallel memory]: the root's parameters, kept to its
                    # post-backward; through the forward a unit's unsharded parameters and its all-gather output
                    seq.alloc(("fsdp_root",), fsdp_root, f"{n.id}/FSDP root's unsharded parameters")
                    seq.alloc(("fsdp_forward",), 2 * fsdp_unit,
                              f"{n.id}/FSDP forward: a unit's unsharded parameters and its all-gather output")
                elif fsdp_unit and not fsdp_layered and n.id == first_grad:   # a model without a layered
                    # backward: the root's parameters, a unit's and an all-gather output, as a bound
                    seq.alloc(("fsdp_all_gather",), fsdp_root + 2 * fsdp_unit,
                              f"{n.id}/FSDP all-gather: the root's parameters, a unit's and an all-gather output")
                _forward_node(seq, typed, n, here, cost, left, saved_refs, grads, compress, desc, actions)
                if fsdp_fwd:
                    seq.free(("fsdp_forward",), f"{n.id}/FSDP forward done")
            # backward
            seq.at = None
            bwd = [n for n in reversed(g.nodes) if n.id in grads and n.id in on_ids]
            grad_of: set[Ref] = set()
            if fsdp_unit and not fsdp_layered:   # a unit's unsharded gradients, a reduce-scatter input (this
                # unit's or the previous one's, held until the next post-backward) and its 1/M shard out
                seq.alloc(("fsdp_reduce_scatter",), 2 * fsdp_unit + -(-fsdp_unit // len(dp.devices)),
                          "FSDP reduce-scatter: a unit's unsharded gradients, a reduce-scatter input and its shard")
            for n in bwd:
                cost = costs[n.id]
                label = f"{n.id}/backward"
                if n.model:
                    for owner in trainable_params:
                        if owner.startswith(n.model + ".") and owner not in layered and \
                                not seq.live_(("grad", owner)):
                            seq.alloc(("grad", owner), trainable_params[owner] * trainable_width[owner],
                                      f"{label} weight grad {owner}")
                            grad_keys[owner].append((("grad", owner), trainable_params[owner] * 4, ()))
                if cost.workspace_bytes and not cost.backward:
                    seq.alloc((n.id, "bwd_ws"), cost.workspace_bytes, f"{label} workspace")
                for port, r in n.inputs:
                    if r.node in grads and r.node in on_ids and r not in grad_of:
                        t = typed.types[r]
                        seq.alloc(("dgrad", r), t.nbytes, f"{label} grad of {r}")
                        grad_of.add(r)
                if cost.workspace_bytes and not cost.backward:
                    seq.free((n.id, "bwd_ws"), label)
                if cost.backward and n.model:
                    _layered_backward(seq, n, cost, label, ctx.models[n.model], layered, trainable_params,
                                      trainable_width, whole, grad_keys,
                                      len(dp.devices) if fsdp_layered and n.model == dp.model else 0,
                                      it == iters - 1)
                for k in typed.outputs_of(n.id):
                    seq.free(("dgrad", Ref(n.id, k)), label)
                seq.free(("saved", n.id), label)
                for j in range(len(cost.saved_tensors)):
                    seq.free(("saved", n.id, "s", j), label)
                for port, r in n.inputs:
                    if port in cost.saved_inputs and r in saved_refs:
                        saved_refs[r] -= 1
                        if saved_refs[r] == 0:
                            del saved_refs[r]
                            if left.get(r, 0) == 0:
                                seq.free(r, f"{label} releases saved {r}")
            for r in list(grad_of):
                seq.free(("dgrad", r), "backward done")
            if fsdp_unit:
                seq.free(("fsdp_reduce_scatter",), "backward done")
                seq.free(("fsdp_all_gather",), "backward done")
                seq.free(("fsdp_rs_input",), "backward done: FSDP's last reduce-scatter input released "
                                             "(_root_post_backward_final_callback)")
            for r, _ in list(saved_refs.items()):
                seq.free(r, "backward done")
            # the loss value is kept for logging until the next step
            for n in on:
                if registry.get(n.op).traits.sink:
                    for k in typed.outputs_of(n.id):
                        seq.free(Ref(n.id, k), f"step {step} done")
        if trainable_params:
            # NOTE [Layered backward]: one request per gradient tensor autograd made (a layered backward's are per
            # parameter), in the parameters' order (train/trainer.py _optimizer_step: each master's fp32 gradient
            # made from its low-precision one, which is dropped at once), and AdamW's foreach temporaries one per
            # master (torch/optim/adam.py _multi_tensor_adam: torch._foreach_sqrt(exp_avg_sqs) returns one tensor
            # per parameter)
            temps: list[int] = []
            for owner, params in trainable_params.items():
                entries = sorted(grad_keys[owner], key=lambda e: e[2]) or [(("grad", owner), params * 4, ())]
                for key, b32, _ in entries:
                    if trainable_width[owner] != 4:   # the grad to fp32 for its master, then the low-precision one goes
                        seq.alloc(("grad32", key), b32, "optimizer/fp32 grads")
                        seq.free(key, "optimizer/grads moved to fp32")
                    temps.append(b32)
            for j, b in enumerate(temps):
                seq.alloc(("optim", step, j), b, "optimizer/foreach temporaries")
            for j in range(len(temps)):
                seq.free(("optim", step, j), "optimizer/step")
            for owner, params in trainable_params.items():
                for key, _, _ in grad_keys[owner] or [(("grad", owner), 0, ())]:
                    seq.free(key, "zero_grad(set_to_none=True)")
                    seq.free(("grad32", key), "zero_grad(set_to_none=True)")
                grad_keys[owner] = []
    return getattr(seq, "events", []), {"weights": weight_bytes, "optimizer": opt_bytes}


def _unit_saved(u) -> tuple[int, ...]:
    """A backward unit's saved bytes as the forward allocated them: its tensors, or one block."""
    return u.saved_tensors if u.saved_tensors and sum(u.saved_tensors) == u.saved_bytes else (u.saved_bytes,)


def _layered_backward(seq, n: Node, cost: NodeCost, label: str, m, layered: dict, trainable_params: dict,
                      trainable_width: dict, whole: dict, grad_keys: dict, fsdp_ranks: int, last_iter: bool) -> None:
    """A node's backward unit by unit (ops/costs.py NOTE [Layered backward]): each unit's weight gradients and
    activation gradients on top of the live set, then its share of the saved bytes freed. `fsdp_ranks` M > 0: the
    units are FSDP2's fully_shard units, with the all-gathers and reduce-scatters torch 2.13 makes around each
    (NOTE [Data-parallel memory]); on a step's last micro-batch (`last_iter`) the gradients are reduce-scattered,
    before it they stay unsharded and accumulate."""
    n_layers = getattr(m.dims, "num_hidden_layers", 1)

    def parts(u):
        """(owner, parameter index, unsharded bytes) of each gradient tensor the unit makes, in autograd's order
        (one per parameter, or per component when the unit lists no tensors)."""
        out = []
        div = n_layers if u.layer is not None else 1
        for i, (comp, elems) in enumerate(u.tensors or tuple((c, None) for c in u.components)):
            owner = m.component_owner(comp)
            if layered.get(owner) != n.id:
                continue
            w = trainable_width[owner]
            out.append((owner, i, whole[owner] * w // div if elems is None else elems * w))
        return out

    def shards(u, ps):
        """FSDP2: (owner, this rank's gradient bytes) of each owner among the unit's tensors: its 1/M share of
        the unit's reduce-scatter output."""
        div = n_layers if u.layer is not None else 1
        return [(o, trainable_params[o] * trainable_width[o] // div) for o in dict.fromkeys(p[0] for p in ps)]

    def padded(b: int) -> int:     # FSDP2's flat all-gather / reduce-scatter buffer: M chunks of one shard
        return fsdp_ranks * -(-b // fsdp_ranks)

    units = [(k, u, parts(u)) for k, u in enumerate(cost.backward)]
    for j, (k, u, ps) in enumerate(units):
        ulabel = f"{label} " + (f"layer {u.layer}" if u.layer is not None else "+".join(u.components))
        unsharded = sum(p[2] for p in ps)
        root = u.layer is None
        if fsdp_ranks and not root:
            # pre_backward (_fsdp_param_group.py pre_backward): the unit's all-gather output (made by the
            # previous unit's prefetch, _backward_prefetch, or by the root's for the first layer), copied out into
            # its unsharded parameters (wait_for_unshard, foreach_all_gather_copy_out), the output freed at once
            # in backward; then the next layer unit's all-gather prefetched, held until its own wait
            if not seq.live_(("fsdp_ag", k)):
                seq.alloc(("fsdp_ag", k), padded(unsharded), f"{ulabel}: FSDP all-gather output")
            seq.alloc(("fsdp_params", k), unsharded, f"{ulabel}: FSDP unsharded parameters")
            seq.free(("fsdp_ag", k), f"{ulabel}: FSDP all-gather output freed after its copy-out")
            nxt = units[j + 1] if j + 1 < len(units) else None
            if nxt is not None and nxt[1].layer is not None:
                seq.alloc(("fsdp_ag", nxt[0]), padded(sum(p[2] for p in nxt[2])),
                          f"{ulabel}: FSDP all-gather output of the next unit (backward prefetch)")
        layer = u.layer
        for owner, i, full in ps:    # one .grad per parameter (AccumulateGrad), accumulated across micro-batches
            if fsdp_ranks:      # autograd's unsharded gradients
                key = ("fsdp_grad", owner, layer, i)
                if not seq.live_(key):
                    seq.alloc(key, full, f"{ulabel} weight grad {owner} (unsharded)")
            else:
                key = ("grad", owner, layer, i)
                if not seq.live_(key):
                    seq.alloc(key, full, f"{ulabel} weight grad {owner}")
                    # the optimizer visits the parameters in the module's order: the layers up, each's reversed
                    grad_keys[owner].append((key, full * 4 // trainable_width[owner], (-1 if layer is None else layer, -i)))
        if u.workspace_bytes:
            seq.alloc((n.id, "bwd_ws", k), u.workspace_bytes, f"{ulabel} backward workspace")
            seq.free((n.id, "bwd_ws", k), f"{ulabel} backward workspace")
        for j in reversed(range(len(_unit_saved(u)))):   # autograd frees them as each op's backward ends
            seq.free(("saved", n.id, k, j), f"{ulabel} releases its saved tensors")
        if fsdp_ranks:
            # post_backward (_fsdp_param_group.py post_backward): reshard (the unit's unsharded parameters freed;
            # the root's too: it was kept from the forward), the previous unit's reduce-scatter input released
            # (reduce_scatter_max_input_buffers = 1), a reduce-scatter input made and the unsharded gradients
            # copied in and dropped, and the 1/M output, which becomes the sharded gradient
            # (_fsdp_collectives.py foreach_reduce); the input is held until the next post_backward or the end
            seq.free(("fsdp_root",) if root else ("fsdp_params", k), f"{ulabel}: FSDP reshard")
            if not last_iter:
                continue
            seq.free(("fsdp_rs_input",), f"{ulabel}: FSDP previous reduce-scatter input released")
            seq.alloc(("fsdp_rs_input",), padded(unsharded), f"{ulabel}: FSDP reduce-scatter input")
            for owner, i, _ in ps:
                seq.free(("fsdp_grad", owner, layer, i), f"{ulabel}: unsharded gradients copied into the reduce-scatter")
            for owner, mine in shards(u, ps):
                key = ("grad", owner, layer)
                seq.alloc(key, mine, f"{ulabel} weight grad {owner} (1/{fsdp_ranks} shard)")
                grad_keys[owner].append((key, mine * 4 // trainable_width[owner], (-1 if layer is None else layer,)))


# --plot and --memory-snapshot draw every allocation event of a device, each written out (a Folded replay's
# skipped repetitions too): their time and memory grow with the events, 3.9 s for qwen27b at 512 layers (about
# 220,000 events per device) and 7.3 s at 2,000. They refuse a device with more than MAX_DRAWN_EVENTS events
# (qwen27b: about 2,400 layers, 10 s), where check alone answers in a second.
MAX_DRAWN_EVENTS = 1_000_000


def event_count(events: list) -> int:
    """How many events an event list with Repeat markers stands for."""
    return sum(ev.times * ev.length if type(ev) is Repeat else 1 for ev in events)


def drawable(typed: Typed, flag: str) -> None:
    """Refuse to draw (--plot, --memory-snapshot) a device with more events than MAX_DRAWN_EVENTS."""
    from ..errors import GraphError, Location, Problem

    for name in typed.ctx.spec.devices:
        n = event_count(folded_events(typed, name)[0])
        if n > MAX_DRAWN_EVENTS:
            raise GraphError(Problem(
                f"{flag} draws every allocation, and device {name} makes {n:,} of them in the simulated steps, over "
                f"the bound of {MAX_DRAWN_EVENTS:,} for drawing", Location(flag=flag),
                hint="check answers without it; to draw, check a shallower copy (--set "
                     "models.NAME.config.num_hidden_layers=...): its layers repeat the same way"))


def _repetition(events: list, j: int, rounded: bool = False) -> tuple[list, int, bool]:
    """The Repeat marker at events[j]: its repetition's events, the live bytes each repetition adds (block sizes
    rounded like the CUDA allocator's with `rounded`), and whether it only allocates. A layer's repetition adds
    nothing (NOTE [Layer folding]); the layers' weights only allocate."""
    rep = events[j - events[j].length:j]
    delta = sum((round_size(e.size) if rounded and e.size else e.size) * (1 if e.op == "alloc" else -1) for e in rep)
    return rep, delta, all(e.op == "alloc" for e in rep)


def _label_at(events: list, i: int) -> str:
    """The label of event i of an event list with Repeat markers, counting every event they stand for ("" past
    the end, or for i < 0)."""
    if i < 0:
        return ""
    x = 0
    for j, ev in enumerate(events):
        if type(ev) is Repeat:
            n = ev.times * ev.length
            if i < x + n:
                k, r = divmod(i - x, ev.length)
                return ev.label(k + 1, r)
            x += n
        else:
            if x == i:
                return ev.label
            x += 1
    return ""


@attrs.frozen
class _NoCacheOom:
    label: str
    requested_bytes: int
    free_bytes: int
    reserved_bytes: int
    allocated_bytes: int


@attrs.frozen
class _NoCacheResult:
    allocated_peak: int
    reserved_peak: int
    allocated_peak_index: int
    reserved_peak_index: int
    oom: _NoCacheOom | None
    timeline: Sequence[tuple[int, int]]


def _no_cache(events: list, usable: int) -> _NoCacheResult:
    """A CPU device's replay: live bytes only (the system allocator caches nothing). A Repeat marker's
    repetitions of a layer each add nothing (NOTE [Layer folding]: the tensors alive after one are those before,
    shifted), so each sees what the first saw: its timeline is the first's, as a run, and no new peak or OOM.
    Repetitions that only allocate (the layers' weights) each add the same bytes: the timeline rises by them from
    one to the next, the peak is at the last one's end, and the first allocation that does not fit is found in
    closed form."""
    live = peak = 0
    peak_i = -1
    oom = None
    timeline: list = []
    runs: list = []
    i = 0
    for j, ev in enumerate(events):
        if type(ev) is Repeat:
            rep, delta, allocs_only = _repetition(events, j)
            if delta and not allocs_only:
                return _no_cache(expand_events(events), usable)
            if delta and oom is None:       # only allocations: the first that does not fit, in closed form
                live0 = live - delta        # at the start of the written repetition (0)
                best = None
                pre = 0
                for r, e in enumerate(rep):
                    # repetition k (1..times) starts at live0 + k * delta; e does not fit when that + pre + size
                    # passes usable
                    k = max(1, -(-(usable - live0 - pre - e.size + 1) // delta))
                    if k <= ev.times and (best is None or (k, r) < best[:2]):
                        best = (k, r, live0 + k * delta + pre)
                    pre += e.size
                if best is not None:
                    k, r, at = best
                    oom = _NoCacheOom(ev.label(k, r), rep[r].size, usable - at, at, at)
            runs.append((timeline[:len(timeline) - ev.length], 1))
            runs.append((timeline[len(timeline) - ev.length:], ev.times + 1, (delta, delta) if delta else None))
            timeline = []
            if delta:       # the live bytes rise through every repetition: the peak is at the last one's end
                live += ev.times * delta
                last = max(r for r, e in enumerate(rep) if e.size > 0)
                if live > peak:
                    peak, peak_i = live, i + (ev.times - 1) * ev.length + last
            i += ev.times * ev.length
            continue
        if ev.op == "alloc" and oom is None and live + ev.size > usable:
            oom = _NoCacheOom(ev.label, ev.size, usable - live, live, live)
        live += ev.size if ev.op == "alloc" else -ev.size
        if live > peak:
            peak, peak_i = live, i
        timeline.append((live, live))
        i += 1
    return _NoCacheResult(peak, peak, peak_i, peak_i, oom, Folded(runs + [(timeline, 1)]) if runs else tuple(timeline))


def outside_bytes(typed: Typed, device: str) -> int:
    """What lies outside PyTorch's allocator on a device: its declared outside_allocator, plus NCCL's buffers for
    each peer rank under torchrun (analysis/launch.py). The one definition every verdict uses."""
    return typed.ctx.spec.devices[device].outside_allocator + nccl_outside_bytes(typed)[device]


def usable_bytes(typed: Typed, device: str) -> int:
    return max(typed.ctx.spec.devices[device].capacity - outside_bytes(typed, device), 0)


def _charged_to(label: str) -> str:
    """The node an event's bytes count toward in a device's node peaks: its label's node, or "backward" for what a
    node's backward allocates (its weight and activation gradients, "<node>/backward ..."), as the live tracker
    charges them (exec/interpreter.py): a node's peak is its forward's, which the tracker measures."""
    node, _, what = label.partition("/")
    return "backward" if what.startswith("backward") else node


def analyze_memory(typed: Typed, allocator: AllocatorConfig | None = None) -> MemoryReport:
    spec = typed.ctx.spec
    if allocator is None:
        allocator = AllocatorConfig(expandable_segments=spec.memory.expandable_segments,
                                    max_split_size_bytes=spec.memory.max_split_size)
    devices = {}
    for name, dev in spec.devices.items():
        events, resident = folded_events(typed, name)
        outside = outside_bytes(typed, name)     # with NCCL's p2p buffers under torchrun (analysis/launch.py)
        usable = usable_bytes(typed, name)
        skey = ("sim", _signature(typed, name), usable, dev.torch.startswith("cuda"), allocator)
        if skey in typed.cache:
            devices[name] = attrs.evolve(typed.cache[skey], name=name, torch=dev.torch,
                                         oom=attrs.evolve(typed.cache[skey].oom, device=name) if typed.cache[skey].oom else None)
            continue
        if dev.torch.startswith("cuda"):
            # The verdict replays the sequence against the usable capacity; the peaks come from that replay when
            # the device fits, and from an unbounded replay when it does not (what the schedule would need).
            sim, need = simulate_pair(events, usable, allocator)
            if need is not None:
                sim = attrs.evolve(need, oom=sim.oom)
        else:
            sim = _no_cache(events, usable)   # CPU tensors come from the system allocator: nothing is cached
        # live (unrounded) bytes and each node's own peak
        live = peak_live = 0
        node_peaks: dict[str, int] = {}
        peak_label = ""
        for j, ev in enumerate(events):
            if type(ev) is Repeat:
                # every repetition of a layer starts with the live bytes the first did (NOTE [Layer folding]) and
                # makes the same curve: no new peak; one that only allocates (the layers' weights) rises through
                # them all: the last one's end is the highest
                rep, delta, allocs_only = _repetition(events, j)
                if delta and not allocs_only:
                    raise AssertionError(f"{name}: a folded repetition both frees and changes the live bytes")
                if delta:
                    live += (ev.times - 1) * delta
                    for i, e in enumerate(rep):
                        live += e.size
                        node = _charged_to(e.label)
                        if live > node_peaks.get(node, -1):
                            node_peaks[node] = live
                        if live > peak_live:
                            peak_live, peak_label = live, ev.label(ev.times, i)
                continue
            if ev.op == "alloc":
                live += ev.size
                node = _charged_to(ev.label)
                if live > node_peaks.get(node, -1):
                    node_peaks[node] = live
                if live > peak_live:
                    peak_live, peak_label = live, ev.label
            else:
                live -= ev.size

        def at(i: int) -> str:
            return _label_at(events, i).split("/")[0]

        oom = None
        if sim.oom is not None:
            o = sim.oom
            node, _, what = o.label.partition("/")
            oom = Oom(name, node, what, o.requested_bytes, o.free_bytes, dev.capacity, o.reserved_bytes,
                      o.allocated_bytes, outside)
        devices[name] = DeviceMemory(
            name=name, torch=dev.torch, capacity_bytes=dev.capacity, usable_bytes=usable,
            weight_bytes=resident["weights"], optimizer_bytes=resident["optimizer"],
            peak_bytes=sim.allocated_peak, live_peak_bytes=peak_live, peak_node=peak_label.split("/")[0],
            reserved_peak_bytes=sim.reserved_peak, reserved_peak_node=at(sim.reserved_peak_index),
            node_peaks=node_peaks, oom=oom, timeline=sim.timeline)
        typed.cache[skey] = devices[name]
    cpus = tuple(n for n, d in spec.devices.items() if is_cpu(d.torch))
    host = None
    if cpus:
        avail, source = host_memory_bytes(spec)
        host = HostMemory(cpus, sum(devices[n].reserved_peak_bytes for n in cpus), avail, source)
    return MemoryReport(devices, allocator, host)


# NOTE [Live curve]: pricing a rewrite candidate (NOTE [Rewrite pricing]) by replaying each device's whole
# allocation sequence costs time linear in the graph for every candidate. The sequence of one step
# (_device_events, one step, compressed programs) is, per device: the load phase; then per iteration the
# forward, one block per node of the graph in order (_forward_node: its program, and the frees of the inputs it
# reads last), then a tail (the backward, the iteration's end, and after the last one the optimizer). A block
# is summarised by (delta, rise): the live bytes it adds, and the most it rises above its start (at least 0).
# The peak is then max(load rise, over each iteration i: base_i + max_k(P_k + rise_k), base_i + P + tail rise_i)
# with P_k the forward's deltas before block k, P their sum and base_i the live bytes at the start of iteration
# i. A _Curve keeps these per device, measured by the full replay (_CurveSeq; only used when every iteration's
# forward gives each node the same block, as it does when no tensor outlives its iteration).
# A rewrite changes the blocks of: the nodes inferred again (analysis/infer: `_reinferred`) and those it added
# or rewired; the last reader of a tensor whose readers it changed, or whose producer it inferred again (that
# reader frees it, with its size), before and after; and the producer of a tensor whose readers it changed (an
# unread output is freed at once). Those blocks are computed again by _forward_node with the state they see
# (the tensors they read and their sizes, whether they read them last, whether autograd saved them): the other
# blocks, the load and the tails are the same, when
#   - no node it changes, and none of those recomputed, is on autograd's path (grad_nodes, the same set before
#     and after), reads hooked layers or makes layers a hook node reads, is a sink with outputs, or is on a group
#     (the replica count); a node that uses model components leaves the device's load signature;
#   - the graph kept its order (not resorted) and the device still hosts (or still does not) a node of its own.
# A transfer with a queue keeps q - 1 more buffers from the load on: a rewrite that removes, makes or re-infers
# one moves the load's bytes by theirs (the load only allocates, so its rise is its delta and both move alike;
# a fuzzed graph of 400 queued transfers, each removed as unread, took 12.8 CPU s when each was a full replay).
# Otherwise (and for the first graph) the device is replayed in full. The peak, and where the live bytes first
# pass a bound (for rejection certificates), are read off the curve: the same answer as the replay. The blocks
# sit in a persistent tree keyed by the nodes' order keys (analysis/curve_tree.py, NOTE [Curve tree]) that keeps
# P and max_k(P_k + rise_k) at its root, and the tensors' sizes in a persistent map (immutables.Map): a
# candidate's curve is a new version sharing its parent's, built in O(changed · log N) (before, a copy of both
# tables and one sum and one max over every node: O(N) per candidate and device);
# tests/test_rewrite_properties.py checks that pricing with and without curves applies the same rewrites on
# random graphs, and rewrite(verify=True) compares every priced candidate with a full replay.

class _Curve(NamedTuple):
    load: tuple[int, int]                   # (delta, rise) of the load phase
    fwd: Any                                # curve_tree of (order key, node id, delta, rise) of each node's
                                            # forward block, every iteration (NOTE [Curve tree])
    tails: tuple[tuple[int, int], ...]      # per iteration: (delta, rise) of its backward and end
    grads: tuple[int, ...]                  # weight-gradient bytes live at the start of each iteration
    refsize: Any                            # immutables.Map: Ref -> the bytes allocated for it on the device
                                            # (persistent: a candidate's curve shares it, NOTE [Curve tree])
    direct: int                             # nodes placed on the device itself
    owners: dict                            # model component -> how many of the device's nodes use it
    count: int                              # nodes on the device (placed on it or on a group with it)
    saved: frozenset                        # the tensors autograd keeps for a backward on the device: those a
                                            # node on autograd's path there reads on a port its cost saves. A
                                            # rewrite priced off the curve changes no such node (_rewrite_delta),
                                            # so the set is handed on, and a tensor's readers are not scanned


class _CurveSeq(_PeakSeq):
    """A _PeakSeq that also measures each block of the sequence (NOTE [Live curve])."""

    def __init__(self, rounded: bool, limit: int | None = None):
        super().__init__(rounded, limit)
        self._at: str | None = ""
        self._phase: Any = "load"
        self._b0 = self._bmax = 0
        self.load: tuple[int, int] | None = None
        self.fwd: dict[str, tuple[int, int]] = {}
        self.tails: list[tuple[int, int]] = []
        self.same = True
        self.refsize: dict[Ref, int] = {}

    @property
    def at(self) -> str | None:
        return self._at

    @at.setter
    def at(self, value: str | None) -> None:
        self._close()
        self._at = value
        self._phase = ("tail",) if value is None else value

    def start(self, it: int) -> None:
        self._close()
        super().start(it)

    def alloc(self, key: Any, size: int, label: str = "") -> None:
        if size <= 0:
            return
        super().alloc(key, size, label)
        if self.live > self._bmax:
            self._bmax = self.live
        if type(key) is Ref:
            self.refsize[key] = self.sizes[key]

    def _close(self) -> None:
        block = (self.live - self._b0, self._bmax - self._b0)
        ph = self._phase
        if ph == "load":
            self.load = block
        elif ph == ("tail",):
            self.tails.append(block)
        elif ph is not None:
            if self.it == 0:
                self.fwd[ph] = block
            elif self.fwd.get(ph) != block:
                self.same = False
        self._b0 = self._bmax = self.live
        self._phase = None

    def curve(self, typed: Typed, device: str) -> _Curve | None:
        self._close()
        if not self.same or self.load is None or len(self.tails) != len(self.starts):
            return None
        fwd, key = self.fwd, typed.graph._key
        blocks = curve_tree.build((key[n.id], n.id, *fwd[n.id]) for n in typed.graph.nodes)
        return _Curve(self.load, blocks, tuple(self.tails), tuple(g for _, g in self.starts),
                      immutables.Map(self.refsize), sum(1 for n in typed.graph.nodes if n.device == device),
                      _device_owners(typed, device), _on(typed, typed.graph.nodes, device), _saved(typed, device))


class _BlockSeq(_PeakSeq):
    """One node's forward block, from live 0 (NOTE [Live curve])."""

    def __init__(self, rounded: bool):
        super().__init__(rounded)
        self.made: dict[Ref, int] = {}

    def alloc(self, key: Any, size: int, label: str = "") -> None:
        if size <= 0:
            return
        super().alloc(key, size, label)
        if type(key) is Ref:
            self.made[key] = self.sizes[key]


class _Delta(NamedTuple):
    gone: list                # nodes of the old graph not in the new one (as objects)
    made: list                # nodes of the new graph not in the old one
    dirty: frozenset          # ids of the new graph's nodes whose forward blocks change
    comps: bool               # a changed node uses model components (check the load signature)
    moved: frozenset | None   # kept nodes with another order key; None: the keys may all differ (not patched)
    queues: tuple = ()        # (sign, typed, node): transfers whose queue buffers the load loses (-1) or gains


def _frozen_grads(typed: Typed) -> frozenset:
    grad_nodes(typed)
    return typed.cache["_grad_nodes"]


def _rewrite_delta(prev: Typed, typed: Typed) -> _Delta | None:
    """What the rewrite prev -> typed changes, device by device the same (NOTE [Live curve]); None where the
    curve cannot be updated."""
    again = typed.cache.get("_reinferred")
    if prev.ctx is not typed.ctx or again is None or replicas(prev) != replicas(typed):
        return None
    g0, g1 = prev.graph, typed.graph
    b0, b1 = g0._by_id, g1._by_id
    ch = g1._change if g1.parent() is g0 else None
    if ch is None:
        # sorting again can change the order of the nodes it kept: which node reads a tensor last, then
        reordered = g1.resorted and [n.id for n in g0.nodes if n.id in b1] != [n.id for n in g1.nodes if n.id in b0]
        gone = [n for n in g0.nodes if b1.get(n.id) is not n]
        made = [n for n in g1.nodes if b0.get(n.id) is not n]
    else:      # what Graph.replace changed (NOTE [Incremental replace]): no pass over the graph
        reordered, gone, made = ch.reordered, list(ch.gone), list(ch.made)
    moved = None if ch is None else ch.moved
    # autograd's path is the same when the rewrite removes none of its nodes and makes none (no seed, nothing
    # reading it): every node it kept reads what it read, of the same kind
    grads = _frozen_grads(prev)
    if any(n.id in grads for n in gone) or \
            any(grad_seed(typed, n) or any(r.node in grads for _, r in n.inputs) for n in made):
        return None
    if "_grad_nodes" not in typed.cache:
        typed.cache["_grad_nodes"] = grads
    read = set()
    for n in gone:
        read.update(r for _, r in n.inputs)
    for n in made:
        read.update(r for _, r in n.inputs)
    # a node inferred again to the same outputs and params (a hook node always is) keeps its block
    p0, p1 = prev.params, typed.params
    again = {nid for nid in again if nid not in b0 or b0[nid] is not b1[nid] or p0.get(nid) != p1[nid]
             or prev.outputs_of(nid) != typed.outputs_of(nid)}
    for nid in again:
        read.update(Ref(nid, k) for k in typed.outputs_of(nid))
    dirty = again | {n.id for n in made}
    c0, c1 = g0._consumers, g1._consumers
    if reordered:
        if ch is None:
            read.update(r for r, readers in c1.items() if c0.get(r, ((None, None),))[-1][0] != readers[-1][0])
        else:        # only what a node sorted again reads can have another last reader
            read.update(r for i in ch.window for _, r in b1[i].inputs
                        if c0.get(r, ((None, None),))[-1][0] != c1[r][-1][0])
    for r in read:
        readers0, readers1 = c0.get(r), c1.get(r)
        if readers0:
            dirty.add(readers0[-1][0])
        if readers1:
            dirty.add(readers1[-1][0])
        if (not readers0) != (not readers1):
            dirty.add(r.node)         # an output nobody reads now, or read now (its producer frees it at once)
    dirty = {i for i in dirty if i in b1}
    h0, h1 = prev._handles(), typed._handles()
    comps = False
    queues: list = []
    for t, nodes, sign in ((prev, gone, -1), (typed, made, 1), (typed, [b1[i] for i in dirty], 0)):
        for n in nodes:
            op = registry.get(n.op)
            outs = t.outputs_of(n.id)
            # (a forward whose taps no hook node reads allocates no hooked layer: its block is its own)
            if n.id in grads or ("taps" in outs and hook_refs(t, n.id)) or any(r in h0 or r in h1 for _, r in n.inputs) \
                    or (op.traits.sink and outs):
                return None
            if op.traits.movement:
                # a queued transfer's buffers are in the load (NOTE [Live curve]): those it had go, those it has come
                if sign == 0:       # kept as it was, inferred again (a replaced node is in gone and made)
                    if b0.get(n.id) is n and int(t.params[n.id].get("queue", 1)) > 1:
                        queues.append((-1, prev, n))
                        queues.append((1, t, n))
                elif int(t.params[n.id].get("queue", 1)) > 1:
                    queues.append((sign, t, n))
            if sign and n.model and op.components:
                comps = True
    return _Delta(gone, made, frozenset(dirty), comps, moved, tuple(queues))


def _owners(typed: Typed, n: Node) -> set[str]:
    """The model components (their owners) whose weights a node uses."""
    op = registry.get(n.op)
    if not (n.model and op.components):
        return set()
    m = typed.ctx.models[n.model]
    return {m.component_owner(c) for c in op.components}


def _device_owners(typed: Typed, device: str) -> dict[str, int]:
    """How many of a device's nodes use each model component (its load: component_bytes)."""
    from collections import Counter

    out: Counter = Counter()
    for n in typed.graph.nodes:
        if device in typed.ctx.devices_of(n.device):
            out.update(_owners(typed, n))
    return dict(out)


def _curve_price(old: _Curve, delta: _Delta, prev: Typed, typed: Typed, device: str, cuda: bool,
                 limit: int | None) -> tuple[int | None, Any] | None:
    """(peak, curve) of a device after the rewrite prev -> typed, or (None, where the live bytes pass `limit`:
    live_peaks' `_over`), from the curve before (NOTE [Live curve]); None where a full replay is needed."""
    ctx = typed.ctx
    direct = old.direct - sum(1 for n in delta.gone if n.device == device) + \
        sum(1 for n in delta.made if n.device == device)
    if (direct > 0) != (old.direct > 0):
        return None
    owners = old.owners
    if delta.comps:        # the load is the same while the device uses the same components
        owners = dict(owners)
        for t, nodes, sign in ((prev, delta.gone, -1), (typed, delta.made, 1)):
            for n in nodes:
                if device in ctx.devices_of(n.device):
                    for o in _owners(t, n):
                        owners[o] = owners.get(o, 0) + sign
        owners = {o: c for o, c in owners.items() if c}
        if owners.keys() != old.owners.keys():
            return None
    load = old.load
    if delta.queues:    # the load only allocates: its rise is its delta, and both move by the queue bytes
        dq = 0
        for sign, t, n in delta.queues:
            if device in ctx.devices_of(n.device):
                size = t.types[Ref(n.id, "out")].nbytes
                if size > 0:
                    dq += sign * (int(t.params[n.id].get("queue", 1)) - 1) * (round_size(size) if cuda else size)
        if load[0] != load[1]:
            return None
        load = (load[0] + dq, load[1] + dq)
    g0, g1 = prev.graph, typed.graph
    c1 = g1._consumers
    k0, k1 = g0._key, g1._key
    # the blocks: a new version of the tree (NOTE [Curve tree]), O(changed · log N), sharing the rest; the
    # removed nodes and those with another key leave first (a made node can take a removed one's key)
    fwd = old.fwd
    if delta.moved is None:     # the graph was rebuilt, not patched: its keys can all differ (one pass)
        blocks = {nid: (d, r) for _, nid, d, r in curve_tree.items(fwd)}
        fwd = None
    else:
        blocks = None
        made = {n.id for n in delta.made}
        for n in delta.gone:
            if n.id not in made or k0[n.id] != k1[n.id]:    # (a node rewired in place is assigned below)
                fwd = curve_tree.delete(fwd, k0[n.id])
        gone = {n.id for n in delta.gone}
        # every old key leaves before a new one is set: a node sorted again can take another's old key
        keep = []
        for i in delta.moved:
            if i in gone:
                continue        # a rewired node: its old self left, its new self is made (and dirty)
            if i not in delta.dirty:
                b = curve_tree.get(fwd, k0[i])
                keep.append((k1[i], i, b.delta, b.rise))
            fwd = curve_tree.delete(fwd, k0[i])
        for k, i, d, r in keep:
            fwd = curve_tree.assign(fwd, k, i, d, r)
    refsize = old.refsize.mutate()
    for n in delta.gone:
        for k in prev.outputs_of(n.id):
            refsize.pop(Ref(n.id, k), None)
    dirty = delta.dirty
    for nid in dirty:
        if nid in g0:
            for k in prev.outputs_of(nid):
                refsize.pop(Ref(nid, k), None)
    grads = _frozen_grads(typed)
    kept = old.saved
    for n in sorted((g1[i] for i in dirty), key=lambda n: k1[n.id]):
        here = device in ctx.devices_of(n.device)
        if not here and not any(r in refsize for _, r in n.inputs):
            # a node elsewhere that reads nothing allocated here: an empty block (_forward_node frees nothing)
            if blocks is None:
                b = curve_tree.get(fwd, k1[n.id])
                if b is None or b.delta or b.rise or b.nid != n.id:
                    fwd = curve_tree.assign(fwd, k1[n.id], n.id, 0, 0)
            else:
                blocks[n.id] = (0, 0)
            continue
        seq = _BlockSeq(cuda)
        left: dict[Ref, int] = {}
        for _, r in n.inputs:
            left[r] = left.get(r, 0) + 1
            if r in refsize:
                seq.sizes[r] = refsize[r]
        saved: dict[Ref, int] = {}
        for r in left:
            readers = c1[r]
            if readers[-1][0] != n.id:
                left[r] += 1                  # a later node reads it last
            elif r in kept:
                saved[r] = 1                  # autograd keeps it for the backward
        if here:
            for k in typed.outputs_of(n.id):
                left[Ref(n.id, k)] = len(c1.get(Ref(n.id, k), ()))
            cost = _cached_cost(typed, n, False)
        else:
            cost = NodeCost()
        _forward_node(seq, typed, n, here, cost, left, saved, grads, True, _no_desc)
        if blocks is None:
            # most recomputed blocks come out as they were (on the other devices, a node elsewhere): a look-up
            # then, no new path (at 1,000 nodes: 4 in 5 of them)
            b = curve_tree.get(fwd, k1[n.id])
            if b is None or b.delta != seq.live or b.rise != seq.peak or b.nid != n.id:
                fwd = curve_tree.assign(fwd, k1[n.id], n.id, seq.live, seq.peak)
        else:
            blocks[n.id] = (seq.live, seq.peak)
        for r, size in seq.made.items():
            refsize[r] = size
    refsize = refsize.finish()
    if blocks is not None:
        fwd = curve_tree.build((k1[n.id], n.id, *blocks[n.id]) for n in g1.nodes)
    # P and max_k(P_k + rise_k) at the root, the first block over a bound a descent (NOTE [Curve tree])
    top = curve_tree.top(fwd)
    total = curve_tree.total(fwd)
    peak = load[1]
    base = load[0]
    if limit is not None and peak > limit:
        return None, (device, "", -1, None, None)
    starts: list[tuple[int, int]] = []
    for it, (tail_delta, tail_rise) in enumerate(old.tails):
        starts.append((base, old.grads[it]))
        if limit is not None and base + top > limit:
            return None, (device, curve_tree.first_over(fwd, limit - base).nid, it, starts[0], starts[-1])
        if limit is not None and base + total + tail_rise > limit:
            return None, (device, None, it, starts[0], starts[-1])
        peak = max(peak, base + top, base + total + tail_rise)
        base += total + tail_delta
    return peak, _Curve(load, fwd, old.tails, old.grads, refsize, direct, owners,
                        old.count + _on(typed, delta.made, device) - _on(prev, delta.gone, device), kept)


def _saved(typed: Typed, device: str) -> frozenset:
    """The tensors autograd keeps for the backward on `device` (_Curve.saved)."""
    grads, g = _frozen_grads(typed), typed.graph
    return frozenset(r for c in grads if c in g and device in typed.ctx.devices_of(g[c].device)
                     for p, r in g[c].inputs if p in _cached_cost(typed, g[c], True).saved_inputs)


def _on(typed: Typed, nodes, device: str) -> int:
    return sum(1 for n in nodes if device in typed.ctx.devices_of(n.device))


def _flops(typed: Typed, prev: Typed | None) -> dict[str, int]:
    """FLOPs of one step per device, in the order devices first appear; given `prev`, the graph `typed` was
    rewritten from with the same autograd path (_rewrite_delta), as prev's less the nodes the rewrite removed or
    inferred again plus those it made or inferred again."""
    ctx = typed.ctx
    grads = _frozen_grads(typed)
    old = prev.cache.get("_flops") if prev is not None else None
    if old is None:
        flops: dict[str, int] = {}
        for n in typed.graph.nodes:
            f = _cached_cost(typed, n, n.id in grads).flops
            for d in ctx.devices_of(n.device):
                flops[d] = flops.get(d, 0) + f
    else:
        g0, g1 = prev.graph, typed.graph
        b0, b1 = g0._by_id, g1._by_id
        again = typed.cache["_reinferred"]
        ch = g1._change if g1.parent() is g0 else None
        if ch is None:
            out = {n.id for n in g0.nodes if b1.get(n.id) is not n} | {i for i in again if i in b0}
            into = {n.id for n in g1.nodes if b0.get(n.id) is not n} | again
        else:
            out = {n.id for n in ch.gone} | {i for i in again if i in b0}
            into = {n.id for n in ch.made} | again
        acc = dict(old)
        for t, ids, sign in ((prev, out, -1), (typed, into, 1)):
            for nid in ids:
                n = t.graph[nid]
                f = _cached_cost(t, n, nid in grads).flops * sign
                for d in ctx.devices_of(n.device):
                    acc[d] = acc.get(d, 0) + f
        flops = {d: acc[d] for d in _device_order(prev, typed, ch)}
    typed.cache["_flops"] = flops
    return dict(flops)


def _device_order(prev: Typed, typed: Typed, ch) -> dict:
    """The physical devices in the order their placements first appear in the graph. Given what the rewrite
    prev -> typed changed, prev's order while the rewrite removed, made and moved no node at or before the
    first of its placement's nodes; else a pass."""
    g1 = typed.graph
    firsts = prev.cache.get("_first_placed") if ch is not None else None
    if firsts is not None:
        k0, k1 = prev.graph._key, g1._key
        for n in ch.gone:
            if firsts.get(n.device) == n.id:
                firsts = None
                break
        else:
            for i in (*(n.id for n in ch.made), *ch.moved):
                p = g1[i].device
                f = firsts.get(p)
                if f is None or f == i or f not in k1 or k1[i] < k1[f] or k0.get(f) != k1[f]:
                    firsts = None
                    break
    if firsts is None:
        firsts = {}
        for n in g1.nodes:
            firsts.setdefault(n.device, n.id)
    typed.cache["_first_placed"] = firsts
    return dict.fromkeys(d for p in firsts for d in typed.ctx.devices_of(p))


def _no_desc(typed: Typed, ref: Ref) -> str:
    return ""


def live_peaks(typed: Typed, bound: Mapping[str, int] | None = None,
               prev: Typed | None = None) -> tuple[dict[str, int], dict[str, int]] | None:
    """Fast per-device (live peak bytes, FLOPs) of one step, without the allocator model: the rewrite driver's
    cost function. With `bound` (a peak per device), None as soon as one device's peak is seen to pass its
    bound: the rewrite driver rejects that candidate without replaying the rest (NOTE [Rewrite pricing]).
    With `prev`, the graph `typed` was rewritten from (and priced), each device's live curve is updated where
    the rewrite changed it instead of replayed, where it can be (NOTE [Live curve]): the same answer."""
    delta = _rewrite_delta(prev, typed) if prev is not None and "_curves" in prev.cache else None
    flops = _flops(typed, prev if delta is not None else None)
    keys, counts = {}, {}
    olds = prev.cache["_curves"] if delta is not None else {}
    for name in typed.ctx.spec.devices:
        cuda = typed.ctx.spec.devices[name].torch.startswith("cuda")
        if all(olds.get(d) is not None for d in typed.ctx.spec.devices):
            # (priced from the curves: a key per device, not the signature of its nodes, which takes a pass)
            keys[name] = ("live_peak_of", name, cuda)
            counts[name] = olds[name].count + _on(typed, delta.made, name) - _on(prev, delta.gone, name)
        else:
            keys[name] = ("live_peak", _signature(typed, name), cuda)
            counts[name] = len(keys[name][1])
    # under a bound the device with the most nodes goes first (it is where a rewrite's effect usually is, and
    # the first device over its bound ends the replay); the answer lists the devices in their written order
    order = sorted(keys, key=lambda d: -counts[d]) if bound is not None else list(keys)
    found = {}
    curves = typed.cache.setdefault("_curves", {})
    for name in order:
        key, cuda = keys[name], keys[name][2]
        if key not in typed.cache:
            # on CUDA every block is rounded (allocator.round_size): a rewrite that saves bytes but adds a
            # tensor can still raise the rounded total
            limit = None if bound is None else bound.get(name, 0)
            old = olds.get(name)
            priced = None
            if old is not None and delta is not None:
                priced = _curve_price(old, delta, prev, typed, name, cuda, limit)
            if priced is None:          # the full replay
                seq = _CurveSeq(cuda, limit)    # = events_peak(device_events(typed, name, 1, True)[0], cuda)
                # (the nodes it goes through: the rewrite driver's replay budget, rewrite/engine.py)
                typed.cache["_replayed_nodes"] = typed.cache.get("_replayed_nodes", 0) + counts[name]
                try:
                    _device_events(typed, name, 1, True, seq)
                except _OverLimit:
                    # the device, where its live bytes passed the bound, in which iteration, and the live and
                    # weight-gradient bytes at the start of the first iteration and of that one
                    typed.cache["_over"] = (name, seq.at, seq.it, seq.starts[0] if seq.starts else None,
                                            seq.starts[-1] if seq.starts else None)
                    return None
                priced = (seq.peak, seq.curve(typed, name))
            elif priced[0] is None:
                typed.cache["_over"] = priced[1]
                return None
            typed.cache[key] = priced[0]
            typed.cache[("live_curve", key)] = priced[1]
        curves[name] = typed.cache.get(("live_curve", key))
        found[name] = typed.cache[key]
        if bound is not None and found[name] > bound.get(name, 0):
            return None
    return {name: found[name] for name in keys}, flops


live_peaks.bounded = True      # the rewrite driver may pass `bound`
live_peaks.incremental = True  # ... and `prev` (NOTE [Live curve])


def load_signature(typed: Typed, device: str) -> tuple:
    """What a device's allocation sequence depends on beyond its nodes in order: the resident weights and
    training state (which components its nodes use, as counts of nodes, so that two graphs with the same
    signature keep it when the same nodes are removed from both), the transfer queue buffers, and gradient
    accumulation. How often a step runs the device's nodes (the replica count, and whether a node is placed on
    it directly) is the rewrite driver's to check. Its rejection certificates (rewrite/engine.py) hold while the
    signature is unchanged."""
    key = ("_load_signature", device)
    if key not in typed.cache:
        g, ctx = typed.graph, typed.ctx
        on = [n for n in g.nodes if device in ctx.devices_of(n.device)]
        comps = _device_owners(typed, device)
        queues = tuple((n.id, int(typed.params[n.id].get("queue", 1)), typed.types[Ref(n.id, "out")].nbytes)
                       for n in on if registry.get(n.op).traits.movement and int(typed.params[n.id].get("queue", 1)) > 1)
        typed.cache[key] = (tuple(sorted(comps.items())), queues, int(ctx.spec.train.get("grad_accum", 1) or 1))
    return typed.cache[key]


def events_peak(events, rounded: bool = False) -> int:
    """The most live bytes an allocation sequence reaches (block sizes rounded like the CUDA allocator's). A
    Repeat marker's repetitions that each add nothing (NOTE [Layer folding]) reach what the first reached."""
    live = peak = 0
    for j, ev in enumerate(events):
        if type(ev) is Repeat:
            _, delta, allocs_only = _repetition(events, j, rounded)
            if delta and not allocs_only:
                return events_peak(expand_events(events), rounded)
            live += ev.times * delta        # rising through every repetition, or back where it was
            peak = max(peak, live)
            continue
        size = round_size(ev.size) if rounded and ev.size else ev.size
        live += size if ev.op == "alloc" else -size
        peak = max(peak, live)
    return peak


def activation_peak(typed: Typed, device: str) -> int:
    """Peak live bytes of one step on a device above what is resident from the start (weights, training state,
    queue buffers): what a live-tensor tracker measures when the weights are external to it."""
    events, _ = device_events(typed, device, steps=1)
    resident = sum(ev.size for ev in events if ev.op == "alloc" and ev.label.startswith("load/"))
    return events_peak(events) - resident
