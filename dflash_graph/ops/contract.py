"""How an op kind is declared: its tensor contract (jaxtyping-style dim strings, dtype and device rules), its
params, its traits (read by the rewrites), its cost (read by the memory analysis) and where its torch
implementation lives. One declaration per op, in ops/catalog.py; everything else reads it.

Dim strings: space-separated tokens, as in jaxtyping: `seq hidden`, `*batch hidden`, `anchors block vocab`.
  name     a dim, bound on first use within one node and checked on every later use
  *name    a variadic run of dims (any rank), bound and checked the same way
  12       a literal size
  a*b      an expression over bound dims (outputs, mostly)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ..ir.types import Dim

if TYPE_CHECKING:
    import sympy

    from .costs import CostContext, NodeCost

Binds = dict[str, "Dim | tuple[Dim, ...]"]


@attrs.frozen
class Port:
    name: str
    dims: str
    dtype: str = "model"   # a dtype name, "model" (the node's model dtype), "like:<input>", "float" (inputs: any float)
    optional: bool = False  # outputs: may be dropped when no one reads them
    doc: str = ""


@attrs.frozen
class Param:
    name: str
    kind: str          # int | float | str | bool | dim | list[int] | layer_ids (decoder layers of the node's model)
    doc: str
    default: Any = None
    required: bool = False
    choices: tuple[str, ...] = ()
    low: float | None = None     # bounds of a number param, checked by infer (open_low: low itself refused)
    high: float | None = None
    open_low: bool = False
    shown: bool = False   # `check` prints its value next to the node (a size the memory model chose)


@attrs.frozen
class IndexRemap:
    """out[..., i, ...] = x[..., (i - shift) mod n, ...] along `axis`: a pure permutation of positions (roll)."""
    shift_param: str
    axis_param: str


@attrs.frozen
class Selection:
    """out = x indexed along `axis` by an integer tensor: out[*pre, *idx, *post] = x[*pre, index[*idx], *post]."""
    source: str
    index: str
    axis_param: str
    # what the implementation does with an index outside [0, n): "clamp" to [0, n-1] (torch_impl.gather) or
    # "error"; read by the proofs (rewrite/proofs.py), which find where a rule is exact only for in-range indices
    out_of_range: str = "clamp"


@attrs.frozen
class LinearHead:
    """out = x @ W.T along the last axis, W = the `component` weight of the node's model (no bias), position-wise
    on every other axis: the op is a linear projection whose weight can be read by another op."""
    input: str
    output: str
    component: str


@attrs.frozen
class FusesHeads:
    """The op reads two logits tensors row by row (`student`, `target`, [*rows, vocab]; the target is a constant:
    no gradient flows into it) and op `into` computes the same outputs from the inputs of the linear heads that
    produce them (`into`'s ports `student_input`, `target_input`) and one weight, when both heads use the same
    weight. The other inputs are passed through under their names. See docs/rules/fuse_heads_into_loss.md."""
    student: str
    target: str
    into: str
    student_input: str
    target_input: str
    # the fused op's params from this op's params and the sizes (rows, hidden, vocab): the chunk the memory
    # model chooses is written into the node, so that `check` shows it
    params: Callable[[Mapping[str, Any], int, int, int], Mapping[str, Any]] | None = None


@attrs.frozen
class PortsExample:
    """Params that docs/ops.md shows an op's ports with, for an op whose ports depend on its params, and what it
    adds to the outputs line."""
    params: tuple[tuple[str, Any], ...]
    note: str


@attrs.frozen
class ReadsLayers:
    """The op reads, on input `port`, the outputs of a target's decoder layers concatenated on the last axis, in
    the order its model's config key `config_key` lists them (drafter_forward: `target_layer_ids`). Inference
    traces that input back to the layers hooked (analysis/infer.py, NOTE [Layer provenance])."""
    port: str
    config_key: str


@attrs.frozen
class Traits:
    # The op treats each position of every axis in the variadic group `positionwise` independently: for every
    # input and output that carries the group, axis k of the group corresponds one-to-one, and
    # f(x)[..., i, ...] depends only on x[..., i, ...]. Norm, lm_head, elementwise ops, transfers.
    positionwise: str | None = None
    remap: IndexRemap | None = None
    selection: Selection | None = None
    movement: bool = False        # copies its input to another device unchanged (transfer)
    pure: bool = True             # no side effects: removable when no output is read
    deterministic: bool = True    # same inputs and params, same outputs: may be merged with a twin or recomputed
    sink: bool = False            # a graph result (loss): never removed
    # builds the equivalent subgraph: (node, graph) -> list of replacement nodes; outputs keep their names
    decompose: Callable | None = None
    # new params when the given optional outputs are dropped (None: the node cannot drop them alone)
    drop_outputs: Callable[[Mapping[str, Any], frozenset[str]], Mapping[str, Any]] | None = None
    # the op's index-level definition, for the proofs (rewrite/proofs.py): (t, params, **inputs) -> {output: tensor},
    # written with the proof algebra `t` (tensors are functions of their index). When given, the traits above are
    # checked against it; when absent, they are the proofs' axioms.
    reference: Callable | None = None
    linear_head: LinearHead | None = None   # a linear projection by a model weight (lm_head)
    # the torch modules its implementation asks for at run time (`ExecContext.module(role)`), which the model store
    # builds before the first step and the live tracker charges to the node's device (exec/models.py): "body" (the
    # model built whole; its body is charged, an lm_head where an lm_head node uses it), "trainable" (the model's
    # trainable module, with the weights it borrows), or a component name. None: one per component of the op.
    modules: tuple[str, ...] | None = None
    # NOTE [Layer provenance]: what the last (feature) axis of the outputs holds, for tracing which decoder layers
    # reach a `reads_layers` input. `captures`: params -> {output: layer id} (hook_capture: output layer{i} is
    # layer i of the node's model); `features`: "concat" (the inputs' feature axes, in port order: concat) or
    # "kept" (the input's, unchanged: a movement, or a selection along another axis). Absent: unknown.
    captures: Callable[[Mapping[str, Any]], Mapping[str, int]] | None = None
    features: str | None = None
    reads_layers: ReadsLayers | None = None
    fuses_heads: FusesHeads | None = None   # a loss over two heads' logits that a fused op can compute from their inputs
    # components a trainable model upstream of this node must own rather than share, under these params, with why:
    # params -> {component: reason} (a loss whose objective trains the drafter's own final norm). Checked by
    # inference against each upstream trainable model's `shares`.
    trains_own: Callable[[Mapping[str, Any]], Mapping[str, str]] | None = None


@attrs.frozen
class AtMost:
    """A relation between two of the op's bound dims that its implementation needs: `small` <= `large` (e.g. a
    block must fit in the sequence). Checked by inference with the concrete sizes, so that dims that contradict
    each other are refused by `check`, not found by the run."""
    small: str
    large: str
    why: str


@attrs.frozen
class OpDef:
    name: str
    doc: str
    inputs: tuple[Port, ...] | Callable[[Mapping[str, Any], int], tuple[Port, ...]]
    outputs: tuple[Port, ...] | Callable[[Mapping[str, Any]], tuple[Port, ...]]
    params: tuple[Param, ...] = ()
    traits: Traits = Traits()
    model_arch: tuple[str, ...] = ()         # archs this op accepts as `model` (empty: no model)
    components: tuple[str, ...] = ()         # model components whose weights the node uses (resident on its device)
    bind: Callable[["BindContext"], Mapping[str, tuple[sympy.Expr, int]]] | None = None
    # params that contradict each other: params -> None, or raises ValueError with the fix (checked by inference
    # after each param alone, located at the node's params)
    validate: Callable[[Mapping[str, Any]], None] | None = None
    shape_fn: Callable[["BindContext", Mapping[str, Any]], Mapping[str, tuple[Dim, ...]]] | None = None
    device_rule: str = "node"                # "node": inputs and outputs on the node's device; "any_input":
                                             # its input on any device, its outputs on the node's
    variadic_input: str | None = None        # list inputs become ports <name>0, <name>1, ...
    cost: Callable[["CostContext"], "NodeCost"] | None = None
    impl: str | None = None                  # "module:function" of the torch implementation
    example: PortsExample | None = None      # params the generated docs show its ports with (ports from params)
    requires: tuple[AtMost, ...] = ()        # relations between bound dims the implementation needs

    def module_roles(self) -> tuple[str, ...]:
        """The modules a node of this op uses at run time (Traits.modules; by default its components)."""
        return self.components if self.traits.modules is None else self.traits.modules

    def input_ports(self, params: Mapping[str, Any], n_inputs: int = 0) -> tuple[Port, ...]:
        return self.inputs(params, n_inputs) if callable(self.inputs) else self.inputs

    def output_ports(self, params: Mapping[str, Any]) -> tuple[Port, ...]:
        return self.outputs(params) if callable(self.outputs) else self.outputs

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    def layer_ids(self, params: Mapping[str, Any]) -> tuple[int, ...]:
        """The model layers this node names (its `layer_ids` param), e.g. the layers a hook_capture hooks."""
        return tuple(int(i) for p in self.params if p.kind == "layer_ids" for i in params.get(p.name, ()))


@attrs.frozen
class BindContext:
    """What a contract may read while binding dims: its params (dim params already evaluated), its model's config
    (resolved), and the graph's dims."""
    params: Mapping[str, Any]
    model_config: Mapping[str, Any] | None
    model_dims: Any                      # the arch's Dims object (e.g. Qwen35Dims) or None
    dim: Callable[[str | int], tuple[sympy.Expr, int]]         # evaluate a dim expression of the graph
    model_ref: Callable[[str], tuple[sympy.Expr, int]]         # a config value of the node's model, as a dim


