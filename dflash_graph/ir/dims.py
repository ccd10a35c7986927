"""Named symbolic sizes.

Dims come from `[dims]` (integers or expressions of other dims and of model config values such as
`target.hidden_size`) and from model configs. Each graph dim is a symbol with a concrete value; expressions stay
symbolic so that memory can later be solved for a dim ("largest seq that fits").

NOTE [Dims without sympy]: the dims of real graphs are sums, products and integer powers of dims (`anchors *
block`, `vocab - 1`, `5*hidden`): those are `IntPoly` values, exact integer polynomials that print as sympy prints
the same expression, so `check` does not import sympy (with sympy's import and simplify's, a qwen27b check took
1.73 s of CPU, without them 0.82 s: benchmarks/check_startup.py).
What an IntPoly cannot hold exactly (`//`, `%`, min(), max() of symbols, a product of two sums) is computed by
sympy as before, imported then; tests/test_dims.py checks both agree on random expressions.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import short as _short

if TYPE_CHECKING:
    import sympy

_BINOPS: dict[type, Callable] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}


class DimError(ValueError):
    pass


# NOTE [Dim bounds]: `check` must answer every input quickly, so an expression is bounded before it is parsed
# and every value while it is computed: `9 ** 9 ** 9` or a 3,000-term sum is refused with a message, never
# computed (Python would take minutes, sympy longer, and the parser itself overflows the stack on deep trees).
# No real size comes near these: the largest dims of a 27B run are ~2**18 (vocab) and ~2**20 (tokens).
MAX_DIM = 2**48
MAX_EXPR_CHARS = 256


def _bounded(v: int, what: str) -> int:
    if abs(v) > MAX_DIM:
        raise DimError(f"{what} is over the bound of 2**48 = {MAX_DIM:,} for a size")
    return v


def symbol(name: str) -> sympy.Symbol:
    import sympy

    return sympy.Symbol(name, integer=True, positive=True)


Monomial = tuple[tuple[str, int], ...]     # ((name, power), ...) sorted by name; () is the constant term


class IntPoly:
    """An integer polynomial in named dims, in the form sympy gives the same sum or product automatically: like
    terms collected, an integer times a sum distributed, a product of monomials merged. `str()` is sympy's `str()`
    of that expression. Operations sympy would leave unexpanded (a sum times a symbol or a sum, a sum to a power)
    return NotImplemented here, and `evaluate` computes them with sympy."""

    __slots__ = ("terms",)

    def __init__(self, terms: Mapping[Monomial, int]):
        self.terms: dict[Monomial, int] = {m: c for m, c in terms.items() if c}

    @classmethod
    def of(cls, x: int | str) -> IntPoly:
        """An integer, or one dim by its name."""
        return cls({(): x}) if isinstance(x, int) else cls({((x, 1),): 1})

    @property
    def constant(self) -> int | None:
        """Its value when it names no dim."""
        return self.terms.get((), 0) if all(m == () for m in self.terms) else None

    def _single(self) -> bool:
        return len(self.terms) <= 1

    def is_linear(self) -> bool:
        return all(len(m) <= 1 and all(k == 1 for _, k in m) for m in self.terms)

    def __add__(self, other: Any) -> IntPoly:
        if isinstance(other, int) and not isinstance(other, bool):
            other = IntPoly.of(other)
        if not isinstance(other, IntPoly):
            return NotImplemented
        out = dict(self.terms)
        for m, c in other.terms.items():
            out[m] = out.get(m, 0) + c
        return IntPoly(out)

    __radd__ = __add__

    def __neg__(self) -> IntPoly:
        return IntPoly({m: -c for m, c in self.terms.items()})

    def __sub__(self, other: Any) -> IntPoly:
        return self + (-other) if isinstance(other, (int, IntPoly)) and not isinstance(other, bool) else NotImplemented

    def __rsub__(self, other: Any) -> IntPoly:
        return -self + other

    def __mul__(self, other: Any) -> IntPoly:
        if isinstance(other, int) and not isinstance(other, bool):
            other = IntPoly.of(other)
        if not isinstance(other, IntPoly):
            return NotImplemented
        a, b = (other, self) if other.constant is not None else (self, other)
        if a.constant is not None:        # sympy distributes a number over a sum: 2*(x + y) is 2*x + 2*y
            return IntPoly({m: a.constant * c for m, c in b.terms.items()})
        if not (a._single() and b._single()):
            return NotImplemented          # x*(y + z) stays unexpanded in sympy
        ((ma, ca),), ((mb, cb),) = a.terms.items(), b.terms.items()
        powers = dict(ma)
        for name, k in mb:
            powers[name] = powers.get(name, 0) + k
        return IntPoly({tuple(sorted(powers.items())): ca * cb})

    __rmul__ = __mul__

    def __pow__(self, k: Any) -> IntPoly:
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            return NotImplemented
        if k == 0:
            return IntPoly.of(1)
        if k == 1:
            return self
        if not self._single():
            return NotImplemented          # (x + y)**2 stays unexpanded in sympy
        if not self.terms:
            return self
        ((m, c),) = self.terms.items()
        return IntPoly({tuple((name, p * k) for name, p in m): c ** k})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IntPoly) and self.terms == other.terms

    def __hash__(self) -> int:
        return hash(frozenset(self.terms.items()))

    def __str__(self) -> str:
        # NOTE [sympy's order]: sympy prints a sum's terms in lexicographic order of their exponent vectors over
        # the symbols sorted by name, largest first (Expr.as_ordered_terms, order='lex'), the constant last, and
        # a product's factors by name after its coefficient (Mul.as_ordered_factors); a positive number and a
        # negative multiple of one power of a dim print the number first
        if not self.terms:
            return "0"
        gens = sorted({name for m in self.terms for name, _ in m})
        pos = {g: i for i, g in enumerate(gens)}

        def vector(m: Monomial) -> tuple[int, ...]:
            v = [0] * len(gens)
            for name, k in m:
                v[pos[name]] = k
            return tuple(v)

        order = sorted(self.terms.items(), key=lambda t: vector(t[0]), reverse=True)
        if len(order) == 2 and order[1][0] == () and order[1][1] > 0 and order[0][1] < 0 and len(order[0][0]) == 1:
            order.reverse()        # sympy's one exception (Expr.as_ordered_terms): `2 - seq`, not `-seq + 2`
        out = []
        for m, c in order:
            body = "*".join(name if k == 1 else f"{name}**{k}" for name, k in m)
            term = str(c) if not body else body if c == 1 else f"-{body}" if c == -1 else f"{c}*{body}"
            out.append(term if not out else (f"- {term[1:]}" if term.startswith("-") else f"+ {term}"))
        return " ".join(out)

    __repr__ = __str__

    def to_sympy(self, make_symbol: Callable[[str], Any] = symbol) -> sympy.Expr:
        import sympy

        return sympy.Add(*[sympy.Integer(c) * sympy.Mul(*[make_symbol(n) ** k for n, k in m])
                           for m, c in self.terms.items()])


def as_sympy(x: Any, make_symbol: Callable[[str], Any] = symbol) -> sympy.Expr:
    """A dim's symbolic value as a sympy expression (an IntPoly converted, a sympy expression as it is)."""
    return x.to_sympy(make_symbol) if isinstance(x, IntPoly) else x


