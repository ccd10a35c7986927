"""Derive an arch's program: trace at the design points, fit, check at held-out sizes, write the JSON."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from dflash_graph.models import programs

from .archs import ARCHS, CHUNK_SEQS, DELTA_RULE_CHUNK, ArchSpec, with_seq
from .fit import FitError, fit_program
from .record import Trace, trace_causal_lm


def design(spec: ArchSpec) -> list[dict[str, int]]:
    """The base point, each dim at its two alternates, each pair of dims at their first alternates (the points
    that fix a polynomial of degree <= 2), and for a chunked arch seqs with more chunks. Invalid configs skipped
    (replaced by the second alternate where that makes it valid)."""
    names = list(spec.alts)
    base = dict(spec.base)
    pts = [base]
    for n in names:
        pts += [dict(base, **{n: spec.alts[n][0]}), dict(base, **{n: spec.alts[n][1]})]
    for a, b in zip(*__import__("numpy").triu_indices(len(names), 1)):
        na, nb = names[a], names[b]
        for ia, ib in ((0, 0), (1, 1), (0, 1), (1, 0)):
            p = dict(base, **{na: spec.alts[na][ia], nb: spec.alts[nb][ib]})
            if spec.valid is None or spec.valid(p) is None:
                pts.append(p)
                break
    if spec.arch == "qwen3_5":
        for s in CHUNK_SEQS:
            pts.append(dict(base, seq=s))
        for n in names:
            if n != "seq":
                pts.append(dict(base, seq=CHUNK_SEQS[0], **{n: spec.alts[n][0]}))
    return [p for p in pts if spec.valid is None or spec.valid(p) is None]


def held_out(spec: ArchSpec, n: int = 3, seed: int = 0) -> list[dict[str, int]]:
    """Points where every dim differs from the design's values (valid configs only)."""
    rng = random.Random(seed)
    out: list[dict[str, int]] = []
    while len(out) < n:
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
        if spec.arch == "qwen3_5":
            p["seq"] = rng.randrange(130, 330)
        if spec.valid is None or spec.valid(p) is None:
            out.append(p)
    return out


def trace_at(spec: ArchSpec, point: dict[str, int], packing: str) -> Trace:
    cfg = spec.config({k: v for k, v in point.items() if k != "seq"})
    return trace_causal_lm(spec.model_class(), cfg, point["seq"], packing=packing)


def program_dims(spec: ArchSpec, point: dict[str, int]) -> dict[str, int]:
    return with_seq(point, point["seq"], spec.arch == "qwen3_5")


def derive(arch: str, packing: str = "documents", log=print) -> dict[str, Any]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    spec = ARCHS[arch]
    chunked = arch == "qwen3_5"
    names = list(spec.alts) + (["chunks"] if chunked else [])
    pts = design(spec)
    t0 = time.time()
    traces = [(program_dims(spec, p), trace_at(spec, p, packing)) for p in pts]
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
        "dims": {n: (spec.dims.get(n) or n) for n in names},
        "fixed": spec.fixed,
        "holds_when": list(spec.holds_when),
        "layer_types": layer_types,
        "chunk_size": DELTA_RULE_CHUNK if chunked else None,
        "design_points": len(pts),
        **fitted,
    }
    # held-out check: every event's size and the peak, at points outside the design
    checks = []
    for p in held_out(spec):
        tr = trace_at(spec, p, packing)
        types = [pc.name.removeprefix("layer:") for pc in tr.pieces if pc.name.startswith("layer:")]
        run = programs.evaluate(prog, {k: v for k, v in p.items() if k != "seq"}, p["seq"], types)
        got = [e.nbytes for e in run.events if e.kind == "alloc"]
        want = [e.nbytes for e in tr.flat() if hasattr(e, "nbytes")]
        if got != want or run.peak != tr.peak:
            raise FitError(f"{arch}: the program disagrees with a trace at held-out {p}: peak {run.peak} vs "
                           f"{tr.peak}, {sum(a != b for a, b in zip(got, want))} allocations differ, "
                           f"{len(got)} vs {len(want)} allocations")
        checks.append({"point": p, "peak": tr.peak, "allocations": len(want)})
    prog["held_out"] = checks
    log(f"{arch}/{packing}: exact at {len(checks)} held-out points")
    return prog


def write(prog: dict[str, Any]) -> Path:
    k = prog["key"]
    path = programs.path_of(k["arch"], k["attn"], k["transformers"], k["kernels"], k["dtype"], k["packing"])
    path.write_text(json.dumps(prog, indent=None, separators=(",", ":")) + "\n")
    return path
