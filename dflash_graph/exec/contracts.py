"""Run-time contract checks: the same dim strings `check` used, checked on real tensors with jaxtyping (dims
bound once per node call across all of its inputs and outputs), plus the exact sizes, dtype and device that
static inference predicted. A disagreement between static and run time is therefore impossible to miss."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from jaxtyping import Bool, Float, Int, Shaped, jaxtyped

from ..ir.types import TensorType
from ..ops.contract import OpDef

_KINDS = {"bool": Bool, "int64": Int, "int32": Int}


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

    @jaxtyped(typechecker=None)
    def _same_dims() -> None:
        for name, t in tensors.items():
            if name not in dims or not isinstance(t, torch.Tensor) or op.shape_fn is not None:
                continue
            kind = _KINDS.get(str(t.dtype).removeprefix("torch."), Float if t.is_floating_point() else Shaped)
            spec = dims[name].replace("+", " + ") if "+" in dims[name] else dims[name]
            if not isinstance(t, kind[torch.Tensor, spec.replace(" + ", "+")]):
                raise ContractViolation(f"node '{node_id}' ({op.name}) port '{name}': shape {tuple(t.shape)} "
                                        f"does not match [{dims[name]}] given the other ports' dims")

    _same_dims()
