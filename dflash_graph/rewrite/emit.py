"""Write a plan's graph (the rewritten one, or the original under --no-rewrite) back as a TOML graph file.

The file loads with `spec.loader` and checks to the same per-device peaks as the plan it came from (the round
trip is tested in tests/test_plan_emit.py and, on random graphs, in tests/test_rewrite_properties.py):

- every section but the nodes as the graph wrote it (--set applied), key by key, walked by the declared
  sections of spec/schema.py, so no key is dropped ([dims] keeps its expressions, a device its throughput);
- every node as [[nodes]], in schedule order, with its own params (never the evaluated `Typed.params`), inputs
  as a table, device and model; a node made or changed by a rewrite gets a comment naming the rule;
- paths (model config files and every key declared as a path: weights, data files) are rewritten relative to
  the output file's directory.

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

from ..spec import schema
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
    """The plan's graph as TOML text. Paths are written relative to `out_path`'s directory (absolute if None).

    Every section but the nodes is written from the document as loaded (`GraphSpec.resolved`: what the file says,
    --set applied), walked by the declared sections (spec/schema.py), so every key the graph wrote is written
    again: a key the schema gains is never dropped. Keys declared as paths are rebased."""
    typed = plan.typed
    spec = typed.ctx.spec
    out_dir = Path(out_path).parent if out_path is not None else None
    doc = spec.resolved
    w: list[str] = []

    w.append(f"# Written by `dflash-graph plan --emit` from {spec.file or '(text)'}"
             + (f": {len(plan.applied)} rewrites applied." if plan.rewritten else " (--no-rewrite)."))
    w.append("# Nodes made or changed by a rewrite carry a comment naming the rule; see docs/rules/.")
    w.append("")
    # the name is written even where the file has none (a graph without one is named after its file)
    _table(w, "graph", schema.GRAPH, {**doc.get("graph", {}), "name": spec.name}, spec.base_dir, out_dir)
    for key in schema.TOP.keys:
        name, v = key.name, doc.get(key.name)
        if name in ("graph", "nodes") or not isinstance(v, Mapping):
            continue
        sec = _SECTIONS.get(name)
        if sec is not None:                       # [memory], [launch], [train], [data]
            _table(w, name, sec, v, spec.base_dir, out_dir)
        elif f"{name}.<name>" in _SECTIONS:       # [devices.<name>], [models.<name>]
            for item, t in v.items():
                header = f"{name}.{toml_key(item)}"
                if name == "models":
                    t = _model_table(spec, item, t, out_dir)
                _table(w, header, _SECTIONS[f"{name}.<name>"], t, spec.base_dir, out_dir)
        else:                                     # free-form: [dims] (expressions as written), [groups]
            _table(w, name, None, v, spec.base_dir, out_dir)

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


_SECTIONS = {s.name: s for s in schema.SECTIONS}


def _model_table(spec, name: str, table: Mapping[str, Any], out_dir: Path | None) -> dict:
    """A model's table, its config as the file it came from when the file still says what was checked (no --set
    changed it), else inline."""
    m = spec.models.get(name)
    t = dict(table)
    if m is not None and m.config_file and _config_from_file(m.config_file, m.config):
        t["config"] = _rebase(m.config_file, None, out_dir)
    return t


def _table(w: list[str], header: str, sec, table: Mapping[str, Any], base: Path, out_dir: Path | None) -> None:
    """One table: its scalar and inline keys as written (a key declared as a path rebased), then each of its
    sub-tables (a model's inline config) as `[header.key]`."""
    w.append(f"[{header}]")
    subs = []
    for k, v in table.items():
        if v is None:
            continue
        key = sec.key(k) if sec is not None else None
        if key is not None and key.path and isinstance(v, str):
            v = _rebase(v, base, out_dir)
        if isinstance(v, Mapping) and (key is None or key.kind != "table"):
            subs.append((k, v))
            continue
        w.append(f"{toml_key(str(k))} = {toml_value(v)}")
    w.append("")
    for k, v in subs:
        _table(w, f"{header}.{toml_key(str(k))}", None, v, base, out_dir)
