"""Derive an arch's program: trace at the design points, fit, check at held-out sizes, write the JSON."""

from __future__ import annotations

import json
import logging
import pickle
import random
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from dflash_graph.models import programs

from .archs import ARCHS, CHUNK_SEQS, DELTA_RULE_CHUNK, ArchSpec
from .fit import FitError, fit_program
from .params import derive_params
from .record import Alloc, Trace, trace_causal_lm


def design(spec: ArchSpec, packing: str) -> list[dict[str, int]]:
    """The base point, each dim at its two alternates, each pair of dims at their first alternates (the points
    that fix a polynomial of degree <= 2), and for a chunked arch seqs with more chunks. Points that are not valid
    configs, or where transformers runs other code under this packing (`spec.admits`), are skipped (a pair is
    replaced by other alternates where that makes it admissible)."""
    names = list(spec.alts)
    base = dict(spec.base)
    pts = [base]
    for n in names:
        pts += [dict(base, **{n: spec.alts[n][0]}), dict(base, **{n: spec.alts[n][1]})]
    for a, b in zip(*__import__("numpy").triu_indices(len(names), 1)):
        na, nb = names[a], names[b]
        for ia, ib in ((0, 0), (1, 1), (0, 1), (1, 0)):
            p = dict(base, **{na: spec.alts[na][ia], nb: spec.alts[nb][ib]})
            if spec.admits(p, packing):
                pts.append(p)
                break
    if "chunks" in spec.derived:
        for s in CHUNK_SEQS:
            pts.append(dict(base, seq=s))
        for n in names:
            if n != "seq":
                pts.append(dict(base, seq=CHUNK_SEQS[0], **{n: spec.alts[n][0]}))
    return [p for p in pts if spec.admits(p, packing)]


def held_out(spec: ArchSpec, packing: str, n: int = 3, seed: int = 0) -> list[dict[str, int]]:
    """Points where every dim differs from the design's values (admissible configs only)."""
    rng = random.Random(seed)
    out: list[dict[str, int]] = []
    for _ in range(100_000 * n):
        if len(out) == n:
            break
        p = {}
        for k, b in spec.base.items():
            lo, hi = min((b, *spec.alts[k])), max((b, *spec.alts[k]))
            step = 8 if k in ("head_dim",) else 1
            p[k] = rng.randrange(max(step, lo - 2 * step), hi + 3 * step, step)
        if p.get("kv_heads"):
            p["heads"] = p["kv_heads"] * rng.choice((1, 2, 3))
        if p.get("lin_k_heads"):
            p["lin_v_heads"] = p["lin_k_heads"] * rng.choice((2, 3))
        if p.get("top_k"):
            p["top_k"] = min(p["top_k"], p["experts"])
        if "chunks" in spec.derived:
            p["seq"] = rng.randrange(130, 330)
        used = {k: {spec.base[k], *spec.alts[k]} | (set(CHUNK_SEQS) if k == "seq" else set()) for k in p}
        if spec.admits(p, packing) and not any(p[k] in used[k] for k in p) and p not in out:
            out.append(p)
    if len(out) < n:
        raise FitError(f"{spec.arch} ({packing}): {len(out)} of {n} held-out points found in {100_000 * n} draws: the arch "
                       "entry's holds_when admits too few configs away from the design's values")
    return out


def trace_at(spec: ArchSpec, point: dict[str, int], packing: str, cache: Path | None = None,
             layers: list[str] | None = None) -> Trace:
    """One traced forward at `point`; a config transformers refuses is a FitError naming the point (the arch
    entry's `valid` should have skipped it: the fix is there). With `cache`, a trace taken before under the same
    transformers and torch is read back instead (a refit after changing the fitter costs no new trace)."""
    if cache is not None:
        name = "-".join(f"{k}{v}" for k, v in sorted(point.items())) + ("-" + "-".join(layers) if layers else "")
        path = cache / f"{spec.arch}-{packing}-tf{transformers.__version__}-torch{torch.__version__}" / f"{name}.pkl"
        if path.exists():
            return pickle.loads(path.read_bytes())
        tr = trace_at(spec, point, packing, layers=layers)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(tr))
        return tr
    try:
        cfg = spec.config({k: v for k, v in point.items() if k != "seq"}, layers=layers)
    except Exception as e:  # transformers' config validation: ValueError, TypeError, StrictDataclass errors
        raise FitError(f"{spec.arch}: transformers' {spec.config_cls} refuses the point {point}: "
                       f"{type(e).__name__}: {' '.join(str(e).split())[:400]}; make the arch entry's "
                       f"`valid` (models/trace/archs.py) skip such points") from e
    try:
        return trace_causal_lm(spec.model_class(), cfg, point["seq"], packing=packing)
    except Exception as e:  # a kernel's or a module's check (torch._grouped_mm's alignment, ...)
        raise FitError(f"{spec.arch}/{packing}: transformers' {spec.model_cls} fails at the point {point}: "
                       f"{type(e).__name__}: {' '.join(str(e).split())[:400]}; a program holds only where the "
                       f"forward runs: add the condition to the arch entry's `holds_when` or `valid` "
                       f"(models/trace/archs.py)") from e


def program_dims(spec: ArchSpec, point: dict[str, int]) -> dict[str, int]:
    return spec.with_derived(point)


