"""The layouts a graph's devices allow (docs/distributed.md, "Layouts"), each a variant of the given graph.

A graph has a target side (the nodes on one placement that the trainable model's nodes do not share) and a
drafter side (every node on the trainable model's placement: NOTE [Data-parallel placement]), joined by
transfers (ops whose Traits.movement is set). Over the graph's D devices, in the order of [devices]:

  colocated-ddp, colocated-fsdp   both sides on one group of all D devices; the transfers are dropped (their
                                  readers read what they carried) and the drafter is data-parallel
  N:M-ddp, N:M-fsdp (M > 1)       the target side on the first N devices, the drafter side on the last M
  N:1                             the drafter on the last device, without `parallel`, as today

Each variant is a GraphSpec built from the given one (devices, models and dims as declared, nodes by their own
records), so it goes through the same pipeline as any graph: build, infer, the rewrites, the memory model and
the launch analysis. No torch here.

NOTE [Colocated start]: a colocated graph has no transfers to say where its target side ends. Its target side is
then the least that must stay with the target's forward: the nodes that run a model's body (Traits.modules
"body"), everything they read (transitively), and the nodes that read a handle they make (a hook reads the
forward's taps, which cannot cross devices). Every other node is the drafter side, and a split layout carries each
tensor that crosses from the target side to the drafter side in a transfer of its own (`<node>_<output>_tx`,
placed before its first reader); the rewrites then narrow them as they do any transfer.
"""

from __future__ import annotations

import copy

import attrs

from ..errors import GraphError, Location, Problem
from ..ir.graph import Ref
from ..ops import registry
from ..ops.catalog import TRANSFER
from ..spec.document import GraphSpec, NodeSpec, frozen_map
from .infer import Typed
from .parallel import trainable_placements, trained_model


@attrs.frozen
class Layout:
    name: str              # "colocated-fsdp", "7:1", "4:4-ddp"
    targets: tuple[str, ...]
    drafters: tuple[str, ...]
    engine: str | None     # "ddp" | "fsdp" | None (one drafter device)


def sides(typed: Typed) -> tuple[str, str, set[str]]:
    """(target placement, drafter placement, transfer node ids) of a checked graph, or a located refusal."""
    spec = typed.ctx.spec
    name = trained_model(typed)
    places = trainable_placements(typed)
    if name is None or len(places) != 1:
        raise GraphError(Problem("--layouts moves a trained drafter between devices, and this graph trains none",
                                 spec.loc("models"), hint="declare trainable = true on the drafter model"))
    drafter = next(iter(places))
    moves = {n.id for n in typed.graph.nodes if registry.get(n.op).traits.movement and n.device == drafter}
    others = {n.device for n in typed.graph.nodes if n.device != drafter}
    if not others and not moves:      # colocated: NOTE [Colocated start]
        return drafter, drafter, set()
    if not moves:
        raise GraphError(Problem("--layouts starts from a graph whose target nodes feed the drafter's through "
                                 "transfers (N:M or N:1), or share its placement (colocated); in this one they "
                                 "sit apart with no transfer between them", spec.loc("nodes"),
                                 hint="carry what the drafter's nodes read from the target's in `transfer` nodes "
                                      "placed on the drafter's device or group"))
    if len(others) > 1:
        raise GraphError(Problem(f"--layouts needs the graph's target nodes on one device or group; they are on "
                                 f"{', '.join(sorted(others))}", spec.loc("nodes"),
                                 hint="place every target-side node on one group (graphs/qwen27b.toml: `targets`)"))
    return (next(iter(others)) if others else drafter), drafter, moves


def _target_side(typed: Typed) -> set[str]:
    """NOTE [Colocated start]: the nodes that stay with the target's forward."""
    g = typed.graph
    side: set[str] = set()
    todo = [n.id for n in g.nodes if "body" in registry.get(n.op).module_roles()]
    while todo:
        nid = todo.pop()
        if nid in side:
            continue
        side.add(nid)
        todo += [r.node for _, r in g[nid].inputs]
        for k, t in typed.outputs_of(nid).items():
            if t.dtype == "handle":
                todo += [c for c, _ in g.consumers(Ref(nid, k))]
    return side


