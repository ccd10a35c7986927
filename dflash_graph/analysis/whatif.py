"""What-if: the largest value of one dim for which every device fits (`check --max dims.seq`).

Two parts, as the verdict has two parts:

1. Live bytes, solved. Each device's live bytes at each node's own peak is a polynomial in the dim wherever the
   op formulas are (they are products of dims, with ceilings to a multiple of 64 at most, so they are polynomial
   on the lattice `x0 + k*h`, h a multiple of 64). The polynomial of every (device, node) is recovered exactly
   with sympy from the memory model at a few lattice points (degree <= 3, checked at two more points), then
   `peak(x) <= usable` is solved for x with `sympy.real_roots`. The smallest bound over devices and nodes is
   the live bound, and its (device, node) is what binds. A node whose peak is not polynomial there (a branch of
   a max switching between the points) is left to step 2.
2. The allocator, replayed. What the caching allocator reserves is at least the live bytes, so the answer is at
   most the live bound. The few candidates near it are replayed through the full memory model (allocator
   included), moving the target down by the allocator's measured overhead, then bisecting, until a value v fits
   and v + 1 does not. v and v + 1 are confirmed with the whole pipeline (load, infer, rewrite, memory) at
   those dims, exactly what `check --set dims.X=v` would say.

The samples and the search re-type the graph as rewritten at the current dims (a rewrite's concrete params,
such as a roll's modulo, do not change its memory); the confirmation rewrites afresh at v and v + 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import sympy

from ..errors import GraphError, Location, Problem, did_you_mean
from ..ir.dims import symbol
from ..ir.graph import Graph
from .infer import Typed, build, infer
from .allocator import AllocatorConfig, simulate_pair
from .memory import (HostMemory, MemoryReport, Oom, _signature, analyze_memory, device_events, events_peak,
                     folded_events, host_memory_bytes, is_cpu, usable_bytes)

_POINTS = 4          # lattice points that fix a polynomial of degree <= 3
_CHECKS = 2          # more points it must also match
_MAX_REPLAYS = 40


@attrs.frozen
class Bound:
    device: str
    node: str
    value: int | None            # largest x with this node's live peak <= usable; None: not limited
    expression: sympy.Expr       # its live peak in bytes, as a polynomial in the dim


@attrs.frozen
class MaxResult:
    dim: str                     # "seq"
    current: int
    value: int | None            # the answer: fits at value, not at value + 1; None when memory sets no limit
    live_bound: int | None       # from the solve, before the allocator
    binding: Bound | None        # the (device, node) whose live peak sets live_bound
    next_oom: Oom | None         # what fails at value + 1
    replays: tuple[tuple[int, bool], ...]   # candidates replayed through the allocator model, in order
    confirmed: bool              # v and v + 1 checked by the whole pipeline, rewrites included
    non_polynomial: tuple[str, ...]          # "device/node" peaks left to the replays
    seconds: float
    note: str = ""
    next_host: HostMemory | None = None      # the CPU devices' shared memory at value + 1, when it overflows

    def to_json(self) -> dict:
        b, o = self.binding, self.next_oom
        return {
            "dim": f"dims.{self.dim}", "current": self.current, "value": self.value, "live_bound": self.live_bound,
            "binding": None if b is None else {"device": b.device, "node": b.node,
                                               "live_peak_bytes": str(b.expression)},
            "next": None if self.value is None else {
                "value": self.value + 1,
                "oom": None if o is None else {"device": o.device, "node": o.node, "tensor": o.tensor,
                                               "requested_bytes": o.requested_bytes, "free_bytes": o.free_bytes},
                "host": None if self.next_host is None else {
                    "need_bytes": self.next_host.need_bytes, "available_bytes": self.next_host.available_bytes}},
            "replays": [list(r) for r in self.replays], "confirmed": self.confirmed,
            "non_polynomial": list(self.non_polynomial), "seconds": round(self.seconds, 3), "note": self.note,
        }


def node_live_peaks(typed: Typed) -> dict[tuple[str, str], int]:
    """(device, node) -> live bytes at that node's own peak on that device, over the simulated steps."""
    out: dict[tuple[str, str], int] = {}
    done: dict[tuple, dict[str, int]] = {}
    for dev in typed.ctx.spec.devices:
        sig = _signature(typed, dev)
        if sig not in done:
            events, _ = device_events(typed, dev, compress=True)
            peaks: dict[str, int] = {}
            live = 0
            for ev in events:
                live += ev.size if ev.op == "alloc" else -ev.size
                if ev.op == "alloc":
                    node = ev.label.split("/")[0]
                    if live > peaks.get(node, -1):
                        peaks[node] = live
            done[sig] = peaks
        for node, b in done[sig].items():
            out[(dev, node)] = b
    return out