class ContractError(ValueError):
    def __init__(self, msg: str, expected: str | None = None, actual: str | None = None):
        super().__init__(msg)
        self.expected, self.actual = expected, actual


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def tokens(spec: str) -> list[str]:
    return spec.split()


def dim_of(expr: Any, value: int) -> Dim:
    """The Dim of a symbolic value (an IntPoly or a sympy expression, ir/dims.py) and its concrete value."""
    return Dim(str(expr).replace(" ", ""), int(value))


def match(spec: str, shape: tuple[Dim, ...], binds: Binds) -> None:
    """Bind the dims of `spec` against `shape`, or raise ContractError naming the first conflict."""
    toks = tokens(spec)
    var_idx = [i for i, t in enumerate(toks) if t.startswith("*")]
    unknown = [i for i in var_idx if toks[i][1:] not in binds]
    if len(unknown) > 1:
        raise ContractError(f"ambiguous contract {spec!r}: two unbound variadic dims")
    fixed = sum(1 if not t.startswith("*") else (len(binds[t[1:]]) if t[1:] in binds else 0) for t in toks)
    if (len(shape) < fixed) if unknown else (len(shape) != fixed):
        raise ContractError(f"rank {len(shape)} does not match {spec!r}", expected=f"[{spec}]", actual=_shape(shape))
    pos = 0
    for t in toks:
        if t.startswith("*"):
            name = t[1:]
            if name in binds:
                n = len(binds[name])
                got = shape[pos:pos + n]
                if tuple(d.value for d in got) != tuple(d.value for d in binds[name]):
                    raise ContractError(f"the dims *{name} are {_shape(got)} which do not equal the bound {_shape(binds[name])}",
                                        expected=_shape(binds[name]), actual=_shape(got))
            else:
                n = len(shape) - fixed
                binds[name] = tuple(shape[pos:pos + n])
            pos += n
            continue
        d = shape[pos]
        pos += 1
        if _IDENT.match(t):
            if t in binds:
                b = binds[t]
                if b.value != d.value:
                    raise ContractError(f"the size of dimension '{t}' is {d.value:,} ({d.sym}) which does not equal the "
                                        f"bound value {b.value:,} ({b.sym})", expected=f"{t}={b.value:,}", actual=f"{t}={d.value:,}")
            else:
                binds[t] = d
        else:
            want = evaluate_token(t, binds)
            if want.value != d.value:
                raise ContractError(f"dimension {t} is {d.value:,} but should be {want.value:,}",
                                    expected=f"{t}={want.value:,}", actual=f"{d.value:,}")


