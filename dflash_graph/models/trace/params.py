"""Parameter counts per component (embedding, each layer type, final norm, lm_head), derived, not written by hand.

transformers' causal-LM class is built on the meta device (no memory) at the design points, and each parameter's
shape entries are fitted in the dims with the fitter's `fit_poly` (simplest first), as allocation shapes are. A
component's count is the sum over its parameters of the product of their entries, expanded into one stored
polynomial (`programs.poly_value` reads it) and checked exactly at the held-out points. Buffers: the archs
derived so far hold only the rotary embedding's `inv_freq` and `original_inv_freq` (fp32, rotary dim / 2 each),
both non-persistent (not in a checkpoint) and no part of any component counted here.
"""

from __future__ import annotations

from typing import Any

import torch

from .archs import ArchSpec
from .fit import FitError, Poly, fit_poly, poly_add, poly_mul, poly_text
from .record import _layer_type

#: the components of a causal LM whose parameters a program counts, and where transformers keeps them
COMPONENTS = {"embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}


def build_meta(spec: ArchSpec, point: dict[str, int], layers: list[str] | None = None):
    """transformers' causal LM at these dims on the meta device (shapes, no memory)."""
    cfg = spec.config({k: v for k, v in point.items() if k != "seq"}, layers=layers)
    with torch.device("meta"):
        return spec.model_class()(cfg), cfg


def shapes(spec: ArchSpec, point: dict[str, int], layers: list[str] | None = None
           ) -> dict[str, dict[str, tuple[int, ...]]]:
    """component -> parameter name -> shape: embed, norm, lm_head and one `layer:<type>` per layer type (every
    layer of a type must have the same parameters; a FitError otherwise)."""
    model, cfg = build_meta(spec, point, layers)
    out = {c: {n: tuple(p.shape) for n, p in model.get_submodule(path).named_parameters()}
           for c, path in COMPONENTS.items()}
    for i, layer in enumerate(model.model.layers):
        name = f"layer:{_layer_type(cfg, i)}"
        got = {n: tuple(p.shape) for n, p in layer.named_parameters()}
        if out.setdefault(name, got) != got:
            raise FitError(f"{spec.arch}: layer {i} ({name}) has other parameters than the first {name} at {point}")
    return out


def counts(spec: ArchSpec, point: dict[str, int], layers: list[str] | None = None) -> dict[str, int]:
    """component -> numel of transformers' own parameters at this point (the check a fit must pass)."""
    model, cfg = build_meta(spec, point, layers)
    out = {c: sum(p.numel() for p in model.get_submodule(path).parameters()) for c, path in COMPONENTS.items()}
    for i, layer in enumerate(model.model.layers):
        out[f"layer:{_layer_type(cfg, i)}"] = sum(p.numel() for p in layer.parameters())
    return out


def param_names(spec: ArchSpec) -> list[str]:
    """The dims a parameter count may depend on: the program's, without seq and the dims derived from it."""
    return [n for n in spec.names() if n != "seq" and "seq" not in spec.derived.get(n, ())]


def derive_params(spec: ArchSpec, design: list[dict[str, int]], checks: list[dict[str, Any]]) -> dict[str, Poly]:
    """component -> its parameter count as a polynomial in the dims, fitted at the design points (each
    parameter's shape entries), and checked exactly at `checks` ({"point", "layers"}: the held-out points)."""
    names = param_names(spec)
    pts, seen = [], set()
    for p in design:
        key = tuple(sorted((k, v) for k, v in p.items() if k != "seq"))
        if key not in seen:
            seen.add(key)
            pts.append(p)
    per_point = [shapes(spec, p, list(spec.layers) or None) for p in pts]
    values = [spec.with_derived(dict(p)) for p in pts]
    out: dict[str, Poly] = {}
    for comp in per_point[0]:
        total: list[Poly] = []
        for param, shape0 in per_point[0][comp].items():
            got = [s.get(comp, {}).get(param) for s in per_point]
            if any(g is None or len(g) != len(shape0) for g in got):
                raise FitError(f"{spec.arch}: {comp}'s parameter {param} is missing or of another rank at some "
                               f"design points: {got}")
            term: Poly = [[1, 1]]
            for d in range(len(shape0)):
                poly = fit_poly(values, [g[d] for g in got], names)
                if poly is None:
                    ys = sorted({(tuple(sorted(p.items())), g[d]) for p, g in zip(pts, got)})[:4]
                    raise FitError(f"{spec.arch}: {comp}'s parameter {param}, shape entry {d}, does not fit a "
                                   f"polynomial of degree <= 2 in {names}; e.g. {ys}")
                term = poly_mul(term, poly)
            total.append(term)
        out[comp] = poly_add(*total)
    from dflash_graph.models.programs import poly_value

    for c in checks:
        want = counts(spec, c["point"], c["layers"])
        vals = spec.with_derived({k: v for k, v in c["point"].items()})
        for comp, n in want.items():
            if comp not in out:
                raise FitError(f"{spec.arch}: {comp} at held-out {c['point']} was not at any design point")
            got = poly_value(out[comp], vals)
            if got != n:
                raise FitError(f"{spec.arch}: {comp}'s parameter count {poly_text(out[comp])} = {got} at held-out "
                               f"{c['point']}, transformers has {n}")
    return out


__all__ = ["COMPONENTS", "counts", "derive_params", "param_names", "shapes"]
