"""A drafter's `weights`: the published DFlash draft checkpoint it starts from, checked against the graph without
torch (config.json and the safetensors header, read as JSON: models/published.py).

The checkpoint must be the drafter the graph declares: the same block size, target layers (in order), mask
token and shapes, and a target of the layer count it was trained for. Each difference is one located problem
naming the graph's value and the checkpoint's; `run` then loads exactly those tensors (exec/models.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import Problem, short
from ..models import published
from ..models.registry import ARCHS
from ..spec.document import GraphSpec

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


def _source(name: str, models: Mapping[str, Any]) -> str | None:
    """The model a drafter reads its context from: the one it shares components with, else the only other model
    with layers (as analysis/infer's target_layer_ids check)."""
    info = models[name]
    sources = {t.split(".", 1)[0] for t in info.spec.shares.values()} & set(models)
    if not sources:
        sources = {o for o, i in models.items() if o != name and hasattr(i.dims, "num_hidden_layers")}
    return sources.pop() if len(sources) == 1 else None


def _value(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    if isinstance(v, float):
        return float(v)
    return v


def _same(a: Any, b: Any) -> bool:
    a, b = _value(a), _value(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def checkpoint_problems(spec: GraphSpec, models: Mapping[str, Any]) -> list[Problem]:
    """Every drafter whose `weights` name a checkpoint that is not the drafter the graph declares. A path that
    does not exist is left to spec/paths.py (check reports it; run refuses it)."""
    problems: list[Problem] = []
    for name, info in models.items():
        m = info.spec
        if m.weights is None or ARCHS[m.arch].target:
            continue
        path = Path(m.weights) if Path(m.weights).is_absolute() else spec.base_dir / m.weights
        if not path.exists():
            continue
        problems += _problems(spec, models, name, info, path)
    return problems


def _problems(spec: GraphSpec, models, name: str, info, path: Path) -> list[Problem]:
    where = spec.loc("models", name, "weights")
    try:
        ck = published.read(path)
    except published.CheckpointError as e:
        return [Problem(f"model '{name}' cannot start from {short(str(info.spec.weights))}: {e}", where, hint=e.hint)]
    d = info.dims
    out = []
    for key in published.COMPARED:
        theirs, ours = ck.config.get(key), getattr(d, key)
        if theirs is None or _same(theirs, ours):
            continue
        ours_v, theirs_v = _value(ours), _value(theirs)
        said = (f" (speculators' aux_hidden_state_layer_ids {[i + 1 for i in theirs]}, hidden_states indices)"
                if key == "target_layer_ids" and ck.format == "speculators" else "")
        hint = f"set models.{name}.config.{key} = {theirs_v!r}"
        if key == "target_layer_ids":
            hint += f", and hook and concatenate the target's layers {theirs_v} in that order"
        out.append(Problem(
            f"model '{name}' declares {key} = {ours_v!r}, but the checkpoint it starts from ({ck.format} format, "
            f"{ck.path}) was trained with {key} = {theirs_v!r}{said}",
            spec.loc("models", name, "config", key), expected=f"{key} = {theirs_v!r} (the checkpoint's config.json)",
            actual=f"{key} = {ours_v!r} (the graph's drafter)",
            hint=hint + ", or point weights at a checkpoint of the drafter this graph declares"))
    src = _source(name, models)
    n = getattr(models[src].dims, "num_hidden_layers", None) if src else None
    if ck.num_target_layers is not None and isinstance(n, int) and ck.num_target_layers != n:
        out.append(Problem(
            f"model '{name}' starts from a checkpoint trained for a target of {ck.num_target_layers} layers "
            f"(dflash_config.num_target_layers), but model '{src}' has {n}", where,
            expected=f"a target of {ck.num_target_layers} layers", actual=f"model '{src}': {n} layers",
            hint="fine-tune a drafter on the target it was trained for"))
    if out:
        return out           # the shapes follow from the config: report the cause, not its echo
    want = published.expected_shapes(d)
    missing = [k for k in want if k not in ck.tensors and k != published.NORM]
    wrong = [(k, want[k], ck.tensors[k][0]) for k in want if k in ck.tensors and ck.tensors[k][0] != want[k]]
    extra = [k for k in ck.tensors if k not in want]
    bad_dtype = sorted({dt for _, dt in ck.tensors.values()} - FLOAT_DTYPES)
    fmt = lambda ks: ", ".join(ck.names.get(k, k) for k in ks[:4]) + (" ..." if len(ks) > 4 else "")  # noqa: E731
    if missing:
        out.append(Problem(f"model '{name}': the checkpoint {ck.path} lacks {len(missing)} of the drafter's "
                           f"tensors: {fmt(missing)}", where,
                           hint="the checkpoint is incomplete; export or download it again"))
    for k, w, got in wrong[:4]:
        out.append(Problem(f"model '{name}': the checkpoint's {ck.names[k]} has shape {list(got)}, not the "
                           "drafter's", where, expected=str(list(w)), actual=str(list(got)),
                           hint="its config.json does not describe its tensors; export or download it again"))
    if extra:
        out.append(Problem(f"model '{name}': the checkpoint holds {len(extra)} tensors the drafter does not have: "
                           f"{fmt(extra)}", where, hint="its config.json does not describe its tensors"))
    if bad_dtype:
        out.append(Problem(f"model '{name}': the checkpoint holds {', '.join(bad_dtype)} tensors", where,
                           expected="F32, BF16, F16 or F64", actual=", ".join(bad_dtype),
                           hint="dequantize the drafter before fine-tuning it"))
    return out
