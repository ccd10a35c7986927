"""Each model's arch: declared (`models.<name>.arch`) or found from its config's `model_type`, and checked
against that config. Never a silent substitution: a config of another family under a declared arch would be
modelled as another network (a Qwen3-8B config under `qwen3_5` takes Qwen3.5's defaults for the keys it lacks:
27 of its 36 layers would become Gated DeltaNet layers).

NOTE [Arch from model_type] (the rule, docs/guide.md "Supported targets"):
- `arch` omitted: the config's `model_type` (and a multimodal config's `text_config.model_type`) names a target
  arch of the registry. A model_type of a target issue 22 brings, or one nobody knows, is refused; so is a
  config with no model_type. A drafter always declares `arch = "dflash"`.
- `arch` declared: a model_type the config names must be one the arch accepts (`Arch.model_types`).
- A config.json file must name its model_type (transformers' `save_pretrained` always writes it); an inline
  config may leave it out only under a declared arch.
- Whatever the model_type, a key that only other families' configs carry (`registry.FAMILY_KEYS`:
  `sliding_window`, `num_experts`, `mlp_bias`, ...) is refused: the config is another model's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs

from ..errors import Problem, did_you_mean, short
from ..models.registry import (ARCHS, COMING, Arch, foreign_keys, model_types_of, not_modelled, supported_text,
                               target_arch_of)
from ..spec.document import GraphSpec, ModelSpec


def resolve_archs(spec: GraphSpec) -> tuple[GraphSpec, list[Problem]]:
    """The spec with every model's arch filled in (those that could be), and the problems found. A model whose
    arch cannot be settled keeps arch None (build skips it; its problem is in the list)."""
    problems: list[Problem] = []
    models = {}
    for name, m in spec.models.items():
        arch, found = _arch_of(spec, m)
        problems += found
        if arch is not None and not found:
            found = _contradicting_keys(spec, m, ARCHS[arch])
            problems += found
        models[name] = attrs.evolve(m, arch=arch if not found else None)
    return attrs.evolve(spec, models=models), problems


def _arch_of(spec: GraphSpec, m: ModelSpec) -> tuple[str | None, list[Problem]]:
    named = model_types_of(m.config)
    bad_type = next(((p, v) for p, v in named if not isinstance(v, str)), None)
    if bad_type is not None:
        return None, [Problem(f"model '{m.name}': config key '{'.'.join(bad_type[0])}' must be a string, got "
                              f"{short(bad_type[1])}", _loc(spec, m, bad_type[0]), hint=supported_text())]
    if m.arch is None:
        return _found(spec, m, named)
    if m.arch not in ARCHS:
        if m.arch in COMING:
            return None, [Problem(f"model '{m.name}': " + not_modelled(f"arch '{m.arch}' ({COMING[m.arch]})"),
                                  spec.loc("models", m.name, "arch"), hint=supported_text())]
        return None, [Problem(f"unknown arch '{m.arch}'{did_you_mean(m.arch, list(ARCHS))}",
                              spec.loc("models", m.name, "arch"),
                              hint=f"archs: {', '.join(ARCHS)}; {supported_text()}")]
    arch = ARCHS[m.arch]
    problems = []
    for path, mt in named:
        if mt in arch.model_types:
            continue
        other = target_arch_of(mt)
        what = (f"a {ARCHS[other].label} config (arch '{other}')" if other else
                "a " + not_modelled(f"{mt} config ({COMING[mt]}), which") if mt in COMING else
                "a model_type dflash-graph does not know")
        fix = (f"set arch = \"{other}\" (or leave arch out: it comes from model_type)" if other and arch.target else
               "a drafter's config names the type of its layers: model_type \"qwen3\"" if not arch.target else
               "point `config` at the target's own config.json, or correct its model_type")
        problems.append(Problem(
            f"model '{m.name}' is declared arch '{m.arch}', but its config{_in_file(m, path, mt)} says model_type "
            f"'{mt}': {what}; arch '{m.arch}' would model it as another network",
            _loc(spec, m, path), expected=f"model_type {' or '.join(repr(t) for t in arch.model_types)}",
            actual=repr(mt), hint=f"{fix}; {supported_text()}"))
    if not named and m.config_file is not None:
        problems.append(Problem(
            f"model '{m.name}': the config file {m.config_file} names no model_type, so nothing says it is a "
            f"{arch.label} config", spec.loc("models", m.name, "config"),
            expected=f"model_type {' or '.join(repr(t) for t in arch.model_types)}", actual="no model_type",
            hint=f"add \"model_type\": \"{arch.model_types[-1]}\" to {Path(m.config_file).name} (transformers' "
                 "save_pretrained writes it), or give the config inline"))
    return (None if problems else m.arch), problems


def _found(spec: GraphSpec, m: ModelSpec, named: list[tuple[tuple[str, ...], Any]]) -> tuple[str | None, list[Problem]]:
    """The arch of a model that declares none, from its config's model_type."""
    if not named:
        return None, [Problem(f"model '{m.name}' declares no arch, and its config names no model_type",
                              spec.loc("models", m.name),
                              hint="declare a target's arch (or give its config's model_type), "
                                   f"arch = \"dflash\" for a drafter; {supported_text()}")]
    archs = {p: target_arch_of(v) for p, v in named}
    for path, mt in named:
        if archs[path] is None:
            what = (not_modelled(f"{mt} ({COMING[mt]})") if mt in COMING else "a model_type dflash-graph does not know")
            return None, [Problem(f"model '{m.name}' declares no arch, and its config{_in_file(m, path, mt)} says "
                                  f"model_type '{mt}': {what}", _loc(spec, m, path), hint=supported_text())]
    if len(set(archs.values())) > 1:
        (p0, a0), (p1, a1) = list(archs.items())[:2]
        return None, [Problem(f"model '{m.name}': its config's {'.'.join(p0)} names arch '{a0}' but its "
                              f"{'.'.join(p1)} names arch '{a1}'", _loc(spec, m, p1),
                              hint="a multimodal config and its text_config name the same family")]
    return next(iter(archs.values())), []


def _contradicting_keys(spec: GraphSpec, m: ModelSpec, arch: Arch) -> list[Problem]:
    out = []
    for key, fams in foreign_keys(arch, m.config).items():
        path = (key,) if key in m.config else ("text_config", key)
        out.append(Problem(
            f"model '{m.name}' (arch '{arch.name}'): config key '{key}'{_in_file(m, path)} belongs to "
            f"{', '.join(fams)} configs, not to a {arch.label} config: this config is another model's",
            _loc(spec, m, path), hint=f"point `config` at the {arch.label} config, or remove '{key}'; "
                                      f"{supported_text()}"))
    return out


def _loc(spec: GraphSpec, m: ModelSpec, path: tuple[str, ...]):
    return spec.loc("models", m.name, "config", *path)


def _in_file(m: ModelSpec, path: tuple[str, ...], value: Any = None) -> str:
    """' (FILE, line N)' for a key of a config.json file; '' for an inline config."""
    if m.config_file is None:
        return ""
    line = _json_line(m.config_file, path[-1], value)
    return f" ({m.config_file}{f', line {line}' if line else ''})"


def _json_line(file: str, key: str, value: Any) -> int | None:
    """The line of `"key": value` (or of `"key"`) in a JSON file, or None."""
    try:
        text = Path(file).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    want = f'"{re.escape(key)}"\\s*:' + (f'\\s*"{re.escape(value)}"' if isinstance(value, str) else "")
    hit = re.search(want, text)
    return text.count("\n", 0, hit.start()) + 1 if hit else None

