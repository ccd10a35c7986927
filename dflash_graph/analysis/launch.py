"""The torchrun launch of a graph, statically: which rank owns each device, which transfers cross ranks (and so
become send/recv), what distribution adds to each device's memory, and each device's busy time per step.

One rank per device by default, in the order of [devices]; `rank` on the devices declares another map. A node
placed on a group runs on the group's r-th device for replica r (`device_for`), exactly as the interpreter and the
memory model run it. No torch here: `check` uses this module, `exec/distributed.py` runs what it describes.

Busy time: each node's forward FLOPs come from its op's declared cost; a node that autograd records runs a
backward of twice its forward when it holds trainable weights (gradients of inputs and of weights) and of once
its forward otherwise (gradients of inputs only): the 2N + 4N FLOPs per parameter and token of Kaplan et al.
2020, section 2.1. Time is FLOPs over the device's declared `throughput`. Transfers and the optimizer step are
not counted (their FLOPs are not declared).

NOTE [Collective time]: a model declared `parallel` on M devices adds its collectives to each replica's busy
time, at [launch] intra_node_bandwidth (inter_node_bandwidth when the group spans nodes), for P bytes of its
trainable parameters in their dtype. A ring moves (M-1)/M x bytes per device per all-gather or reduce-scatter and
2(M-1)/M x bytes per all-reduce (Patarasuk and Yuan 2009; NCCL's bus bandwidth, nccl-tests doc/PERFORMANCE.md).
DDP: one all-reduce of the gradients per optimizer step (the accumulated micro-batches under no_sync), 2(M-1)/M x
P. FSDP2 with reshard_after_forward: per forward+backward of a replica, an all-gather of every unit's parameters
in forward, again in backward, and a reduce-scatter of their gradients, 3 (M-1)/M x P. Added to compute, not
overlapped with it: torch overlaps both with the backward, so this is an upper bound on their cost.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..models.registry import ARCHS
from ..ops import registry
from ..units import DTYPE_BYTES
from .infer import Typed
from .nodecost import grad_nodes, grad_seed, node_cost
from .parallel import data_parallel


@attrs.frozen
class CrossTransfer:
    node: str
    replica: int
    src_device: str
    dst_device: str
    src_rank: int
    dst_rank: int
    nbytes: int
    queue: int


@attrs.frozen
class DeviceLaunch:
    name: str
    rank: int
    peers: tuple[int, ...]            # other ranks this device sends to or receives from
    nccl_bytes: int                   # declared NCCL memory outside the allocator (CUDA devices with peers)
    receive_queue_bytes: int          # q receive buffers per incoming cross-rank transfer (what check counts)
    staging_bytes: int                # send/recv staging copies (0: every op returns contiguous tensors)
    flops: int                        # forward + backward FLOPs per optimizer step
    busy_seconds: float | None        # flops / throughput (+ collective_seconds); None without a throughput
    collective_bytes: int = 0         # a data-parallel replica's collectives per step, as the ring moves them
    collective_seconds: float = 0.0   # collective_bytes at the declared link bandwidth


@attrs.frozen
class Launch:
    world_size: int
    backend: str
    devices: Mapping[str, DeviceLaunch]
    transfers: tuple[CrossTransfer, ...]
    replicas: int

    def rank_devices(self, rank: int) -> list[str]:
        return [d for d, v in self.devices.items() if v.rank == rank]

    def rank_busy(self) -> dict[int, float | None]:
        out: dict[int, float | None] = {}
        for v in self.devices.values():
            if v.busy_seconds is None or out.get(v.rank, 0.0) is None:
                out[v.rank] = None
            else:
                out[v.rank] = out.get(v.rank, 0.0) + v.busy_seconds
        return out

    def bottleneck(self) -> tuple[list[int], float] | None:
        """The ranks that bound the step (busy within 1% of the busiest) and their busy seconds per step: with
        the queues deep enough, a step takes as long as its busiest rank."""
        busy = self.rank_busy()
        if not busy or any(b is None for b in busy.values()):
            return None
        top = max(busy.values())
        return sorted(k for k, b in busy.items() if b >= 0.99 * top), top


def replicas(typed: Typed) -> int:
    # asked per node and device by step_flops: computed once per typed graph (it was the square of the node count)
    if "_replicas" not in typed.cache:
        typed.cache["_replicas"] = max((len(typed.ctx.devices_of(n.device)) for n in typed.graph.nodes), default=1)
    return typed.cache["_replicas"]


def device_for(typed: Typed, placement: str, r: int) -> str:
    devs = typed.ctx.devices_of(placement)
    return devs[r % len(devs)]


def choose_backend(typed: Typed) -> str:
    spec = typed.ctx.spec
    if spec.launch.backend != "auto":
        return spec.launch.backend
    kinds = {d.torch.split(":")[0] for d in spec.devices.values()}
    return "nccl" if kinds == {"cuda"} else "gloo"


def cross_transfers(typed: Typed) -> tuple[CrossTransfer, ...]:
    """Every (transfer node, replica) whose sender and receiver are on different ranks, in the order the graph
    runs them: the order in which a sender sends and a receiver posts its receives."""
    spec, g = typed.ctx.spec, typed.graph
    out = []
    for r in range(replicas(typed)):
        for n in g.nodes:
            if not registry.get(n.op).traits.movement:
                continue
            (_, src_ref), = n.inputs
            src = device_for(typed, g[src_ref.node].device, r)
            dst = device_for(typed, n.device, r)
            if spec.rank_of(src) != spec.rank_of(dst):
                out.append(CrossTransfer(n.id, r, src, dst, spec.rank_of(src), spec.rank_of(dst),
                                         typed.types[src_ref].nbytes, int(typed.params[n.id].get("queue", 1))))
    return tuple(out)


def executions(typed: Typed, node_device: str, device: str) -> int:
    """How often per micro-batch a node placed on `node_device` runs on `device` (once per replica index r whose
    device it is)."""
    return sum(1 for r in range(replicas(typed)) if device_for(typed, node_device, r) == device)


def step_flops(typed: Typed) -> dict[str, int]:
    """Forward + backward FLOPs per optimizer step on each device (see the module docstring)."""
    grads = grad_nodes(typed)
    accum = int(typed.ctx.spec.train.get("grad_accum", 1) or 1)
    out = {d: 0 for d in typed.ctx.spec.devices}
    for n in typed.graph.nodes:
        grad = n.id in grads
        f = node_cost(typed, n, grad).flops
        if grad:
            f *= 3 if grad_seed(typed, n) else 2     # a seed holds trainable weights of its own
        for d in set(typed.ctx.devices_of(n.device)):
            out[d] += f * executions(typed, n.device, d) * accum
    return out


def analyze_launch(typed: Typed) -> Launch:
    spec = typed.ctx.spec
    transfers = cross_transfers(typed)
    peers: dict[str, set[int]] = {d: set() for d in spec.devices}
    queue: dict[str, int] = {d: 0 for d in spec.devices}
    seen: set[tuple[str, str]] = set()
    for t in transfers:
        peers[t.src_device].add(t.dst_rank)
        peers[t.dst_device].add(t.src_rank)
        if (t.node, t.dst_device) not in seen:          # one set of q buffers per transfer node and receiver
            seen.add((t.node, t.dst_device))
            queue[t.dst_device] += t.queue * t.nbytes
    flops = step_flops(typed)
    coll = collective_bytes(typed)
    dp = data_parallel(typed)
    if dp is not None and len(dp.devices) > 1:   # the replicas all-reduce or all-gather among themselves
        for dev in dp.devices:
            peers[dev] |= {spec.rank_of(o) for o in dp.devices if o != dev}
    devices = {}
    for name, d in spec.devices.items():
        cuda = d.torch.startswith("cuda")
        nccl = spec.launch.nccl_memory_per_peer * len(peers[name]) if cuda else 0
        secs = coll.get(name, 0) / link_bandwidth(typed) if coll.get(name) else 0.0
        devices[name] = DeviceLaunch(
            name=name, rank=spec.rank_of(name), peers=tuple(sorted(peers[name])), nccl_bytes=nccl,
            receive_queue_bytes=queue[name], staging_bytes=0, flops=flops[name],
            busy_seconds=flops[name] / d.throughput + secs if d.throughput else None,
            collective_bytes=coll.get(name, 0), collective_seconds=secs)
    return Launch(spec.world_size, choose_backend(typed), devices, transfers, replicas(typed))


def link_bandwidth(typed: Typed) -> float:
    """The bandwidth a data-parallel model's collectives run at: intra-node when its devices share a node."""
    spec, dp = typed.ctx.spec, data_parallel(typed)
    nodes = {spec.devices[d].node for d in dp.devices} if dp is not None else {0}
    return spec.launch.intra_node_bandwidth if len(nodes) == 1 else spec.launch.inter_node_bandwidth


