"""The rewrite rules proven for every size, offset, index and rank, by an SMT solver (z3).

Each theorem is built from the declarations the rules read (ops/catalog.py `Traits`, `IndexRemap`,
`Selection`, port dim strings) and from the rules' own index arithmetic (rules.remap_index,
rules.positionwise_axis, rules._group_span, evaluated here on solver terms), one theorem per declaring op. A
tensor is a function of its index: a variadic dim group (`*batch`) is one index of the sequence sort (any rank),
a named dim one integer; values are reals (integers for int64 ports). An op with a `Traits.reference` is
modelled by it, so its traits are checked; an op without one is modelled by its traits (the axioms: a
position-wise map is an uninterpreted function of the position's slice). A theorem is proved when the negation
of its equality, with every axiom, is unsatisfiable; otherwise the solver's model is printed as a
counterexample: sizes, indices, and the two sides of the equality that broke. docs/rules/ states each theorem.

`python -m dflash_graph.rewrite.proofs` (or `dflash-graph prove`) prints each theorem and its proof time.
z3 (`pip install z3-solver`) is imported only when a proof runs.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import attrs

from ..ops import registry
from ..ops.contract import OpDef, Port, tokens
from . import rules

TIMEOUT_MS = 30_000         # per query: true theorems take well under a second; this only bounds the hopeless
NICE_TIMEOUT_MS = 2_000
_NAMES = itertools.count()     # solver names are global to z3's context: never reuse one
_SUM: list = []                # the one recursive sum definition
_SUM_ABS: list = []            # and its uninterpreted abstraction


class ProverMissing(RuntimeError):
    pass


def _z3():
    try:
        import z3
    except ImportError as e:  # exercised only without the extra
        raise ProverMissing("the proofs need z3: pip install z3-solver  (or pip install -e '.[prove]')") from e
    return z3


# -- the algebra: tensors as functions of their index ------------------------------------------------------------

@attrs.frozen
class Tensor:
    """`kinds`: one letter per token of the port's dims, 'i' (one integer index) or 's' (a variadic group: a
    sequence of integers, any length); `at(*index)` is the value there (a solver term)."""
    kinds: tuple[str, ...]
    at: Callable[..., Any]
    size: Callable[[Any], Any] | None = None     # the size of a flat axis, where the theorem knows it


class Algebra:
    """What an op's `Traits.reference` is written with (the `t` argument) and what the theorems are built from."""

    def __init__(self, abstract_sums: bool = False):
        self.abstract_sums = abstract_sums     # sums as an uninterpreted function: sound for proofs, never refutes
        self.z3 = z3 = _z3()
        self.IDX = z3.SeqSort(z3.IntSort())
        self.requires: list[tuple[Any, str]] = []
        self._pw: dict = {}

    # names and sorts
    def fresh(self, base: str) -> str:
        return f"{base}!{next(_NAMES)}"

    def sort(self, kind: str):
        return self.IDX if kind == "s" else self.z3.IntSort()

    def value_sort(self, dtype: Any):
        return self.z3.IntSort() if dtype is int or (isinstance(dtype, str) and dtype.startswith("int")) \
            else self.z3.RealSort()

    def const(self, name: str, kind: str):
        return self.z3.Const(name, self.sort(kind))

    def input(self, name: str, kinds: Sequence[str], dtype: Any = float) -> tuple[Tensor, Any]:
        """An arbitrary tensor: an uninterpreted function of its index."""
        f = self.z3.Function(self.fresh(name), *[self.sort(k) for k in kinds], self.value_sort(dtype))
        return Tensor(tuple(kinds), f), f

    # what references use
    def tensor(self, kinds: Sequence[str], at: Callable[..., Any], dtype: Any = float) -> Tensor:
        return Tensor(tuple(kinds), at)

    def require(self, cond, why: str) -> None:
        """A run-time check of the op: the theorem holds where every check passes."""
        self.requires.append((cond, why))

    def all(self, *conds):
        return self.z3.And(*conds)

    def where(self, cond, a, b):
        return self.z3.If(cond, a, b)

    def unit(self, i):
        return self.z3.Unit(i)

    def cat(self, *seqs):
        seqs = [s for s in seqs if s is not None]
        return seqs[0] if len(seqs) == 1 else self.z3.Concat(*seqs)

    def take(self, s, start, length):
        return self.z3.SubSeq(s, start, length)

    def length(self, s):
        return self.z3.Length(s)

    def nth(self, s, i):
        return s[i]

    def clamp(self, v, n):
        return self.z3.If(v < 0, 0, self.z3.If(v > n - 1, n - 1, v))

    def sum(self, lo, hi, body: Callable[[Any], Any]):
        """sum_{lo <= i < hi} body(i) (0 when hi <= lo), a recursive definition over an array of the terms."""
        z3 = self.z3
        if self.abstract_sums:
            if not _SUM_ABS:
                _SUM_ABS.append(z3.Function("sum", z3.ArraySort(z3.IntSort(), z3.RealSort()), z3.IntSort(),
                                            z3.IntSort(), z3.RealSort()))
            i = z3.Int(self.fresh("i"))
            return _SUM_ABS[0](z3.Lambda([i], body(i)), lo, hi)
        if not _SUM:
            A = z3.ArraySort(z3.IntSort(), z3.RealSort())
            f = z3.RecFunction("sum", A, z3.IntSort(), z3.IntSort(), z3.RealSort())
            a, l, h = z3.Const("a", A), z3.Int("l"), z3.Int("h")
            z3.RecAddDefinition(f, [a, l, h], z3.If(h <= l, z3.RealVal(0), f(a, l, h - 1) + a[h - 1]))
            _SUM.append(f)
        i = z3.Int(self.fresh("i"))
        return _SUM[0](z3.Lambda([i], body(i)), lo, hi)

    def slice(self, x: Tensor, fixed: dict[int, Any]):
        """x with the slots in `fixed` held at the given indices, as an array over the other slots (or the value
        itself when every slot is fixed)."""
        free = [j for j in range(len(x.kinds)) if j not in fixed]
        if not free:
            return x.at(*[fixed[j] for j in range(len(x.kinds))])
        vs = [self.const(self.fresh("s"), x.kinds[j]) for j in free]
        env = dict(fixed) | dict(zip(free, vs))
        return self.z3.Lambda(vs, x.at(*[env[j] for j in range(len(x.kinds))]))