def _fit(xs: Sequence[int], ys: Sequence[int], x: sympy.Symbol) -> sympy.Expr | None:
    """The polynomial through the first _POINTS samples, if it also goes through the rest; else None."""
    p = sympy.expand(sympy.interpolate(list(zip(xs[:_POINTS], ys[:_POINTS])), x))
    return p if all(p.subs(x, xi) == yi for xi, yi in zip(xs[_POINTS:], ys[_POINTS:])) else None


def _largest_within(p: sympy.Expr, x: sympy.Symbol, budget: int, lo: int = 1) -> int | None:
    """Largest integer x >= lo with p(x) <= budget, for p that grows past its last root; None if p never
    exceeds the budget for large x; lo - 1 if not even lo fits."""
    poly = sympy.Poly(p - budget, x)
    if poly.degree() <= 0:
        return None if poly.as_expr() <= 0 else lo - 1
    if poly.LC() < 0:
        return None
    roots = sympy.real_roots(poly)
    if not roots:
        return None          # never reaches the budget
    r = int(sympy.floor(max(roots)))
    while r >= lo and p.subs(x, r) > budget:    # a root on the boundary, or an algebraic floor
        r -= 1
    return max(r, lo - 1)


def solve_live(samples: dict[int, dict[tuple[str, str], int]], usable: dict[str, int], name: str
               ) -> tuple[list[Bound], list[str]]:
    """The live-peak polynomial of every (device, node) and its bound; the keys that are not polynomial."""
    x = symbol(name)
    xs = sorted(samples)
    keys = set.intersection(*(set(s) for s in samples.values()))
    bounds, rough = [], []
    by_values: dict[tuple, sympy.Expr | None] = {}
    for key in sorted(keys):
        ys = tuple(samples[xi][key] for xi in xs)
        if ys not in by_values:        # the replicas of a group share their curves
            by_values[ys] = _fit(xs, ys, x)
        p = by_values[ys]
        if p is None:
            rough.append(f"{key[0]}/{key[1]}")
            continue
        bounds.append(Bound(key[0], key[1], _largest_within(p, x, usable[key[0]]), p))
    return bounds, rough


@attrs.frozen
class _Replay:
    """One candidate through the allocator model on the devices that contend."""
    fits: bool
    shortfall: dict[str, tuple[int, int, int]]    # device -> (reserved need, live peak, usable)


