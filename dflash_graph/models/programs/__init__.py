"""Derived memory programs: load one (JSON, in this folder) and evaluate it for a config's dims and a seq.

Pure Python, no torch: `check` can read these. A program is the allocation order of one transformers causal LM's
forward (batch 1, torch.no_grad, use_cache=False), derived by running transformers' own modules under fake tensors
(`dflash_graph.models.trace`, `tools/derive_programs.py`; the method and the format: docs/memory-programs.md).

    prog = load("qwen3", attn="sdpa", kernels="cpu_flash")
    run = evaluate(prog, {"hidden": 4096, ...}, seq=32768, layer_types=["decoder"] * 36)
    run.peak, run.events, run.piece_peak
    params(prog, {"hidden": 4096, ...}, ["decoder"] * 36)   # {"embed", "layers", "norm", "lm_head"}: counts
"""

from __future__ import annotations

import hashlib
import json
import os
from fractions import Fraction
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

HERE = Path(__file__).resolve().parent


class ProgramError(ValueError):
    pass


@attrs.frozen
class Event:
    kind: str  # "alloc" or "free"
    id: str  # unique in the run: "<piece index>:<id in the piece>[@<iteration>]"
    nbytes: int
    label: str  # "<piece> <module> <op> <shape>"
    piece: str


@attrs.frozen
class Run:
    peak: int  # the live-bytes peak over the whole forward (embedding output and logits included)
    piece_peak: dict[str, int]  # the live-bytes peak reached inside each piece (max over instances)
    peak_event: int  # index in events of the allocation at the peak
    # the events, expanded on first use (a qwen3_5 forward at seq 32k has 400k): a callable, and where it is kept
    _replay: Callable[[], tuple[Event, ...]] = attrs.field(repr=False, eq=False)
    _kept: list = attrs.field(factory=list, repr=False, eq=False)

    @property
    def events(self) -> tuple[Event, ...]:
        """Every allocation and free of the forward, in order (expanded iteration by iteration when first read)."""
        if not self._kept:
            self._kept.append(self._replay())
        return self._kept[0]


#: where `dflash-graph trace-model` writes the programs it derives for a config, and `load` looks besides this
#: folder: $DFLASH_GRAPH_PROGRAMS, else $XDG_CACHE_HOME/dflash-graph/programs, else ~/.cache/dflash-graph/programs
USER_DIR_ENV = "DFLASH_GRAPH_PROGRAMS"