def kinds_of(dims: str) -> tuple[str, ...]:
    return tuple("s" if t.startswith("*") else "i" for t in tokens(dims))


def _dtype(port: Port, ports: Sequence[Port]) -> Any:
    if port.dtype.startswith("like:"):
        src = next((p for p in ports if p.name == port.dtype[5:]), None)
        return _dtype(src, ports) if src is not None and src is not port else float
    return int if port.dtype.startswith("int") else float


# -- theorems and their outcomes ---------------------------------------------------------------------------------

@attrs.frozen
class Theorem:
    name: str
    rule: str
    statement: str
    axioms: tuple[str, ...]
    check: Callable[[], tuple[str, str]]     # -> (status, detail): proved | refuted | unknown
    expect: str = "proved"                   # "refuted": the rule must not fire here (and does not)
    show_detail: bool = False                # print the detail (sub-lemmas, the condition found) even when as required


@attrs.frozen
class Outcome:
    theorem: Theorem
    status: str
    seconds: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == self.theorem.expect


def _solve(t: Algebra, facts: Sequence[Any], goal, show: Callable[[Any], str],
           nice: Sequence[Any] = (), timeout_ms: int | None = None) -> tuple[str, str]:
    """Prove `goal` under `facts` (unsat of the negation); on sat, a counterexample, made small and readable with
    the `nice` constraints when they still allow one."""
    z3 = t.z3
    s = z3.Solver()
    s.set("timeout", timeout_ms or TIMEOUT_MS)
    s.add(*facts)
    s.add(z3.Not(goal))
    r = s.check()
    if r == z3.unsat:
        return "proved", ""
    if r == z3.unknown:
        return "unknown", f"solver: {s.reason_unknown()}"
    model = s.model()
    if nice:   # the same counterexample question among small sizes and indices: easier to read
        s.add(*nice)
        s.set("timeout", NICE_TIMEOUT_MS)
        if s.check() == z3.sat:
            model = s.model()
    return "refuted", show(model)


def _unfold_sums(v, limit: int = 64):
    """Evaluate the recursive sums left in a model value whose bounds are numbers (the model's own values)."""
    z3 = _z3()
    if not _SUM:
        return v
    for _ in range(limit):
        apps, seen = [], set()

        def walk(e):
            if e.get_id() in seen:
                return
            seen.add(e.get_id())
            if z3.is_app(e):
                if e.decl().eq(_SUM[0]):
                    apps.append(e)
                for ch in e.children():
                    walk(ch)
            elif z3.is_quantifier(e):
                walk(e.body())
        walk(v)
        ready = [e for e in apps if all(z3.is_int_value(z3.simplify(b)) for b in e.children()[1:])
                 and not any(z3.is_app(c) and c.decl().eq(_SUM[0]) for c in e.children())]
        if not ready:
            return v
        e = ready[0]
        a, lo, hi = e.children()
        lo, hi = z3.simplify(lo).as_long(), z3.simplify(hi).as_long()
        total = z3.RealVal(0)
        for i in range(lo, min(hi, lo + 1000)):
            total = total + a[i]
        v = z3.simplify(z3.substitute(v, (e, z3.simplify(total))))
    return v


def _small(*seqs, bound: int = 3):
    """Readable counterexamples: the first elements of these index sequences in [0, bound]."""
    z3 = _z3()
    return [z3.Implies(z3.Length(q) > i, z3.And(q[i] >= 0, q[i] <= bound)) for q in seqs for i in range(3)]


def _val(model, term) -> str:
    """A readable value: integers and reals as numbers, sequences as lists."""
    z3 = _z3()
    v = _unfold_sums(z3.simplify(model.eval(term, model_completion=True)))
    if z3.is_seq(v):
        n = model.eval(z3.Length(v), model_completion=True).as_long()
        return "[" + ", ".join(_val(model, v[i]) for i in range(n)) + "]"
    if z3.is_rational_value(v):
        return str(v.as_fraction()) if v.denominator_as_long() != 1 else str(v.numerator_as_long())
    return str(v)


