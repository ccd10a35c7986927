"""Markdown reference pages generated from the declarations themselves: the TOML schema (spec/schema.py), the
architectures' config keys, and the op registry. `python tools/gen_docs.py` writes them into docs/; a test
fails when docs/ is out of date."""

from __future__ import annotations

from ..spec import schema


def _default(v) -> str:
    return "" if v is None else f"`{v!r}`".replace("'", '"')


def toml_reference() -> str:
    from ..models.registry import ARCHS, COMING

    out = ["# TOML reference", "",
           "Generated from `dflash_graph/spec/schema.py` (and the arch registry) by `python tools/gen_docs.py`; do not edit by hand.", "",
           "Unknown keys are errors that list the valid ones. Any scalar can be overridden from the command line "
           "with `--set dotted.path=value` (nodes by id: `--set nodes.<id>.params.<name>=...`).", ""]
    for sec in schema.SECTIONS:
        title = sec.name if sec.name == "(top level)" else (f"[[{sec.name[:-2]}]]" if sec.name.endswith("[]") else f"[{sec.name}]")
        out += [f"## {title}", "", sec.doc, ""]
        if sec.open:
            out += ["Free-form keys.", ""]
        if sec.keys:
            out += ["| key | type | required | default | meaning |", "|---|---|---|---|---|"]
            for k in sec.keys:
                doc = k.doc + (f" One of: {', '.join(k.choices)}." if k.choices else "")
                if k.path:
                    doc += (f" A path: `{k.path}` reads it, so `check` verifies it exists (a warning under "
                            "`--memory-only`); `plan --emit` rewrites it relative to the file it writes.")
                out.append(f"| `{k.name}` | {k.kind} | {'yes' if k.required else ''} | {_default(k.default)} | {doc} |")
            out.append("")
    out += ["## Model configs by arch", "",
            "Target families not modelled yet, refused with what is supported: "
            + ", ".join(f"`{t}` ({what})" for t, what in COMING.items()) + ".", ""]
    for name, arch in ARCHS.items():
        found = ("`arch` may be omitted: a config with one of these is this arch." if arch.target else
                 "A drafter always declares its arch.")
        out += [f"### `{name}`", "", arch.doc, "",
                f"Config `model_type`: {' or '.join(f'`{t}`' for t in arch.model_types)}. {found}", "",
                "Keys the cost model reads: " + ", ".join(f"`{k}`" for k in sorted(arch.model_keys)) + ".", "",
                "Also accepted in an inline config (read by transformers at run time): "
                + ", ".join(f"`{k}`" for k in sorted(arch.config_keys - arch.model_keys)) + ".", ""]
    return "\n".join(out).rstrip() + "\n"


def ops_reference() -> str:
    from ..ops import registry

    out = ["# Node kinds", "",
           "Generated from the op registry (`dflash_graph/ops/catalog.py`) by `python tools/gen_docs.py`; do not "
           "edit by hand. Each op is declared once: this page, `check`, the rewrites and `run --strict` all read "
           "the same declaration.", ""]
    for name, op in sorted(registry.all_ops().items()):
        out += [f"## `{name}`", "", op.doc, ""]
        if op.model_arch:
            out.append(f"- model: arch {' or '.join(op.model_arch)}; weights used: {', '.join(op.components)}")
        example = dict(op.example.params) if op.example else {}
        ins = op.input_ports(example, 2)
        outs = op.output_ports({**example, "_n_inputs": 2})
        var = f" (a list: `{op.variadic_input}0`, `{op.variadic_input}1`, ...)" if op.variadic_input else ""
        out.append("- inputs" + var + ": " + (", ".join(f"`{p.name}` [{p.dims}] {p.dtype}" for p in ins) or "none"))
        out.append("- outputs: " + (", ".join(f"`{p.name}` [{p.dims}] {p.dtype}" + (" (optional)" if p.optional else "")
                                            for p in outs) or "none")
                   + (f" — {op.example.note}" if op.example else ""))
        if op.params:
            out.append("- params: " + "; ".join(f"`{p.name}` ({p.kind}{', required' if p.required else ''}"
                                               f"{', default ' + repr(p.default) if p.default is not None and not p.required else ''})"
                                               f": {p.doc.rstrip('.')}" for p in op.params))
        t = op.traits
        traits = [f"position-wise along `*{t.positionwise}`" if t.positionwise else "",
                  f"index remap (shift `{t.remap.shift_param}`, axis `{t.remap.axis_param}`)" if t.remap else "",
                  "selection" if t.selection else "", "movement" if t.movement else "",
                  "decomposes" if t.decompose else "", "drops unread optional outputs" if t.drop_outputs else "",
                  "sink (a result)" if t.sink else "", "" if t.pure else "has effects (never removed)",
                  "" if t.deterministic else "random (never merged or recomputed)"]
        traits = [x for x in traits if x]
        if traits:
            out.append("- traits: " + "; ".join(traits))
        if op.requires:
            out.append("- requires (checked by `check`): " + "; ".join(f"`{r.small} <= {r.large}`: {r.why}"
                                                                       for r in op.requires))
        if op.device_rule != "node":
            out.append(f"- devices: {op.device_rule} (input on any device, output on the node's device)")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


_PARAM_KIND = {"layer_ids": "list[int]"}


def graph_json_schema() -> dict:
    """spec.schema.json_schema, refined by the registries: `op` is one of the registered ops and each op's params
    are its declared ones; `arch` is one of the registered archs and an inline config has that arch's keys and
    model_types (without `arch`, a target's model_type)."""
    from ..models.registry import ARCHS
    from ..ops import registry

    js = schema.json_schema()
    node = js["properties"]["nodes"]["items"]
    ops = sorted(registry.all_ops())
    node["properties"]["op"] = {**node["properties"]["op"], "enum": ops}
    rules = []
    for name in ops:
        op = registry.get(name)
        params = {}
        for p in op.params:
            ps = schema.kind_schema(_PARAM_KIND.get(p.kind, p.kind))
            if p.choices:
                ps = {"enum": list(p.choices)}
            ps["description"] = p.doc
            if p.default is not None:
                ps["default"] = p.default
            params[p.name] = ps
        then = {"properties": {"params": {"type": "object", "properties": params, "additionalProperties": False,
                                          "required": [p.name for p in op.params if p.required]}}}
        if not then["properties"]["params"]["required"]:
            del then["properties"]["params"]["required"]
        rules.append({"if": {"properties": {"op": {"const": name}}, "required": ["op"]}, "then": then})
    node["allOf"] = rules
    model = js["properties"]["models"]["additionalProperties"]
    model["properties"]["arch"] = {**model["properties"]["arch"], "enum": list(ARCHS)}
    model["allOf"] = [
        {"if": {"properties": {"arch": {"const": name}}, "required": ["arch"]},
         "then": {"properties": {"config": {"oneOf": [
             {"type": "string"},
             {"type": "object", "propertyNames": {"enum": sorted(arch.config_keys)},
              "properties": {"model_type": {"enum": list(arch.model_types)}}}]}}}}
        for name, arch in ARCHS.items()]
    # no arch: an inline config names a target's model_type (NOTE [Arch from model_type])
    targets = [t for a in ARCHS.values() if a.target for t in a.model_types]
    model["allOf"].append({"if": {"not": {"required": ["arch"]}}, "then": {"properties": {"config": {"oneOf": [
        {"type": "string"},
        {"type": "object", "required": ["model_type"], "properties": {"model_type": {"enum": targets}}}]}}}})
    return js


def graph_json_schema_text() -> str:
    import json

    return json.dumps(graph_json_schema(), indent=2, sort_keys=False) + "\n"
