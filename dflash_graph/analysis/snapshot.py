"""The predicted run as a PyTorch memory snapshot (`check --memory-snapshot FILE.pickle`).

`torch.cuda.memory._snapshot()` returns a dict with `segments` (the allocator's segments and their blocks when
it is called) and `device_traces` (one list of trace events per CUDA device: `alloc`, `free_requested`,
`free_completed`, `segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`, `oom`). This module builds
the same dict from the allocator model (analysis/allocator.py) replaying each device's predicted allocation
sequence, so that the prediction opens in PyTorch's own viewers (https://pytorch.org/memory_viz, and
`python -m torch.cuda._memory_viz`) next to a measured snapshot. No torch import: the file is a plain pickle.

Field meanings follow torch/csrc/cuda/memory_snapshot.cpp and c10/cuda/CUDACachingAllocator.cpp: an `alloc`
event carries the requested size, `free_requested`/`free_completed` the block's requested size, segment events
the cudaMalloc'd (or mapped) bytes. Each event's one frame names the node (its TOML file and line) and what it
allocates, so the viewer's stack pane shows the graph, not Python. `time_us` is the event's index in the
sequence: the prediction has an order, not a clock. The segments are the state at the end of the sequence, or
at the OOM, as a snapshot taken in an OOM observer would show them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .allocator import AllocatorConfig, AllocatorOutOfMemory, CachingAllocatorSim, _Block
from .infer import Typed
from .memory import _signature, device_events, usable_bytes


class _Recorder(CachingAllocatorSim):
    """The allocator model, also writing the segment events PyTorch's trace records."""

    def __init__(self, capacity: int | None, config: AllocatorConfig):
        super().__init__(capacity, config)
        self.seg_events: list[tuple[str, int, int]] = []

    def _alloc_block(self, pool, size, alloc_size):
        b = super()._alloc_block(pool, size, alloc_size)
        if b is not None and not self.config.expandable_segments:
            self.seg_events.append(("segment_alloc", b.seg.base, b.size))
        return b

    def _release_block(self, b: _Block) -> None:
        self.seg_events.append(("segment_free", b.seg.base, b.size))
        super()._release_block(b)

    def _map_block(self, to_map: _Block, size: int) -> bool:
        addr, before = to_map.addr, self.reserved
        ok = super()._map_block(to_map, size)
        if ok:
            self.seg_events.append(("segment_map", addr, self.reserved - before))
        return ok

    def _unmap_block(self, block: _Block) -> None:
        seg = block.seg
        begin = -(-(block.addr - seg.base) // seg.page)
        before = self.reserved
        super()._unmap_block(block)
        if self.reserved != before:
            self.seg_events.append(("segment_unmap", seg.base + begin * seg.page, before - self.reserved))


def _frame(typed: Typed, label: str, cache: dict) -> list[dict]:
    if label not in cache:
        node, _, what = label.partition("/")
        spec = typed.ctx.spec
        line = 0
        if node in typed.graph:
            line = typed.ctx.loc(typed.graph[node]).line or 0
        cache[label] = [{"filename": spec.file or "<graph>", "line": line,
                         "name": f"{node}: {what}" if what else node}]
    return cache[label]


def device_trace(typed: Typed, device: str, allocator: AllocatorConfig, index: int) -> tuple[list[dict], list[dict]]:
    """(trace events, segments at the end) of one CUDA device's predicted sequence, replayed against its usable
    memory; the trace stops at the first OOM, as the run would."""
    spec = typed.ctx.spec
    dev = spec.devices[device]
    usable = usable_bytes(typed, device)
    events, _ = device_events(typed, device)
    sim = _Recorder(usable, allocator)
    frames: dict[str, list[dict]] = {}
    trace: list[dict] = []
    live: dict[int, tuple[_Block, int, str]] = {}

    def flush_segments(t: int) -> None:
        for action, addr, size in sim.seg_events:
            trace.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
                          "frames": []})
        sim.seg_events.clear()

    for i, ev in enumerate(events):
        sim.step = i
        if ev.op == "alloc":
            if ev.size == 0:
                continue
            try:
                blk = sim.malloc(ev.size, ev.label, ev.tensor)
            except AllocatorOutOfMemory as e:
                flush_segments(i)
                trace.append({"action": "oom", "addr": 0, "size": e.report.requested_bytes, "stream": 0,
                              "time_us": i, "device_free": max(e.report.free_bytes, 0),
                              "frames": _frame(typed, ev.label, frames)})
                break
            flush_segments(i)
            live[ev.tensor] = (blk, ev.size, ev.label)
            blk.requested = ev.size
            trace.append({"action": "alloc", "addr": blk.addr, "size": ev.size, "stream": 0, "time_us": i,
                          "frames": _frame(typed, ev.label, frames)})
        elif ev.op == "empty_cache":
            sim.empty_cache()
            flush_segments(i)
        elif ev.op == "free" and ev.tensor in live:
            blk, size, label = live.pop(ev.tensor)
            f = _frame(typed, label, frames)
            addr = blk.addr       # before the free: merging with a free neighbour moves the block's start
            trace.append({"action": "free_requested", "addr": addr, "size": size, "stream": 0, "time_us": i,
                          "frames": f})
            sim.free(blk)
            trace.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0, "time_us": i,
                          "frames": f})
            flush_segments(i)
    by_addr = {blk.addr: (size, label) for blk, size, label in live.values()}
    return trace, _segments(sim, by_addr, index, typed, frames)


