"""Match the allocations of traces taken at several sizes and fit each one's shape in the dims.

A piece's own events (its allocations and the frees of them) must have the same structure in every trace: the
same ops from the same modules in the same order, except for one loop whose iteration count may vary (the
delta rule's scan over ceil(seq/64) chunks): then the piece is head + body x count + tail, found from two traces
whose counts differ by one. Each entry of each allocation's shape is fitted as a polynomial of degree <= 2 in the
dims (rational coefficients, solved by least squares over the design and then checked exactly at every trace);
the loop's count is fitted the same way. An allocation whose shape does not fit, or a structure that differs
between traces, is a `FitError` naming the piece, the event and the traces: nothing is dropped.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any

import numpy as np

from ..programs import poly_value
from .record import Alloc, Free, Trace

Poly = list[list]  # [[num, den, var, ...], ...]: sum of num/den * product of vars


class FitError(Exception):
    pass


def monomials(names: list[str]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [()]
    out += [(n,) for n in names]
    out += [tuple(p) for p in itertools.combinations_with_replacement(names, 2)]
    return out




def fit_poly(points: list[dict[str, int]], ys: list[int], names: list[str]) -> Poly | None:
    """The simplest polynomial of degree <= 2 in `names` through every (point, y), or None.

    Simplest first: a constant, one monomial, two monomials, then every monomial at once (least squares). The
    design has fewer points than there are monomials once derived dims are in (kv groups, chunks): a dense fit
    would find some polynomial through the design that is wrong elsewhere; the sparse one is the rule the code
    computes (a shape entry is a dim, a product of two, or a dim plus a constant)."""
    if all(y == ys[0] for y in ys):
        return [[ys[0], 1]] if ys[0] else []
    mons = monomials(names)
    a = np.array([[float(np.prod([p[n] for n in m])) if m else 1.0 for m in mons] for p in points])
    y = np.array(ys, dtype=float)
    for poly in _sparse_fits(a, y, mons):
        if all(poly_value(poly, p) == yy for p, yy in zip(points, ys)):
            return poly
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    poly = _rational(zip(mons, coef))
    if poly is not None and all(poly_value(poly, p) == yy for p, yy in zip(points, ys)):
        return poly
    return None


def _rational(terms) -> Poly | None:
    poly: Poly = []
    for m, c in terms:
        fr = Fraction(float(c)).limit_denominator(256)
        if fr != 0 and abs(float(fr) - c) < 1e-6 * max(1.0, abs(c)):
            poly.append([fr.numerator, fr.denominator, *m])
        elif abs(c) > 1e-6:
            return None
    return poly


def _sparse_fits(a: np.ndarray, y: np.ndarray, mons: list[tuple[str, ...]]):
    """Candidate polynomials of one, then two monomials that pass through every point in floating point, lowest
    degree first (the caller checks each exactly)."""
    scale = max(1.0, float(np.abs(y).max()))
    with np.errstate(divide="ignore", invalid="ignore"):
        c1 = (a * y[:, None]).sum(0) / (a * a).sum(0)
        err1 = np.abs(a * c1 - y[:, None]).max(0)
    for i in sorted(np.flatnonzero(err1 < 1e-6 * scale), key=lambda i: len(mons[i])):
        poly = _rational([(mons[i], c1[i])])
        if poly:
            yield poly
    g = a.T @ a
    b = a.T @ y
    with np.errstate(divide="ignore", invalid="ignore"):
        det = np.outer(np.diag(g), np.diag(g)) - g * g
        ci = (np.diag(g)[None, :] * b[:, None] - g * b[None, :]) / det  # coefficient of monomial i in pair (i, j)
        cj = (np.diag(g)[:, None] * b[None, :] - g * b[:, None]) / det
        err = np.abs(a[:, :, None] * ci[None] + a[:, None, :] * cj[None] - y[:, None, None]).max(0)
    ok = [(i, j) for i, j in zip(*np.nonzero(err < 1e-6 * scale))
          if i < j and abs(det[i, j]) > 1e-9 * g[i, i] * g[j, j]]
    for i, j in sorted(ok, key=lambda ij: (len(mons[ij[0]]) + len(mons[ij[1]]), ij)):
        poly = _rational([(mons[i], ci[i, j]), (mons[j], cj[i, j])])
        if poly:
            yield poly


def poly_text(poly: Poly) -> str:
    if not poly:
        return "0"
    parts = []
    for num, den, *vs in poly:
        c = Fraction(num, den)
        mon = "*".join(vs)
        if not mon:
            parts.append(str(c))
        elif c == 1:
            parts.append(mon)
        elif c.denominator == 1:
            parts.append(f"{c.numerator}*{mon}")
        else:
            parts.append(f"{c.numerator}*{mon}/{c.denominator}" if c.numerator != 1 else f"{mon}/{c.denominator}")
    return " + ".join(parts).replace("+ -", "- ")


# ---------------------------------------------------------------------------------------------------------------
# structure: a piece instance's own events, its exports and the cross frees it hosts


def _split(trace: Trace) -> list[dict[str, Any]]:
    """Per piece instance: own events, exports (allocs alive at its end) and the cross-piece frees it hosts."""
    owner: dict[int, int] = {}
    for pi, p in enumerate(trace.pieces):
        for e in p.events:
            if isinstance(e, Alloc):
                owner[e.id] = pi
    out = []
    for pi, p in enumerate(trace.pieces):
        own, cross, freed = [], [], set()
        for e in p.events:
            if isinstance(e, Alloc) or owner[e.id] == pi:
                own.append(e)
                if isinstance(e, Free):
                    freed.add(e.id)
            else:
                cross.append((len(own), e.id))
        exports = [e.id for e in own if isinstance(e, Alloc) and e.id not in freed]
        out.append({"name": p.name, "own": own, "cross": cross, "exports": exports})
    return out


def _tokens(own: list) -> list[tuple]:
    tok: dict[int, tuple] = {}
    out = []
    for e in own:
        if isinstance(e, Alloc):
            tok[e.id] = ("a", e.op, e.module, len(e.shape), e.dtype)
            out.append(tok[e.id])
        else:
            out.append(("f",) + tok[e.id][1:])
    return out


def _structure(name: str, seqs: list[list[tuple]]) -> tuple[int, int, int] | None:
    """(head, body, tail) lengths in tokens when the sequences differ by a repeated body; None when all equal."""
    if all(s == seqs[0] for s in seqs):
        return None
    lens = sorted({len(s) for s in seqs})
    if len(lens) == 1:
        i = next(k for k in range(len(seqs[0])) if len({s[k] for s in seqs}) > 1)
        raise FitError(f"{name}: traces run different ops at event {i}: {sorted({s[i] for s in seqs})}")
    short = next(s for s in seqs if len(s) == lens[0])
    longer = next(s for s in seqs if len(s) == lens[1])
    body = lens[1] - lens[0]
    i = 0
    while i < len(short) and short[i] == longer[i]:
        i += 1
    x = longer[i:i + body]
    if short != longer[:i] + longer[i + body:]:
        raise FitError(f"{name}: traces differ other than by a repeated block (first difference at event {i})")
    s = i
    while s - body >= 0 and longer[s - body:s] == x:
        s -= body
    e = i + body
    while longer[e:e + body] == x:
        e += body
    head, tail = s, len(longer) - e
    for seq in seqs:
        n, r = divmod(len(seq) - head - tail, body)
        if r or seq[:head] != longer[:head] or seq[len(seq) - tail:] != longer[len(longer) - tail:] or any(
                seq[head + k * body: head + (k + 1) * body] != x for k in range(n)):
            raise FitError(f"{name}: a trace is not head + body x n + tail of the others' blocks")
    return head, body, tail


def _regions(own: list, shape: tuple[int, int, int] | None) -> tuple[list, list[list], list]:
    if shape is None:
        return own, [], []
    head, body, tail = shape
    n = (len(own) - head - tail) // body
    return own[:head], [own[head + k * body: head + (k + 1) * body] for k in range(n)], own[len(own) - tail:]


def _coords(head, iters, tail) -> dict[int, tuple]:
    """alloc id -> its id in the program: ("h", k) / ("b", k, iteration) / ("t", k)."""
    out: dict[int, tuple] = {}
    for region, tag in ((head, "h"), (tail, "t")):
        k = 0
        for e in region:
            if isinstance(e, Alloc):
                out[e.id] = (tag, k)
                k += 1
    for it, block in enumerate(iters):
        k = 0
        for e in block:
            if isinstance(e, Alloc):
                out[e.id] = ("b", k, it)
                k += 1
    return out


def _free_ref(coord: tuple, where: str, it: int, n_iters: int) -> dict[str, Any]:
    if coord[0] != "b":
        return {"f": f"{coord[0]}{coord[1]}"}
    if where == "b":
        return {"f": f"b{coord[1]}", "iter": coord[2] - it}
    return {"f": f"b{coord[1]}", "iter": coord[2] - n_iters}  # -1: the last iteration


def fit_program(arch: str, traces: list[tuple[dict[str, int], Trace]], names: list[str]) -> dict[str, Any]:
    """The program (as JSON data) of traces of one arch at the design points: pieces by template name, in the
    order of the first trace, with each piece's events, loop, exports and where each export dies."""
    splits = [(v, _split(t)) for v, t in traces]
    order = [p["name"] for p in splits[0][1]]
    for v, sp in splits:
        if [p["name"] for p in sp] != order:
            raise FitError(f"{arch}: the pieces of the trace at {v} differ from the first trace's")
    templates: dict[str, dict[str, Any]] = {}
    # pieces that occur once in any forward; a layer type traced once is not one of them: in another composition
    # it repeats, so where its exports die is relative to it (an offset), never a named piece (its output dies
    # after the next layer, or after the norm when it is last: three pieces later either way)
    unique = {n for n in order if order.count(n) == 1 and not n.startswith("layer:")}
    for name in dict.fromkeys(order):
        positions = [i for i, n in enumerate(order) if n == name]
        samples = [(v, sp[i]) for v, sp in splits for i in positions]
        seqs = [_tokens(s["own"]) for _, s in samples]
        shape = _structure(name, seqs)
        regions = [(v, _regions(s["own"], shape)) for v, s in samples]
        first = regions[0][1]
        piece: dict[str, Any] = {}
        for key, idx in (("head", 0), ("tail", 2)):
            piece[key] = _fit_events(f"{name}.{key}", [(v, r[idx], r) for v, r in regions], names, key[0])
        if shape is not None:
            counts = [len(r[1]) for _, r in regions]
            count = fit_poly([v for v, _ in regions], counts, names)
            if count is None:
                raise FitError(f"{name}: the loop's count {counts} does not fit in {names}")
            body = _fit_events(f"{name}.body", [(v, r[1][0], r) for v, r in regions if r[1]], names, "b",
                               every_iteration=[(v, r) for v, r in regions])
            piece["loop"] = {"count": count, "count_text": poly_text(count), "body": body}
        # exports and where each dies
        exports = []
        for j, _ in enumerate(samples[0][1]["exports"]):
            rules = set()
            for v, sp in splits:
                for i in positions:
                    ident = sp[i]["exports"][j]
                    host, at = next((h, a) for h, s in enumerate(sp) for a, x in s["cross"] if x == ident) \
                        if any(x == ident for s in sp for _, x in s["cross"]) else (None, None)
                    if host is None:
                        rules.add(("never", 0))
                    elif name in unique and order[host] in unique:
                        rules.add(("piece", order[host], at))
                    else:
                        rules.add(("offset", host - i, at))
            if len(rules) != 1:
                raise FitError(f"{name}: export {j} dies in different places across traces: {sorted(rules)}")
            rule = rules.pop()
            coord = _coords(*first)[samples[0][1]["exports"][j]]
            ref = f"{coord[0]}{coord[1]}"
            if rule[0] == "never":
                exports.append({"id": ref, "dies": None})
            elif rule[0] == "piece":
                exports.append({"id": ref, "dies": {"piece": rule[1], "at": rule[2]}})
            else:
                exports.append({"id": ref, "dies": {"offset": rule[1], "at": rule[2]}})
        piece["exports"] = exports
        templates[name] = piece
    return {"pieces": templates, "order": order}


