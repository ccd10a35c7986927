"""Tests for the CUDA caching allocator simulator (dflash_graph.analysis.allocator)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_graph.analysis.allocator import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocatorSim,
    Event,
    Folded,
    Repeat,
    allocation_size,
    min_fitting_capacity,
    pool_of,
    round_size,
    simulate,
    simulate_pair,
)
from dflash_graph.analysis import allocator
from test_layer_folding import CONFIGS, _same, repeated_events

KiB = 1024
MiB = 1024 * KiB
DEFAULT = AllocatorConfig()
EXPANDABLE = AllocatorConfig(expandable_segments=True)


def A(t: int, size: int, label: str = "") -> Event:
    return Event("alloc", t, size, label)


def F(t: int) -> Event:
    return Event("free", t, 0)


def mib(pairs):
    return [(a / MiB, r / MiB) for a, r in pairs]


# ---------------------------------------------------------------- rounding


@pytest.mark.parametrize(
    "n, expected",
    [
        (0, 512),
        (1, 512),
        (511, 512),
        (512, 512),
        (513, 1024),
        (1000, 1024),
        (1 * MiB, 1 * MiB),
        (1 * MiB + 1, 1 * MiB + 512),
        (270 * MiB + 3, 270 * MiB + 512),
    ],
)
def test_round_size(n, expected):
    assert round_size(n) == expected


def test_round_size_power2_divisions_and_errors():
    # 5000 lies in [4096, 8192); 4 divisions -> steps of 1024 -> 5120
    assert round_size(5000, 4) == 5120
    assert round_size(4096, 4) == 4096
    # at or below 512 * divisions the plain 512 rounding applies
    assert round_size(1200, 4) == 1536
    with pytest.raises(ValueError):
        round_size(-1)


@pytest.mark.parametrize(
    "rounded, pool, seg",
    [
        (512, "small", K_SMALL_BUFFER),
        (K_SMALL_SIZE, "small", K_SMALL_BUFFER),
        (K_SMALL_SIZE + 512, "large", K_LARGE_BUFFER),
        (10 * MiB - 512, "large", K_LARGE_BUFFER),
        (10 * MiB, "large", 10 * MiB),
        (10 * MiB + 512, "large", 12 * MiB),
        (530 * MiB, "large", 530 * MiB),
    ],
)
def test_pool_and_segment_size(rounded, pool, seg):
    assert pool_of(rounded) == pool
    assert allocation_size(rounded) == seg


# ---------------------------------------------------------------- basic packing


def test_small_allocations_share_a_2mib_segment():
    r = simulate([A(0, 100), A(1, 1 * MiB), A(2, 1 * MiB)], None)
    assert r.timeline[0] == (512, 2 * MiB)
    assert r.timeline[1] == (512 + 1 * MiB, 2 * MiB)
    # 1 MiB does not fit in the rest (1 MiB - 512) of the first segment
    assert r.timeline[2] == (512 + 2 * MiB, 4 * MiB)
    assert r.allocated_peak == r.live_rounded_peak == 512 + 2 * MiB


def test_medium_large_requests_share_a_20mib_segment():
    r = simulate([A(0, 3 * MiB), A(1, 3 * MiB), A(2, 14 * MiB)], None)
    assert [t[1] for t in r.timeline] == [20 * MiB, 20 * MiB, 20 * MiB]
    # the 14 MiB request exactly fills the remainder of the 20 MiB segment
    assert r.allocated_peak == 20 * MiB


def test_unsplit_remainder_counts_as_allocated():
    # 13 MiB -> 14 MiB segment; the 1 MiB remainder is not > kSmallSize, so the
    # block is not split and max_memory_allocated reports 14 MiB
    r = simulate([A(0, 13 * MiB)], None)
    assert r.allocated_peak == 14 * MiB
    assert r.live_rounded_peak == 13 * MiB
    # expandable segments split whenever >= 512 bytes remain
    r = simulate([A(0, 13 * MiB)], None, EXPANDABLE)
    assert r.allocated_peak == 13 * MiB
    assert r.reserved_peak == 20 * MiB  # one 20 MiB page


def test_zero_size_tensors_never_reach_the_allocator():
    r = simulate([A(0, 0), F(0), A(1, 0)], 0)
    assert r.oom is None
    assert r.timeline == ((0, 0), (0, 0), (0, 0))


def test_plain_reuse_keeps_reserved_flat():
    events = []
    for it in range(50):
        base = 10 * it
        events += [A(base, 100 * MiB), A(base + 1, 3 * MiB), A(base + 2, 4 * KiB)]
        events += [F(base + 2), F(base), F(base + 1)]
    for cfg in (DEFAULT, EXPANDABLE):
        r = simulate(events, None, cfg)
        first = r.timeline[5][1]
        assert all(res == first for _, res in r.timeline[5:])
        assert r.reserved_peak == first
        assert r.final_allocated == 0
    r = simulate(events, None)
    assert r.num_device_alloc == 3  # 100 MiB, 20 MiB, 2 MiB segments, once
    assert r.reserved_peak == 122 * MiB


# ---------------------------------------------------------------- public cases

# vLLM PR 41268: a 270 MiB tensor placed in a cached 530 MiB block pins it.
VLLM = [
    A(1, 530 * MiB, "A"),
    A(2, 100 * MiB, "D"),
    F(1),
    A(3, 270 * MiB, "B"),  # best fit: the cached 530 MiB block, split 270 + 260
    F(2),
    A(4, 650 * MiB, "C"),
]


def test_vllm_41268_small_tensor_pins_cached_segment():
    r = simulate(VLLM, None)
    allocated, reserved = r.timeline[4]
    assert allocated == 270 * MiB
    assert reserved >= 530 * MiB  # the 530 MiB segment cannot be given back
    # the later big request has to grow reserved by a whole new segment
    assert r.timeline[5] == (920 * MiB, 1280 * MiB)
    assert r.reserved_peak == 1280 * MiB and r.reserved_peak_index == 5


def test_vllm_41268_ooms_where_expandable_fits():
    cap = 1000 * MiB
    assert 270 * MiB + 650 * MiB <= cap  # live tensors fit on paper
    r = simulate(VLLM, cap)
    assert r.oom is not None and r.oom.index == 5 and r.oom.label == "C"
    x = simulate(VLLM, cap, EXPANDABLE)
    assert x.oom is None
    assert x.final_allocated == 920 * MiB
    assert x.reserved_peak <= cap


# pytorch issue 35901: a big cached segment gets fragmented by smaller tensors
# of the next iteration; with some of them live it cannot be released, and the
# big tensor cannot be re-created.
ISSUE_35901 = (
    [A(0, 600 * MiB, "big"), F(0)]
    + [A(10 + i, 16 * MiB, f"act{i}") for i in range(10)]
    + [F(10 + i) for i in range(0, 10, 2)]
    + [A(1, 600 * MiB, "big again")]
)


def test_issue_35901_fragmented_segment_ooms():
    cap = 1000 * MiB
    r = simulate(ISSUE_35901, cap)
    assert r.oom is not None and r.oom.label == "big again"
    assert r.oom.allocated_bytes == 5 * 16 * MiB
    assert r.oom.allocated_bytes + r.oom.requested_bytes < cap
    # the whole 600 MiB segment stays reserved: split, so not releasable
    assert r.oom.reserved_bytes == 600 * MiB
    assert r.oom.largest_free_block_bytes < 600 * MiB


def test_issue_35901_fits_with_expandable_segments_or_max_split():
    cap = 1000 * MiB
    x = simulate(ISSUE_35901, cap, EXPANDABLE)
    assert x.oom is None and x.final_allocated == 680 * MiB
    # the fix of PR 44742: oversize blocks are not split for small requests
    m = simulate(ISSUE_35901, cap, AllocatorConfig(max_split_size_bytes=200 * MiB))
    assert m.oom is None and m.final_allocated == 680 * MiB


def test_torchtune_1185_growing_sizes_inflate_reserved():
    # Every step allocates three activations a bit larger than the last step's
    # (varying sequence length). Default: the cached, exactly-sized segments of
    # earlier steps are all too small, so each step adds new segments and
    # reserved keeps growing (nothing is given back without memory pressure).
    # Expandable: freed ranges merge into one region that the next step reuses.
    events, t = [], 0
    for step in range(10):
        ids = list(range(t, t + 3))
        t += 3
        events += [A(i, (100 + 2 * step) * MiB) for i in ids] + [F(i) for i in ids]
    d = simulate(events, None)
    x = simulate(events, None, EXPANDABLE)
    assert d.live_rounded_peak == x.live_rounded_peak == 3 * 118 * MiB
    assert d.reserved_peak == 3 * sum(100 + 2 * s for s in range(10)) * MiB
    assert x.reserved_peak <= x.live_rounded_peak + K_LARGE_BUFFER
    # under a capacity the default allocator releases the unsplit cached
    # segments and retries, so this pattern costs retries rather than an OOM
    c = simulate(events, 400 * MiB)
    assert c.oom is None and c.num_alloc_retries > 0


def test_oom_report_fields():
    cap = 1000 * MiB
    r = simulate(VLLM, cap)
    o = r.oom
    assert o is not None
    assert o.requested_bytes == round_size(650 * MiB) == 650 * MiB
    assert o.orig_requested_bytes == 650 * MiB
    assert o.alloc_size_bytes == 650 * MiB
    assert o.allocated_bytes == 270 * MiB
    # D's unsplit 100 MiB segment was released before giving up; the pinned
    # 530 MiB one was not
    assert o.reserved_bytes == 530 * MiB
    assert o.free_bytes == cap - o.reserved_bytes == 470 * MiB
    assert o.reserved_unallocated_bytes == 260 * MiB
    assert o.capacity_bytes == cap and o.pool == "large" and o.tensor == 4
    assert o.live_rounded_bytes == 270 * MiB
    assert "Tried to allocate 650.00 MiB" in o.message()
    # simulation stops at the OOM; the failing event has a timeline entry
    assert len(r.timeline) == o.index + 1
    assert r.timeline[-1] == (o.allocated_bytes, o.reserved_bytes)
    assert r.num_alloc_retries == 1


def test_oom_request_size_is_rounded_and_alloc_size_is_the_segment():
    r = simulate([A(0, 3 * MiB + 1, "x")], 10 * MiB)
    o = r.oom
    assert o is not None
    assert o.requested_bytes == 3 * MiB + 512
    assert o.alloc_size_bytes == K_LARGE_BUFFER
    assert o.free_bytes == 10 * MiB and o.reserved_bytes == 0


def test_release_on_oom_frees_cached_segments_before_failing():
    events = [A(0, 600 * MiB), F(0), A(1, 700 * MiB)]
    r = simulate(events, 1000 * MiB)
    assert r.oom is None and r.final_reserved == 700 * MiB
    assert r.num_alloc_retries == 1 and r.num_device_free == 1
    n = simulate(events, 1000 * MiB, AllocatorConfig(release_on_oom=False))
    assert n.oom is not None and n.oom.reserved_bytes == 600 * MiB


# ---------------------------------------------------------------- config rules


def test_max_split_size_oversize_rules():
    cfg = AllocatorConfig(max_split_size_bytes=100 * MiB)
    # a cached oversize block is not handed to a smaller (non-oversize) request
    r = simulate([A(0, 300 * MiB), F(0), A(1, 50 * MiB)], None, cfg)
    assert r.final_reserved == 350 * MiB
    # an oversize request reuses it within max_non_split_rounding (20 MiB) ...
    r = simulate([A(0, 300 * MiB), F(0), A(1, 290 * MiB)], None, cfg)
    assert r.final_reserved == 300 * MiB
    assert r.final_allocated == 300 * MiB  # not split
    # ... but not beyond
    r = simulate([A(0, 300 * MiB), F(0), A(1, 280 * MiB)], None, cfg)
    assert r.final_reserved == 580 * MiB
    # under pressure one oversize cached block is released (release_available_cached_blocks)
    r = simulate([A(0, 300 * MiB), A(2, 200 * MiB), F(0), F(2), A(1, 280 * MiB)], 600 * MiB, cfg)
    assert r.oom is None and r.num_alloc_retries == 0
    assert r.final_reserved == 480 * MiB  # the 300 MiB block went, the 200 MiB one stayed


def test_config_validation_and_parsing():
    with pytest.raises(ValueError):
        AllocatorConfig(max_split_size_bytes=10 * MiB)
    with pytest.raises(ValueError):
        AllocatorConfig(garbage_collection_threshold=1.5)
    with pytest.raises(ValueError):
        AllocatorConfig(roundup_power2_divisions=3)
    cfg = AllocatorConfig.from_alloc_conf(
        "expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6,"
        "pinned_use_background_threads:True"
    )
    assert cfg == AllocatorConfig(
        expandable_segments=True, max_split_size_bytes=128 * MiB, garbage_collection_threshold=0.6
    )
    with pytest.raises(ValueError):
        AllocatorConfig.from_alloc_conf("backend:cudaMallocAsync")


def test_garbage_collection_threshold_releases_old_cached_segments():
    events = [A(0, 600 * MiB), F(0), A(1, 700 * MiB)]
    no_gc = simulate(events, 2000 * MiB)
    assert no_gc.reserved_peak == 1300 * MiB
    gc = simulate(events, 2000 * MiB, AllocatorConfig(garbage_collection_threshold=0.25))
    assert gc.reserved_peak == 700 * MiB and gc.num_alloc_retries == 0
    # without a capacity (no memory fraction) GC never runs, as in PyTorch
    assert simulate(events, None, AllocatorConfig(garbage_collection_threshold=0.25)).reserved_peak == 1300 * MiB


def test_empty_cache():
    ev = [A(0, 100 * MiB), A(1, 3 * MiB), A(2, 3 * MiB), F(0), F(1), Event("empty_cache", -1, 0)]
    r = simulate(ev, None)
    # the 100 MiB segment is released; the 20 MiB one still holds tensor 2
    assert r.timeline[-1] == (3 * MiB, 20 * MiB)
    x = simulate(ev, None, EXPANDABLE)
    # expandable: the five fully free 20 MiB pages of [0, 100) MiB are
    # unmapped; the page [100, 120) holding tensor 2 stays mapped
    assert x.timeline[-2] == (3 * MiB, 122 * MiB - 2 * MiB)
    assert x.timeline[-1] == (3 * MiB, 20 * MiB)


# ---------------------------------------------------------------- expandable


def test_expandable_segment_grows_in_pages_and_reuses_tail():
    x = simulate([A(0, 30 * MiB), A(1, 5 * MiB), A(2, 600 * KiB)], None, EXPANDABLE)
    assert mib(x.timeline) == [(30, 40), (35, 40), (35 + 600 / 1024, 42)]


def test_expandable_is_not_always_smaller_without_capacity():
    # Without memory pressure nothing is ever unmapped, and the 20 MiB page
    # rounding of the growing segment can cost more than exact-size segments.
    ev = [A(0, 30 * MiB), A(1, 30 * MiB), F(0), A(2, 32 * MiB)]
    assert simulate(ev, None).reserved_peak == 92 * MiB
    assert simulate(ev, None, EXPANDABLE).reserved_peak == 100 * MiB


def test_expandable_unmaps_free_pages_under_pressure():
    # X's freed range is split by a small tensor Q. Default: X's segment is
    # pinned, Y OOMs. Expandable: the free pages of the hole are unmapped on the
    # failed map and Y is mapped at the tail instead.
    ev = [A(0, 200 * MiB, "X"), A(1, 20 * MiB, "P"), F(0), A(2, 2 * MiB, "Q"), A(3, 260 * MiB, "Y")]
    d = simulate(ev, 300 * MiB)
    assert d.oom is not None and d.oom.label == "Y"
    assert d.oom.allocated_bytes + d.oom.requested_bytes <= 300 * MiB
    x = simulate(ev, 300 * MiB, EXPANDABLE)
    assert x.oom is None and x.num_alloc_retries == 1
    # [2, 20) MiB stays mapped (partial page), [20, 200) MiB was unmapped
    assert x.final_reserved == 300 * MiB and x.final_allocated == 282 * MiB


def test_min_fitting_capacity():
    # vLLM case: default needs the pinned 530 MiB segment plus a new 650 MiB
    # one (minus what it can release); expandable needs about the live peak.
    d = min_fitting_capacity(VLLM)
    x = min_fitting_capacity(VLLM, EXPANDABLE)
    assert d is not None and x is not None
    assert simulate(VLLM, d).oom is None and simulate(VLLM, d - 2 * MiB).oom is not None
    assert d == 1180 * MiB
    assert 920 * MiB <= x <= 940 * MiB < d
    assert simulate(VLLM, x, EXPANDABLE).oom is None
    assert min_fitting_capacity([]) == 0


# ---------------------------------------------------------------- trace errors


def test_malformed_traces():
    with pytest.raises(ValueError):
        simulate([A(0, 10), A(0, 10)], None)
    with pytest.raises(ValueError):
        simulate([F(3)], None)
    with pytest.raises(ValueError):
        simulate([A(0, 10), Event("free", 0, 20)], None)
    with pytest.raises(ValueError):
        simulate([A(0, -1)], None)
    assert simulate([A(0, 10), Event("free", 0, 10)], None).final_reserved == 2 * MiB
    sim = CachingAllocatorSim(30 * MiB)
    b = sim.malloc(3 * MiB)  # a 20 MiB segment
    sim.free(b)
    with pytest.raises(ValueError):
        sim.free(b)
    with pytest.raises(ValueError):
        sim.malloc(0)
    with pytest.raises(AllocatorOutOfMemory) as exc:
        sim.malloc(31 * MiB)  # 32 MiB segment > capacity even after releasing the cache
    assert exc.value.report.reserved_bytes == 0  # the cached 20 MiB segment was released
    assert sim.malloc(21 * MiB).size == 22 * MiB


# ---------------------------------------------------------------- property


_sizes = st.one_of(
    st.integers(1, 2 * MiB),  # small pool and the 1-2 MiB edge
    st.integers(1 * MiB, 40 * MiB),  # kLargeBuffer / kMinLargeAlloc range
    st.integers(1, 400 * MiB),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), _sizes),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("empty_cache"), st.just(0)),
    ),
    max_size=60,
)
_configs = st.sampled_from(
    [
        DEFAULT,
        EXPANDABLE,
        AllocatorConfig(max_split_size_bytes=64 * MiB),
        AllocatorConfig(expandable_segments=True, max_split_size_bytes=64 * MiB),
        AllocatorConfig(garbage_collection_threshold=0.5),
        AllocatorConfig(roundup_power2_divisions=4),
    ]
)
_caps = st.one_of(st.none(), st.integers(20, 3000).map(lambda m: m * MiB))


def _events(ops) -> list[Event]:
    events, live, tid = [], [], 0
    for op, arg in ops:
        if op == "alloc":
            events.append(A(tid, arg))
            live.append(tid)
            tid += 1
        elif op == "free" and live:
            events.append(F(live.pop(arg % len(live))))
        elif op == "empty_cache":
            events.append(Event("empty_cache", -1, 0))
    return events


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, cfg=_configs, cap=_caps)
def test_invariants_hold_for_random_traces(ops, cfg, cap):
    events = _events(ops)
    r = simulate(events, cap, cfg)
    n = len(r.timeline)
    assert n == (r.oom.index + 1 if r.oom else len(events))

    # internal consistency after every event (block tiling, merging, pool
    # indexes, allocated/reserved bookkeeping, reserved <= capacity)
    sim = CachingAllocatorSim(cap, cfg)
    handles = {}
    for i, e in enumerate(events[:n]):
        sim.step = i
        if e.op == "alloc":
            try:
                handles[e.tensor] = sim.malloc(e.size)
            except AllocatorOutOfMemory:
                assert r.oom is not None and i == r.oom.index
        elif e.op == "free":
            sim.free(handles.pop(e.tensor))
        else:
            sim.empty_cache()
        sim.check_invariants()
        assert (sim.allocated, sim.reserved) == r.timeline[i]

    # independent bookkeeping of live rounded sizes
    live: dict[int, int] = {}
    peak = 0
    divisions = cfg.roundup_power2_divisions
    for i, e in enumerate(events[:n]):
        if e.op == "alloc" and not (r.oom and i == r.oom.index):
            live[e.tensor] = e.size
        elif e.op == "free":
            live.pop(e.tensor)
        rounded = sum(round_size(s, divisions) for s in live.values())
        peak = max(peak, rounded)
        allocated, reserved = r.timeline[i]
        assert allocated <= reserved
        if cap is not None:
            assert reserved <= cap
        assert allocated >= rounded
        if cfg.expandable_segments:
            assert allocated == rounded  # blocks split whenever >= 512 B remain
        elif cfg.max_split_size_bytes is None:
            # an unsplit large block exceeds its request by at most kSmallSize
            n_large = sum(1 for s in live.values() if round_size(s, divisions) > K_SMALL_SIZE)
            assert allocated - rounded <= n_large * K_SMALL_SIZE
    assert r.live_rounded_peak == peak
    assert r.allocated_peak == max((a for a, _ in r.timeline), default=0)
    assert r.allocated_peak >= r.live_rounded_peak
    assert r.reserved_peak >= max((res for _, res in r.timeline), default=0)
    if cap is not None:
        assert r.reserved_peak <= cap

    if r.oom is not None:
        o = r.oom
        failing = events[o.index]
        assert o.requested_bytes == round_size(failing.size, divisions)
        assert o.free_bytes == cap - o.reserved_bytes
        assert (o.allocated_bytes, o.reserved_bytes) == r.timeline[-1]
        if cfg.expandable_segments:
            page = K_SMALL_BUFFER if o.requested_bytes <= K_SMALL_SIZE else K_LARGE_BUFFER
            assert o.free_bytes < -(-o.requested_bytes // page) * page
        else:
            assert o.free_bytes < o.alloc_size_bytes

    has_empty_cache = any(e.op == "empty_cache" for e in events)
    if cap is None:
        assert r.oom is None
        if not has_empty_cache:
            # nothing is given back without memory pressure or empty_cache
            res = [x for _, x in r.timeline]
            assert res == sorted(res)

    if cfg.garbage_collection_threshold is None and not (cfg.expandable_segments and has_empty_cache):
        # A capacity at least the unlimited reserved peak changes nothing. (GC
        # only runs with a capacity; and once empty_cache has punched unmapped
        # holes into an expandable segment, its finite virtual range, 1 1/8 x
        # capacity, can run out where the unlimited one does not.)
        unlimited = simulate(events, None, cfg)
        enough = simulate(events, unlimited.reserved_peak, cfg)
        assert enough.oom is None and enough.timeline == unlimited.timeline
        if r.oom is not None:
            assert cap < unlimited.reserved_peak


# ---------------------------------------------------------------- forked replay (NOTE [Forked replay])


def _pair_is_two_replays(events, cap, cfg) -> None:
    bounded, need = simulate_pair(events, cap, cfg)
    _same(bounded, simulate(events, cap, cfg))
    if bounded.oom is None:
        assert need is None
    else:
        _same(need, simulate(events, None, cfg))


def test_forked_replay_goes_on_from_the_event_that_pressed():
    # 100 MiB: three 30 MiB segments, one freed; the 40 MiB request presses (130 MiB), the cached 30 MiB segment
    # is released; the next 30 MiB request does not fit: OOM. The unbounded replay goes on from a copy taken
    # before the 40 MiB request, the event that pressed (index 4).
    events = [A(0, 30 * MiB), A(1, 30 * MiB), A(2, 30 * MiB), F(1), A(3, 40 * MiB), A(4, 30 * MiB), F(0), F(4)]
    replay = allocator._Replay(events, CachingAllocatorSim(100 * MiB))
    assert replay.run(fork=True).oom.index == 5
    assert replay.forked.at == (4, 0, 0, 4)
    assert replay.forked.sim.capacity is None and replay.forked.timeline == [
        (30 * MiB, 30 * MiB), (60 * MiB, 60 * MiB), (90 * MiB, 90 * MiB), (60 * MiB, 90 * MiB)]
    _pair_is_two_replays(events, 100 * MiB, DEFAULT)
    # inside a Repeat: two 20 MiB tensors a repetition; at 70 MiB the second of the first repetition presses
    rep = [A(0, 20 * MiB), A(1, 20 * MiB), Repeat(2, 5, 2, 0, lambda k, i: f"rep {k}.{i}")]
    replay = allocator._Replay(rep, CachingAllocatorSim(70 * MiB))
    assert replay.run(fork=True).oom.label == "rep 1.1"
    assert replay.forked.at == (2, 1, 1, 3)
    _pair_is_two_replays(rep, 70 * MiB, DEFAULT)
    assert simulate_pair(rep, 70 * MiB)[1].reserved_peak == 12 * 20 * MiB
    # ten 30 MiB weights, the last seven grown in closed form (made only when one is freed), then 100 MiB: it
    # presses at 350 MiB, the bounded replay runs out there, and the copy frees every weight
    weights = [A(0, 30 * MiB), Repeat(1, 9, 1, 0, lambda k, i: f"w{k}"), A(10, 100 * MiB), F(10),
               *[F(t) for t in range(10)]]
    replay = allocator._Replay(weights, CachingAllocatorSim(350 * MiB))
    assert replay.run(fork=True).oom.index == 10
    assert replay.forked.at == (2, 0, 0, 10) and replay.forked.lazy
    _pair_is_two_replays(weights, 350 * MiB, DEFAULT)
    # 100,001 weights of 30 MiB, grown in closed form until 3,000 MiB presses, at the 100th: the copy folds the
    # repetitions left again (it counts its tries at folding from where it starts), the 99,900 are not replayed
    many = [A(0, 30 * MiB), Repeat(1, 100_000, 1, 0, lambda k, i: f"w{k}")]
    bounded, need = simulate_pair(many, 3000 * MiB)
    assert bounded.oom.index == 100 and need.reserved_peak == 100_001 * 30 * MiB
    assert isinstance(need.timeline, Folded) and sum(len(run[0]) for run in need.timeline.runs) < 100
    _pair_is_two_replays(many, 3000 * MiB, DEFAULT)
    # never forked where the capacity changes the allocator before it presses: garbage collection, expandable
    # segments (the pair is then two replays from scratch)
    for cfg in (AllocatorConfig(garbage_collection_threshold=0.5), EXPANDABLE):
        replay = allocator._Replay(events, CachingAllocatorSim(100 * MiB, cfg))
        assert replay.run(fork=True).oom is not None and replay.forked is None
        _pair_is_two_replays(events, 100 * MiB, cfg)


def _pressed(events, cfg, share: float) -> int:
    """A capacity `share` of what the events need unbounded, so that most draws press it (or run out)."""
    return max(1, int(share * simulate(events, None, cfg).reserved_peak))


_shares = st.floats(0.3, 1.1)


@settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, cfg=_configs, share=_shares)
def test_forked_replay_is_two_replays_from_scratch(ops, cfg, share):
    """simulate_pair == simulate against the capacity and, on an OOM, without one: every field, the timeline event
    for event, on random alloc/free/empty_cache traces and capacities."""
    events = _events(ops)
    _pair_is_two_replays(events, _pressed(events, cfg, share), cfg)


@settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(events=repeated_events(), cfg=st.sampled_from(CONFIGS), share=_shares)
def test_forked_replay_of_folded_events_is_two_replays_from_scratch(events, cfg, share):
    """The same on event lists with a Repeat marker (NOTE [Folded replay]): a fork taken inside a repetition goes
    on from the event that pressed."""
    _pair_is_two_replays(events, _pressed(events, cfg, share), cfg)