def build(spec: str, binds: Binds) -> tuple[Dim, ...]:
    out: list[Dim] = []
    for t in tokens(spec):
        if t.startswith("*"):
            if t[1:] not in binds:
                raise ContractError(f"output dims *{t[1:]} were not bound by any input")
            out.extend(binds[t[1:]])
        else:
            out.append(evaluate_token(t, binds))
    return tuple(out)


def evaluate_token(t: str, binds: Binds) -> Dim:
    if _IDENT.match(t):
        if t not in binds:
            raise ContractError(f"dimension '{t}' was not bound")
        return binds[t]
    if t.isdigit():
        return Dim(t, int(t))
    # NOTE [Contract expressions cached]: an expression's dim is a function of its text and of the symbols and
    # values of the dims it names, and sympy's simplify (where it is needed) costs milliseconds: a graph of hundreds of nodes of one
    # kind (a node block copied 400 times took 4 s to infer) evaluates each expression once per bindings
    key = []
    for name in _names(t):
        b = binds.get(name)
        if not isinstance(b, Dim):
            raise ContractError(f"dimension '{name}' in {t!r} was not bound")
        key.append((name, b.sym, b.value))
    return _evaluate(t, tuple(key))


@functools.lru_cache(maxsize=4096)
def _names(t: str) -> tuple[str, ...]:
    """The dims an expression names, once each."""
    from ..ir.dims import names_in, parse_expr

    return tuple(dict.fromkeys(names_in(parse_expr(t))))