def user_dir() -> Path:
    """The user program directory (it may not exist yet)."""
    if os.environ.get(USER_DIR_ENV):
        return Path(os.environ[USER_DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "dflash-graph" / "programs"


def fixed_tag(fixed: dict[str, Any]) -> str:
    """A short hash of a program's fixed values: user programs whose fixed values differ get different names."""
    text = json.dumps(fixed, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def path_of(arch: str, attn: str, transformers_version: str, kernels: str = "cpu_flash", dtype: str = "bfloat16",
            packing: str = "documents", fixed: dict[str, Any] | None = None) -> Path:
    """A program's file: packaged (this folder) without `fixed`; with it, in the user directory, its name ending
    in the hash of the fixed values (`fixed_tag`)."""
    name = f"{arch}-{attn}-{kernels}-{dtype}-{packing}-tf{transformers_version}"
    if fixed is None:
        return HERE / f"{name}.json"
    return user_dir() / f"{name}-fixed{fixed_tag(fixed)}.json"


def _stored() -> list[tuple[dict[str, Any], dict[str, Any], Path]]:
    """(key, fixed values, file) of every program: the packaged ones first, then the user directory's."""
    out = []
    user = user_dir()
    for folder in (HERE, user):
        for p in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            try:
                prog = json.loads(p.read_text())
                out.append((prog["key"], prog.get("fixed", {}), p))
            except (OSError, ValueError, KeyError, TypeError):
                if folder == HERE:
                    raise
                # a user directory's stray or broken file is not a program: skipped, never fatal to check
                continue
    return out


def available() -> list[dict[str, Any]]:
    """The key of every stored program, packaged and the user directory's (`user_dir`), each with its "fixed"
    values and "user": whether it is a user program (derived by `dflash-graph trace-model`)."""
    return [dict(key, fixed=fixed, user=path.parent != HERE) for key, fixed, path in _stored()]


def same_value(a: Any, b: Any) -> bool:
    """A config value equals a program's fixed value (None and [] both mean "no layers" for a list key)."""
    if isinstance(b, list) and a is None:
        return b == []
    if isinstance(a, list) and b is None:
        return a == []
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def load(arch: str, *, attn: str = "sdpa", kernels: str = "cpu_flash", dtype: str = "bfloat16",
         packing: str = "documents", transformers_version: str | None = None,
         fixed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The program of an arch for a forward. `fixed`: the config's values of the keys a program holds for (only
    those given are compared); a program whose recorded "fixed" has them is chosen, a packaged one first, then
    one in the user directory. None: the packaged program (the arch's default values)."""
    want = {"arch": arch, "attn": attn, "kernels": kernels, "dtype": dtype, "packing": packing}
    stored = _stored()
    found = [(k, f, p) for k, f, p in stored if all(k[x] == y for x, y in want.items())
             and (transformers_version is None or k["transformers"] == transformers_version)
             and (p.parent == HERE if fixed is None else
                  all(x in f and same_value(v, f[x]) for x, v in fixed.items()))]
    if not found:
        have = ", ".join(f"{k['arch']}/{k['attn']}/{k['kernels']}/{k['dtype']}/{k['packing']}/tf{k['transformers']}"
                         + (f" ({', '.join(f'{x} = {json.dumps(v)}' for x, v in f.items())})" if p.parent != HERE
                            else "") for k, f, p in stored)
        held = "" if fixed is None else f" holding for {', '.join(f'{x} = {json.dumps(v)}' for x, v in fixed.items())}"
        raise ProgramError(f"no derived memory program for {want}{held}; stored: {have}; derive one with "
                           f"`dflash-graph trace-model CONFIG` (a config.json of the model)")

    def rank(item):
        k, _, p = item
        return (p.parent == HERE, [int(x) for x in k["transformers"].split(".") if x.isdigit()])

    key, _, path = max(found, key=rank)
    prog = json.loads(path.read_text())
    prog["path"] = str(path)     # where it was read (check's report names it); not part of the stored file
    return prog


_COMPARE = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<=": lambda a, b: a <= b,
            ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, ">": lambda a, b: a > b}


def holds(condition: str, values: dict[str, int]) -> bool:
    """Whether a program's condition holds for these dims: "<a> <op> <b>" or "<a> % <n> <op> <b>", each side a dim
    or an integer, op one of == != <= >= < >. A program holds only where transformers runs the code it was
    traced with."""
    words = condition.split()
    if len(words) not in (3, 5) or (len(words) == 5 and words[1] != "%"):
        raise ProgramError(f"the condition {condition!r} is not '<a> <op> <b>' or '<a> % <n> <op> <b>'")

    def side(x: str) -> int:
        if x.lstrip("-").isdigit():
            return int(x)
        if x not in values:
            raise ProgramError(f"the condition {condition!r} names {x!r}, not a dim of the program")
        return values[x]

    a = side(words[0]) % side(words[2]) if len(words) == 5 else side(words[0])
    op, b = words[-2], side(words[-1])
    if op not in _COMPARE:
        raise ProgramError(f"the condition {condition!r}: unknown comparison {op!r} (one of {' '.join(_COMPARE)})")
    return _COMPARE[op](a, b)


def derived_values(derived: dict[str, list], values: dict[str, int]) -> dict[str, int]:
    """The derived dims (a program's "derived": name -> ["div", a, b] for a / b, exact, or ["ceildiv", a, b] for
    ceil(a / b); a and b dims or integers) from the given ones: kv groups = heads / kv_heads, the delta rule's
    chunks = ceil(seq / 64). A size that is a quotient of dims is a polynomial in the quotient, not in the dims."""
    out = {}
    for name, (op, a, b) in derived.items():
        x = values[a] if isinstance(a, str) else a
        y = values[b] if isinstance(b, str) else b
        if op == "ceildiv":
            out[name] = -(-x // y)
        elif op == "div":
            if y <= 0 or x % y:
                raise ProgramError(f"{name} = {a} / {b} must be a whole number, and here {a} = {x}, {b} = {y}")
            out[name] = x // y
        else:
            raise ProgramError(f"derived dim {name}: unknown operation {op!r} (div, ceildiv)")
    return out


def poly_value(poly: list[list], values: dict[str, int]) -> Fraction:
    """A stored polynomial's value: each term is [numerator, denominator, *dim names multiplied]."""
    total = Fraction(0)
    for term in poly:
        v = Fraction(term[0], term[1])
        for name in term[2:]:
            v *= values[name]
        total += v
    return total


def _poly(poly: list[list], values: dict[str, int]) -> int:
    total = poly_value(poly, values)
    if total.denominator != 1:
        raise ProgramError(f"a size evaluates to {total}, not an integer, at {values}")
    return int(total)


def _loop_count(piece: dict[str, Any], values: dict[str, int]) -> int:
    """How many times a piece's loop runs at these dims (0 without a loop). A loop may run fewer times than the
    offsets of its tail's frees: the tail then frees the tensor the loop started from (`init`), as transformers
    does for the delta rule's one chunk (seq <= 64; byte for byte against MemTracker, tests/test_target_memory.py)."""
    loop = piece.get("loop")
    return _poly(loop["count"], values) if loop else 0


def label_of(ev: dict[str, Any], shape: list[int]) -> str:
    """What an allocation is, in the words a memory report shows: its op, its shape at these dims, its dtype and
    the module that made it ("aten.mm [65,536, 6,144] bfloat16 in self_attn.q_proj")."""
    op = ev["op"].removesuffix(".default")
    where = f" in {ev['module']}" if ev["module"] else ""
    return f"{op} [{', '.join(f'{x:,}' for x in shape)}] {ev['dtype']}{where}"


def _expand(piece: dict[str, Any], values: dict[str, int], limit: int | None = None) -> list[tuple[str, str, int, str]]:
    """A piece's own events: ("a", id, nbytes, label) / ("f", id, 0, ""); `limit`: write at most that many
    iterations of its loop (the tail then frees what the last of them left)."""
    out: list[tuple[str, str, int, str]] = []
    sized: dict[int, tuple[int, str]] = {}  # an event's size and label, once per piece (a loop repeats its body)

    def alloc(ev: dict[str, Any], ident: str) -> None:
        if id(ev) not in sized:
            shape = [_poly(p, values) for p in ev["shape"]]
            n = ev["itemsize"]
            for x in shape:
                n *= x
            sized[id(ev)] = n, label_of(ev, shape)
        n, label = sized[id(ev)]
        out.append(("a", ident, n, label))

    for ev in piece["head"]:
        alloc(ev, ev["alloc"]) if "alloc" in ev else out.append(("f", ev["f"], 0, ""))
    loop = piece.get("loop")
    n = _loop_count(piece, values)
    if limit is not None:
        n = min(n, limit)
    for it in range(n):
        for ev in loop["body"]:
            if "alloc" in ev:
                alloc(ev, f"{ev['alloc']}@{it}")
            elif "iter" not in ev:
                out.append(("f", ev["f"], 0, ""))
            elif it + ev["iter"] >= 0:
                out.append(("f", f"{ev['f']}@{it + ev['iter']}", 0, ""))
            elif "init" in ev:
                out.append(("f", ev["init"], 0, ""))
    # a loop-carried tensor the tail frees from an iteration that never ran (fewer iterations than its offset) is
    # the one the loop started from: its `init`
    init = {ev["f"]: ev["init"] for ev in (loop["body"] if loop else ()) if "init" in ev}
    for ev in piece["tail"]:
        if "alloc" in ev:
            alloc(ev, ev["alloc"])
        elif "iter" in ev and n + ev["iter"] < 0:
            out.append(("f", init[ev["f"]], 0, ""))
        elif "iter" in ev:
            out.append(("f", f"{ev['f']}@{n + ev['iter']}", 0, ""))
        else:
            out.append(("f", ev["f"], 0, ""))
    return out


# NOTE: [the fast walk] A piece's own events are the same in every instance of it (for given dims), and a loop's
# iterations are the same once no free reaches back before the first one (after k iterations, k the largest
# `iter` offset of the body's frees). So each piece is summarised once: its events as a few runs (the head and the
# first k iterations, the n - k identical iterations as one repeated block, the tail), and each stretch between
# the positions where other pieces' exports die as (length, net change, highest level above its start after an
# allocation and where, highest after any event). A repeated block's highest point is in its first iteration
# when the block's net change is <= 0, else in its last. The walk over the forward then costs a few steps per
# piece instance, whatever the loop counts, and gives the peak, piece_peak and peak_event of the full replay.


@attrs.frozen
class _Stretch:
    length: int  # own events in it
    net: int  # live bytes at its end minus at its start
    top: int | None  # highest live bytes above its start right after one of its allocations (None: no allocation)
    top_at: int  # the first event (counted from the stretch's start) at that height
    high: int | None  # highest above its start after any of its events (None: no event)


def _scan(deltas: list[tuple[int, bool]]) -> _Stretch:
    r = 0
    top, top_at, high = None, 0, None
    for k, (d, is_alloc) in enumerate(deltas):
        r += d
        if is_alloc and (top is None or r > top):
            top, top_at = r, k
        high = r if high is None or r > high else high
    return _Stretch(len(deltas), r, top, top_at, high)


def _runs(piece: dict[str, Any], values: dict[str, int]) -> tuple[list, dict[str, int]]:
    """A piece's own events as runs: ("x", [(delta, is_alloc), ...]) or ("r", block, times); and the size of each
    of its head and tail allocations (exports are among them)."""
    size: dict[str, int] = {}

    def nbytes(ev: dict[str, Any]) -> int:
        n = ev["itemsize"]
        for p in ev["shape"]:
            n *= _poly(p, values)
        size[ev["alloc"]] = n
        return n

    head = [(nbytes(ev), True) if "alloc" in ev else (-size[ev["f"]], False) for ev in piece["head"]]
    runs: list = [("x", head)]
    loop = piece.get("loop")
    n = _loop_count(piece, values)
    if n > 0:
        body = loop["body"]
        for ev in body:
            if "alloc" in ev:
                nbytes(ev)
        k = max([-ev["iter"] for ev in body if "iter" in ev], default=0)

        def iteration(it: int) -> list[tuple[int, bool]]:
            out = []
            for ev in body:
                if "alloc" in ev:
                    out.append((size[ev["alloc"]], True))
                elif "iter" not in ev or it + ev["iter"] >= 0:
                    out.append((-size[ev["f"]], False))
                elif "init" in ev:
                    out.append((-size[ev["init"]], False))
            return out

        for it in range(min(k, n)):
            runs[-1][1].extend(iteration(it))
        if n > k:
            runs.append(("r", iteration(k), n - k))
    init = {ev["f"]: ev["init"] for ev in (loop["body"] if loop else ()) if "init" in ev}

    def freed(ev: dict[str, Any]) -> int:       # a loop-carried tensor from an iteration that never ran: its init
        return size[init[ev["f"]]] if "iter" in ev and n + ev["iter"] < 0 else size[ev["f"]]

    tail = [(nbytes(ev), True) if "alloc" in ev else (-freed(ev), False) for ev in piece["tail"]]
    runs.append(("x", tail))
    return runs, size


def _stretches(runs: list, cuts: tuple[int, ...]) -> list[_Stretch]:
    """The stretches of a piece's own events between the positions `cuts` (sorted, within 0..length)."""
    spans, pos = [], 0
    for run in runs:
        length = len(run[1]) * (run[2] if run[0] == "r" else 1)
        if run[0] == "r" and any(pos < c < pos + length for c in cuts):
            run = ("x", run[1] * run[2])  # an export dies inside the repeated iterations: expand them
        spans.append((pos, run))
        pos += length
    bounds = [0, *cuts, pos]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        r = idx = 0
        top, top_at, high = None, 0, None
        for start, run in spans:
            if run[0] == "x":
                lo, hi = max(a, start), min(b, start + len(run[1]))
                if lo >= hi:
                    continue
                st = _scan(run[1][lo - start: hi - start])
                parts = [(st, 1)]
            else:
                block, times = run[1], run[2]
                if not (a <= start and start + len(block) * times <= b) or not times:
                    continue
                parts = [(_scan(block), times)]
            for st, times in parts:
                if st.top is not None:
                    t = times - 1 if st.net > 0 else 0
                    if top is None or r + t * st.net + st.top > top:
                        top, top_at = r + t * st.net + st.top, idx + t * st.length + st.top_at
                if st.high is not None:
                    h = r + (times - 1) * max(st.net, 0) + st.high
                    high = h if high is None or h > high else high
                r += times * st.net
                idx += times * st.length
        out.append(_Stretch(idx, r, top, top_at, high))
    return out


def _walk(program: dict[str, Any], pieces: list[str], values: dict[str, int],
          scheduled: dict[tuple[int, int], list[str]]) -> tuple[int, dict[str, int], int]:
    """The peak, piece_peak and peak_event of the forward, piece by piece (NOTE: [the fast walk])."""
    runs = {name: _runs(program["pieces"][name], values) for name in dict.fromkeys(pieces)}
    cuts_of: dict[int, list[int]] = {}
    for host, pos in scheduled:
        cuts_of.setdefault(host, []).append(pos)
    cache: dict[tuple[str, tuple[int, ...]], list[_Stretch]] = {}
    live: dict[str, int] = {}
    cur = peak = peak_at = n_events = 0
    piece_peak: dict[str, int] = {}
    for i, name in enumerate(pieces):
        piece_runs, size = runs[name]
        length = sum(len(r[1]) * (r[2] if r[0] == "r" else 1) for r in piece_runs)
        cuts = tuple(sorted(c for c in set(cuts_of.get(i, ())) if c <= length))
        inner = tuple(c for c in cuts if 0 < c < length)
        if (name, inner) not in cache:
            cache[name, inner] = _stretches(piece_runs, inner)
        for ex in program["pieces"][name]["exports"]:
            live[f"{i}:{ex['id']}"] = size[ex["id"]]
        for at, st in zip((0, *inner), cache[name, inner]):
            for ident in scheduled.get((i, at), ()):
                cur -= live.pop(ident)
                n_events += 1
            if st.top is not None and cur + st.top > peak:
                peak, peak_at = cur + st.top, n_events + st.top_at
            if st.high is not None:
                piece_peak[name] = max(piece_peak.get(name, 0), cur + st.high)
            cur += st.net
            n_events += st.length
        if length > 0:  # (with no own events the frees at 0 were those at the end)
            for ident in scheduled.get((i, length), ()):
                cur -= live.pop(ident)
                n_events += 1
    return peak, piece_peak, peak_at


def sequence(program: dict[str, Any], layer_types: list[str]) -> list[str]:
    """The pieces of a forward over these layers: embed, prologue, each layer and the code after it, norm, ..."""
    known = [n.removeprefix("layer:") for n in program["pieces"] if n.startswith("layer:")]
    bad = [t for t in layer_types if t not in known]
    if bad:
        raise ProgramError(f"layer type {bad[0]!r} has no derived program (derived: {known})")
    seq = ["start", "embed", "prologue"]
    for t in layer_types:
        seq += [f"layer:{t}", "between"]
    seq += ["norm", "epilogue", "lm_head", "end"]
    return [n for n in seq if n in program["pieces"]]  # a piece with no events may be left out


def bind(program: dict[str, Any], dims: dict[str, int], seq: int) -> dict[str, int]:
    """The values a program's sizes read: the dims given, seq and the derived dims; raises ProgramError where a dim
    is missing or the program does not hold (transformers runs other code there)."""
    derived = program.get("derived", {})
    need = set(program["dims"]) - {"seq"} - set(derived)
    missing = sorted(need - set(dims))
    if missing:
        raise ProgramError(f"missing dims {missing} (the program's dims: {sorted(need)})")
    values = dict(dims, seq=seq)
    values.update(derived_values(derived, values))
    broken = [c for c in program.get("holds_when", ()) if not holds(c, values)]
    if broken:
        cond = broken[0]
        shown = ", ".join(f"{n} = {values[n]}" for n in dict.fromkeys(cond.split()) if n in values)
        raise ProgramError(f"the stored {program['key']['arch']} program (packing {program['key']['packing']}) holds "
                           f"when {cond}, and here {shown}: transformers runs other code; a program for this config "
                           f"must be derived (python tools/derive_programs.py, later `dflash-graph trace-model "
                           f"CONFIG`)")
    return values


def steady_iterations(loop: dict[str, Any]) -> int | None:
    """How many iterations of a loop stand for all of them, or None. A loop is steady when every tensor an
    iteration allocates is freed by a later one at most k iterations on (or by itself): from iteration k on,
    every iteration starts from the same live bytes and allocates and frees the same sizes (they are
    polynomials in the dims, the same for every iteration), so iterations k + 1, k + 2, ... repeat iteration k's
    live-bytes curve exactly, and k + 2 written out give the same peak and the same bytes left for the tail."""
    allocs = {ev["alloc"] for ev in loop["body"] if "alloc" in ev}
    freed = {ev["f"] for ev in loop["body"] if "f" in ev and "iter" in ev}
    if allocs != freed:
        return None
    return max((-ev["iter"] for ev in loop["body"] if "iter" in ev), default=0) + 2


def piece_events(program: dict[str, Any], values: dict[str, int], name: str, *,
                 steady: bool = False) -> list[tuple[str, str, int, str]]:
    """One piece's own events at these values (`bind`): ("a", id, bytes, label) and ("f", id, 0, ""), a loop
    written out; ids are the piece's own (an iteration's get "@<i>"). `steady`: a steady loop is written for as
    many iterations as stand for all of them (`steady_iterations`): the same peak and the same bytes after it."""
    piece = program["pieces"][name]
    loop = piece.get("loop")
    limit = steady_iterations(loop) if steady and loop else None
    return _expand(piece, values, limit)


def evaluate(program: dict[str, Any], dims: dict[str, int], seq: int, layer_types: list[str], *,
             upto: str = "end", expand: bool = False) -> Run:
    """The forward's live-bytes peak, each piece's peak and its allocation events, for dims (the program's dim
    names) and seq tokens.

    upto="epilogue" stops when the body returns (no lm_head: the embedding, the body and its output). The peaks
    are computed piece by piece, a loop's iterations extrapolated once they repeat (`_walk`); the events are
    expanded only when `run.events` is read. expand=True walks every event instead (the reference the fast walk
    is tested against: the same peak, piece_peak and peak_event)."""
    values = bind(program, dims, seq)
    pieces = sequence(program, layer_types)
    if upto != "end" and upto not in pieces:
        raise ProgramError(f"upto must be a piece of the forward, one of {sorted(set(pieces))}")
    # cross-piece frees: each export of a piece dies in a later piece, at a position among that piece's own events
    scheduled: dict[tuple[int, int], list[str]] = {}
    for i, name in enumerate(pieces):
        for ex in program["pieces"][name]["exports"]:
            d = ex["dies"]
            if d is None:
                continue
            host = i + d["offset"] if "offset" in d else pieces.index(d["piece"])
            scheduled.setdefault((host, d["at"]), []).append(f"{i}:{ex['id']}")
    stop = pieces.index(upto) if upto != "end" else len(pieces) - 1
    pieces = pieces[: stop + 1]

    def replay() -> tuple[tuple[Event, ...], int, dict[str, int], int]:
        # every instance of a piece has the same own events for these dims: expand each piece once
        once = {name: _expand(program["pieces"][name], values) for name in dict.fromkeys(pieces)}
        return _replay(pieces, once, scheduled)

    if expand:
        events, peak, piece_peak, peak_at = replay()
        return Run(peak, piece_peak, peak_at, lambda: events)
    peak, piece_peak, peak_at = _walk(program, pieces, values, scheduled)
    return Run(peak, piece_peak, peak_at, lambda: replay()[0])


def _replay(pieces: list[str], once: dict[str, list[tuple[str, str, int, str]]],
            scheduled: dict[tuple[int, int], list[str]]) -> tuple[tuple[Event, ...], int, dict[str, int], int]:
    """The forward event by event: (events, peak, piece_peak, index of the allocation at the peak)."""
    events: list[Event] = []
    live: dict[str, int] = {}
    cur = peak = peak_at = 0
    piece_peak: dict[str, int] = {}
    for i, name in enumerate(pieces):
        own = once[name]
        for pos in range(len(own) + 1):
            for ident in scheduled.get((i, pos), ()):
                cur -= live.pop(ident)
                events.append(Event("free", ident, 0, "", name))
            if pos == len(own):
                break
            kind, local, n, label = own[pos]
            ident = f"{i}:{local}"
            if kind == "a":
                live[ident] = n
                cur += n
                events.append(Event("alloc", ident, n, f"{name} {label}", name))
                if cur > peak:
                    peak, peak_at = cur, len(events) - 1
            else:
                cur -= live.pop(ident)
                events.append(Event("free", ident, 0, "", name))
            piece_peak[name] = max(piece_peak.get(name, 0), cur)
    return tuple(events), peak, piece_peak, peak_at


def params(program: dict[str, Any], dims: dict[str, int], layer_types: list[str]) -> dict[str, int]:
    """The parameter count of each component of the causal LM for these dims and layers: {"embed", "layers" (the
    sum over `layer_types`), "norm", "lm_head"}, from the program's "params" (each component's count as a
    polynomial in the dims, derived from transformers' own model built on the meta device). No seq: a parameter's
    size does not depend on it (nor on the packing)."""
    stored = program.get("params")
    if stored is None:
        raise ProgramError(f"the stored {program['key']['arch']} program (packing {program['key']['packing']}) has "
                           f"no parameter counts; derive them with `python tools/derive_programs.py --arch "
                           f"{program['key']['arch']} --params-only`")
    derived = program.get("derived", {})
    need = set(program["dims"]) - {"seq"} - set(derived)
    missing = sorted(need - set(dims))
    if missing:
        raise ProgramError(f"missing dims {missing} (the program's dims: {sorted(need)})")
    values = dict(dims)
    # the derived dims computable without seq (kv groups, linear value heads per key head; not the chunk count)
    values.update(derived_values({k: v for k, v in derived.items()
                                  if all(not isinstance(x, str) or x in values for x in v[1:])}, values))
    per_type: dict[str, int] = {}
    for t in dict.fromkeys(layer_types):
        if f"layer:{t}" not in stored:
            known = [n.removeprefix("layer:") for n in stored if n.startswith("layer:")]
            raise ProgramError(f"layer type {t!r} has no derived parameter count (derived: {known})")
        per_type[t] = _poly(stored[f"layer:{t}"], values)
    return {"embed": _poly(stored["embed"], values), "layers": sum(per_type[t] for t in layer_types),
            "norm": _poly(stored["norm"], values), "lm_head": _poly(stored["lm_head"], values)}


__all__ = ["Event", "ProgramError", "Run", "available", "bind", "derived_values", "evaluate", "holds", "load",
           "params", "path_of", "same_value", "user_dir", "fixed_tag", "piece_events", "poly_value", "sequence", "steady_iterations"]
