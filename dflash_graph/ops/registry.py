"""The one registry of node kinds: the built-in ones (`declare(OpDef(...))` in ops/catalog.py) and any a test
registers for a while (`registered`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .catalog import BUILTIN
from .contract import OpDef

OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in OPS:
        raise ValueError(f"op '{op.name}' is already registered")
    OPS[op.name] = op
    return op


for _op in BUILTIN:
    register(_op)


def get(name: str) -> OpDef | None:
    return OPS.get(name)


def all_ops() -> dict[str, OpDef]:
    return dict(OPS)


@contextmanager
def registered(op: OpDef) -> Iterator[OpDef]:
    """Register an op for the duration of a block (tests register ops the rules have never seen)."""
    register(op)
    try:
        yield op
    finally:
        OPS.pop(op.name, None)
