"""Run-time contract checks: the same dim strings `check` used, checked on real tensors with jaxtyping and
beartype (dims bound once per node call across all of its inputs and outputs), plus the exact sizes, dtype and device that
static inference predicted. A disagreement between static and run time is therefore impossible to miss."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from beartype import beartype
from beartype.roar import BeartypeCallHintViolation
from jaxtyping import Bool, Float, Int, Shaped, TypeCheckError, jaxtyped

from ..ir.types import TensorType
from ..ops.contract import OpDef

class ContractViolation(RuntimeError):
    pass


def check_node(op: OpDef, node_id: str, params: Mapping, tensors: Mapping[str, torch.Tensor],
               expected: Mapping[str, TensorType], torch_device: str, n_inputs: int) -> None:
    ports = [*op.input_ports(params, n_inputs), *op.output_ports(params)]
    dims = {p.name: p.dims for p in ports}
    for name, t in tensors.items():
        exp = expected.get(name)
        if exp is None or not isinstance(t, torch.Tensor):
            continue
        where = f"node '{node_id}' ({op.name}) port '{name}'"
        if tuple(t.shape) != exp.sizes:
            raise ContractViolation(f"{where}: shape {tuple(t.shape)} but check inferred {exp.concrete_str()} "
                                    f"({exp.sym_str()})")
        if str(t.dtype).removeprefix("torch.") != exp.dtype:
            raise ContractViolation(f"{where}: dtype {t.dtype} but check inferred {exp.dtype}")
        if torch.device(torch_device).type != t.device.type:
            raise ContractViolation(f"{where}: on {t.device} but the node runs on {torch_device}")

    checked = {name: t for name, t in tensors.items()
               if name in dims and isinstance(t, torch.Tensor) and op.shape_fn is None}
    if not checked:
        return
    fn = _checker(op.name, tuple((name, dims[name], _kind_name(t)) for name, t in checked.items()))
    try:
        fn(**checked)
    except (BeartypeCallHintViolation, TypeCheckError) as e:
        lines = str(e).splitlines()
        which = next((ln for ln in lines if ln.startswith("The problem arose")), "")
        bound = lines[lines.index(next(ln for ln in lines if ln.startswith("The current values"))) + 1:] \
            if any(ln.startswith("The current values") for ln in lines) else []
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in checked.items())
        raise ContractViolation(f"node '{node_id}' ({op.name}): tensors do not match the contract "
                                f"{ {k: dims[k] for k in checked} } with {shapes}. {which} Dims bound by the "
                                f"other ports: {' '.join(bound)}") from None


def _kind_name(t: torch.Tensor) -> str:
    d = str(t.dtype).removeprefix("torch.")
    return "Bool" if d == "bool" else ("Int" if d.startswith("int") else ("Float" if t.is_floating_point() else "Shaped"))


@functools.lru_cache(maxsize=1024)
def _checker(op_name: str, ports: tuple[tuple[str, str, str], ...]):
    """A function whose parameters are the node's ports, annotated with the contract's jaxtyping types and
    checked by beartype under jaxtyped: every dim named in one port must have the same size in all of them."""
    kinds = {"Bool": Bool, "Int": Int, "Float": Float, "Shaped": Shaped}
    names = [name for name, _, _ in ports]
    src = f"def check_{op_name}({', '.join(names)}):\n    return None\n"
    namespace: dict = {}
    exec(src, namespace)   # noqa: S102 (port names are identifiers from the op registry)
    fn = namespace[f"check_{op_name}"]
    fn.__annotations__ = {name: kinds[kind][torch.Tensor, spec] for name, spec, kind in ports}
    return jaxtyped(typechecker=beartype)(fn)