def _table(model, fn, limit: int = 6) -> str:
    """The interesting entries of an uninterpreted tensor in the model: `x[[0, 1]] = 2, ..., else 0`."""
    z3 = _z3()
    try:
        interp = model[fn]
    except Exception:
        interp = None
    if interp is None:
        return "any"
    if isinstance(interp, z3.FuncInterp):
        rows = []
        for e in interp.as_list()[:-1][:limit]:
            *args, v = e
            rows.append(f"[{', '.join(_val(model, a) for a in args)}] = {_val(model, v)}")
        rows.append(f"else {_val(model, interp.else_value())}")
        return ", ".join(rows)
    return str(interp)


def _report(equality: str, model, named: Sequence[tuple[str, Any]], tensors: Sequence[tuple[str, Any]] = ()) -> str:
    lines = [f"equality that broke: {equality}"]
    lines += [f"  {k} = {_val(model, v)}" for k, v in named]
    lines += [f"  {k}: {_table(model, f)}" for k, f in tensors]
    return "\n".join(lines)


# -- gather through a remap (IndexRemap, roll) -------------------------------------------------------------------

def _select(t: Algebra, sel, x_at, idx_at, n):
    """The selection's value at (pre, J, post): x[pre, index[J], post], with the declared out-of-range behaviour."""
    def at(pre, J, post):
        v = idx_at(J)
        if sel.out_of_range == "clamp":
            v = t.clamp(v, n)
        else:
            t.require(t.all(v >= 0, v < n), "selection: 0 <= index < n")
        return x_at(pre, v, post)
    return at


def _remap_parts(sel_op: OpDef, remap_op: OpDef, check_range: bool | None):
    """Both sides of gather(remap(x, k), idx) = gather(x, index'(idx)) at one index of the result, with the
    rewritten index node built by rules.remap_index on solver terms."""
    t = Algebra()
    z3 = t.z3
    sel, remap = sel_op.traits.selection, remap_op.traits.remap
    n, k, a, r = z3.Ints("n shift axis rank_idx")
    pre, post, J = z3.Const("pre", t.IDX), z3.Const("post", t.IDX), z3.Const("J", t.IDX)
    x_t, x = t.input("x", "s")
    idx_t, idx = t.input("idx", "s", int)
    size = z3.Function("size_of_x", z3.IntSort(), z3.IntSort())
    x_t = Tensor(x_t.kinds, x_t.at, size)
    X = lambda p, i, q: x(t.cat(p, t.unit(i), q))                  # noqa: E731  x[*pre, i, *post]
    rparams = {**_params_for(remap_op, t, 0), remap.shift_param: k, remap.axis_param: a}
    if remap_op.traits.reference is not None:   # the op's own definition: the IndexRemap trait is checked
        (rin,), (rout,) = remap_op.input_ports(rparams), remap_op.output_ports(rparams)
        y_t = remap_op.traits.reference(t, rparams, **{rin.name: x_t})[rout.name]
        Y = lambda p, i, q: y_t.at(t.cat(p, t.unit(i), q))          # noqa: E731
    else:   # IndexRemap(shift_param, axis_param): out[..., i, ...] = x[..., (i - shift) mod n, ...] along axis_param
        Y = lambda p, i, q: X(p, (i - rparams[remap.shift_param]) % n, q)   # noqa: E731
    lhs = _select(t, sel, Y, idx, n)(pre, J, post)
    op_name, params = rules.remap_index(k, n)
    if check_range is not None:
        params = {**params, "check_range": check_range}
    shift_op = registry.get(op_name)
    ref = shift_op.traits.reference
    (iport,) = shift_op.input_ports(params)
    new_idx = ref(t, params, **{iport.name: idx_t})["out"]
    rhs = _select(t, sel, X, new_idx.at, n)(pre, J, post)
    facts = [n >= 1, a >= 0, r >= 0, z3.Length(pre) == a, z3.Length(J) == r, size(a) == n]
    checks = [c for c, _ in t.requires]
    named = [("n (axis length)", n), ("shift", k), ("axis", a), ("index J", J), ("idx[J]", idx(J)),
             ("pre", pre), ("post", post), ("lhs", lhs), ("rhs", rhs)]
    eq = (f"{sel_op.name}({remap_op.name}(x, {remap.shift_param}=k, {remap.axis_param}=a), idx)[pre, J, post] == "
          f"{sel_op.name}(x, {op_name}(idx, {', '.join(f'{p}={v}' for p, v in _show_params(params))}))[pre, J, post]")
    nice = [n <= 4, z3.Length(J) == 1, z3.Length(pre) <= 1, z3.Length(post) <= 1, *_small(pre, J, post),
            k >= -8, k <= 8]
    return SimpleNamespace(t=t, facts=facts, checks=checks, lhs=lhs, rhs=rhs, named=named, eq=eq, v=idx(J), n=n,
                           tensors=[("x", x)], nice=nice)


def _show_params(params):
    shown = {"shift": "(-k) mod n", "modulo": "n"}
    return [(p, shown.get(p, v)) for p, v in params.items()]


