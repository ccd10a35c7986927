"""Simulator of PyTorch's CUDA caching allocator (pure Python, no torch).

Replays a sequence of tensor alloc/free events through a model of
``c10/cuda/CUDACachingAllocator.cpp`` (class ``DeviceCachingAllocator``) and
reports what ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``
would say, and whether (and where) the allocator would raise
``torch.OutOfMemoryError`` for a given amount of obtainable device memory.

Why: live tensors alone under-predict. Memory that the allocator caches in
segments it cannot hand out as one block (fragmentation), block rounding and
segment rounding all count against the device. See ``docs/allocator.md``.

Source references are given as ``# NOTE:`` comments next to each constant and
rule: "CCA.cpp" is ``c10/cuda/CUDACachingAllocator.cpp`` and "AllocatorConfig.h"
is ``c10/core/AllocatorConfig.h`` (PyTorch main, 2.8+ layout; older releases
keep the same constants in CUDACachingAllocator.cpp / CUDAAllocatorConfig.h).

Modelled (single device, single stream, no CUDA graphs / private pools):

* size rounding (``round_size``, optional ``roundup_power2_divisions``),
* small (<= 1 MiB) and large pools, segment sizes (``get_allocation_size``),
* best fit over cached free blocks by (size, address) (``get_free_block``),
  including the ``max_split_size`` oversize rules,
* block splitting (``should_split`` / ``alloc_found_block``) and merging of
  adjacent free blocks on free (``free_block`` / ``try_merge_blocks``),
* on a failed cudaMalloc: ``release_available_cached_blocks`` then
  ``release_cached_blocks`` and retry, then OOM,
* ``garbage_collection_threshold`` (``garbage_collect_cached_blocks``), taking
  ``capacity_bytes`` as the per-process memory limit,
* ``expandable_segments``: one growable virtual segment per pool, mapped in
  20 MiB (large) / 2 MiB (small) pages (``ExpandableSegment``,
  ``find_expandable_block``, ``try_allocate_expandable_block``, ``map_block``,
  ``unmap_block``, ``release_blocks``), following the real code closely.

Simplified: see ``docs/allocator.md`` ("Simplifications").
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence as SequenceABC
from typing import Literal, Sequence

import attrs

__all__ = [
    "K_MIN_BLOCK_SIZE",
    "K_SMALL_SIZE",
    "K_SMALL_BUFFER",
    "K_LARGE_BUFFER",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "AllocatorConfig",
    "Event",
    "OomReport",
    "SimResult",
    "CachingAllocatorSim",
    "AllocatorOutOfMemory",
    "simulate",
    "simulate_pair",
    "Repeat",
    "Folded",
    "expand_events",
    "min_fitting_capacity",
    "round_size",
    "pool_of",
    "allocation_size",
    "format_size",
]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# NOTE: AllocatorConfig.h / CCA.cpp `kMinBlockSize = 512`: "all sizes are
# rounded to at least 512 bytes".
K_MIN_BLOCK_SIZE = 512
# NOTE: `kSmallSize = 1048576`: "largest 'small' allocation is 1 MiB"; requests
# <= this go to the small pool (CCA.cpp `get_pool`).
K_SMALL_SIZE = 1 * MiB
# NOTE: `kSmallBuffer = 2097152`: "'small' allocations are packed in 2 MiB
# blocks" (CCA.cpp `get_allocation_size`), also the page size of the small
# pool's expandable segment (`find_expandable_block`).
K_SMALL_BUFFER = 2 * MiB
# NOTE: AllocatorConfig.h `kLargeBuffer = 20971520`: "'large' allocations may
# be packed in 20 MiB blocks"; page size of the large pool's expandable
# segment; minimum max_split_size_mb / max_non_split_rounding_mb; default
# max_non_split_rounding_size.
K_LARGE_BUFFER = 20 * MiB
# NOTE: `kMinLargeAlloc = 10485760`: "allocations between 1 and 10 MiB may use
# kLargeBuffer" (CCA.cpp `get_allocation_size`).
K_MIN_LARGE_ALLOC = 10 * MiB
# NOTE: `kRoundLarge = 2097152`: "round up large allocations to 2 MiB"
# (CCA.cpp `get_allocation_size`).
K_ROUND_LARGE = 2 * MiB

# Virtual address space handed to one expandable segment when capacity is
# unknown (None). The real code reserves 1 1/8 x totalGlobalMem
# (CCA.cpp `ExpandableSegment::ExpandableSegment`, `max_handles_`).
_UNLIMITED_VA = 1 << 50


# --------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    # NOTE: CCA.cpp `DeviceCachingAllocator::roundup_power2_next_division`:
    # round up to the next of `divisions` equal steps between two powers of 2.
    if _is_pow2(size):
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(n: int, roundup_power2_divisions: int | None = None) -> int:
    """Bytes the allocator really reserves in a block for an ``n``-byte request.

    NOTE: CCA.cpp `DeviceCachingAllocator::round_size`: sizes < kMinBlockSize
    become kMinBlockSize, everything else is rounded up to a multiple of 512,
    unless `roundup_power2_divisions` is configured (default: not), in which
    case sizes above 512 * divisions round up to the next power-of-2 division.
    """
    if n < 0:
        raise ValueError(f"negative size {n}")
    if n < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    d = roundup_power2_divisions or 0
    if d > 1 and n > K_MIN_BLOCK_SIZE * d:
        return _roundup_power2_next_division(n, d)
    return K_MIN_BLOCK_SIZE * ((n + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def pool_of(rounded: int) -> Literal["small", "large"]:
    """Pool that serves a request of ``rounded`` bytes (already rounded).

    NOTE: CCA.cpp `get_pool`: `size <= kSmallSize` -> small_blocks, else large.
    """
    return "small" if rounded <= K_SMALL_SIZE else "large"


def allocation_size(rounded: int) -> int:
    """Size of the new segment cudaMalloc'ed when no cached block fits.

    NOTE: CCA.cpp `get_allocation_size`: <= 1 MiB -> 2 MiB (kSmallBuffer);
    < 10 MiB (kMinLargeAlloc) -> 20 MiB (kLargeBuffer); else rounded up to a
    multiple of 2 MiB (kRoundLarge). PyTorch's OOM message ("Tried to allocate
    X") prints this size.
    """
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


def format_size(n: int) -> str:
    """Like c10's `format_size` used in PyTorch's OOM message."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1048576:
        return f"{n / 1024:.2f} KiB"
    if n <= 1073741824:
        return f"{n / 1048576:.2f} MiB"
    return f"{n / 1073741824:.2f} GiB"


# --------------------------------------------------------------------------
# Public value types
# --------------------------------------------------------------------------


def _check_max_split(inst: object, attr: attrs.Attribute, value: int | None) -> None:
    # NOTE: AllocatorConfig.cpp `parseMaxSplitSize`: max_split_size_mb must be
    # >= kLargeBuffer / 1 MiB (older releases: > 20). This also guarantees that
    # every cached free block >= max_split_size is a whole, unsplit segment.
    if value is not None and value < K_LARGE_BUFFER:
        raise ValueError(
            f"max_split_size_bytes must be >= {K_LARGE_BUFFER} (20 MiB), got {value}"
        )


def _check_gc(inst: object, attr: attrs.Attribute, value: float | None) -> None:
    # NOTE: AllocatorConfig.cpp `parseGarbageCollectionThreshold`: in (0, 1).
    if value is not None and not (0.0 < value < 1.0):
        raise ValueError(f"garbage_collection_threshold must be in (0, 1), got {value}")


def _check_rounding(inst: object, attr: attrs.Attribute, value: int) -> None:
    # NOTE: AllocatorConfig.cpp `parseMaxNonSplitRoundingSize`: >= 20 MiB.
    if value < K_LARGE_BUFFER:
        raise ValueError(f"max_non_split_rounding_bytes must be >= {K_LARGE_BUFFER}")


