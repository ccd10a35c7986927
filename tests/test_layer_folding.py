"""Folded layers give exactly the literal replay's answer (ops/costs.py, NOTE [Layer folding]; analysis/allocator.py,
NOTE [Folded replay]):

- the folded body program, written out, is the literal program step for step (keys included);
- the allocator model on an event list with Repeat markers gives what it gives on the list written out: every
  peak and index, the OOM, the timeline, on random repeated event lists, capacities and allocator settings;
- check on deep graphs gives the same report, timeline and event list with and without folding;
- folding does fold: deep graphs have markers, and the replay skips repetitions.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, strategies as st

from dflash_graph.analysis.allocator import (AllocatorConfig, Event, Folded, Repeat, expand_events, simulate,
                                             K_LARGE_BUFFER)
from dflash_graph.analysis.memory import device_events, folded_events
from dflash_graph.ops import costs
from dflash_graph.rewrite.pipeline import compile_graph

MiB = 1 << 20
L = "models.target.config.num_hidden_layers="


# -- the program ----------------------------------------------------------------------------------------------

def _target_dims(graph: str, layers: int):
    return compile_graph(graph, [f"{L}{layers}"], rewrite=False).typed.ctx.models["target"].dims


@pytest.fixture(scope="module")
def qwen_dims():
    return {n: _target_dims("tests/graphs/minimal.toml", n) for n in (2, 9, 40, 97)}


@given(layers=st.sampled_from([2, 9, 40, 97]), data=st.data(), has_hidden=st.booleans(),
       dtype=st.sampled_from([2, 4]), logits=st.sampled_from([0, 4096]))
def test_folded_program_written_out_is_the_literal_program(qwen_dims, layers, data, has_hidden, dtype, logits):
    d = qwen_dims[layers]
    captured = frozenset(data.draw(st.sets(st.integers(0, layers - 1), max_size=4)))
    folded = costs._body_steps(d, 16, dtype, captured, has_hidden, logits, True)
    literal = costs._body_steps(d, 16, dtype, captured, has_hidden, logits, False)
    assert not any(st[0] == "repeat" for st in literal)
    assert costs.expand_program(folded) == literal
    assert costs.program_peak(folded) == costs.program_peak(literal)
    assert costs.program_steps(folded) == costs.program_steps(literal)


def test_deep_programs_fold(qwen_dims):
    d = qwen_dims[97]
    folded = costs._body_steps(d, 16, 2, frozenset({30}), True, 0, True)
    reps = [st[1] for st in folded if st[0] == "repeat"]
    assert reps and sum(r.times * r.layers for r in reps) > 60
    assert len(folded) < len(costs.expand_program(folded)) / 3


def test_layer_period():
    assert costs._layer_period(("a", "a", "a", "b") * 5) == 4
    assert costs._layer_period(("x",) + ("a",) * 9) == 1
    assert costs._layer_period(("a", "b", "c")) == 2      # nothing to compare a period of 2 with: no repeat to fold
    assert costs._layer_period(tuple("ab"[i % 2] for i in range(40)) + ("c",)) is None


# -- the allocator model on random repeated event lists -------------------------------------------------------

SIZES = [512, 3000, 700 * 1024, 1 * MiB + 512, 3 * MiB, 12 * MiB, 25 * MiB, 64 * MiB]


@st.composite
def repeated_events(draw):
    """A prefix of random allocations (some freed), a period written once and repeated by a marker, then frees
    of what is left: the shape of a body forward's events (NOTE [Folded replay])."""
    events: list = []
    nxt = 0
    live: list[tuple[int, int]] = []
    for _ in range(draw(st.integers(0, 6))):
        size = draw(st.sampled_from(SIZES))
        events.append(Event("alloc", nxt, size, f"pre{nxt}"))
        live.append((nxt, size))
        nxt += 1
        if live and draw(st.booleans()):
            t, s = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append(Event("free", t, s, f"pre-free{t}"))
    k = draw(st.integers(1, 5))
    sizes = [draw(st.sampled_from(SIZES)) for _ in range(k)]
    grows = draw(st.booleans())     # only allocations, none freed (a model's layer weights)
    kept = set() if grows else draw(st.sets(st.integers(0, k - 1), max_size=k))   # freed by the next repetition
    # an order of the period's operations: ("a", i) alloc, ("f", i) free in the period, ("p", i) free of the
    # previous repetition's tensor i
    ops = [("a", i) for i in range(k)]
    for i in range(k):
        if i not in kept and not grows:
            ops.insert(draw(st.integers(ops.index(("a", i)) + 1, len(ops))), ("f", i))
    for i in sorted(kept):
        ops.insert(draw(st.integers(0, len(ops))), ("p", i))

    def period(base: int, first: bool) -> list:
        out = []
        for kind, i in ops:
            if kind == "a":
                out.append(Event("alloc", base + i, sizes[i], f"t{base + i}"))
            elif kind == "f":
                out.append(Event("free", base + i, sizes[i], f"free t{base + i}"))
            elif not first:
                out.append(Event("free", base - k + i, sizes[i], f"free t{base - k + i}"))
        return out

    events += period(nxt, True)
    nxt += k
    lo = nxt
    rep0 = period(lo, False)
    events += rep0
    times = draw(st.integers(1, 30))
    labels = [e.label for e in rep0]

    def label(j: int, i: int) -> str:
        e = rep0[i]
        t = e.tensor + j * k if e.tensor >= lo - k else e.tensor
        return f"{'free ' if e.op == 'free' else ''}t{t}"

    events.append(Repeat(len(rep0), times, k, lo, label))
    last = lo + times * k
    if grows and draw(st.booleans()):     # then temporaries after them, as a forward after the load
        events += [Event("alloc", last + k, 5 * MiB, "after"), Event("free", last + k, 5 * MiB, "after")]
    for i in sorted(kept):
        events.append(Event("free", last + i, sizes[i], f"free t{last + i}"))
    for t, s in live:
        if draw(st.booleans()):
            events.append(Event("free", t, s, f"end-free{t}"))
    assert labels
    return events