def _replay(typed: Typed, devices: Sequence[str], alloc: AllocatorConfig) -> _Replay:
    spec = typed.ctx.spec
    out: dict[str, tuple[int, int, int]] = {}
    ok = True
    seen: dict[tuple, tuple[bool, tuple[int, int, int]]] = {}
    for dev in devices:
        d = spec.devices[dev]
        usable = usable_bytes(typed, dev)
        key = (_signature(typed, dev), usable, d.torch.startswith("cuda"))
        if key not in seen:
            events, _ = folded_events(typed, dev)      # layers folded (NOTE [Folded replay])
            live = events_peak(events)
            if d.torch.startswith("cuda"):
                sim, unbounded = simulate_pair(events, usable, alloc)    # (NOTE [Forked replay])
                need = (sim if unbounded is None else unbounded).reserved_peak
                seen[key] = (sim.oom is None, (need, live, usable))
            else:
                seen[key] = (live <= usable, (live, live, usable))
        fit, out[dev] = seen[key]
        ok = ok and fit
    # the CPU devices share the host's memory (analysis/memory.py, HostMemory): their peaks together must fit it
    cpus = [n for n, d in spec.devices.items() if is_cpu(d.torch)]
    if cpus and all(n in out for n in cpus):
        avail = host_memory_bytes(spec)[0]
        ok = ok and (avail is None or sum(out[n][1] for n in cpus) <= avail)
    return _Replay(ok, out)


def max_dim(typed_at: Callable[[int, bool], Typed], typed0: Typed, name: str, alloc: AllocatorConfig,
            t0: float | None = None, confirm: bool = True) -> MaxResult:
    """Search the largest value of dim `name`. `typed_at(v, full)` is the typed graph at `v` (full: load, infer
    and rewrite afresh; else the current rewritten graph re-typed). `confirm=False` when the two are the same
    pipeline (no rewrites)."""
    t0 = time.perf_counter() if t0 is None else t0
    spec = typed0.ctx.spec
    x0 = typed0.ctx.env.value(name)
    usable = {n: usable_bytes(typed0, n) for n in spec.devices}
    h = 64 * max(1, x0 // (64 * 16))
    samples: dict[int, dict[tuple[str, str], int]] = {}
    note = ""
    for k in range(_POINTS + _CHECKS):
        xi = x0 + k * h
        try:
            samples[xi] = node_live_peaks(typed_at(xi, False))
        except GraphError:
            note = f"the graph is not valid at {name}={xi}: no live solve, replays only"
            break
    bounds, rough = solve_live(samples, usable, name) if len(samples) == _POINTS + _CHECKS else ([], [])
    limited = [b for b in bounds if b.value is not None]
    binding = min(limited, key=lambda b: b.value) if limited else None
    live_bound = binding.value if binding else None
    if live_bound is None and bounds and not rough:
        return MaxResult(name, x0, None, None, None, None, (), False, (), time.perf_counter() - t0,
                         f"no node's live bytes grow with {name}: memory sets no limit on it")
    if live_bound is not None and live_bound < 1:
        return MaxResult(name, x0, None, live_bound, binding, None, (), False, tuple(rough),
                         time.perf_counter() - t0,
                         f"no value of {name} fits: {binding.device}'s live bytes at '{binding.node}' exceed its "
                         f"usable memory whatever {name} is")
    # Devices that contend: every device with a node whose peak is not polynomial, and those whose own live
    # bound is within 25% of the smallest. The others are replayed only in the confirmation.
    per_dev: dict[str, int | None] = {}
    for b in bounds:
        if b.value is not None:
            per_dev[b.device] = b.value if per_dev.get(b.device) is None else min(per_dev[b.device], b.value)
    rough_devs = {r.split("/")[0] for r in rough}
    if live_bound is None:
        contend = list(spec.devices)
    else:
        contend = [d for d in spec.devices
                   if d in rough_devs or (per_dev.get(d) is not None and per_dev[d] <= live_bound * 1.25)
                   or is_cpu(spec.devices[d].torch)]     # the CPU devices contend for the host's memory together
    replays: list[tuple[int, bool]] = []
    cache: dict[tuple[int, bool], _Replay | None] = {}

    def fits(v: int, full: bool = False) -> bool:
        if (v, full) not in cache:
            try:
                cache[(v, full)] = _replay(typed_at(v, full), list(spec.devices) if full else contend, alloc)
            except GraphError:
                cache[(v, full)] = None     # invalid at v: it does not fit either
            if not full:
                replays.append((v, cache[(v, full)] is not None and cache[(v, full)].fits))
        r = cache[(v, full)]
        return r is not None and r.fits

    def search(full: bool) -> tuple[int | None, int | None]:
        x = max(int(live_bound if live_bound is not None else x0), 1)
        for _ in range(3):
            # fixed point: the largest x whose live peak fits in each device's usable bytes less what the
            # allocator reserved above the live bytes at the last candidate
            fits(x, full)
            r = cache[(x, full)]
            nxt = _next_guess(r, bounds, name) if r is not None else None
            if nxt is None or nxt < 1 or nxt == x or (nxt, full) in cache:
                break
            x = nxt
        # gallop from the last guess to a bracket lo (fits) < hi (does not), then halve it
        step = 1
        if fits(x, full):
            lo = x
            while fits(lo + step, full):
                lo += step
                step *= 2
                if len(replays) > _MAX_REPLAYS:
                    return lo, None
            hi = lo + step
        else:
            hi = x
            while hi - step >= 1 and not fits(hi - step, full):
                hi -= step
                step *= 2
            if hi - step < 1:
                # the smallest value at which the graph is valid (an op may need, say, block <= seq: below it the
                # graph is refused, which is not an OOM), found by doubling from 1
                low = 1
                while not fits(low, full) and cache[(low, full)] is None and low * 2 < hi:
                    low *= 2
                if not fits(low, full):
                    return None, low
                lo = low
            else:
                lo = hi - step
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid, full):
                lo = mid
            else:
                hi = mid
        return lo, hi

    lo, hi = search(False)
    confirmed = not confirm and contend == list(spec.devices)
    if lo is not None and hi == lo + 1 and not confirmed:
        confirmed = fits(lo, True) and not fits(lo + 1, True)
        if not confirmed:       # the rewrites or a non-contending device differ: search with the whole pipeline
            contend = list(spec.devices)
            lo, hi = search(True)
            confirmed = lo is not None and hi == lo + 1
    next_oom = next_host = None
    if lo is None and not note:
        note = (f"the graph does not fit at the smallest {name} at which it is valid ({name}={hi:,}), nor at any "
                f"value the search tried" if hi is not None else f"no value of {name} fits")
    if lo is not None:
        next_oom, next_host = _oom_at(typed_at(lo + 1, confirm), alloc)
    return MaxResult(name, x0, lo, live_bound, binding, next_oom, tuple(replays), confirmed, tuple(rough),
                     time.perf_counter() - t0, note, next_host)