def derive(arch: str, packing: str = "documents", log=print, cache: Path | None = None,
           spec: ArchSpec | None = None, step=None) -> dict[str, Any]:
    """The program of `arch` under `packing`, checked at held-out points. `spec`: the arch entry to derive with
    (default ARCHS[arch]; `dflash-graph trace-model` passes one whose `fixed` values are a config's); `step`:
    called as step(what, i, n, point) before the i-th of n traces, `what` "design" or "held-out" (progress)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    spec = spec or ARCHS[arch]
    chunked = "chunks" in spec.derived
    names = spec.names()
    pts = design(spec, packing)
    t0 = time.time()
    traces = []
    for i, p in enumerate(pts):
        if step is not None:
            step("design", i, len(pts), p)
        traces.append((program_dims(spec, p), trace_at(spec, p, packing, cache)))
    log(f"{arch}/{packing}: {len(traces)} traces in {time.time() - t0:.0f} s")
    fitted = fit_program(arch, traces, names)
    layer_types = list(dict.fromkeys(n.removeprefix("layer:") for n in fitted["order"] if n.startswith("layer:")))
    prog = {
        "key": {"arch": arch, "attn": "sdpa", "kernels": "cpu_flash", "dtype": "bfloat16", "packing": packing,
                "transformers": transformers.__version__},
        "torch": torch.__version__.split("+")[0],
        "model_class": spec.model_cls,
        "experts_implementation": "grouped_mm" if arch.endswith("moe") else None,
        "linear_kernels": "torch" if chunked else None,
        "dims": {n: (spec.dims.get(n) or n) for n in names if n not in spec.derived},
        "derived": {k: list(v) for k, v in spec.derived.items()},
        "fixed": spec.fixed,
        "holds_when": list(spec.conditions(packing)),
        "layer_types": layer_types,
        "chunk_size": DELTA_RULE_CHUNK if chunked else None,
        "design_points": len(pts),
        **fitted,
    }
    # held-out check: every event's size and the peak, at points outside the design
    checks = []
    # the last point is traced with the layers in another order and number than the design's (a layer type
    # first, twice in a row, last): the program must compose layers as transformers runs them
    composed = list(reversed(spec.layers)) + list(spec.layers) if spec.layers else ["decoder"] * 3
    points = held_out(spec, packing)
    for i, p in enumerate(points):
        if step is not None:
            step("held-out", i, len(points), p)
        layers = composed if i == len(points) - 1 else None
        tr = trace_at(spec, p, packing, cache, layers=layers)
        types = [pc.name.removeprefix("layer:") for pc in tr.pieces if pc.name.startswith("layer:")]
        run = programs.evaluate(prog, {k: v for k, v in p.items() if k != "seq"}, p["seq"], types)
        problem = disagreement(run, tr)
        if problem:
            raise FitError(f"{arch}/{packing}: the program disagrees with a trace at held-out {p}, layers {types}: "
                           f"{problem}")
        allocations = sum(isinstance(e, Alloc) for e in tr.flat())
        checks.append({"point": p, "layers": types, "peak": tr.peak, "allocations": allocations})
    prog["held_out"] = checks
    log(f"{arch}/{packing}: exact at {len(checks)} held-out points")
    prog["params"] = derive_params(spec, pts, checks)
    log(f"{arch}/{packing}: parameter counts exact at the {len(checks)} held-out points")
    return prog


def with_params(arch: str, packing: str = "documents", log=print) -> dict[str, Any]:
    """The stored program with its "params" (re)derived and nothing else changed: the parameter counts need no
    trace, only the model built on the meta device at the program's design points, checked at its held-out
    points."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    spec = ARCHS[arch]
    prog = programs.load(arch, packing=packing, transformers_version=transformers.__version__)
    prog["params"] = derive_params(spec, design(spec, packing), prog["held_out"])
    log(f"{arch}/{packing}: parameter counts exact at the {len(prog['held_out'])} held-out points")
    return prog


def disagreement(run: programs.Run, tr: Trace) -> str | None:
    """None when the program's allocations and peak are the trace's, byte for byte; else what differs (the
    first allocations that differ, each with the program's label and the trace's op, module and shape)."""
    got = [e for e in run.events if e.kind == "alloc"]
    want = [e for e in tr.flat() if isinstance(e, Alloc)]
    diff = [i for i, (a, b) in enumerate(zip(got, want)) if a.nbytes != b.nbytes]
    if not diff and len(got) == len(want) and run.peak == tr.peak:
        return None
    shown = "; ".join(f"allocation {i}: program {got[i].nbytes} B ({got[i].label}), trace {want[i].nbytes} B "
                      f"({want[i].op} in {want[i].module or 'the piece'}, shape {list(want[i].shape)})"
                      for i in diff[:3])
    return (f"peak {run.peak} vs {tr.peak}, {len(diff)} allocations differ, {len(got)} vs {len(want)} "
            f"allocations" + (f"; {shown}" if shown else ""))


def write(prog: dict[str, Any], user: bool = False, out: Path | None = None) -> Path:
    """Write a program: into the package (tools/derive_programs.py), or with `user` into the user program
    directory (programs.user_dir(), or `out`), its name holding the hash of its fixed values."""
    k = prog["key"]
    path = programs.path_of(k["arch"], k["attn"], k["transformers"], k["kernels"], k["dtype"], k["packing"],
                            fixed=prog["fixed"] if user else None)
    if out is not None:
        path = out / path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = {key: v for key, v in prog.items() if key != "path"}   # "path": where `load` read it, not data
    path.write_text(json.dumps(stored, indent=None, separators=(",", ":")) + "\n")
    return path
