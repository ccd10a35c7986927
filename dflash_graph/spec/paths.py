"""The files a graph names (keys declared with `Key.path` in schema.py: a target's weights, the corpus, the
tokenizer, a chat template), relative to the graph file. `check` reports each one that does not exist (an error;
a warning under `check --memory-only`, which predicts memory without them), and `run` and `eval` refuse one
before any work, each with the graph file, line and TOML path."""

from __future__ import annotations

from pathlib import Path

import attrs

from ..errors import GraphError, Problem
from . import schema
from .document import GraphSpec
from .toml_lines import render_path


@attrs.frozen
class MissingPath:
    key: str            # TOML path, e.g. "data.corpus"
    path: str           # the file as the command would open it
    needed_by: str      # the command that reads it
    problem: Problem


def missing_paths(spec: GraphSpec) -> list[MissingPath]:
    base = spec.base_dir
    out = []
    for where, key, value in schema.path_keys(dict(spec.resolved)):
        p = Path(value) if Path(value).is_absolute() else base / value
        if p.exists():
            continue
        toml = render_path(where)
        out.append(MissingPath(toml, str(p), key.path, Problem(
            f"{toml} = {value!r}: no such file or directory: {p}", spec.loc(*where),
            hint=f"`{key.path}` reads it; paths are relative to the graph file's directory ({base})")))
    return out


def require_paths(spec: GraphSpec, command: str = "run") -> None:
    """Raise one GraphError naming every path `command` reads that does not exist."""
    missing = [m.problem for m in missing_paths(spec) if m.needed_by == command]
    if missing:
        raise GraphError(missing)
