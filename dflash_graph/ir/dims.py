"""Named symbolic sizes.

Dims come from `[dims]` (integers or expressions of other dims and of model config values such as
`target.hidden_size`) and from model configs. Each graph dim is a sympy Symbol with a concrete value;
expressions stay symbolic so that memory can later be solved for a dim ("largest seq that fits").
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping

import sympy

from ..errors import short as _short

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
    return sympy.Symbol(name, integer=True, positive=True)


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


def evaluate(node: ast.expr, lookup: Callable[[str], tuple[sympy.Expr, int]]) -> tuple[sympy.Expr, int]:
    """(symbolic, concrete) value of an expression. `lookup(name)` resolves dims and model refs."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        v = _bounded(node.value, f"the number {node.value}" if node.value < 10**30 else "a number")
        return sympy.Integer(v), v
    if isinstance(node, ast.Name):
        return lookup(node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return lookup(f"{node.value.id}.{node.attr}")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        (ls, lv), (rs, rv) = evaluate(node.left, lookup), evaluate(node.right, lookup)
        op = _BINOPS[type(node.op)]
        text = ast.unparse(node)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and rv == 0:
            side = ast.unparse(node.right)
            raise DimError(f"division by zero in dim expression: in {text!r}, {side!r} is 0")
        if isinstance(node.op, ast.FloorDiv):
            return sympy.floor(ls / rs), _bounded(lv // rv, repr(text))
        if isinstance(node.op, ast.Mod):
            return sympy.Mod(ls, rs), lv % rv
        if isinstance(node.op, ast.Pow):
            if rv < 0:
                raise DimError(f"negative exponent in dim expression {text!r}: sizes are integers")
            # the size of lv ** rv is known from bit lengths before it is computed
            if abs(lv) > 1 and (abs(lv).bit_length() - 1) * rv > MAX_DIM.bit_length():
                raise DimError(f"{text!r} is over the bound of 2**48 = {MAX_DIM:,} for a size")
        return op(ls, rs), _bounded(op(lv, rv), repr(text))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max") and node.args:
        vals = [evaluate(a, lookup) for a in node.args]
        f = sympy.Min if node.func.id == "min" else sympy.Max
        g = min if node.func.id == "min" else max
        return f(*[s for s, _ in vals]), g(v for _, v in vals)
    raise DimError(f"unsupported dim expression {ast.unparse(node)!r}: use integers, dim names, "
                   "model.config_key, + - * // % ** and min()/max()")


class DimEnv:
    """Resolves graph dims and model config references to (symbol, value)."""

    def __init__(self, dims: Mapping[str, object], model_configs: Mapping[str, Mapping[str, object]]):
        self._raw = dict(dims)
        self._models = model_configs
        self._done: dict[str, tuple[sympy.Expr, int]] = {}
        self._stack: list[str] = []
        # a graph dim defined exactly as `model.key` names that model value in shapes
        self.alias_of_ref: dict[str, str] = {}
        for name, v in self._raw.items():
            if isinstance(v, str) and "." in v.strip() and v.strip().replace(".", "").replace("_", "").isalnum():
                self.alias_of_ref[v.strip()] = name

    @property
    def names(self) -> list[str]:
        return list(self._raw)

    def get(self, name: str) -> tuple[sympy.Expr, int]:
        """A graph dim: its Symbol and value."""
        return symbol(name), self.value(name)

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
                expr, val = sympy.Integer(raw), _bounded(raw, f"dim '{name}'")
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

    def ref(self, model: str, key: str) -> tuple[sympy.Expr, int]:
        """A model config value as a dim; symbolic when a graph dim is defined as exactly this reference."""
        alias = self.alias_of_ref.get(f"{model}.{key}")
        if alias is not None and alias not in self._stack:
            return self.get(alias)
        return self._raw_ref(model, key)

    def _raw_ref(self, model: str, key: str) -> tuple[sympy.Expr, int]:
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
        return sympy.Integer(v), v

    def _lookup(self, name: str) -> tuple[sympy.Expr, int]:
        if "." in name:
            model, key = name.split(".", 1)
            v = self._raw_ref(model, key)[1]
            return sympy.Integer(v), v
        return self.get(name)

    def eval_text(self, text: str | int) -> tuple[sympy.Expr, int]:
        if isinstance(text, int) and not isinstance(text, bool):
            return sympy.Integer(text), _bounded(text, f"the size {_short(text)}")
        return evaluate(parse_expr(str(text)), self._lookup)

    def bindings(self) -> dict[str, int]:
        return {n: self.value(n) for n in self._raw}

    def bindings_text(self) -> str:
        try:
            return "dims: " + " ".join(f"{k}={v}" for k, v in self.bindings().items())
        except DimError:
            return ""