def enumerate_layouts(typed: Typed) -> list[Layout]:
    """Every layout of the graph's devices: colocated, each N:M split (M > 1), N:1."""
    devs = tuple(typed.ctx.spec.devices)
    engine = typed.ctx.models[trained_model(typed)].spec.parallel if trained_model(typed) else None
    engines = (engine,) if engine else ("ddp", "fsdp")
    out = [Layout(f"colocated-{e}", devs, devs, e) for e in engines] if len(devs) > 1 else []
    for m in range(len(devs) - 1, 0, -1):
        n = len(devs) - m
        if m == 1:
            out.append(Layout(f"{n}:1", devs[:n], devs[n:], None))
        else:
            out += [Layout(f"{n}:{m}-{e}", devs[:n], devs[n:], e) for e in engines]
    return out


def layout_spec(typed: Typed, layout: Layout) -> GraphSpec:
    """The given graph in `layout`: a GraphSpec the pipeline checks like any other (and `plan --emit` writes)."""
    spec = typed.ctx.spec
    tplace, dplace, moves = sides(typed)
    model = trained_model(typed)
    colocated = layout.targets == layout.drafters
    groups = {g: v for g, v in spec.groups.items() if g not in (tplace, dplace)}
    tname = tplace if tplace in spec.groups else "targets"
    dname = dplace if dplace in spec.groups and dplace != tplace else "drafters"
    groups[tname] = layout.targets
    if colocated:
        dname = tname
    elif len(layout.drafters) > 1:
        groups[dname] = layout.drafters
    else:
        dname = layout.drafters[0]
    if len(layout.targets) == 1 and not colocated:
        del groups[tname]
        tname = layout.targets[0]
    carried = {}
    for ns in spec.nodes:   # what each dropped transfer carried: its readers read that instead
        if colocated and ns.id in moves:
            (src,) = ns.inputs.values() if hasattr(ns.inputs, "values") else ns.inputs
            carried[f"{ns.id}.out"] = src

    def rewire(inputs):
        if hasattr(inputs, "items"):
            return frozen_map({p: carried.get(r, r) for p, r in inputs.items()})
        return tuple(carried.get(r, r) for r in inputs)

    nodes = []
    if tplace == dplace:      # a colocated start: NOTE [Colocated start]
        target_side = _target_side(typed)
        drafter_side = {ns.id for ns in spec.nodes if ns.id not in target_side}
    else:
        drafter_side = {ns.id for ns in spec.nodes if ns.device == dplace}
    carry: dict[str, str] = {}      # a tensor from the target side -> the transfer that carries it (split layouts)

    def carried_in(ns, inputs):
        if colocated or ns.id not in drafter_side or tplace != dplace:
            return inputs
        out = {}
        for p, r in (inputs.items() if hasattr(inputs, "items") else enumerate(inputs)):
            if r.partition(".")[0] not in drafter_side:
                if r not in carry:
                    carry[r] = tx = f"{r.replace('.', '_')}_tx"
                    nodes.append(NodeSpec(ns.index, tx, TRANSFER.name, frozen_map({"x": r}), frozen_map({}), dname,
                                          note=f"--layout {layout.name}: carries {r} to the drafter side"))
                r = f"{carry[r]}.out"
            out[p] = r
        return frozen_map(out) if hasattr(inputs, "items") else tuple(out[i] for i in range(len(inputs)))

    for ns in spec.nodes:
        if colocated and ns.id in moves:
            continue
        device = dname if ns.id in drafter_side else tname
        inputs = carried_in(ns, rewire(ns.inputs))
        nodes.append(attrs.evolve(ns, device=device, inputs=inputs))
    models = dict(spec.models)
    models[model] = attrs.evolve(models[model], parallel=layout.engine)
    doc = copy.deepcopy(dict(spec.resolved))
    doc["groups"] = {g: list(v) for g, v in groups.items()}
    doc.setdefault("models", {}).setdefault(model, {})
    if layout.engine:
        doc["models"][model]["parallel"] = layout.engine
    else:
        doc["models"][model].pop("parallel", None)
    doc.setdefault("graph", {})["name"] = f"{spec.name}-{layout.name.replace(':', 'x')}"
    return attrs.evolve(spec, groups=frozen_map(groups), nodes=tuple(nodes), models=frozen_map(models),
                        name=f"{spec.name}-{layout.name.replace(':', 'x')}", resolved=doc)


def find_layout(typed: Typed, name: str) -> Layout:
    layouts = enumerate_layouts(typed)
    for lay in layouts:
        if lay.name == name:
            return lay
    raise GraphError(Problem(f"no layout '{name}' for the graph's {len(typed.ctx.spec.devices)} devices",
                             Location(flag=f"--layout {name}"),
                             hint="layouts: " + ", ".join(lay.name for lay in layouts)))
