"""What a run from the hidden-state cache holds in memory (`run --hidden-states DIR`, docs/offline.md).

NOTE [From-disk memory]: a run from the cache is the graph cut at its transfers (analysis/capture.find_cut). Only
the drafter side's devices exist: their prediction is check's, unchanged, because the cut's transfers' outputs
arrive on the drafter device as they do from a target rank (analysis/memory.py counts each transfer's output on
its receiving device, from the transfer node to its last reader), and the target parts the drafter side uses (the
embedding, final norm and lm_head its nodes read) are the drafter device's weights as they are online (the run
reads those three from the target's weights file: models/nn/target.build_target_heads). The target devices do
not exist, so they are not in the report nor in the verdict. The host gets one term more: the cache's loader.

The loader (train/hidden_cache.CacheSource) is a torch DataLoader whose item is one whole shard. With W > 0
workers and prefetch_factor P, torch keeps at most P * W items outstanding across the workers
(torch/utils/data/dataloader.py, _MultiProcessingDataLoaderIter: `_tasks_outstanding < _prefetch_factor *
_num_workers`; the DataLoader docs: "2 means there will be a total of 2 * num_workers batches prefetched across
all workers"); a worker reading a shard holds its file's bytes and the decoded tensors together (2 shards' worth
while it decodes); the training process holds the shard being consumed. So at most (P * W + W + 1) shards; with
W = 0 the training process reads itself: the shard being consumed, or a shard's bytes and its tensors while it
decodes one (2). A shard is counted at its size on disk (the tensors plus a small header).

Measured (tests/test_from_disk.py): on tiny the drafter device's live peak is check's to within 0.02%, the same
gap as online (tests/test_run.py); the shard the training process holds is what the live tracker charges to the
source (train/trainer.SOURCE_HOST), within the bound above. The workers' share (the prefetched shards in other
processes) is the DataLoader's documented bound, not measured by the tracker, which sees one process.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from .launch import Launch, analyze_launch, device_for
from .memory import HostMemory, MemoryReport, host_memory_bytes, is_cpu


@attrs.frozen
class LoaderMemory:
    """The host memory of the cache's loader: shards of `shard_bytes` (the cache's largest) in flight, in each of
    `readers` processes (under torchrun every drafter rank reads its own samples)."""
    shard_bytes: int
    workers: int
    prefetch: int
    readers: int = 1

    @property
    def shards(self) -> int:
        """NOTE [From-disk memory]: the most shards' worth the loader holds at once."""
        if self.workers == 0:
            return 2
        return self.prefetch * self.workers + self.workers + 1

    @property
    def bytes(self) -> int:
        return self.shards * self.shard_bytes * self.readers

    def text(self) -> str:
        from ..units import fmt_bytes

        how = ("read in the training process: a shard's bytes and its tensors while it decodes" if self.workers == 0
               else f"{self.workers} worker{'s' if self.workers > 1 else ''} x prefetch {self.prefetch}, a shard being decoded per worker, "
                    "and the one being consumed")
        each = f" in each of {self.readers} ranks" if self.readers > 1 else ""
        return f"{self.shards} shards of {fmt_bytes(self.shard_bytes)}{each} ({how})"


@attrs.frozen
class FromDiskMemory:
    """The drafter side's devices as check predicts them, and the host: its CPU devices' peaks and the loader."""
    memory: MemoryReport
    loader: LoaderMemory

    @property
    def fits(self) -> bool:
        return self.memory.fits


def from_disk_memory(memory: MemoryReport, spec, drafter_devices: Iterable[str],
                     loader: LoaderMemory) -> FromDiskMemory:
    """NOTE [From-disk memory]: `memory` (the whole graph's, as check predicts it) cut to the drafter side, with the
    loader's shards added to what the host must hold (also when every drafter device is a GPU)."""
    keep = set(drafter_devices)
    devices = {n: d for n, d in memory.devices.items() if n in keep}
    cpus = tuple(n for n, d in devices.items() if is_cpu(d.torch))
    avail, source = host_memory_bytes(spec)
    host = HostMemory(cpus, sum(devices[n].reserved_peak_bytes for n in cpus) + loader.bytes, avail, source)
    return FromDiskMemory(attrs.evolve(memory, devices=devices, host=host), loader)


def drafter_launch(typed, drafter_devices: Iterable[str]) -> Launch:
    """NOTE [From disk under torchrun]: the launch of a run from the cache: the drafter side's devices on ranks
    0..M-1 (their graph ranks in order), no cross-rank transfer, the graph's replicas. Raises GraphError when the
    drafter side itself sends between ranks."""
    from ..errors import GraphError, Problem
    from ..ops import registry

    spec, g = typed.ctx.spec, typed.graph
    full = analyze_launch(typed)
    side = [d for d in spec.devices if d in set(drafter_devices)]
    ranks = sorted({full.devices[d].rank for d in side})
    new = {old: k for k, old in enumerate(ranks)}
    for r in range(full.replicas):
        for n in g.nodes:
            if not registry.get(n.op).traits.movement:
                continue
            (_, src), = n.inputs
            a, b = device_for(typed, g[src.node].device, r), device_for(typed, n.device, r)
            if a in side and b in side and full.devices[a].rank != full.devices[b].rank:
                raise GraphError(Problem(
                    f"transfer '{n.id}' goes from {a} (rank {full.devices[a].rank}) to {b} (rank "
                    f"{full.devices[b].rank}) on the drafter side: a run from the hidden-state cache under torchrun "
                    "runs each drafter replica's side on one rank", typed.ctx.loc(n),
                    hint="give the drafter side's devices of one replica one rank (`rank` on the devices), or run "
                         "--hidden-states in one process"))
    devices = {d: attrs.evolve(full.devices[d], rank=new[full.devices[d].rank],
                               peers=tuple(sorted(new[p] for p in full.devices[d].peers if p in new)),
                               receive_queue_bytes=0)
               for d in side}
    return Launch(len(ranks), full.backend, devices, (), full.replicas)