CONFIGS = [AllocatorConfig(), AllocatorConfig(expandable_segments=True),
           AllocatorConfig(max_split_size_bytes=K_LARGE_BUFFER), AllocatorConfig(garbage_collection_threshold=0.6),
           AllocatorConfig(release_on_oom=False)]


def _same(a, b) -> None:
    for f in attrs.fields(type(a)):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "timeline":
            assert list(x) == list(y)
        else:
            assert x == y, f.name


@given(events=repeated_events(), capacity=st.sampled_from([None, 8 * MiB, 40 * MiB, 100 * MiB, 300 * MiB]),
       config=st.sampled_from(CONFIGS))
def test_folded_replay_is_the_literal_replay(events, capacity, config):
    literal = expand_events(events)
    assert not any(type(e) is Repeat for e in literal)
    _same(simulate(events, capacity, config), simulate(literal, capacity, config))


@given(events=repeated_events(), usable=st.sampled_from([0, 8 * MiB, 40 * MiB, 100 * MiB, 300 * MiB, 10**12]))
def test_folded_cpu_replay_is_the_literal_replay(events, usable):
    """A CPU device's replay (live bytes, no cache) on folded events is the one on the events written out."""
    from dflash_graph.analysis.memory import _no_cache

    a, b = _no_cache(events, usable), _no_cache(expand_events(events), usable)
    assert (a.allocated_peak, a.allocated_peak_index, a.oom) == (b.allocated_peak, b.allocated_peak_index, b.oom)
    assert list(a.timeline) == list(b.timeline)


def test_weights_load_in_closed_form():
    """10,000 layer weight blocks, each a new wholly allocated segment: a few replayed, the rest made at once."""
    size = 100 * MiB
    rep = [Event("alloc", 1, size, "w")]
    events = [Event("alloc", 0, size, "w"), *rep, Repeat(1, 9_998, 1, 1, lambda k, i: "w"),
              Event("alloc", 10_000, 3 * MiB, "x"), Event("free", 10_000, 3 * MiB, "x")]
    r = simulate(events, None)
    assert r.allocated_peak == 10_000 * size + 3 * MiB and r.reserved_peak == 10_000 * size + 20 * MiB
    assert isinstance(r.timeline, Folded) and len(r.timeline) == 10_002
    _same(r, simulate(expand_events(events), None))
    fits = simulate(events, 5_000 * size + 20 * MiB)       # the OOM at the first block that does not fit
    assert fits.oom is not None and fits.oom.index == 5_000
    _same(fits, simulate(expand_events(events), 5_000 * size + 20 * MiB))