def _check_divisions(inst: object, attr: attrs.Attribute, value: int | None) -> None:
    # NOTE: AllocatorConfig.cpp `parseRoundUpPower2Divisions`: power of 2.
    if value is not None and value != 0 and not _is_pow2(value):
        raise ValueError(f"roundup_power2_divisions must be a power of 2, got {value}")


@attrs.frozen
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF knobs the simulator models."""

    expandable_segments: bool = False
    # PYTORCH_CUDA_ALLOC_CONF max_split_size_mb (in bytes here). None = unlimited.
    max_split_size_bytes: int | None = attrs.field(default=None, validator=_check_max_split)
    # Used only when capacity_bytes is given (it stands in for the limit set by
    # torch.cuda.set_per_process_memory_fraction, which PyTorch requires).
    garbage_collection_threshold: float | None = attrs.field(default=None, validator=_check_gc)
    # Free cached unused segments and retry before declaring OOM (what PyTorch
    # does). False = OOM as soon as one cudaMalloc fails (a what-if knob).
    release_on_oom: bool = True
    # PYTORCH_CUDA_ALLOC_CONF max_non_split_rounding_mb (bytes); only matters
    # when max_split_size_bytes is set.
    max_non_split_rounding_bytes: int = attrs.field(default=K_LARGE_BUFFER, validator=_check_rounding)
    # Legacy single-value form of roundup_power2_divisions (applies to all sizes).
    roundup_power2_divisions: int | None = attrs.field(default=None, validator=_check_divisions)
    # cudaDeviceProp.totalGlobalMem; only sizes the virtual range of an
    # expandable segment (1 1/8 of it). None: use capacity_bytes.
    device_total_bytes: int | None = None

    @classmethod
    def from_alloc_conf(cls, conf: str) -> "AllocatorConfig":
        """Parse a PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF string.

        Keys the simulator does not model (pinned_*, release_lock_on_cudamalloc,
        graph_capture_record_stream_reuse, ...) are ignored; the per-interval
        list form of roundup_power2_divisions is not supported.
        """
        kw: dict[str, object] = {}
        for item in conf.replace(" ", "").split(","):
            if not item:
                continue
            key, sep, val = item.partition(":")
            if not sep:
                raise ValueError(f"malformed allocator setting {item!r}")
            if key == "expandable_segments":
                if val not in ("True", "False", "true", "false"):
                    raise ValueError(f"expandable_segments expects True/False, got {val!r}")
                kw["expandable_segments"] = val in ("True", "true")
            elif key == "max_split_size_mb":
                kw["max_split_size_bytes"] = int(val) * MiB
            elif key == "max_non_split_rounding_mb":
                kw["max_non_split_rounding_bytes"] = int(val) * MiB
            elif key == "garbage_collection_threshold":
                kw["garbage_collection_threshold"] = float(val)
            elif key == "roundup_power2_divisions":
                if val.startswith("["):
                    raise ValueError("per-interval roundup_power2_divisions is not modelled")
                kw["roundup_power2_divisions"] = int(val)
            elif key == "backend" and val != "native":
                raise ValueError(f"allocator backend {val!r} is not modelled (only 'native')")
            # other keys: not modelled, ignored
        return cls(**kw)  # type: ignore[arg-type]


@attrs.frozen
class Event:
    """One allocator call.

    ``op`` "alloc"/"free" pair up by ``tensor``; a free's ``size`` may be 0 (the
    simulator remembers the allocation's size). ``op="empty_cache"`` models
    ``torch.cuda.empty_cache()`` (``tensor``/``size`` ignored).
    """

    op: Literal["alloc", "free", "empty_cache"]
    tensor: int
    size: int
    label: str = ""


@attrs.frozen
class OomReport:
    """What PyTorch's ``torch.OutOfMemoryError`` would have said.

    All byte counts are taken after the allocator's release-and-retry, exactly
    as PyTorch reads its stats when it builds the message.
    """

    index: int  # event index that failed
    label: str
    requested_bytes: int  # round_size(request)
    free_bytes: int  # capacity - reserved ("of which X is free")
    reserved_bytes: int  # reserved by PyTorch at the failure
    allocated_bytes: int  # allocated by PyTorch at the failure
    capacity_bytes: int = 0
    orig_requested_bytes: int = 0  # the unrounded request
    alloc_size_bytes: int = 0  # segment size, printed by PyTorch as "Tried to allocate"
    pool: Literal["small", "large"] = "large"
    tensor: int = -1
    largest_free_block_bytes: int = 0  # largest cached free block (any pool)
    live_rounded_bytes: int = 0  # sum of round_size over live tensors

    @property
    def reserved_unallocated_bytes(self) -> int:
        return self.reserved_bytes - self.allocated_bytes

    def message(self) -> str:
        """PyTorch-style OOM text (capacity stands in for the device total)."""
        return (
            f"CUDA out of memory. Tried to allocate {format_size(self.alloc_size_bytes)}. "
            f"Allocator capacity {format_size(self.capacity_bytes)} of which "
            f"{format_size(self.free_bytes)} is free. Of the allocated memory "
            f"{format_size(self.allocated_bytes)} is allocated by PyTorch, and "
            f"{format_size(self.reserved_unallocated_bytes)} is reserved by PyTorch "
            f"but unallocated. (event {self.index} {self.label!r}, request "
            f"{format_size(self.requested_bytes)}, largest cached free block "
            f"{format_size(self.largest_free_block_bytes)})"
        )


@attrs.frozen
class SimResult:
    # max over time of the sum of live *block* sizes: torch.cuda.max_memory_allocated.
    # A block can be larger than round_size(request) when the remainder was too
    # small to split (large pool: up to 1 MiB more; oversize blocks: up to
    # max_non_split_rounding more). See live_rounded_peak for the plain sum.
    allocated_peak: int
    reserved_peak: int  # torch.cuda.max_memory_reserved
    allocated_peak_index: int  # event index where it was reached (-1: never)
    reserved_peak_index: int
    oom: OomReport | None  # first OOM; the simulation stops there
    timeline: tuple[tuple[int, int], ...]  # (allocated, reserved) after each processed event
    live_rounded_peak: int = 0  # max over time of sum(round_size(size)) of live tensors
    live_rounded_peak_index: int = -1
    final_allocated: int = 0
    final_reserved: int = 0
    num_alloc_retries: int = 0  # cudaMalloc retried after releasing the whole cache
    num_device_alloc: int = 0  # cudaMalloc / page-map calls
    num_device_free: int = 0  # cudaFree / page-unmap calls

    @property
    def fragmentation_peak(self) -> int:
        """reserved_peak - live_rounded_peak: what live tensors alone miss."""
        return self.reserved_peak - self.live_rounded_peak


# --------------------------------------------------------------------------
# Internal state
# --------------------------------------------------------------------------


class _Segment:
    __slots__ = ("base", "size", "expandable", "page", "is_small")

    def __init__(self, base: int, size: int, expandable: bool, page: int, is_small: bool):
        self.base = base
        self.size = size  # cudaMalloc size, or virtual size of an expandable segment
        self.expandable = expandable
        self.page = page
        self.is_small = is_small


class _Block:
    """CCA.cpp `struct Block`: a contiguous slice of a segment."""

    __slots__ = ("size", "addr", "pool", "seg", "allocated", "mapped", "prev", "next", "gc_base", "requested",
                 "tensor")

    def __init__(self, size: int, addr: int, pool: "_Pool", seg: _Segment, mapped: bool = True):
        self.size = size
        self.addr = addr
        self.pool = pool
        self.seg = seg
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.gc_base = 0
        self.requested = 0
        self.tensor = -1    # while allocated in a replay (simulate): the tensor it holds

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        st = "A" if self.allocated else ("F" if self.mapped else "U")
        return f"<{st} {self.addr:#x}+{self.size}>"


class _Pool:
    """CCA.cpp `struct BlockPool`: cached free blocks sorted by (size, addr)
    (`BlockComparatorSize`) and unmapped blocks sorted by address
    (`BlockComparatorAddress`)."""

    __slots__ = ("is_small", "free", "free_by_addr", "unmapped", "unmapped_by_addr", "gc_calls")

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.free: list[tuple[int, int]] = []
        self.free_by_addr: dict[int, _Block] = {}
        self.unmapped: list[int] = []
        self.unmapped_by_addr: dict[int, _Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count

    # `insert_into_blocks` also stamps the block's gc age base.
    def insert_free(self, b: _Block) -> None:
        assert b.mapped and not b.allocated and b.addr not in self.free_by_addr
        bisect.insort(self.free, (b.size, b.addr))
        self.free_by_addr[b.addr] = b
        b.gc_base = self.gc_calls

    def remove_free(self, b: _Block) -> None:
        key = (b.size, b.addr)
        i = bisect.bisect_left(self.free, key)
        assert i < len(self.free) and self.free[i] == key, "block not in pool"
        del self.free[i]
        del self.free_by_addr[b.addr]

    def insert_unmapped(self, b: _Block) -> None:
        assert not b.mapped and b.addr not in self.unmapped_by_addr
        bisect.insort(self.unmapped, b.addr)
        self.unmapped_by_addr[b.addr] = b

    def remove_unmapped(self, b: _Block) -> None:
        i = bisect.bisect_left(self.unmapped, b.addr)
        assert i < len(self.unmapped) and self.unmapped[i] == b.addr
        del self.unmapped[i]
        del self.unmapped_by_addr[b.addr]


class AllocatorOutOfMemory(Exception):
    """Raised by :meth:`CachingAllocatorSim.malloc` (carries the report)."""

    def __init__(self, report: OomReport):
        super().__init__(report.message())
        self.report = report


class CachingAllocatorSim:
    """Step-by-step model of one `DeviceCachingAllocator` on one stream.

    ``malloc`` returns an opaque block handle (or raises
    :class:`AllocatorOutOfMemory`); ``free`` gives it back. ``step`` is the
    event index stamped on peaks and reports.
    """

    def __init__(self, capacity_bytes: int | None, config: AllocatorConfig = AllocatorConfig()):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity = capacity_bytes
        self.config = config
        self.small = _Pool(True)
        self.large = _Pool(False)
        self.active: dict[int, _Block] = {}  # addr -> allocated block
        self.allocated = 0
        self.reserved = 0
        self.allocated_peak = 0
        self.reserved_peak = 0
        self.allocated_peak_index = -1
        self.reserved_peak_index = -1
        self.num_alloc_retries = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.step = -1
        self._next_addr = K_LARGE_BUFFER  # bump pointer for segment addresses
        self._max_split = config.max_split_size_bytes if config.max_split_size_bytes is not None else float("inf")
        # NOTE: CCA.cpp `malloc` / `get_free_block`: GC runs only when
        # `set_fraction && garbage_collection_threshold() > 0`.
        self._gc = config.garbage_collection_threshold is not None and capacity_bytes is not None
        self._sizes: dict[int, tuple[int, int]] = {}    # request -> (round_size, allocation_size)
        # called when a cudaMalloc first would not fit, before anything is released (NOTE [Forked replay])
        self.on_press: Callable[[], None] | None = None

    def copy(self, capacity_bytes: int | None) -> tuple["CachingAllocatorSim", dict[int, _Block]]:
        """This allocator as it stands, with another capacity, and its blocks by the id of the block each copies
        (NOTE [Forked replay]: valid while the capacity has changed nothing)."""
        new = CachingAllocatorSim(capacity_bytes, self.config)
        for name in ("allocated", "reserved", "allocated_peak", "reserved_peak", "allocated_peak_index",
                     "reserved_peak_index", "num_alloc_retries", "num_device_alloc", "num_device_free", "step",
                     "_next_addr"):
            setattr(new, name, getattr(self, name))
        new._sizes = self._sizes           # (a cache of pure functions of the request and the config)
        pools = {id(self.small): new.small, id(self.large): new.large}
        olds = list(self.active.values())
        for pool in (self.small, self.large):
            copy = pools[id(pool)]
            copy.gc_calls = pool.gc_calls
            copy.free = list(pool.free)
            copy.unmapped = list(pool.unmapped)
            olds.extend(pool.free_by_addr.values())
            olds.extend(pool.unmapped_by_addr.values())
        blocks: dict[int, _Block] = {}
        for b in olds:                     # every block of every segment: allocated, cached free or unmapped
            c = _Block(b.size, b.addr, pools[id(b.pool)], b.seg, b.mapped)   # (segments never change)
            c.allocated, c.gc_base, c.requested, c.tensor = b.allocated, b.gc_base, b.requested, b.tensor
            blocks[id(b)] = c
        for b in olds:
            c = blocks[id(b)]
            c.prev = None if b.prev is None else blocks[id(b.prev)]
            c.next = None if b.next is None else blocks[id(b.next)]
        new.active = {addr: blocks[id(b)] for addr, b in self.active.items()}
        for pool in (self.small, self.large):
            copy = pools[id(pool)]
            copy.free_by_addr = {addr: blocks[id(b)] for addr, b in pool.free_by_addr.items()}
            copy.unmapped_by_addr = {addr: blocks[id(b)] for addr, b in pool.unmapped_by_addr.items()}
        return new, blocks

    # ------------------------------------------------------------------ stats
    def _add_reserved(self, n: int) -> None:
        self.reserved += n
        if self.reserved > self.reserved_peak:
            self.reserved_peak = self.reserved
            self.reserved_peak_index = self.step

    def _add_allocated(self, n: int) -> None:
        self.allocated += n
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
            self.allocated_peak_index = self.step

    def _fits(self, n: int) -> bool:
        return self.capacity is None or self.reserved + n <= self.capacity

    def _new_addr(self, size: int, align: int) -> int:
        base = -(-self._next_addr // align) * align
        # leave a gap so segments are never adjacent (they are distinct cudaMallocs)
        self._next_addr = base + size + K_LARGE_BUFFER
        return base

    def largest_free_block(self) -> int:
        sizes = [p.free[-1][0] for p in (self.small, self.large) if p.free]
        return max(sizes, default=0)

    # ------------------------------------------------------------------ malloc
    def malloc(self, orig_size: int, label: str = "", tensor: int = -1) -> _Block:
        """CCA.cpp `DeviceCachingAllocator::malloc` (single stream)."""
        if orig_size <= 0:
            raise ValueError("malloc of a non-positive size (size-0 tensors never reach the allocator)")
        cfg = self.config
        sizes = self._sizes.get(orig_size)
        if sizes is None:   # a replay repeats a few hundred request sizes
            r = round_size(orig_size, cfg.roundup_power2_divisions)
            sizes = self._sizes[orig_size] = (r, allocation_size(r))
        size, alloc_size = sizes
        pool = self.small if size <= K_SMALL_SIZE else self.large

        # NOTE: CCA.cpp `malloc`: first `get_free_block` (callbacks not modelled).
        block = self._get_free_block(pool, size)
        if block is None:
            # NOTE: CCA.cpp `malloc`: `garbage_collect_cached_blocks` before a
            # new allocation when set_fraction && threshold > 0.
            if self._gc:
                self._garbage_collect()
            # NOTE: CCA.cpp `malloc`: alloc_block || (release_available_cached_blocks
            # && alloc_block) || (release_cached_blocks && alloc_block(isRetry)).
            block = self._alloc_block(pool, size, alloc_size)
            if block is None and cfg.release_on_oom:
                if self._release_available_cached_blocks(pool, size):
                    block = self._alloc_block(pool, size, alloc_size)
                if block is None:
                    self._release_cached_blocks()
                    self.num_alloc_retries += 1
                    block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            raise AllocatorOutOfMemory(
                OomReport(
                    index=self.step,
                    label=label,
                    requested_bytes=size,
                    free_bytes=(self.capacity or 0) - self.reserved,
                    reserved_bytes=self.reserved,
                    allocated_bytes=self.allocated,
                    capacity_bytes=self.capacity or 0,
                    orig_requested_bytes=orig_size,
                    alloc_size_bytes=alloc_size,
                    pool="small" if pool.is_small else "large",
                    tensor=tensor,
                    largest_free_block_bytes=self.largest_free_block(),
                )
            )
        # NOTE: CCA.cpp `should_split` (see _should_split), inline: it is asked on every allocation.
        remaining = block.size - size
        if block.pool.is_small or cfg.expandable_segments:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._max_split and remaining > K_SMALL_SIZE
        return self._alloc_found_block(block, size, orig_size, split)

    def _should_split(self, block: _Block, size: int) -> bool:
        # NOTE: CCA.cpp `should_split`: small pool or expandable segments ->
        # split if remaining >= kMinBlockSize; large pool -> split only if the
        # request is below max_split_size and remaining > kSmallSize (1 MiB).
        remaining = block.size - size
        if block.pool.is_small or self.config.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: _Block, size: int, orig_size: int, split: bool) -> _Block:
        # NOTE: CCA.cpp `alloc_found_block`: the front `size` bytes become the
        # allocated block; the remainder stays cached in the pool.
        if split:
            rest = block
            block = _Block(size, rest.addr, rest.pool, rest.seg)
            prev = block.prev = rest.prev
            if prev is not None:
                prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size -= size
            rest.pool.insert_free(rest)
        block.allocated = True
        block.requested = orig_size
        self.active[block.addr] = block
        # (_add_allocated, inline)
        self.allocated += block.size
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
            self.allocated_peak_index = self.step
        return block

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        # NOTE: CCA.cpp `get_free_block`: lower_bound over (size, address), i.e.
        # best fit, lowest address among equal sizes.
        if self._gc:
            pool.gc_calls += 1
        free = pool.free
        i = bisect.bisect_left(free, (size, -1))
        if i == len(free):
            return None
        by_addr = pool.free_by_addr
        b = by_addr[free[i][1]]
        if b.seg.expandable:
            # NOTE: CCA.cpp `get_free_block`: for expandable blocks compare the
            # size they could grow to (block + following unmapped range) and
            # prefer a later block that is less expandable.
            def exp_size(x: _Block) -> int:
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)

            j = i + 1
            while b.seg.expandable and j < len(free):
                nb = by_addr[free[j][1]]
                if exp_size(nb) < exp_size(b):
                    b = nb
                    i = j
                    j += 1
                else:
                    break
        # NOTE: CCA.cpp `get_free_block`: "Do not return an oversized block for
        # a large request" and "Allow oversized block size to be rounded up but
        # within a limit" (max_non_split_rounding_size, default kLargeBuffer).
        ms = self._max_split
        if size < ms and b.size >= ms:
            return None
        if size >= ms and b.size >= size + self.config.max_non_split_rounding_bytes:
            return None
        del free[i]             # (pool.remove_free(b), the index known)
        del by_addr[b.addr]
        return b

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        # NOTE: CCA.cpp `alloc_block`: expandable -> try_allocate_expandable_block,
        # else cudaMalloc(alloc_size). cudaMalloc "fails" here when the bytes held
        # by the allocator would exceed capacity (set_fraction check has the
        # same form: total_allocated_memory + size > allowed_memory_maximum).
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        if not self._fits(alloc_size):
            if self.on_press is not None:
                self.on_press()
            return None
        seg = _Segment(self._new_addr(alloc_size, K_ROUND_LARGE), alloc_size, False, alloc_size, pool.is_small)
        self._add_reserved(alloc_size)
        self.num_device_alloc += 1
        return _Block(alloc_size, seg.base, pool, seg)

    # ---------------------------------------------------------- expandable
    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        # NOTE: CCA.cpp `find_expandable_block`: lowest-address unmapped range
        # (plus the free block right before it) with enough room; otherwise a
        # new expandable segment (2 MiB pages small pool, 20 MiB large pool).
        def has_room(b: _Block | None) -> bool:
            got = 0
            while got < size and b is not None and not b.allocated:
                got += b.size
                b = b.next
            return got >= size

        for addr in pool.unmapped:
            c = pool.unmapped_by_addr[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if has_room(c):
                return c
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER
        dev = self.config.device_total_bytes if self.config.device_total_bytes is not None else self.capacity
        total = dev + dev // 8 if dev is not None else _UNLIMITED_VA
        vsize = page * max(1, -(-total // page))
        seg = _Segment(self._new_addr(vsize, K_LARGE_BUFFER), vsize, True, page, pool.is_small)
        c = _Block(vsize, seg.base, pool, seg, mapped=False)
        pool.insert_unmapped(c)
        return c

    def _map_block(self, to_map: _Block, size: int) -> bool:
        # NOTE: CCA.cpp `map_block` + `ExpandableSegment::map`: map whole pages
        # covering [ptr, ptr+size); all-or-nothing (cuMemCreate failure releases
        # the handles of this call).
        seg = to_map.seg
        page = seg.page
        off = to_map.addr - seg.base
        assert not to_map.mapped and off % page == 0 and size <= to_map.size
        mapped = -(-(off + size) // page) * page - off
        assert mapped <= to_map.size
        if not self._fits(mapped):
            return False
        pool = to_map.pool
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.size - mapped, to_map.addr + mapped, pool, seg, mapped=False)
            rest.prev = to_map
            rest.next = to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        pool.insert_free(to_map)
        self._add_reserved(mapped)
        self.num_device_alloc += 1
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        # NOTE: CCA.cpp `try_allocate_expandable_block`.
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt  # map_block merged the old candidate into nxt
        pool.remove_free(c)
        return c

    def _unmap_block(self, block: _Block) -> None:
        # NOTE: CCA.cpp `unmap_block` + `ExpandableSegment::unmap`: unmap the
        # pages lying entirely inside a free block; partial pages stay mapped.
        seg = block.seg
        page = seg.page
        off = block.addr - seg.base
        begin = -(-off // page)
        end = (off + block.size) // page
        if begin >= end:
            return
        pool = block.pool
        pool.remove_free(block)
        u_addr = seg.base + begin * page
        u_size = (end - begin) * page
        before = u_addr - block.addr
        if before > 0:
            bf = _Block(before, block.addr, pool, seg)
            bf.prev = block.prev
            if bf.prev is not None:
                bf.prev.next = bf
            bf.next = block
            block.prev = bf
            pool.insert_free(bf)
        after = block.size - before - u_size
        if after > 0:
            af = _Block(after, u_addr + u_size, pool, seg)
            af.next = block.next
            if af.next is not None:
                af.next.prev = af
            af.prev = block
            block.next = af
            pool.insert_free(af)
        block.addr = u_addr
        block.size = u_size
        block.mapped = False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.insert_unmapped(block)
        self.reserved -= u_size
        self.num_device_free += 1

    # ---------------------------------------------------------------- free
    def free(self, block: _Block) -> None:
        """CCA.cpp `DeviceCachingAllocator::free` -> `free_block` (no stream uses)."""
        if not block.allocated or self.active.get(block.addr) is not block:
            raise ValueError("free of a block that is not allocated")
        del self.active[block.addr]
        block.allocated = False
        self.allocated -= block.size
        # NOTE: CCA.cpp `free_block`: merge with free neighbours, then cache.
        # (_try_merge is called only for a neighbour that is there and free)
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._try_merge(block, prev)
        if nxt is not None and not nxt.allocated:
            self._try_merge(block, nxt)
        block.pool.insert_free(block)

    def _try_merge(self, dst: _Block, src: _Block | None) -> int:
        # NOTE: CCA.cpp `try_merge_blocks`: only a free neighbour in the same
        # mapped state merges. `dst` is never in a pool index here.
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            src.pool.remove_free(src)
        else:
            src.pool.remove_unmapped(src)
        dst.size += src.size
        return src.size

    # ------------------------------------------------------------- release
    def _release_block(self, b: _Block) -> None:
        # NOTE: CCA.cpp `release_block`: cudaFree a whole cached segment.
        assert not b.seg.expandable and not b.is_split() and not b.allocated
        b.pool.remove_free(b)
        self.reserved -= b.size
        self.num_device_free += 1

    def _release_blocks(self, pool: _Pool) -> None:
        # NOTE: CCA.cpp `release_blocks`: cudaFree every unsplit cached segment;
        # unmap free pages of expandable segments, dropping an expandable segment
        # that became entirely unmapped (`release_expandable_segment`).
        to_unmap = []
        for _, addr in list(pool.free):
            b = pool.free_by_addr[addr]
            if b.seg.expandable:
                to_unmap.append(b)
            elif not b.is_split():
                self._release_block(b)
        for b in to_unmap:
            self._unmap_block(b)
            if not b.is_split() and not b.mapped:
                pool.remove_unmapped(b)

    def _release_cached_blocks(self) -> None:
        # NOTE: CCA.cpp `release_cached_blocks` (default pool): large, then small.
        self._release_blocks(self.large)
        self._release_blocks(self.small)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache() -> CCA.cpp `emptyCache` -> release_cached_blocks."""
        self._release_cached_blocks()

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        # NOTE: CCA.cpp `release_available_cached_blocks`: only with
        # max_split_size set; free one cached oversize block >= max(size,
        # max_split_size), or else several oversize blocks, largest first,
        # until their total reaches that size.
        ms = self._max_split
        if ms == float("inf"):
            return False
        key = max(size, int(ms))
        free = pool.free
        i = bisect.bisect_left(free, (key, -1))
        if i == len(free) or pool.free_by_addr[free[i][1]].seg.expandable:
            if i == 0:
                return False
            total = 0
            j = i - 1
            while total < key and j >= 0 and free[j][0] >= ms:
                b = pool.free_by_addr[free[j][1]]
                if not b.seg.expandable:
                    total += b.size
                    self._release_block(b)
                j -= 1
            return total >= key
        self._release_block(pool.free_by_addr[free[i][1]])
        return True

    def _garbage_collect(self) -> None:
        # NOTE: CCA.cpp `garbage_collect_cached_blocks`: once reserved exceeds
        # threshold * allowed memory, free unsplit large-pool cached segments
        # whose age (get_free_block calls since cached) >= the mean age, until
        # the excess is reclaimed.
        assert self.capacity is not None and self.config.garbage_collection_threshold is not None
        threshold = int(self.config.garbage_collection_threshold * self.capacity)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.large

        def age(b: _Block) -> int:
            return pool.gc_calls - b.gc_base

        total_age = 0
        count = 0
        for _, addr in pool.free:
            b = pool.free_by_addr[addr]
            if not b.is_split():
                total_age += age(b)
                count += 1
        if count == 0:
            return
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for _, addr in list(pool.free):
                b = pool.free_by_addr[addr]
                if not b.is_split() and not b.seg.expandable and age(b) >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age(b)
                    count -= 1
                    self._release_block(b)

    # ----------------------------------------------------------- checking
    def blocks(self) -> list[_Block]:
        """All blocks (allocated, cached free, unmapped), sorted by address."""
        out = list(self.active.values())
        for p in (self.small, self.large):
            out.extend(p.free_by_addr.values())
            out.extend(p.unmapped_by_addr.values())
        out.sort(key=lambda b: b.addr)
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal state is inconsistent."""
        blocks = self.blocks()
        by_seg: dict[int, list[_Block]] = {}
        for b in blocks:
            by_seg.setdefault(id(b.seg), []).append(b)
        allocated = sum(b.size for b in blocks if b.allocated)
        reserved = sum(b.size for b in blocks if b.mapped)
        assert allocated == self.allocated, (allocated, self.allocated)
        assert reserved == self.reserved, (reserved, self.reserved)
        assert self.allocated <= self.reserved
        if self.capacity is not None:
            assert self.reserved <= self.capacity
        for seg_blocks in by_seg.values():
            seg = seg_blocks[0].seg
            head = seg_blocks[0]
            assert head.addr == seg.base and head.prev is None
            cur: _Block | None = head
            n = 0
            while cur is not None:
                assert cur is seg_blocks[n]
                assert cur.seg is seg and cur.size > 0 and cur.size % K_MIN_BLOCK_SIZE == 0
                if cur.next is not None:
                    assert cur.next.prev is cur and cur.addr + cur.size == cur.next.addr
                    if not cur.allocated and not cur.next.allocated:
                        assert cur.mapped != cur.next.mapped, "unmerged free neighbours"
                if not cur.mapped:
                    assert seg.expandable and not cur.allocated
                    assert (cur.addr - seg.base) % seg.page == 0 and cur.size % seg.page == 0
                if seg.expandable and cur.mapped and (cur.prev is None or not cur.prev.mapped):
                    assert (cur.addr - seg.base) % seg.page == 0, "mapped range not page aligned"
                if seg.expandable and cur.mapped and (cur.next is None or not cur.next.mapped):
                    assert (cur.addr + cur.size - seg.base) % seg.page == 0, "mapped range not page aligned"
                if (
                    not cur.allocated
                    and cur.mapped
                    and not seg.expandable
                    and cur.size >= self._max_split
                ):
                    assert not cur.is_split(), "split oversize cached block"
                n += 1
                cur = cur.next
            assert n == len(seg_blocks)
            assert sum(b.size for b in seg_blocks) == seg.size
        for p in (self.small, self.large):
            assert p.free == sorted((b.size, b.addr) for b in p.free_by_addr.values())
            assert p.unmapped == sorted(p.unmapped_by_addr)
            for b in p.free_by_addr.values():
                assert b.pool is p and b.mapped and not b.allocated
            for b in p.unmapped_by_addr.values():
                assert b.pool is p and not b.mapped


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Repeat:
    """A marker in an event list (NOTE [Folded replay]): the `length` events just before it (one repetition, none
    of them a marker) happen `times` more times. Each repetition allocates `stride` tensors, ids from `lo` on in
    the first, and may free the repetition before's: in the k-th more (k = 1..times) a tensor id t >= lo - stride
    is t + k * stride. `label(k, i)` is the label of its i-th event."""

    length: int
    times: int
    stride: int
    lo: int
    label: Callable[[int, int], str] = attrs.field(repr=False)


def expand_events(events: Sequence) -> list:
    """An event list with its Repeat markers written out: every event, as a literal replay sees it."""
    out: list = []
    for ev in events:
        if type(ev) is not Repeat:
            out.append(ev)
            continue
        base = out[len(out) - ev.length:]
        cut = ev.lo - ev.stride
        for k in range(1, ev.times + 1):
            shift = k * ev.stride
            for i, e in enumerate(base):
                out.append(type(e)(e.op, e.tensor + shift if e.tensor >= cut else e.tensor, e.size, ev.label(k, i)))
    return out


class Folded(SequenceABC):
    """A sequence kept as runs (items, times[, step]): `items` `times` times in a row, the j-th time (from 0) with
    j * step added to each item's parts (step None: as they are), without writing them out (the timeline of a
    folded replay, NOTE [Folded replay]: a repetition that only allocates raises every (allocated, reserved)
    by the same bytes)."""

    def __init__(self, runs: Sequence[tuple]):
        self.runs = [(tuple(r[0]), r[1], r[2] if len(r) > 2 else None) for r in runs if r[0] and r[1] > 0]
        self._ends = list(itertools.accumulate(len(items) * times for items, times, _ in self.runs))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @staticmethod
    def _moved(item, step, j: int):
        return item if step is None or j == 0 else tuple(a + j * d for a, d in zip(item, step))

    def __iter__(self):
        for items, times, step in self.runs:
            for j in range(times):
                if step is None or j == 0:
                    yield from items
                else:
                    for item in items:
                        yield tuple(a + j * d for a, d in zip(item, step))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        r = bisect.bisect_right(self._ends, i)
        items, _, step = self.runs[r]
        j, at = divmod(i - (self._ends[r - 1] if r else 0), len(items))
        return self._moved(items[at], step, j)

    def __eq__(self, other) -> bool:
        return isinstance(other, SequenceABC) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"Folded({len(self)} items in {len(self.runs)} runs)"


# NOTE [Folded replay]: a deep model's forward repeats its layers (ops/costs.py, NOTE [Layer folding]), and the
# event list carries each stretch of identical layers as one repetition and a Repeat marker. simulate replays the
# repetitions one by one and, after each, takes the allocator's state where that repetition touched it: every
# block of the segments it allocated from or freed into (address, size, allocated, mapped, and whose tensor,
# counted from the repetition's first id), and the counters (allocated, reserved, cudaMalloc and cudaFree calls,
# retries, the next segment address, the live rounded bytes). When the last c repetitions left the states the c
# before them left (c = 1: two in a row the same; c = 2: a layer's output alternating between two blocks), the
# allocator is where it was c repetitions ago: a segment touched in the last c was touched in the same place of
# the c before and left the same (its state is the one its last toucher saw), and the counters agree. The
# allocator is deterministic and reads nothing else (garbage collection reads block ages, so a replay with a
# garbage_collection_threshold is never folded), and the next repetitions' events are those c ago with ids
# shifted, so they do exactly what those did, cycle after cycle: the same blocks, the same (allocated, reserved)
# after each event, no new peak, no OOM. The whole cycles left are skipped: the timeline keeps the last cycle's
# entries as a run, and the tensors alive move to the ids of the last skipped repetition; the few left over are
# replayed. Without a cycle within MAX_FOLD_TRIES repetitions the rest is replayed one by one: the same answer,
# slower.
# A repetition that only allocates (a model's layers' weights, one block each) never cycles: it grows the
# allocator. When it made only new segments, each wholly allocated (no free remainder in any pool), and the one
# before it grew the allocator the same way (the same segments and blocks, the same growth of every counter,
# each peak last raised at the same event), the next finds the pools as they were, so its requests again find no
# cached block and make the same segments, cudaMalloc's bump pointer placing them one after the other: every
# repetition left grows the allocator alike, and raises each peak at the same event, while the reserved bytes
# fit the capacity (the rest, from the first that would not, are replayed: the OOM or the release of cached
# blocks happens there as written). The counters and peaks move on in closed form; the skipped segments are made
# only when one of their tensors is freed (grow, made). tests/test_layer_folding.py checks folded against
# written-out replays on random repeated event lists (cycling and growing), and on deep graphs;
# tests/test_memory_digest.py pins every figure.
MAX_FOLD_TRIES = 16
MAX_CYCLE = 4


def _cycle(states: list) -> int:
    """The smallest c <= MAX_CYCLE such that the last c repetitions left, each where it touched the allocator,
    the states the c before them left (NOTE [Folded replay]; a layer's output that alternates between two
    blocks makes c = 2), or 0."""
    n = len(states)
    for c in range(1, MAX_CYCLE + 1):
        if n >= 2 * c and None not in states[n - 2 * c:] and states[n - c:] == states[n - 2 * c:n - c]:
            return c
    return 0


def simulate(
    events: Sequence,
    capacity_bytes: int | None,
    config: AllocatorConfig = AllocatorConfig(),
) -> SimResult:
    """Replay ``events`` through the allocator model.

    ``capacity_bytes``: what the allocator can obtain from the device (device
    total minus memory outside the allocator: CUDA context, cuBLAS/NCCL
    workspaces, other processes); None = unlimited (never OOMs).

    Stops at the first OOM (PyTorch raises ``torch.OutOfMemoryError``; the
    step dies). The failing event gets a timeline entry with the state after
    the allocator's release-and-retry, so ``len(timeline) == oom.index + 1``.

    ``events`` may hold Repeat markers (NOTE [Folded replay]): indices (peaks,
    the OOM) and the timeline count every event they stand for, and the
    timeline is then a Folded sequence.

    Raises ValueError for malformed traces (double alloc of a live tensor id,
    free of an unknown id, negative size, a free whose nonzero size disagrees
    with the allocation).
    """
    return _Replay(events, CachingAllocatorSim(capacity_bytes, config)).run()


def simulate_pair(
    events: Sequence,
    capacity_bytes: int | None,
    config: AllocatorConfig = AllocatorConfig(),
) -> tuple[SimResult, SimResult | None]:
    """``simulate(events, capacity_bytes, config)`` and, when it runs out of
    memory, ``simulate(events, None, config)`` (what the schedule would need),
    else None: equal to those two replays, field for field, but the unbounded
    one goes on from a copy of the bounded one where capacity first pressed
    (NOTE [Forked replay]) instead of replaying the events before it again.
    """
    bounded = _Replay(events, CachingAllocatorSim(capacity_bytes, config))
    result = bounded.run(fork=True)
    if result.oom is None:
        return result, None
    if bounded.forked is not None:
        return result, bounded.forked.run()
    return result, simulate(events, None, config)


# NOTE [Forked replay]: check replays a device's events against its usable memory and, when they do not fit,
# again without a limit (what the schedule would need). The two replays are one until capacity first presses:
# the first cudaMalloc that would not fit (CachingAllocatorSim._alloc_block, before the allocator releases
# cached segments or fails). Until then both allocators made the same calls with the same results, for nothing
# else reads the capacity: garbage collection does (it runs only with a capacity, and counts the calls to
# get_free_block, which it ages blocks by), and so does an expandable segment (its virtual range is sized from
# the capacity), so a replay with either is never forked. At the press nothing of the event has changed the
# allocator yet (get_free_block found no block and took none), so simulate_pair's bounded replay copies itself
# there (_Replay.fork: every block, the tensors alive, the counters, the timeline so far, with capacity None)
# and the copy starts at the event that pressed, inside a Repeat at the repetition and event it was at (the
# bookkeeping that finds a cycle starts afresh there, its MAX_FOLD_TRIES counted from there: folding only skips
# what replaying would do). The bounded replay goes on to its OOM; the copy is run only when there is one.
# tests/test_allocator.py checks the pair against two replays from scratch, event for event, on random event
# lists with and without Repeat markers.


class _Replay:
    """One replay of an event list through an allocator (simulate): the allocator, the tensors alive, the live
    rounded bytes and their peak, the timeline so far, and where in the list it stands (`at`); `fork` copies
    it (NOTE [Forked replay])."""

    def __init__(self, events: Sequence, sim: "CachingAllocatorSim"):
        self.events = events
        self.sim = sim
        self.live: dict[int, tuple[_Block | None, int, int]] = {}     # tensor -> block, size, rounded size
        self.peak = [0, 0, -1]           # live rounded bytes, their peak, its index
        self.timeline: list[tuple[int, int]] = []
        self.runs: list[tuple[Sequence, int]] = []                    # folded parts of the timeline
        self.lazy: list[tuple] = []      # repetitions skipped by grow, their segments made when one is first freed
        self.rounded: dict[int, int] = {}    # round_size by request size: a replay repeats a few hundred sizes
        # the item of `events` to start at, the repetition (1..times) and the event in it when that is a
        # Repeat marker (0, 0 otherwise), and the index of that event counting every event a marker stands for
        self.at = (0, 0, 0, 0)
        self.forked: _Replay | None = None

    def fork(self, at: tuple[int, int, int, int]) -> "_Replay":
        """This replay with no capacity, to go on from `at` (NOTE [Forked replay])."""
        sim, blocks = self.sim.copy(None)
        new = _Replay(self.events, sim)
        new.live = {t: (None if b is None else blocks[id(b)], s, r) for t, (b, s, r) in self.live.items()}
        new.peak = list(self.peak)
        new.timeline = list(self.timeline)
        new.runs = list(self.runs)         # (their parts are never changed once made)
        new.lazy = [(*entry[:-1], set(entry[-1])) for entry in self.lazy]
        new.rounded = self.rounded
        new.at = at
        return new

    def run(self, fork: bool = False) -> SimResult:
        """Replay from `at` to the end or the first OOM; with `fork`, leave in `forked` a copy taken where
        capacity first pressed, if it did and the replay can be forked (NOTE [Forked replay])."""
        events = self.events
        sim = self.sim
        capacity_bytes = sim.capacity
        divisions = sim.config.roundup_power2_divisions
        live, peak = self.live, self.peak
        timeline, runs, lazy, rounded = self.timeline, self.runs, self.lazy, self.rounded
        append = timeline.append
        malloc, free = sim.malloc, sim.free
        touched: dict[int, _Block] | None = None                # id(segment) -> a live block of it, while folding
        j0, k0, r0, x = self.at

        def apply(i: int, op: str, tensor: int, size: int, label: str) -> OomReport | None:
            sim.step = i
            if op == "alloc":
                if tensor in live:
                    raise ValueError(f"event {i}: tensor {tensor} allocated twice without a free")
                if size <= 0:
                    if size < 0:
                        raise ValueError(f"event {i}: negative size {size}")
                    # NOTE: CCA.cpp `NativeCachingAllocator::allocate`: size-0
                    # requests return a null DataPtr and never reach malloc.
                    live[tensor] = (None, 0, 0)
                else:
                    try:
                        blk = malloc(size, label, tensor)
                    except AllocatorOutOfMemory as e:
                        append((sim.allocated, sim.reserved))
                        return attrs.evolve(e.report, live_rounded_bytes=peak[0])
                    r = rounded.get(size)
                    if r is None:
                        r = rounded[size] = round_size(size, divisions)
                    live[tensor] = (blk, size, r)
                    blk.tensor = tensor
                    if touched is not None:
                        touched[id(blk.seg)] = blk
                        if blk.seg.expandable:   # the span it changed: the block and the rest of the free block it split
                            nxt = blk.next
                            note(blk, blk.addr, nxt.addr + nxt.size if nxt is not None and not nxt.allocated
                                 else blk.addr + blk.size)
                    peak[0] += r
                    if peak[0] > peak[1]:
                        peak[1] = peak[0]
                        peak[2] = i
            elif op == "free":
                entry = live.pop(tensor, None)
                if entry is None:
                    if not (lazy and made(tensor)):
                        raise ValueError(f"event {i}: free of unknown tensor {tensor}")
                    entry = live.pop(tensor)
                blk, have, r = entry
                if size != 0 and size != have:
                    raise ValueError(f"event {i}: free size {size} != allocated size {have} for tensor {tensor}")
                if blk is not None:
                    free(blk)
                    if touched is not None:
                        touched[id(blk.seg)] = blk     # (free merges its free neighbours into blk: blk lives on)
                        if blk.seg.expandable:
                            note(blk, blk.addr, blk.addr + blk.size)
                    peak[0] -= r
            elif op == "empty_cache":
                sim.empty_cache()
            else:
                raise ValueError(f"event {i}: unknown op {op!r}")
            append((sim.allocated, sim.reserved))
            return None

        spans: dict[int, list[int]] = {}     # id(expandable segment) -> [lo, hi): where the repetition changed it

        def note(blk: _Block, lo: int, hi: int) -> None:
            s = spans.get(id(blk.seg))
            if s is None:
                spans[id(blk.seg)] = [lo, hi]
            else:
                s[0], s[1] = min(s[0], lo), max(s[1], hi)

        def state(base: int, cut: int) -> tuple | None:
            """The allocator's state where the last repetition touched it (NOTE [Folded replay]); None when a block
            is not where its neighbours say (then nothing is folded). An expandable segment holds every block of its
            pool (a model's weights too): only the blocks over the span the repetition changed are read, the others
            being as they were."""
            segs = []
            for blk in touched.values():
                span = spans.get(id(blk.seg)) if blk.seg.expandable else None
                head = blk
                while head.prev is not None and (span is None or head.addr > span[0]):
                    head = head.prev
                row = [head.seg.base]
                b: _Block | None = head
                while b is not None and (span is None or b.addr < span[1]):
                    if b.next is not None and b.next.prev is not b:
                        return None
                    t = b.tensor if b.allocated else None
                    row.append((b.addr, b.size, b.allocated, b.mapped,
                                None if t is None else (0, t - base) if t >= cut else (1, t)))
                    b = b.next
                segs.append(tuple(row))
            segs.sort()
            return (sim.allocated, sim.reserved, sim.num_device_alloc, sim.num_device_free, sim.num_alloc_retries,
                    sim._next_addr, peak[0], tuple(segs))

        def growth(before: tuple, base: int, first: int) -> tuple | None:
            """How a repetition that only allocates grew the allocator, when it only made new segments, each wholly
            allocated (NOTE [Folded replay]): their blocks (offset, size, request, tensor from the repetition's
            first id), the counters' growth, where in it each peak was last raised, and its timeline less its start;
            None otherwise."""
            x0, a0, r0, n0, f0, t0, next0, l0 = before
            if (sim.num_device_free, sim.num_alloc_retries) != (f0, t0) or sim.allocated_peak_index < x0 or \
                    sim.reserved_peak_index < x0 or peak[2] < x0:
                return None
            segs = []
            for blk in touched.values():
                seg = blk.seg
                if seg.base < next0 or seg.expandable:
                    return None           # an old segment (or the expandable one) changed
                head = blk
                while head.prev is not None:
                    head = head.prev
                row = []
                b: _Block | None = head
                while b is not None:
                    t = b.tensor
                    if not b.allocated or not b.mapped or t < base:
                        return None
                    row.append((b.addr - seg.base, b.size, b.requested, t - base))
                    b = b.next
                segs.append((seg.base, seg.size, seg.is_small, tuple(row)))
            segs.sort()
            at = next0
            for seg_base, size, _, _ in segs:    # one after the other, as `made` will place them again
                if seg_base != at:
                    return None
                at += size + K_LARGE_BUFFER
            if at != sim._next_addr:
                return None
            return (tuple((size, small, row) for _, size, small, row in segs),
                    (sim.allocated - a0, sim.reserved - r0, sim.num_device_alloc - n0, sim._next_addr - next0,
                     peak[0] - l0),
                    (sim.allocated_peak_index - x0, sim.reserved_peak_index - x0, peak[2] - x0),
                    tuple((a - a0, r - r0) for a, r in timeline[first:]))

        def grow(g: tuple, base: int, stride: int, more: int) -> None:
            """`more` repetitions like the last, which only made new, wholly allocated segments (growth): every
            counter and peak moved on, and the segments noted, to be made (at the addresses cudaMalloc gives them)
            only if one of their tensors is ever freed (`made`)."""
            layout, (da, dr, dn, dnext, dl), _, _ = g
            lazy.append((base + stride, base + (more + 1) * stride, stride, layout, sim._next_addr, dnext, set()))
            span = more * len(g[3])
            sim._next_addr += more * dnext
            sim.allocated += more * da
            sim.reserved += more * dr
            sim.num_device_alloc += more * dn
            peak[0] += more * dl
            sim.allocated_peak, sim.allocated_peak_index = sim.allocated_peak + more * da, sim.allocated_peak_index + span
            sim.reserved_peak, sim.reserved_peak_index = sim.reserved_peak + more * dr, sim.reserved_peak_index + span
            peak[1], peak[2] = peak[1] + more * dl, peak[2] + span

        def made(tensor: int) -> bool:
            """Make the segments of the skipped repetition that allocated `tensor` (grow), if one did."""
            for first, end, stride, layout, addr, dnext, done in lazy:
                if first <= tensor < end:
                    j = (tensor - first) // stride
                    if j in done:
                        return False
                    done.add(j)
                    at = addr + j * dnext
                    for size, small, row in layout:
                        # (cudaMalloc's addresses: every segment size is a multiple of the 2 MiB alignment, so the
                        # bump pointer stays aligned and each segment starts where the one before left it)
                        pool = sim.small if small else sim.large
                        seg = _Segment(at, size, False, size, small)
                        at += size + K_LARGE_BUFFER
                        prev: _Block | None = None
                        for off, bsize, requested, rel in row:
                            b = _Block(bsize, seg.base + off, pool, seg)
                            b.allocated = True
                            b.requested = requested
                            b.prev = prev
                            if prev is not None:
                                prev.next = b
                            prev = b
                            sim.active[b.addr] = b
                            t = first + j * stride + rel
                            live[t] = (b, requested, round_size(requested, divisions))
                            b.tensor = t
                    return True
            return False

        where = [j0, 0, 0]          # the item of `events` being replayed, and in a Repeat its repetition and event

        def press() -> None:
            # capacity presses for the first time: copy the replay as it was before this event (NOTE [Forked
            # replay]), to go on from this event
            sim.on_press = None
            j, k, i = where
            self.forked = self.fork((j, k, i, sim.step) if type(events[j]) is Repeat else (j, 0, 0, sim.step))

        if fork and capacity_bytes is not None and not sim._gc and not sim.config.expandable_segments:
            sim.on_press = press
        oom: OomReport | None = None
        for j in range(j0, len(events)):       # x: the index of the next event, counting every event a marker stands for
            ev = events[j]
            if type(ev) is not Repeat:
                where[0] = j
                oom = apply(x, ev.op, ev.tensor, ev.size, ev.label)
                x += 1
                if oom is not None:
                    break
                continue
            base = events[j - ev.length:j]
            cut = ev.lo - ev.stride
            allocs_only = all(e.op == "alloc" for e in base)
            states: list = []           # per repetition: the state where it touched it
            starts: list[int] = []      # per repetition: where its timeline entries start
            grown: list = []            # per repetition that only allocates: how it grew the allocator (or None)
            where[0] = j
            k, r0 = (k0, r0) if j == j0 and k0 else (1, 0)    # a fork goes on inside its repetition
            tries = k + MAX_FOLD_TRIES     # (counted from where this replay starts the marker: a fork too)
            while k <= ev.times:
                shift = k * ev.stride
                touched = {} if not sim._gc and k < tries and not r0 else None
                spans.clear()
                starts.append(len(timeline))
                before = (x, sim.allocated, sim.reserved, sim.num_device_alloc, sim.num_device_free,
                          sim.num_alloc_retries, sim._next_addr, peak[0])
                where[1] = k
                for i in range(r0, len(base)):
                    e = base[i]
                    where[2] = i
                    oom = apply(x, e.op, e.tensor + shift if e.tensor >= cut else e.tensor, e.size, "")
                    x += 1
                    if oom is not None:
                        oom = attrs.evolve(oom, label=ev.label(k, i))
                        break
                r0 = 0
                if oom is not None:
                    break
                if allocs_only and touched is not None:
                    grown.append(growth(before, ev.lo + shift, starts[-1]))
                    if len(grown) >= 2 and grown[-1] is not None and grown[-1] == grown[-2] and k < ev.times:
                        g = grown[-1]
                        more = ev.times - k
                        if capacity_bytes is not None:     # the rest until a cudaMalloc would not fit: one by one
                            more = min(more, (capacity_bytes - sim.reserved) // g[1][1])
                        if more > 0:
                            runs.append((timeline[:starts[-1]], 1))
                            runs.append((timeline[starts[-1]:], more + 1, g[1][:2]))
                            timeline.clear()
                            grow(g, ev.lo + shift, ev.stride, more)
                            x += more * ev.length
                            k += more
                            starts, states, grown = [], [None], []
                            touched = None
                            k += 1
                            continue
                states.append(state(ev.lo + shift, cut + shift) if touched is not None else None)
                touched = None
                c = _cycle(states)
                if c and ev.times - k >= c:
                    skip = (ev.times - k) // c * c     # every later cycle of c repetitions does what the last did
                    first = starts[-c]
                    runs.append((timeline[:first], 1))
                    runs.append((timeline[first:], skip // c + 1))
                    timeline.clear()
                    starts = []
                    moved = {}
                    for t in [t for t in live if t >= cut + shift]:
                        moved[t + skip * ev.stride] = live.pop(t)
                    for t, entry in moved.items():
                        live[t] = entry
                        if entry[0] is not None:
                            entry[0].tensor = t
                    x += skip * ev.length
                    k += skip
                    states = [None]        # the rest (fewer than c) one by one
                k += 1
            if oom is not None:
                break
        return SimResult(
            allocated_peak=sim.allocated_peak,
            reserved_peak=sim.reserved_peak,
            allocated_peak_index=sim.allocated_peak_index,
            reserved_peak_index=sim.reserved_peak_index,
            oom=oom,
            timeline=Folded(runs + [(timeline, 1)]) if runs else tuple(timeline),
            live_rounded_peak=peak[1],
            live_rounded_peak_index=peak[2],
            final_allocated=sim.allocated,
            final_reserved=sim.reserved,
            num_alloc_retries=sim.num_alloc_retries,
            num_device_alloc=sim.num_device_alloc,
            num_device_free=sim.num_device_free,
        )


def min_fitting_capacity(
    events: Sequence[Event],
    config: AllocatorConfig = AllocatorConfig(),
    granularity: int = K_ROUND_LARGE,
) -> int | None:
    """Smallest capacity (to ``granularity``) at which ``events`` replay without OOM.

    A better "how much would it need" than ``simulate(events, None)``'s
    ``reserved_peak``, which never releases anything (no memory pressure) and
    so overstates what the default allocator with ``max_split_size`` or the
    expandable allocator need. Bisection between ``live_rounded_peak`` (no
    capacity below it can fit) and the unlimited ``reserved_peak`` (fits, except
    in the corner cases noted in docs/allocator.md). The allocator is not
    strictly monotone in capacity, so the result always fits but may not be
    the very smallest capacity that does. None if even the upper bound OOMs.
    """
    unlimited = simulate(events, None, config)
    hi = -(-unlimited.reserved_peak // granularity) * granularity
    if simulate(events, hi, config).oom is not None:
        return None
    lo = unlimited.live_rounded_peak // granularity * granularity  # may not fit
    if lo == hi:
        return hi
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        if simulate(events, mid, config).oom is None:
            hi = mid
        else:
            lo = mid
    return hi
