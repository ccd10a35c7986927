"""`dflash-graph trace-model CONFIG`: derive the memory program of one target config, where no stored program holds.

A stored program holds for its arch's `fixed` config values (models/trace/archs.py: `attention_bias = false` for
Qwen3, ...): transformers runs other code for other values. This command derives a program for the values a
config.json sets, as tools/derive_programs.py does for the packaged ones (transformers' own causal LM traced under
fake tensors at a few small sizes, fitted, checked byte for byte at held-out sizes), and writes it into the user
program directory, where `check` finds it (docs/memory-programs.md, "Programs for one config: trace-model").

It imports torch and transformers (the tracer, models/trace); `check` never does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import short
from ..models import decoder, programs
from ..models.registry import ARCHS, supported_text, target_arch_of

PACKINGS = ("documents", "mask")

#: keys of a config.json that say where it came from, not what the model is (transformers' config classes take
#: them or not depending on the version): left out when transformers is asked whether it accepts the config
PROVENANCE = frozenset({"model_type", "architectures", "transformers_version", "_name_or_path"})


class Refused(Exception):
    """Bad input: exit 2 with this message (the file, what was expected and found, what to do)."""


def _read_config(arg: str) -> tuple[Path, dict[str, Any]]:
    path = Path(arg)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise Refused(f"{arg}: error: the directory holds no config.json\n  hint: pass a model's config.json, "
                          "or the directory of a Hugging Face checkpoint that holds one")
    if not path.is_file():
        raise Refused(f"{path}: error: no such file\n  hint: pass a model's config.json (or its directory)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Refused(f"{path}: error: not valid JSON: {e}\n  hint: pass a model's config.json") from None
    if not isinstance(cfg, dict):
        raise Refused(f"{path}: error: expected a JSON object of config keys, found a JSON {type(cfg).__name__}\n"
                      "  hint: pass a model's config.json")
    return path, cfg


def _arch_of(path: Path, cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    supported = [a for a in ARCHS.values() if a.target and a.module is decoder]
    names = ", ".join(f"{t} ({a.label})" for a in supported for t in a.model_types)
    if model_type is None:
        raise Refused(f"{path}: error at model_type: expected the model_type of a target, found none\n"
                      f"  hint: a Hugging Face config.json names it; trace-model derives for model_type {names}")
    arch = target_arch_of(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise Refused(f"{path}: error at model_type: {short(model_type)} is not a target dflash-graph models "
                      f"({supported_text()})\n  hint: trace-model derives for model_type {names}")
    if ARCHS[arch].module is not decoder:
        raise Refused(f"{path}: error at model_type: {model_type!r} ({ARCHS[arch].label}): check reads its "
                      f"memory from models/{ARCHS[arch].module.__name__.rsplit('.', 1)[-1]}.py and its packaged "
                      f"programs only, not from a program traced for one config\n  hint: trace-model derives for "
                      f"model_type {names}; for this arch, `python tools/derive_programs.py --arch {arch}`")
    return arch


def _transformers_accepts(path: Path, cfg: dict[str, Any], spec) -> None:
    """transformers' own config class takes the config (a value it refuses would fail every trace)."""
    import transformers

    kw = {k: v for k, v in cfg.items() if k not in PROVENANCE}
    try:
        getattr(transformers, spec.config_cls)(**kw)
    except Exception as e:  # the config class's validation: ValueError, TypeError, StrictDataclass errors
        raise Refused(f"{path}: error: transformers {transformers.__version__}'s {spec.config_cls} refuses this "
                      f"config: {type(e).__name__}: {short(' '.join(str(e).split()), 400)[1:-1]}\n"
                      f"  hint: fix the key it names; a config that transformers cannot build cannot be traced") \
            from None


def _fixed_of(path: Path, cfg: dict[str, Any], spec) -> dict[str, Any]:
    """The arch's fixed values, with the config's where it sets them (tied embeddings change only which weights
    exist: the program keeps the packaged value, models/decoder.py PARAMS_ONLY)."""
    fixed = dict(spec.fixed)
    for key, want in spec.fixed.items():
        if key in cfg and key not in decoder.PARAMS_ONLY:
            value = cfg[key]
            if isinstance(want, list) and value is None:
                value = []
            if type(value) is not type(want):
                raise Refused(f"{path}: error at {key}: expected a {type(want).__name__} (as {json.dumps(want)}), "
                              f"found {short(value)}\n  hint: set {key} to a {type(want).__name__}")
            fixed[key] = value
    return fixed


def cmd_trace_model(args) -> int:
    try:
        path, cfg = _read_config(args.config)
        arch = _arch_of(path, cfg)
        from ..models.trace.archs import ARCHS as TRACED

        spec = TRACED[arch]
        fixed = _fixed_of(path, cfg, spec)
        if all(programs.same_value(fixed[k], spec.fixed[k]) for k in spec.fixed):
            print(f"{path}: the packaged {arch} memory programs hold for this config "
                  f"({', '.join(f'{k} = {json.dumps(v)}' for k, v in spec.fixed.items())}): nothing to derive; "
                  "check reads them as they are", file=sys.stderr)
            return 0
        _transformers_accepts(path, cfg, spec)
    except Refused as e:
        print(e, file=sys.stderr)
        return 2
    import attrs

    from ..models.trace.derive import derive, write
    from ..models.trace.fit import FitError

    spec = attrs.evolve(spec, fixed=fixed)
    changed = ", ".join(f"{k} = {json.dumps(v)}" for k, v in fixed.items() if not programs.same_value(v, TRACED[arch].fixed[k]))
    out = Path(args.out) if args.out else None
    where = out or programs.user_dir()
    print(f"deriving the {arch} memory program for {changed} ({path}); written to {where}", file=sys.stderr)
    failed = 0
    for packing in args.packing or PACKINGS:
        t0 = time.time()

        def step(what: str, i: int, n: int, point: dict[str, int], packing: str = packing) -> None:
            doing = "tracing design size" if what == "design" else "checking the fit at held-out size"
            dims = ", ".join(f"{k}={v}" for k, v in point.items())
            print(f"  {packing}: {doing} {i + 1}/{n}: {spec.model_cls} under fake tensors, {dims}",
                  file=sys.stderr, flush=True)

        try:
            prog = derive(arch, packing, log=lambda m: print(f"  {m}", file=sys.stderr), spec=spec, step=step)
        except FitError as e:
            print(f"{path}: error: the {arch} program for {changed} (packing {packing}) could not be derived: {e}\n"
                  "  hint: transformers runs code for these values that the fitter cannot express in the config's "
                  "dims; report it with this config", file=sys.stderr)
            failed += 1
            continue
        prog["derived_for"] = {"config": str(path), "command": "dflash-graph trace-model"}
        written = write(prog, user=True, out=out)
        print(f"  {packing}: derived in {time.time() - t0:.0f} s", file=sys.stderr)
        print(written)
    return 1 if failed else 0