def _remap_theorem(sel_op: OpDef, remap_op: OpDef) -> Theorem:
    def check():
        p = _remap_parts(sel_op, remap_op, None)
        return _solve(p.t, p.facts + p.checks, p.lhs == p.rhs, lambda m: _report(p.eq, m, p.named, p.tensors), p.nice)
    return Theorem(
        f"gather_through_remap[{sel_op.name} o {remap_op.name}]", "gather_through_remap",
        f"for all n >= 1, shift k, axis a, rank, index J and idx[J] that pass the inserted check: "
        f"{sel_op.name}({remap_op.name}(x, k, a), idx, a) = {sel_op.name}(x, (idx - k) mod n, a) at [pre, J, post]",
        (f"{remap_op.name} by its Traits.reference (its IndexRemap is checked)" if remap_op.traits.reference else
         f"{remap_op.name} declares IndexRemap: out[..., i, ...] = x[..., (i - shift) mod n, ...]",
         f"{sel_op.name} declares Selection (out_of_range = {sel_op.traits.selection.out_of_range!r}): "
         "out[pre, J, post] = x[pre, idx[J], post]",
         "index_shift by its Traits.reference: (index + shift) mod modulo, check_range: 0 <= index < modulo"),
        check)


def _condition_theorem(sel_op: OpDef, remap_op: OpDef) -> Theorem:
    """Without the inserted check the rule is not exact: find the weakest conjunction of the selection's range
    atoms under which it is, and show the rule's check is exactly that condition."""
    def check():
        p = _remap_parts(sel_op, remap_op, False)
        t, facts, v, n = p.t, p.facts, p.v, p.n
        z3 = t.z3
        atoms = [("0 <= idx", v >= 0), ("idx < n", v < n)]
        show = lambda m: _report(p.eq, m, p.named, p.tensors)   # noqa: E731
        lines = []
        status, detail = _solve(t, facts, p.lhs == p.rhs, show, p.nice)
        if status != "refuted":
            return "unknown", f"the rule without its check was {status}; expected a counterexample"
        lines.append("without a condition: refuted\n" + _indent(detail))
        found = None
        for size in range(1, len(atoms) + 1):
            for combo in itertools.combinations(atoms, size):
                st, det = _solve(t, facts + [c for _, c in combo], p.lhs == p.rhs, show, p.nice)
                label = " and ".join(a for a, _ in combo)
                if st == "proved":
                    found = (label, z3.And(*[c for _, c in combo]))
                    break
                lines.append(f"under {label}: {st}\n" + _indent(det))
            if found:
                break
        if not found:
            return "refuted", "\n".join(lines + ["no conjunction of the range atoms makes it exact"])
        # the rule's inserted check (index_shift check_range) is exactly the condition found
        q = _remap_parts(sel_op, remap_op, True)
        cond = z3.substitute(found[1], (v, q.v), (n, q.n))
        st, det = _solve(q.t, q.facts, z3.And(*q.checks) == cond, lambda m: "the inserted check differs from "
                         f"{found[0]}: " + _report("check == condition", m, [("idx[J]", q.v), ("n", q.n)]))
        lines.append(f"condition found: {found[0]} (weakest conjunction of the range atoms)")
        lines.append(f"rule's run-time check (index_shift check_range) == {found[0]}: {st}")
        return ("proved" if st == "proved" else st), "\n".join(lines)
    return Theorem(
        f"gather_through_remap[{sel_op.name} o {remap_op.name}]: condition", "gather_through_remap",
        "the rewrite without a check is refuted; the weakest conjunction of the range atoms {0 <= idx, idx < n} "
        "that makes it exact is found, and the rule's run-time check is proven equal to it",
        ("as gather_through_remap", "candidate conditions: the selection's own in-range atoms"),
        check, show_detail=True)


def _indent(s: str, by: str = "    ") -> str:
    return "\n".join(by + line for line in s.splitlines())


# -- gather through a position-wise op ---------------------------------------------------------------------------

def _group_slot(dims: str, group: str) -> int | None:
    toks = tokens(dims)
    return toks.index(f"*{group}") if f"*{group}" in toks else None


def _positionwise_model(t: Algebra, op: OpDef, params, inputs: dict[str, Tensor], out_port: Port):
    """The op's output by its Traits.reference, or by the position-wise axiom: out[a, G, c] = F(the slices of
    every input carrying the group at G, every other input whole, a, c) with F uninterpreted."""
    if op.traits.reference is not None:
        return op.traits.reference(t, params, **inputs)[out_port.name]
    z3 = t.z3
    group = op.traits.positionwise
    in_ports = op.input_ports(params, len(inputs))
    okinds = kinds_of(out_port.dims)
    g_out = _group_slot(out_port.dims, group)

    def at(*ix):
        G = ix[g_out]
        args = []
        for p in in_ports:
            x = inputs[p.name]
            g = _group_slot(p.dims, group)
            args.append(t.slice(x, {g: G}) if g is not None else t.slice(x, {}))
        others = [ix[j] for j in range(len(okinds)) if j != g_out]
        F = t._pw.setdefault((op.name, out_port.name), z3.Function(
            t.fresh(f"F_{op.name}_{out_port.name}"), *[a.sort() for a in args], *[o.sort() for o in others],
            t.value_sort(_dtype(out_port, op.output_ports(params)))))
        return F(*args, *others)
    return Tensor(okinds, at)


def _params_for(op: OpDef, t: Algebra, n_inputs: int):
    z3 = t.z3
    params: dict[str, Any] = {"_n_inputs": n_inputs}
    for p in op.params:
        if p.kind in ("int", "dim"):
            params[p.name] = z3.Int(f"param_{p.name}")
        elif p.kind == "float":
            params[p.name] = z3.Real(f"param_{p.name}")
        else:
            params[p.name] = p.default
    return params