def _segments(sim: CachingAllocatorSim, live: Mapping[int, tuple[int, str]], index: int, typed: Typed,
              frames: dict) -> list[dict]:
    """The allocator's segments as `_snapshot()` lists them: one per cudaMalloc, and for an expandable segment
    one per run of mapped pages; each with its blocks in address order."""
    runs: list[list[_Block]] = []
    by_seg: dict[int, list[_Block]] = {}
    for b in sim.blocks():
        by_seg.setdefault(id(b.seg), []).append(b)
    for blocks in by_seg.values():
        cur: list[_Block] = []
        for b in blocks:
            if b.mapped:
                cur.append(b)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
    out = []
    for run in sorted(runs, key=lambda r: r[0].addr):
        seg = run[0].seg
        blocks = []
        for b in run:
            if b.allocated:
                req, label = live.get(b.addr, (b.size, ""))
                blocks.append({"address": b.addr, "size": b.size, "requested_size": req, "state": "active_allocated",
                               "frames": _frame(typed, label, frames) if label else []})
            else:
                blocks.append({"address": b.addr, "size": b.size, "requested_size": 0, "state": "inactive",
                               "frames": []})
        total = sum(b.size for b in run)
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        out.append({
            "device": index, "address": run[0].addr, "total_size": total, "allocated_size": allocated,
            "active_size": allocated, "requested_size": sum(b["requested_size"] for b in blocks),
            "stream": 0, "segment_type": "small" if seg.is_small else "large", "segment_pool_id": (0, 0),
            "is_expandable": seg.expandable, "frames": [], "blocks": blocks,
        })
    return out


def cuda_index(torch_device: str) -> int | None:
    """'cuda:7' -> 7, 'cuda' -> 0, 'cpu' -> None."""
    if not torch_device.startswith("cuda"):
        return None
    _, _, i = torch_device.partition(":")
    return int(i) if i.isdigit() else 0


def snapshot(typed: Typed, allocator: AllocatorConfig) -> dict[str, Any]:
    """The predicted `torch.cuda.memory._snapshot()` of every CUDA device of the graph (devices on the CPU have
    no caching allocator and are left out). Replicas of a group share one replay."""
    spec = typed.ctx.spec
    devices = {name: cuda_index(d.torch) for name, d in spec.devices.items()}
    devices = {k: v for k, v in devices.items() if v is not None}
    n = max(devices.values(), default=-1) + 1
    traces: list[list[dict]] = [[] for _ in range(n)]
    segments: list[dict] = []
    done: dict[tuple, tuple[list[dict], list[dict]]] = {}
    for name, idx in devices.items():
        dev = spec.devices[name]
        key = (_signature(typed, name), usable_bytes(typed, name))
        if key not in done:
            done[key] = device_trace(typed, name, allocator, idx)
        trace, segs = done[key]
        traces[idx] = trace
        segments.extend(s if s["device"] == idx else {**s, "device": idx} for s in segs)
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {"expandable_segments": allocator.expandable_segments,
                               "max_split_size": allocator.max_split_size_bytes or -1},
        "external_annotations": [],
        "dflash_graph": {"graph": spec.name, "file": spec.file, "predicted": True,
                         "devices": {name: idx for name, idx in devices.items()}},
    }
