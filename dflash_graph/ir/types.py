"""Tensor types: symbolic shape (as text over the graph's dims), concrete shape, dtype, device. Immutable values."""

from __future__ import annotations

import math

import attrs

from ..units import DTYPE_BYTES


@attrs.frozen
class Dim:
    sym: str    # "seq", "anchors*block", "5120"
    value: int  # its value under the current bindings

    def __str__(self) -> str:
        return self.sym


@attrs.frozen
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str
    device: str  # a device name or a device-group name from the graph

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(d.value for d in self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def sym_str(self) -> str:
        return "[" + ", ".join(d.sym for d in self.shape) + "]"

    def concrete_str(self) -> str:
        return "[" + ", ".join(f"{d.value:,}" for d in self.shape) + "]"

    def __str__(self) -> str:
        return f"{self.dtype}{self.sym_str()}={self.concrete_str()} @{self.device}"