def _positionwise_theorem(op: OpDef, sel_op: OpDef, out_port: Port, leading: bool) -> Theorem:
    group = op.traits.positionwise
    sel = sel_op.traits.selection
    n_inputs = 2 if op.variadic_input else 0
    where = "an axis after k >= 1 leading dims of the group (batch-like leading dims)" if leading \
        else "the first axis of the group (the declared axis)"

    def check():
        # first with sums abstracted (a proof then holds for the real sums too), then, if that does not prove
        # it, with their recursive definition (a counterexample then is a real one)
        status, detail = attempt(True)
        if status == "proved" or op.traits.reference is None:
            return status, detail
        status2, detail2 = attempt(False)
        return (status2, detail2) if status2 == "refuted" else (status, detail)

    def attempt(abstract_sums: bool):
        t = Algebra(abstract_sums)
        z3 = t.z3
        params = _params_for(op, t, n_inputs)
        in_ports = op.input_ports(params, n_inputs)
        okinds = kinds_of(out_port.dims)
        g_out = _group_slot(out_port.dims, group)
        k, r = z3.Ints("k rank_idx")
        gsz = z3.Function("size_of_group_axis", z3.IntSort(), z3.IntSort())
        P, J, Q = (z3.Const(s, t.IDX) for s in ("P", "J", "Q"))
        if not leading:
            P = z3.Empty(t.IDX)
        _, idx = t.input("idx", "s", int)
        ins, fns = {}, []
        for p in in_ports:
            x, f = t.input(p.name, kinds_of(p.dims), _dtype(p, in_ports))
            ins[p.name] = x
            fns.append((p.name, f))
        others = {j: z3.Const(f"out_{j}", t.sort(okinds[j])) for j in range(len(okinds)) if j != g_out}

        def ix(G):
            return [G if j == g_out else others[j] for j in range(len(okinds))]

        # LHS: select along the output's axis at offset k of the group
        y = _positionwise_model(t, op, params, ins, out_port)
        v = idx(J)
        if sel.out_of_range == "clamp":
            v = t.clamp(v, gsz(k))
        lhs = y.at(*ix(t.cat(P, t.unit(v), Q)))
        # RHS: the rule's rewrite: each input carrying the group is selected along positionwise_axis(...)
        rank = z3.Int("rank_out")
        out_start, _ = rules._group_span(out_port.dims, group, rank)
        axis = out_start + k
        gathered, reads = {}, []
        G_lhs = t.cat(P, t.unit(v), Q)
        for p in in_ports:
            x = ins[p.name]
            span = rules._group_span(p.dims, group, z3.Int(f"rank_{p.name}"))
            if span is None:
                gathered[p.name] = x
                continue
            g = _group_slot(p.dims, group)
            off = rules.positionwise_axis(out_start, axis, span[0]) - span[0]   # the axis's place in the group

            def selected(G, off=off):
                """The group index of x that x selected along the group's axis `off` reads at G."""
                w = idx(t.take(G, off, r))
                if sel.out_of_range == "clamp":
                    w = t.clamp(w, gsz(off))
                return t.cat(t.take(G, 0, off), t.unit(w), t.take(G, off + r, t.length(G) - off - r))

            def at(*xi, x=x, g=g, selected=selected):
                return x.at(*[selected(xi[g]) if j == g else xi[j] for j in range(len(xi))])
            gathered[p.name] = Tensor(x.kinds, at)
            reads.append((p.name, selected(t.cat(P, J, Q))))
        y2 = _positionwise_model(t, op, params, gathered, out_port)
        rhs = y2.at(*ix(t.cat(P, J, Q)))
        facts = [k >= 1 if leading else k == 0, r >= 0, z3.Length(P) == k, z3.Length(J) == r, gsz(k) >= 1]
        checks = [c for c, _ in t.requires]
        named = [("k (offset in *" + group + ")", k), ("rank of idx", r), ("size of the selected axis", gsz(k)),
                 ("P (leading group index)", P), ("J (index of idx)", J), ("Q (trailing group index)", Q),
                 ("idx[J]", idx(J)), *[(f"out index slot {j}", o) for j, o in others.items()]]
        if op.traits.reference is None:
            # the axiom's F is a function: equal values where both sides read the same position of every input
            goal = z3.And(*[G_lhs == G for _, G in reads], lhs == rhs)
            named += [("lhs reads every input at group index", G_lhs),
                      *[(f"rhs reads {name} at group index", G) for name, G in reads]]
            tensors = [("idx", idx)]
        else:
            goal = lhs == rhs
            named += [("lhs", lhs), ("rhs", rhs)]
            tensors = [*fns, ("idx", idx)]
        eq = (f"{sel_op.name}({op.name}(...).{out_port.name}, idx, axis={group}[k])[.., P ++ J ++ Q, ..] == "
              f"{op.name}({', '.join(p.name + ('[rows idx]' if _group_slot(p.dims, group) is not None else '') for p in in_ports)})"
              f".{out_port.name}[.., P ++ J ++ Q, ..]")
        jj = z3.Const("j", t.IDX)
        nice = [gsz(k) <= 4, r == 1, z3.Length(Q) <= 1, z3.ForAll([jj], z3.And(idx(jj) >= 0, idx(jj) < gsz(k))),
                *_small(P, J, Q)] + [z3.And(o >= 0, o <= 3) for o in others.values() if o.sort() == z3.IntSort()]
        return _solve(t, facts + checks, goal, lambda m: _report(eq, m, named, tensors), nice)

    return Theorem(
        f"gather_through_positionwise[{op.name}.{out_port.name}, {'leading dims' if leading else 'declared axis'}]",
        "gather_through_positionwise",
        f"for every rank, every size and every index, selecting along {where} of {op.name}.{out_port.name} "
        f"({out_port.dims}) equals {op.name} of the inputs selected along the corresponding axis "
        f"(rules.positionwise_axis)",
        ((f"{op.name} by its Traits.reference" if op.traits.reference else
          f"{op.name} declares positionwise={group!r}: out[.., G, ..] = F(inputs' slices at G), F uninterpreted"),
         f"{sel_op.name} declares Selection (out_of_range = {sel.out_of_range!r})",
         f"the axes of *{group} correspond one-to-one across {op.name}'s ports (same sizes)"),
        check)