def _fit_events(where: str, samples, names: list[str], tag: str, every_iteration=None) -> list[dict[str, Any]]:
    events0 = samples[0][1]
    out: list[dict[str, Any]] = []
    for k, e in enumerate(events0):
        if isinstance(e, Alloc):
            vals = [(v, ev[k]) for v, ev, _ in samples]
            if every_iteration:
                vals = [(v, blk[k]) for v, r in every_iteration for blk in r[1]]
            shape_ok = all(a.nbytes == a.itemsize * int(np.prod(a.shape, dtype=object)) for _, a in vals)
            dims = [list(a.shape) for _, a in vals] if shape_ok else [[a.nbytes // a.itemsize] for _, a in vals]
            shape = []
            for d in range(len(dims[0])):
                poly = fit_poly([v for v, _ in vals], [x[d] for x in dims], names)
                if poly is None:
                    ys = sorted({(tuple(sorted(v.items())), x[d]) for (v, _), x in zip(vals, dims)})[:4]
                    raise FitError(f"{where} event {k} ({e.op} in {e.module or 'the piece'}): shape entry {d} "
                                   f"does not fit a polynomial of degree <= 2 in {names}; e.g. {ys}")
                shape.append(poly)
            out.append({"alloc": f"{tag}{sum(isinstance(x, Alloc) for x in events0[:k])}", "dtype": e.dtype,
                        "itemsize": e.itemsize, "shape": shape,
                        "shape_text": "[" + ", ".join(poly_text(p) for p in shape) + "]",
                        "storage": "shape" if shape_ok else "elements", "op": e.op, "module": e.module})
        elif tag != "b":
            refs = set()
            for _, ev, regions in samples:
                ref = _free_ref(_coords(*regions)[ev[k].id], tag, 0, len(regions[1]))
                refs.add(tuple(sorted(ref.items())))
            if len(refs) != 1:
                raise FitError(f"{where} event {k}: the free refers to different allocations across traces: {refs}")
            out.append(dict(refs.pop()))
        else:
            # a body free: the same iteration's or an earlier one's allocation; in the first iterations, where that
            # iteration does not exist, an allocation of the head (the loop's initial value)
            deltas, inits = set(), set()
            for _, r in every_iteration:
                coords = _coords(*r)
                for it, blk in enumerate(r[1]):
                    c = coords[blk[k].id]
                    if c[0] == "b":
                        deltas.add(c[2] - it)
                    else:
                        inits.add((it, f"{c[0]}{c[1]}"))
            if len(deltas) != 1 or len({i for _, i in inits}) > 1 or any(it + d >= 0 for it, _ in inits
                                                                           for d in deltas):
                raise FitError(f"{where} event {k}: the free does not refer to one iteration's allocation "
                               f"(iterations back: {sorted(deltas)}, initial values: {sorted(inits)})")
            out.append(_body_free(every_iteration, k, deltas.pop(), inits))
    return out


def _body_free(every_iteration, k: int, delta: int, inits) -> dict[str, Any]:
    for _, r in every_iteration:
        coords = _coords(*r)
        for blk in r[1]:
            c = coords[blk[k].id]
            if c[0] == "b":
                ref: dict[str, Any] = {"f": f"b{c[1]}", "iter": delta}
                if inits:
                    ref["init"] = next(iter(inits))[1]
                return ref
    raise FitError(f"body event {k}: no iteration frees a body allocation")


# ---------------------------------------------------------------------------------------------------------------
# polynomial arithmetic on the stored form (a parameter count is a sum of products of fitted shape entries)


def poly_mul(a: Poly, b: Poly) -> Poly:
    """The product of two stored polynomials, like terms combined (poly_canon's order)."""
    return poly_canon([[x[0] * y[0], x[1] * y[1], *x[2:], *y[2:]] for x in a for y in b])


def poly_add(*polys: Poly) -> Poly:
    return poly_canon([t for p in polys for t in p])


def poly_canon(terms: Poly) -> Poly:
    """Like terms combined, zero terms dropped, each monomial's dims sorted, lowest degree first."""
    acc: dict[tuple[str, ...], Fraction] = {}
    for num, den, *dims in terms:
        m = tuple(sorted(dims))
        acc[m] = acc.get(m, Fraction(0)) + Fraction(num, den)
    return [[c.numerator, c.denominator, *m] for m, c in sorted(acc.items(), key=lambda mc: (len(mc[0]), mc[0]))
            if c != 0]