def collective_bytes(typed: Typed) -> dict[str, int]:
    """Per device of a data-parallel model's group, the bytes each replica sends per optimizer step in its
    collectives over M replicas, for P bytes of trainable parameters (NOTE [Collective time])."""
    dp = data_parallel(typed)
    if dp is None or len(dp.devices) < 2:
        return {}
    m = len(dp.devices)
    info = typed.ctx.models[dp.model]
    comps = ARCHS[info.spec.arch].component_params(info.dims)
    p = sum(comps.get(c, 0) for c in comps if c not in info.spec.shares) * DTYPE_BYTES[info.spec.dtype]
    if dp.engine == "ddp":   # one all-reduce per step (no_sync over the accumulated micro-batches)
        per = 2 * (m - 1) * p // m
    else:                    # per forward+backward: all-gather (forward), all-gather (backward), reduce-scatter
        iters = int(typed.ctx.spec.train.get("grad_accum", 1) or 1) * replicas(typed) // m
        per = 3 * (m - 1) * p // m * iters
    return {d: per for d in dp.devices}


def nccl_outside_bytes(typed: Typed) -> dict[str, int]:
    """Per device, the NCCL memory the launch adds outside the allocator (used by the memory verdict)."""
    key = ("nccl_outside",)
    if key not in typed.cache:
        typed.cache[key] = {n: d.nccl_bytes for n, d in analyze_launch(typed).devices.items()}
    return typed.cache[key]