# -- drop unused, merge duplicates, transfer round trip ----------------------------------------------------------

def _effects(t: Algebra, op: OpDef):
    """An op's step in a program: (value(params, inputs, state), next state). Pure: the state is unchanged
    (axiom from Traits.pure); deterministic: the value does not read the random stream."""
    z3 = t.z3
    S = t._S
    V = z3.Function(t.fresh(f"V_{op.name}"), z3.IntSort(), z3.IntSort(), S, z3.RealSort())
    E = z3.Function(t.fresh(f"E_{op.name}"), z3.IntSort(), S, S)

    def step(ins, state, rng):
        value = V(ins, rng if not op.traits.deterministic else z3.IntVal(0), state)
        return value, (state if op.traits.pure else E(ins, state))
    return step


def _drop_theorem(op: OpDef, expect: str = "proved") -> Theorem:
    def check():
        t = Algebra()
        z3 = t.z3
        t._S = z3.DeclareSort("State")
        s0, rng = z3.Const("state0", t._S), z3.Int("rng")
        ins_n, ins_m = z3.Ints("inputs_of_node inputs_of_reader")
        node = _effects(t, op)
        reader = _effects(t, attrs.evolve(op, name="later", traits=attrs.evolve(op.traits, pure=False)))
        _, s1 = node(ins_n, s0, rng)                  # the unread node runs ...
        v_with, s_with = reader(ins_m, s1, rng)
        v_without, s_without = reader(ins_m, s0, rng)  # ... or does not
        named = [("value of a later node with it", v_with), ("without it", v_without)]
        eq = f"later nodes' values and the final state, with and without the unread {op.name}"
        return _solve(t, [], z3.And(v_with == v_without, s_with == s_without),
                      lambda m: _report(eq, m, named) + "\n  the state after it differs from the state before")
    return Theorem(
        f"drop_unused[{op.name}]", "drop_unused",
        f"removing a node of {op.name} none of whose outputs is read leaves every later value and the final state "
        "unchanged (induction over the schedule: each later node sees the same inputs and state)",
        (f"{op.name} declares pure={op.traits.pure}: its step leaves the state unchanged" if op.traits.pure else
         f"{op.name} declares pure=False: its step changes the state (uninterpreted)",
         "a later node's value is a function of its inputs and the state"),
        check, expect)


def _merge_theorem(op: OpDef, expect: str = "proved") -> Theorem:
    def check():
        t = Algebra()
        z3 = t.z3
        t._S = z3.DeclareSort("State")
        s0 = z3.Const("state0", t._S)
        ins = z3.Int("inputs")
        rng_a, rng_b = z3.Ints("draw_of_first draw_of_twin")
        step = _effects(t, op)
        va, s1 = step(ins, s0, rng_a)
        vb, s2 = step(ins, s1, rng_b)
        named = [("value of the first", va), ("value of its twin", vb)]
        eq = f"{op.name}(inputs) == {op.name}(inputs) (the twin's readers read the first), state after one == after two"
        return _solve(t, [rng_a != rng_b], z3.And(va == vb, s1 == s2), lambda m: _report(eq, m, named))
    return Theorem(
        f"merge_duplicates[{op.name}]", "merge_duplicates",
        f"two nodes of {op.name} with the same params and inputs give the same value, and running one leaves the "
        "same state as running two: the twin's readers may read the first",
        (f"{op.name} declares deterministic={op.traits.deterministic}: "
         + ("its value is a function of params and inputs" if op.traits.deterministic
            else "each node draws from its own random stream"),
         f"{op.name} declares pure={op.traits.pure}"),
        check, expect)