def test_a_long_repetition_is_skipped():
    """A period of temporaries repeated 100,000 times replays a few repetitions, and its timeline is one run."""
    rep = [Event("alloc", 10, 3 * MiB, "a"), Event("alloc", 11, 1000, "b"), Event("free", 8, 3 * MiB, "p"),
           Event("free", 11, 1000, "c")]
    events = [Event("alloc", 8, 3 * MiB, "x"), *rep, Repeat(len(rep), 100_000, 2, 10, lambda k, i: rep[i].label)]
    r = simulate(events, None)
    assert isinstance(r.timeline, Folded) and len(r.timeline) == 1 + 4 * 100_001
    assert len(r.timeline.runs) <= 4
    assert r.timeline[-1] == r.timeline[4] and r.allocated_peak == 6 * MiB + 1024


# -- check on deep graphs -------------------------------------------------------------------------------------

DEEP = [
    ("tests/graphs/minimal.toml", [f"{L}300"]),
    ("tests/graphs/minimal.toml", [f"{L}300", "devices.a.torch=cuda:0", "devices.a.capacity=64 MiB"]),
    ("tests/graphs/minimal.toml", [f"{L}300", "devices.a.torch=cuda:0", "devices.a.capacity=8 MiB"]),
    ("tests/graphs/minimal.toml", [f"{L}300", "devices.a.torch=cuda:0", "devices.a.capacity=64 MiB",
                                   "memory.expandable_segments=true"]),
    ("graphs/qwen27b.toml", [f"{L}200"]),
    ("graphs/qwen27b.toml", [f"{L}200", "models.target.dtype=float32", "models.drafter.dtype=float32"]),
    ("graphs/qwen27b.toml", [f"{L}300", "memory.expandable_segments=true"]),
]


@pytest.mark.parametrize("graph,overrides", DEEP, ids=[f"{g.split('/')[-1]}-{i}" for i, (g, _) in enumerate(DEEP)])
def test_check_is_the_same_with_and_without_folding(graph, overrides, monkeypatch):
    folded = compile_graph(graph, overrides)
    monkeypatch.setattr(costs, "FOLD_LAYERS", False)
    literal = compile_graph(graph, overrides)
    assert folded.applied == literal.applied
    for a, b in ((folded.memory, literal.memory), (folded.memory_before, literal.memory_before)):
        if a is None:
            assert b is None
            continue
        assert a.devices == b.devices      # every peak, peak node, node peak and OOM
        for name in a.devices:
            assert list(a.devices[name].timeline) == list(b.devices[name].timeline)
    for t, u in ((folded.original, literal.original), (folded.typed, literal.typed)):
        for d in t.ctx.spec.devices:
            assert device_events(t, d) == device_events(u, d)
    # and it folded
    marks = [e for t in (folded.original, folded.typed) for d in t.ctx.spec.devices
             for e in folded_events(t, d)[0] if type(e) is Repeat]
    assert marks
    # ... and the allocator model skipped repetitions (a CPU device's replay folds without it)
    report = folded.memory_before or folded.memory
    assert any(isinstance(d.timeline, Folded) for d in report.devices.values())


def test_a_skipped_weight_block_can_still_be_freed():
    """The blocks of repetitions skipped in closed form are made when one is freed: freeing layer 5,000's weights
    (an event list could) gives what the written-out replay gives."""
    size = 100 * MiB + 3 * 512
    rep = [Event("alloc", 1, size, "w")]
    events = [Event("alloc", 0, size, "w"), *rep, Repeat(1, 9_998, 1, 1, lambda k, i: "w"),
              Event("free", 5_000, size, "free w5000"), Event("alloc", 10_000, 50 * MiB, "x"),
              Event("free", 7_000, 0, "free w7000"), Event("alloc", 10_001, 100 * MiB, "y")]
    for cap in (None, 20_000 * size):
        _same(simulate(events, cap), simulate(expand_events(events), cap))
