"""The one registry of node kinds. Adding a node kind is one `register(OpDef(...))` call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .contract import OpDef

OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in OPS:
        raise ValueError(f"op '{op.name}' is already registered")
    OPS[op.name] = op
    return op


def get(name: str) -> OpDef | None:
    op = OPS.get(name)
    if op is None:
        _load()
        op = OPS.get(name)
    return op


def all_ops() -> dict[str, OpDef]:
    _load()
    return dict(OPS)


@contextmanager
def registered(op: OpDef) -> Iterator[OpDef]:
    """Register an op for the duration of a block (tests register ops the rules have never seen)."""
    _load()
    register(op)
    try:
        yield op
    finally:
        OPS.pop(op.name, None)


def _load() -> None:
    from . import catalog  # noqa: F401  (registers the built-in ops)