def _round_trip_theorem(op: OpDef) -> Theorem:
    def check():
        t = Algebra()
        z3 = t.z3
        (port,) = op.input_ports({})
        (oport,) = op.output_ports({})
        kinds = kinds_of(port.dims)
        x, f = t.input("x", kinds)
        Dev = z3.DeclareSort("Device")
        A, B = z3.Consts("A B", Dev)

        def move(v: Tensor, dev):
            if op.traits.reference is not None:
                return op.traits.reference(t, {}, **{port.name: v})[oport.name], dev
            return Tensor(v.kinds, v.at), dev          # Traits.movement: out = x, on the node's device
        there, d1 = move(x, B)
        back, d2 = move(there, A)                     # the rule fires only when the end device is x's device
        ix = [z3.Const(f"i{j}", t.sort(kd)) for j, kd in enumerate(kinds)]
        named = [("index", ix[0]) if ix else ("index", z3.IntVal(0)), ("x", x.at(*ix)), ("round trip", back.at(*ix))]
        return _solve(t, [], z3.And(back.at(*ix) == x.at(*ix), d2 == A),
                      lambda m: _report(f"{op.name}({op.name}(x) @B) @A == x", m, named))
    return Theorem(
        f"transfer_round_trip[{op.name}]", "transfer_round_trip",
        f"{op.name}({op.name}(x, A->B), B->A) = x at every index, on A",
        (f"{op.name} declares movement: out[i] = x[i] on the node's device"
         + (" (checked against its Traits.reference)" if op.traits.reference else ""),
         "from a device group and back, replica r's value returns to replica r (exec: ExecContext.send)",
         "the rule fires only when the second movement ends on the first one's source device (rules.py checks it)"),
        check)


# -- the chunked row reduction (the fused head-loss) -------------------------------------------------------------

def chunked_sum_theorem(chunk_end: Callable | None = None) -> Theorem:
    """sum over chunks [cC, min((c+1)C, R)) for c < ceil(R/C) of sum of g over the chunk == sum of g over [0, R).

    The definitions are axioms (S(a, b) = sum_{a <= r < b} g(r); T(m) = the first m chunks); the lemmas are proven
    by induction, each case a solver query: L1 (split) S(a, c) = S(a, b) + S(b, c) for a <= b <= c, by induction
    on c; L2 T(m) = S(0, min(mC, R)), by induction on m; L3 ceil(R/C) * C >= R, so T(ceil(R/C)) = S(0, R)."""
    def steps(t: Algebra, g, S, defs):
        z3 = t.z3
        T = z3.Function("T", z3.IntSort(), z3.RealSort())
        a, b, c, m, R, C, u = z3.Ints("a b c m R C u")
        mn = lambda p, q: z3.If(p < q, p, q)                    # noqa: E731
        split = lambda a_, b_, c_: S(a_, c_) == S(a_, b_) + S(b_, c_)   # noqa: E731
        end = chunk_end or (lambda start, size, rows: mn(start + size, rows))   # torch: s2[i:i + chunk]
        lo, hi = mn(u, R), mn(u + C, R)        # the invariant's bounds: the first m chunks cover [0, min(mC, R))
        M = (R + C - 1) / C                    # ceil(R/C): the chunks `range(0, R, C)` visits
        named = [("rows R", R), ("chunk size C", C), ("chunk m", m), ("its first row u = mC", u),
                 ("T(m+1) (the chunks' sum)", T(m + 1)), ("S(0, min((m+1)C, R)) (the rows' sum)", S(0, hi))]
        return {
            # L1: for a <= b <= c, S(a, c) = S(a, b) + S(b, c); induction on c from c = b
            "L1 split, base c = b": ([*defs, a <= b], split(a, b, b), []),
            "L1 split, step c -> c+1": ([*defs, a <= b, b <= c, split(a, b, c)], split(a, b, c + 1), []),
            # L2: T(m) = S(0, min(mC, R)); induction on m, u = mC (so (m+1)C = u + C)
            "L2 chunks, base m = 0": ([*defs, T(0) == 0, R >= 0], T(0) == S(0, mn(0, R)), []),
            "L2 chunks, step m -> m+1": ([*defs, R >= 0, C >= 1, u >= 0,
                                          z3.Implies(z3.And(0 <= lo, lo <= hi), split(0, lo, hi)),   # L1
                                          T(m) == S(0, lo), T(m + 1) == T(m) + S(u, end(u, C, R))],
                                         T(m + 1) == S(0, hi), named),
            # L3: the last chunk ends at R: ceil(R/C) * C >= R, so T(ceil(R/C)) = S(0, min(ceil(R/C) C, R)) = S(0, R)
            "L3 all chunks, T(ceil(R/C)) = S(0, R)": ([R >= 0, C >= 1, T(M) == S(0, mn(M * C, R))], T(M) == S(0, R),
                                                      []),
        }, (m, R, C, u)

    def check():
        # proofs: S is uninterpreted with its defining equations as axioms (the solver instantiates them)
        t = Algebra()
        z3 = t.z3
        g = z3.Function("g", z3.IntSort(), z3.RealSort())       # row r's loss (uninterpreted)
        Sf = z3.Function("S", z3.IntSort(), z3.IntSort(), z3.RealSort())
        qa, qb = z3.Ints("qa qb")
        defs = [z3.ForAll([qa, qb], z3.Implies(qb <= qa, Sf(qa, qb) == 0), patterns=[Sf(qa, qb)]),
                z3.ForAll([qa, qb], z3.Implies(qa < qb, Sf(qa, qb) == Sf(qa, qb - 1) + g(qb - 1)), patterns=[Sf(qa, qb)])]
        proofs, _ = steps(t, g, Sf, defs)
        # counterexamples: S by its recursive definition, among small sizes, u = mC
        cx, (m, R, C, u) = steps(t, g, lambda lo_, hi_: t.sum(lo_, hi_, g), [])
        lines, worst = [], "proved"
        for name, (facts, goal, named) in proofs.items():
            t0 = time.perf_counter()
            st, det = _solve(t, facts, goal, lambda mdl: "", timeout_ms=3_000)
            if st != "proved":
                f2, g2, n2 = cx[name]
                st2, det2 = _solve(t, [*f2, u == m * C, R <= 8, C <= 4, m >= 0, m <= 8], g2,
                                   lambda mdl: _report(name, mdl, n2, [("g (row losses)", g)]))
                if st2 == "refuted":
                    st, det = st2, det2
            lines.append(f"{name}: {st} ({time.perf_counter() - t0:.2f} s)" + (("\n" + _indent(det)) if det else ""))
            if st != "proved":
                worst = st
        return worst, "\n".join(lines)
    return Theorem(
        "chunked_row_reduction", "fused head-loss (chunking)",
        "for every row count R >= 0 and chunk size C >= 1 (any remainder R mod C): the sum over the ceil(R/C) "
        "chunks [cC, min((c+1)C, R)) of the sum of g over the chunk equals the sum of g over [0, R)",
        ("S(a, b) = sum_{a <= r < b} g(r), by its recursive definition: 0 for b <= a, S(a, b-1) + g(b-1) for a < b",
         "T(m) = the sum of the first m chunks: T(0) = 0, T(m+1) = T(m) + S(mC, min((m+1)C, R))",
         "g(r) (row r's loss) depends only on row r (a position-wise head: gather_through_positionwise)",
         "induction over the naturals (each case is a solver query); exact real arithmetic (floating-point "
         "sums differ by rounding)"),
        check, show_detail=True)