def _oom_at(typed: Typed, alloc: AllocatorConfig) -> tuple[Oom | None, HostMemory | None]:
    mem = analyze_memory(typed, alloc)
    return (mem.ooms[0] if mem.ooms else None), (mem.host if mem.host is not None and not mem.host.fits else None)


def _next_guess(r: _Replay, bounds: list[Bound], name: str) -> int | None:
    """Solve again with each device's budget lowered by what the allocator reserved above the live bytes there
    in this replay (for a device that ran out, from the replay without a capacity limit)."""
    sym = symbol(name)
    best = None
    for dev, (need, live, usable) in r.shortfall.items():
        overhead = max(need - live, 0)
        vals = [_largest_within(b.expression, sym, usable - overhead) for b in bounds if b.device == dev]
        vals = [v for v in vals if v is not None]
        if vals:
            best = min(vals) if best is None else min(best, min(vals))
    return best


def check_dim(spec, dim: str) -> str:
    """'dims.seq' or 'seq' -> 'seq', or a GraphError naming the flag."""
    name = dim[5:] if dim.startswith("dims.") else dim
    if name not in spec.dims:
        raise GraphError(Problem(f"the graph has no dim '{name}'{did_you_mean(name, list(spec.dims))}",
                                 Location(spec.file, flag=f"--max {dim}"),
                                 hint="dims: " + ", ".join(f"dims.{d}" for d in spec.dims)))
    return name
