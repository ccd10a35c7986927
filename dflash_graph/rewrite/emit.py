"""Write a plan's graph (the rewritten one, or the original under --no-rewrite) back as a TOML graph file.

The file loads with `spec.loader` and checks to the same per-device peaks as the plan it came from (the round
trip is tested in tests/test_plan_emit.py and, on random graphs, in tests/test_rewrite_properties.py):

- [graph], [dims] (the expressions as written, after --set), [memory], [devices.*], [groups], [models.*],
  [train], [data]; sizes are written in bytes so nothing is lost to rounding;
- every node as [[nodes]], in schedule order, with its own params (never the evaluated `Typed.params`), inputs
  as a table, device and model; a node made or changed by a rewrite gets a comment naming the rule;
- paths (model config files, weights, data) are rewritten relative to the output file's directory.

TOML is written by hand (no writer dependency): strings are basic strings with every escape TOML requires.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..units import fmt_bytes
from .pipeline import Plan

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


# -- values -----------------------------------------------------------------------------------------------------

def toml_str(s: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else toml_str(k)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)          # always has '.' or 'e'; round-trips exactly
    if isinstance(v, str):
        return toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        items = [(k, x) for k, x in v.items() if x is not None]
        if not items:
            return "{}"
        return "{ " + ", ".join(f"{toml_key(str(k))} = {toml_value(x)}" for k, x in items) + " }"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _comment(text: str) -> str:
    return "# " + " ".join(text.split())


# -- paths ------------------------------------------------------------------------------------------------------

def _rebase(path: str | os.PathLike, base: str | os.PathLike | None, out_dir: Path | None) -> str:
    """`path` (relative to `base`, or absolute) as seen from `out_dir`; absolute when there is no out_dir."""
    p = Path(path)
    if not p.is_absolute():
        p = Path(base or ".") / p
    p = Path(os.path.abspath(p))
    if out_dir is None:
        return str(p)
    return os.path.relpath(p, os.path.abspath(out_dir))


def _config_from_file(path: str, config: Mapping[str, Any]) -> bool:
    """True when `config` is exactly the content of the JSON file (no --set override changed it)."""
    try:
        return json.loads(Path(path).read_text()) == dict(config)
    except (OSError, ValueError):
        return False


def _rewrite_comment(n, original, applied) -> str | None:
    """What a rewrite did to node `n`: its note (the rule and why), or for a node a rewrite changed without a
    note, the rule and the change (params, or inputs rewired to another producer)."""
    if n.note:
        return f"rewrite: {n.note}"

    def last_rule(nid: str) -> str:
        return next((a.rule for a in reversed(applied) if nid in a.nodes), "a rewrite")

    if n.id not in original:
        return f"rewrite: made by {last_rule(n.id)}"
    old = original[n.id]
    if n.same_as(old):
        return None
    parts = []
    if dict(n.params) != dict(old.params):
        parts.append(f"params changed by {last_rule(n.id)} (were {toml_value(dict(old.params))})")
    was = dict(old.inputs)
    for port, ref in n.inputs:
        if was.get(port) != ref:
            parts.append(f"{port} rewired by {last_rule(was[port].node) if port in was else 'a rewrite'}: "
                         f"reads {ref} (was {was.get(port)})")
    return "rewrite: " + "; ".join(parts or ["changed"])


# -- sections ---------------------------------------------------------------------------------------------------

def emit_toml(plan: Plan, out_path: str | os.PathLike | None = None) -> str:
    """The plan's graph as TOML text. Paths are written relative to `out_path`'s directory (absolute if None)."""
    typed = plan.typed
    spec = typed.ctx.spec
    graph_dir = Path(spec.file).parent if spec.file else Path(".")
    out_dir = Path(out_path).parent if out_path is not None else None
    w: list[str] = []

    w.append(f"# Written by `dflash-graph plan --emit` from {spec.file or '(text)'}"
             + (f": {len(plan.applied)} rewrites applied." if plan.rewritten else " (--no-rewrite)."))
    w.append("# Nodes made or changed by a rewrite carry a comment naming the rule; see docs/rules/.")
    w.append("")
    w.append("[graph]")
    w.append(f"name = {toml_str(spec.name)}")
    if spec.description:
        w.append(f"description = {toml_str(spec.description)}")
    w.append("")

    w.append("[dims]")
    for k, v in spec.dims.items():
        w.append(f"{toml_key(k)} = {toml_value(v)}")
    w.append("")

    w.append("[memory]")
    w.append(f"expandable_segments = {toml_value(spec.memory.expandable_segments)}")
    if spec.memory.max_split_size is not None:
        w.append(f"max_split_size = {spec.memory.max_split_size}        {_comment(fmt_bytes(spec.memory.max_split_size))}")
    w.append("")

    for name, d in spec.devices.items():
        w.append(f"[devices.{toml_key(name)}]")
        w.append(f"torch = {toml_str(d.torch)}")
        w.append(f"capacity = {d.capacity}        {_comment(fmt_bytes(d.capacity))}")
        if d.outside_allocator:
            w.append(f"outside_allocator = {d.outside_allocator}        {_comment(fmt_bytes(d.outside_allocator))}")
        w.append("")

    if spec.groups:
        w.append("[groups]")
        for g, members in spec.groups.items():
            w.append(f"{toml_key(g)} = {toml_value(list(members))}")
        w.append("")

    for name, m in spec.models.items():
        w.append(f"[models.{toml_key(name)}]")
        w.append(f"arch = {toml_str(m.arch)}")
        w.append(f"dtype = {toml_str(m.dtype)}")
        w.append(f"trainable = {toml_value(m.trainable)}")
        if m.weights is not None:
            w.append(f"weights = {toml_str(_rebase(m.weights, graph_dir, out_dir))}")
        if m.shares:
            w.append(f"shares = {toml_value(dict(m.shares))}")
        for key, value in m.forward.items():   # the declared forward (attn_implementation, packing, linear_kernels)
            w.append(f"{key} = {toml_str(value)}")
        if m.config_file and _config_from_file(m.config_file, m.config):
            w.append(f"config = {toml_str(_rebase(m.config_file, None, out_dir))}")
        else:
            # inline: written as the last key of the table, as its own sub-table, one key per line
            w.append("")
            w.append(f"[models.{toml_key(name)}.config]")
            for k, v in m.config.items():
                w.append(f"{toml_key(k)} = {toml_value(v)}")
        w.append("")

    if spec.train:
        w.append("[train]")
        for k, v in spec.train.items():
            if v is not None:
                w.append(f"{toml_key(k)} = {toml_value(v)}")
        w.append("")

    data = {k: v for k, v in spec.data.items() if not k.startswith("_")}
    if data:
        base = spec.data.get("_base", str(graph_dir))
        w.append("[data]")
        for k, v in data.items():
            if v is None:
                continue
            if k in ("corpus", "tokenizer", "chat_template"):
                v = _rebase(v, base, out_dir)
            w.append(f"{toml_key(k)} = {toml_value(v)}")
        w.append("")

    original = plan.original.graph
    for n in typed.graph.nodes:
        comment = _rewrite_comment(n, original, plan.applied)
        if comment:
            w.append(_comment(comment))
        w.append("[[nodes]]")
        w.append(f"id = {toml_str(n.id)}")
        w.append(f"op = {toml_str(n.op)}")
        if n.model is not None:
            w.append(f"model = {toml_str(n.model)}")
        w.append(f"device = {toml_str(n.device)}")
        if n.inputs:
            w.append(f"inputs = {toml_value({p: str(r) for p, r in n.inputs})}")
        params = {k: v for k, v in n.params.items() if not k.startswith("_")}
        if params:
            w.append(f"params = {toml_value(params)}")
        w.append("")
    return "\n".join(w).rstrip("\n") + "\n"