# -- the theorems of the registry -------------------------------------------------------------------------------

def theorems(ops: dict[str, OpDef] | None = None) -> list[Theorem]:
    """One theorem per rule and declaring op, from the registry's declarations (the same ones the rules read)."""
    ops = registry.all_ops() if ops is None else ops
    sels = [o for o in ops.values() if o.traits.selection is not None]
    out: list[Theorem] = []
    for s in sels:
        for r in (o for o in ops.values() if o.traits.remap is not None):
            out += [_remap_theorem(s, r), _condition_theorem(s, r)]
    for s in sels:
        for op in (o for o in ops.values() if o.traits.positionwise is not None):
            params = {"_n_inputs": 2 if op.variadic_input else 0}
            for p in op.output_ports(params):
                if _group_slot(p.dims, op.traits.positionwise) is None:
                    continue
                out += [_positionwise_theorem(op, s, p, leading=False), _positionwise_theorem(op, s, p, leading=True)]
    for op in ops.values():
        if rules.removable(op):
            out.append(_drop_theorem(op))
    for op in ops.values():
        if rules.mergeable(op):
            out.append(_merge_theorem(op))
        elif op.traits.pure and not op.traits.deterministic and not op.traits.sink:
            out.append(_merge_theorem(op, expect="refuted"))   # why the rule reads Traits.deterministic
    for op in ops.values():
        if op.traits.movement:
            out.append(_round_trip_theorem(op))
    out.append(chunked_sum_theorem())
    return out


def prove(theorem: Theorem) -> Outcome:
    t0 = time.perf_counter()
    status, detail = theorem.check()
    return Outcome(theorem, status, time.perf_counter() - t0, detail)


def prove_all(ths: Sequence[Theorem] | None = None) -> list[Outcome]:
    return [prove(th) for th in (theorems() if ths is None else ths)]


def render(outcomes: Sequence[Outcome], verbose: bool = False) -> str:
    w = max(len(o.theorem.name) for o in outcomes)
    lines = []
    for o in outcomes:
        mark = o.status if o.ok else f"{o.status} (expected {o.theorem.expect})"
        if o.ok and o.theorem.expect == "refuted":
            mark = "refuted, as required: the rule does not fire here"
        lines.append(f"{o.theorem.name:<{w}}  {mark:<10}  {o.seconds:6.2f} s")
        if verbose or not o.ok or o.theorem.show_detail:
            if verbose:
                lines.append(_indent("theorem: " + o.theorem.statement))
                lines += [_indent("axiom: " + a) for a in o.theorem.axioms]
            if o.detail:
                lines.append(_indent(o.detail))
    total = sum(o.seconds for o in outcomes)
    bad = [o for o in outcomes if not o.ok]
    lines.append(f"{len(outcomes)} theorems, {len(outcomes) - len(bad)} as required, {total:.2f} s"
                 + (f"; FAILED: {', '.join(o.theorem.name for o in bad)}" if bad else ""))
    return "\n".join(lines)


def run_cli(verbose: bool = False, only: str | None = None) -> int:
    """`dflash-graph prove`: every theorem of the registry, its status and proof time; exit 1 if one fails."""
    try:
        _z3()
    except ProverMissing as e:
        print(e, file=sys.stderr)
        return 2
    ths = [th for th in theorems() if only is None or only in th.name]
    if not ths:
        print(f"no theorem's name contains {only!r}", file=sys.stderr)
        return 2
    outcomes = prove_all(ths)
    print(render(outcomes, verbose))
    return 0 if all(o.ok for o in outcomes) else 1


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dflash_graph.rewrite.proofs",
                                 description="Prove every rewrite rule for all sizes with z3, from the ops' traits.")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each theorem's statement and axioms")
    ap.add_argument("-k", dest="only", default=None, help="only theorems whose name contains this")
    args = ap.parse_args(argv)
    return run_cli(args.verbose, args.only)


if __name__ == "__main__":
    sys.exit(main())