def is_symbolic(x: Any) -> bool:
    """Whether `x` is a dim's symbolic value (an IntPoly or a sympy expression), e.g. in a (symbol, value) pair."""
    if isinstance(x, IntPoly):
        return True
    import sys

    sympy = sys.modules.get("sympy")             # without sympy imported, nothing is a sympy expression
    return sympy is not None and isinstance(x, sympy.Basic)


def parse_expr(text: str) -> ast.expr:
    text = str(text).strip()
    if len(text) > MAX_EXPR_CHARS:
        raise DimError(f"dim expression of {len(text):,} characters is over the bound of {MAX_EXPR_CHARS}: "
                       f"{text[:40]!r}...; name its parts as separate dims")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise DimError(f"cannot parse dim expression {text!r}: {e.msg}") from None
    except (RecursionError, MemoryError, ValueError) as e:
        raise DimError(f"cannot parse dim expression {text!r}: {type(e).__name__}") from None
    return tree.body


def names_in(node: ast.expr) -> list[str]:
    """Dim names and dotted model references (`target.hidden_size`) used by an expression; not the functions it
    calls (min, max) nor the model name before a dot."""
    not_dims = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Attribute)} | \
        {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            out.append(f"{n.value.id}.{n.attr}")
        elif isinstance(n, ast.Name) and id(n) not in not_dims:
            out.append(n.id)
    return out


Symbolic = Any      # an IntPoly, or a sympy expression where an IntPoly cannot hold it (NOTE [Dims without sympy])


_EXACT = {operator.add: IntPoly.__add__, operator.sub: IntPoly.__sub__, operator.mul: IntPoly.__mul__,
          operator.pow: IntPoly.__pow__}


def _apply(op: Callable, a: Symbolic, b: Symbolic, make_symbol: Callable[[str], Any]) -> Symbolic:
    """`op(a, b)` as sympy computes it: on IntPolys when they hold the result exactly, else in sympy."""
    if isinstance(a, IntPoly) and isinstance(b, IntPoly):
        method = _EXACT.get(op)
        r = NotImplemented if method is None else method(a, b.constant if op is operator.pow else b)
        if r is not NotImplemented:
            return r
    return op(as_sympy(a, make_symbol), as_sympy(b, make_symbol))


def evaluate(node: ast.expr, lookup: Callable[[str], tuple[Symbolic, int]],
             make_symbol: Callable[[str], Any] = symbol) -> tuple[Symbolic, int]:
    """(symbolic, concrete) value of an expression. `lookup(name)` resolves dims and model refs; `make_symbol`
    makes the sympy symbol of a dim, for the expressions sympy computes."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        v = _bounded(node.value, f"the number {node.value}" if node.value < 10**30 else "a number")
        return IntPoly.of(v), v
    if isinstance(node, ast.Name):
        return lookup(node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return lookup(f"{node.value.id}.{node.attr}")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        (ls, lv), (rs, rv) = evaluate(node.left, lookup, make_symbol), evaluate(node.right, lookup, make_symbol)
        op = _BINOPS[type(node.op)]
        text = ast.unparse(node)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and rv == 0:
            side = ast.unparse(node.right)
            raise DimError(f"division by zero in dim expression: in {text!r}, {side!r} is 0")
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)):
            value = _bounded(lv // rv, repr(text)) if isinstance(node.op, ast.FloorDiv) else lv % rv
            if isinstance(ls, IntPoly) and isinstance(rs, IntPoly) and ls.constant is not None \
                    and rs.constant is not None:
                return IntPoly.of(value), value
            import sympy

            ls, rs = as_sympy(ls, make_symbol), as_sympy(rs, make_symbol)
            return (sympy.floor(ls / rs) if isinstance(node.op, ast.FloorDiv) else sympy.Mod(ls, rs)), value
        if isinstance(node.op, ast.Pow):
            if rv < 0:
                raise DimError(f"negative exponent in dim expression {text!r}: sizes are integers")
            # the size of lv ** rv is known from bit lengths before it is computed
            if abs(lv) > 1 and (abs(lv).bit_length() - 1) * rv > MAX_DIM.bit_length():
                raise DimError(f"{text!r} is over the bound of 2**48 = {MAX_DIM:,} for a size")
        value = _bounded(op(lv, rv), repr(text))
        return _apply(op, ls, rs, make_symbol), value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max") and node.args:
        vals = [evaluate(a, lookup, make_symbol) for a in node.args]
        g = min if node.func.id == "min" else max
        value = g(v for _, v in vals)
        if all(isinstance(s, IntPoly) and s.constant is not None for s, _ in vals):
            return IntPoly.of(value), value
        import sympy

        f = sympy.Min if node.func.id == "min" else sympy.Max
        return f(*[as_sympy(s, make_symbol) for s, _ in vals]), value
    raise DimError(f"unsupported dim expression {ast.unparse(node)!r}: use integers, dim names, "
                   "model.config_key, + - * // % ** and min()/max()")


class DimEnv:
    """Resolves graph dims and model config references to (symbol, value)."""

    def __init__(self, dims: Mapping[str, object], model_configs: Mapping[str, Mapping[str, object]]):
        self._raw = dict(dims)
        self._models = model_configs
        self._done: dict[str, tuple[Symbolic, int]] = {}
        self._stack: list[str] = []
        # a graph dim defined exactly as `model.key` names that model value in shapes
        self.alias_of_ref: dict[str, str] = {}
        for name, v in self._raw.items():
            if isinstance(v, str) and "." in v.strip() and v.strip().replace(".", "").replace("_", "").isalnum():
                self.alias_of_ref[v.strip()] = name

    @property
    def names(self) -> list[str]:
        return list(self._raw)

    def get(self, name: str) -> tuple[Symbolic, int]:
        """A graph dim: its symbol and value."""
        return IntPoly.of(name), self.value(name)

    def value(self, name: str) -> int:
        if name in self._done:
            return self._done[name][1]
        if name not in self._raw:
            raise DimError(f"unknown dim '{name}'; defined dims: {', '.join(self._raw) or '(none)'}")
        if name in self._stack:
            raise DimError("dims refer to each other in a cycle: " + " -> ".join([*self._stack, name]))
        self._stack.append(name)
        try:
            raw = self._raw[name]
            if isinstance(raw, bool) or not isinstance(raw, (int, str)):
                raise DimError(f"dim '{name}' must be an integer or an expression string, got {_short(raw)}")
            if isinstance(raw, int):
                expr, val = IntPoly.of(raw), _bounded(raw, f"dim '{name}'")
            else:
                expr, val = evaluate(parse_expr(raw), self._lookup)
            if val <= 0:
                raise DimError(f"dim '{name}' must be positive, got {val}"
                               + (f" (from {raw!r})" if isinstance(raw, str) else ""))
            _bounded(val, f"dim '{name}' = {val}")
            self._done[name] = (expr, val)
            return val
        finally:
            self._stack.pop()

    def ref(self, model: str, key: str) -> tuple[Symbolic, int]:
        """A model config value as a dim; symbolic when a graph dim is defined as exactly this reference."""
        alias = self.alias_of_ref.get(f"{model}.{key}")
        if alias is not None and alias not in self._stack:
            return self.get(alias)
        return self._raw_ref(model, key)

    def _raw_ref(self, model: str, key: str) -> tuple[Symbolic, int]:
        cfg = self._models.get(model)
        if cfg is None:
            raise DimError(f"unknown model '{model}' in dim reference '{model}.{key}'; models: {', '.join(self._models) or '(none)'}")
        if key not in cfg:
            raise DimError(f"model '{model}' has no config key '{key}'")
        v = cfg[key]
        if isinstance(v, str):
            return self.eval_text(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise DimError(f"'{model}.{key}' is {_short(v)}, not an integer size")
        _bounded(v, f"'{model}.{key}'")
        return IntPoly.of(v), v

    def _lookup(self, name: str) -> tuple[Symbolic, int]:
        if "." in name:
            model, key = name.split(".", 1)
            v = self._raw_ref(model, key)[1]
            return IntPoly.of(v), v
        return self.get(name)

    def eval_text(self, text: str | int) -> tuple[Symbolic, int]:
        if isinstance(text, int) and not isinstance(text, bool):
            return IntPoly.of(text), _bounded(text, f"the size {_short(text)}")
        return evaluate(parse_expr(str(text)), self._lookup)

    def bindings(self) -> dict[str, int]:
        return {n: self.value(n) for n in self._raw}

    def bindings_text(self) -> str:
        try:
            return "dims: " + " ".join(f"{k}={v}" for k, v in self.bindings().items())
        except DimError:
            return ""