@functools.lru_cache(maxsize=4096)
def _poly(sym: str):
    """A Dim's symbolic text as an IntPoly, or None where it is not an integer polynomial (`floor(seq/2)`)."""
    from ..ir.dims import DimError, IntPoly, evaluate, parse_expr

    try:
        expr, _ = evaluate(parse_expr(sym), lambda name: (IntPoly.of(name), 2))
    except DimError:
        return None
    return expr if isinstance(expr, IntPoly) else None


@functools.lru_cache(maxsize=65536)
def _evaluate(t: str, bound: tuple[tuple[str, str, int], ...]) -> Dim:
    from ..ir.dims import IntPoly, evaluate, parse_expr

    dims = {name: (sym, value) for name, sym, value in bound}
    # NOTE [Simplified without sympy]: sympy.simplify leaves a monomial (`5*hidden`) and a linear sum (`vocab -
    # 1`) with integer coefficients as they are (a number times a sum is distributed again, and two terms of
    # degree 1 share no factor but a number), so those need no sympy; any other result is simplified by sympy
    # (`a*b - a` becomes `a*(b - 1)`). tests/test_dims.py compares both on random expressions.
    polys = {name: _poly(sym) for name, (sym, _) in dims.items()}
    if all(p is not None for p in polys.values()):
        expr, val = evaluate(parse_expr(t), lambda name: (polys[name], dims[name][1]))
        if isinstance(expr, IntPoly) and (len(expr.terms) <= 1 or expr.is_linear()):
            return dim_of(expr, val)
    import sympy

    def lookup(name: str):
        sym, value = dims[name]
        return sympy.sympify(sym, locals={n: sympy.Symbol(n) for n in re.findall(r"[A-Za-z_]\w*", sym)}), value

    expr, val = evaluate(parse_expr(t), lookup)
    return dim_of(sympy.simplify(expr), val)


def _shape(shape: tuple[Dim, ...]) -> str:
    return "[" + ", ".join(f"{d.sym}={d.value:,}" if d.sym != str(d.value) else str(d.value) for d in shape) + "]"
