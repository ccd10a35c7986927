"""`dflash-graph draw GRAPH -o FILE.svg|png|dot`: the graph as written and as rewritten, laid out by Graphviz.

The DOT text is written here (no Python dependency); `dot` (Graphviz) lays it out and renders SVG or PNG. A
`.dot` output needs nothing else. Each graph is a cluster, each device (or group of replicas) a cluster inside
it; edges carry the tensor's symbolic and concrete shape, dtype and size. Nodes a rewrite made or changed are
green with the rule named; nodes the rewrites removed are grey and dashed; the node where a device runs out
of memory is red.
"""

from __future__ import annotations

import shutil
import subprocess

from ..analysis.infer import Typed
from ..analysis.memory import MemoryReport
from ..errors import GraphError, Location, Problem
from ..rewrite.pipeline import Plan
from ..units import fmt_bytes

_FORMATS = (".svg", ".png", ".dot", ".pdf")


def _q(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "int64": "i64", "bool": "bool"}.get(dtype, dtype)


def _cluster_name(typed: Typed, placement: str) -> str:
    devs = typed.ctx.devices_of(placement)
    if placement in typed.ctx.spec.groups:
        span = f"{devs[0]}..{devs[-1]}" if len(devs) > 2 else ", ".join(devs)
        return f"{placement}: {span} (one replica each)"
    return f"{placement} ({typed.ctx.spec.devices[placement].torch})" if placement in typed.ctx.spec.devices else placement


def graph_dot(typed: Typed, mem: MemoryReport | None, prefix: str, title: str, removed: set[str] = frozenset(),
              rewritten: dict[str, str] | None = None) -> list[str]:
    """The lines of one cluster: the graph `typed` with its devices as sub-clusters."""
    rewritten = rewritten or {}
    oom_nodes = {o.node for o in mem.ooms} if mem is not None else set()
    lines = [f"subgraph {_q('cluster_' + prefix)} {{", f"label={_q(title)}; fontsize=16; style=rounded; "
             f"color=\"#888888\"; fontname=\"Helvetica-Bold\";"]
    by_place: dict[str, list] = {}
    for n in typed.graph.nodes:
        by_place.setdefault(n.device, []).append(n)
    for place, nodes in by_place.items():
        lines.append(f"subgraph {_q(f'cluster_{prefix}_{place}')} {{")
        lines.append(f"label={_q(_cluster_name(typed, place))}; style=\"rounded,filled\"; fillcolor=\"#f4f6fb\"; "
                     "color=\"#4e79a7\"; fontname=\"Helvetica\"; fontsize=12;")
        for n in nodes:
            label = f"{n.id}\n{n.op}" + (f" ({n.model})" if n.model else "")
            attrs = {"shape": "box", "style": "\"rounded,filled\"", "fillcolor": "\"white\"",
                     "fontname": "\"Helvetica\"", "fontsize": "10"}
            if n.id in removed:
                label += "\nremoved by the rewrites"
                attrs.update(style="\"rounded,dashed,filled\"", fillcolor="\"#eeeeee\"", fontcolor="\"#777777\"")
            if n.id in rewritten:
                label += f"\n{rewritten[n.id]}"
                attrs.update(fillcolor="\"#d5ecd0\"", color="\"#59a14f\"", penwidth="2")
            if n.id in oom_nodes:
                label += "\nOOM here"
                attrs.update(fillcolor="\"#f8c9c9\"", color="\"#e15759\"", penwidth="2")
            attrs["label"] = _q(label)
            if n.note:
                attrs["tooltip"] = _q(n.note)
            lines.append(f"{_q(prefix + ':' + n.id)} [" + ", ".join(f"{k}={v}" for k, v in attrs.items()) + "];")
        lines.append("}")
    lines.append("}")
    for n in typed.graph.nodes:
        for port, r in n.inputs:
            t = typed.types.get(r)
            if t is None:
                continue
            if t.dtype == "handle":
                lines.append(f"{_q(prefix + ':' + r.node)} -> {_q(prefix + ':' + n.id)} "
                             f"[label={_q('hooks ' + r.output)}, style=dashed, fontsize=8, color=\"#999999\"];")
                continue
            label = f"{r.output}: {t.sym_str()}\n{t.concrete_str()} {_short(t.dtype)}, {fmt_bytes(t.nbytes)}"
            heavy = t.nbytes >= 2**30
            lines.append(f"{_q(prefix + ':' + r.node)} -> {_q(prefix + ':' + n.id)} [label={_q(label)}, fontsize=8, "
                         f"fontname=\"Helvetica\"" + (", penwidth=2.2, color=\"#e15759\"" if heavy else "") + "];")
    return lines


def plan_dot(plan: Plan) -> str:
    lines = ["digraph dflash_graph {", "rankdir=TB; newrank=true; compound=true; nodesep=0.3; ranksep=0.45;",
             f"label={_q(f'{plan.typed.ctx.spec.file}: edges carry shape, dtype and size; red edges are 1 GiB or more')}; "
             "labelloc=b; fontname=\"Helvetica\"; fontsize=11;"]
    if plan.rewritten and plan.applied:
        after = {n.id for n in plan.typed.graph.nodes}
        removed = {n.id for n in plan.original.graph.nodes} - after
        changed: dict[str, str] = {}
        for n in plan.typed.graph.nodes:
            if n.note:
                changed[n.id] = n.note.split(":")[0]
        lines += graph_dot(plan.original, plan.memory_before, "w", "as written", removed=removed)
        lines += graph_dot(plan.typed, plan.memory, "r", f"rewritten ({len(plan.applied)} rewrites)",
                           rewritten=changed)
    else:
        lines += graph_dot(plan.typed, plan.memory, "w", "as written" + ("" if plan.rewritten else " (--no-rewrite)"))
    lines.append("}")
    return "\n".join(lines) + "\n"


def output(path: str) -> str:
    """-o checked before the graph is: a known suffix, a directory that exists and can be written."""
    from .outputs import output_file

    if not path.lower().endswith(_FORMATS):
        raise GraphError(Problem("the file must end in .svg, .png, .pdf or .dot", Location(flag=f"-o {path}"),
                                 hint="e.g. -o graph.svg"))
    return output_file(path, "-o")


def render(dot_text: str, path: str) -> str:
    low = output(path).lower()
    if low.endswith(".dot"):
        with open(path, "w") as f:
            f.write(dot_text)
        return f"wrote {path}: Graphviz DOT (render it with: dot -Tsvg {path} -o graph.svg)"
    exe = shutil.which("dot")
    if exe is None:
        raise GraphError(Problem("rendering needs Graphviz's `dot` program, which is not on PATH",
                                 Location(flag=f"-o {path}"),
                                 hint="install Graphviz (apt-get install graphviz, brew install graphviz, or conda "
                                      "install graphviz), or write the layout's input with -o graph.dot"))
    fmt = low.rsplit(".", 1)[1]
    p = subprocess.run([exe, f"-T{fmt}", "-o", path], input=dot_text, capture_output=True, text=True)
    if p.returncode != 0:
        raise GraphError(Problem(f"Graphviz's dot could not write it (exit {p.returncode}): "
                                 f"{p.stderr.strip()[:300] or 'no message'}", Location(flag=f"-o {path}"),
                                 hint="write the layout's input with -o graph.dot and run dot on it yourself"))
    return f"wrote {path}: laid out by Graphviz {fmt.upper()}"


def cmd_draw(args) -> int:
    from .options import plan_from_args

    output(args.output)
    plan = plan_from_args(args)
    print(render(plan_dot(plan), args.output))
    return 0
