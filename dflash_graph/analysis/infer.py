"""Static shape, dtype and device inference over symbolic dims.

`build(spec)` resolves dims and models and turns the document into an `ir.Graph`; `infer(graph, ctx)` types
every output from the op contracts. Both collect problems and raise one GraphError naming file, line, TOML
path, node, expected vs actual and the current dim bindings.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import immutables

from ..errors import GraphError, Location, Problem, did_you_mean, short
from ..ir.dims import MAX_DIM, DimEnv, DimError, IntPoly
from ..ir.graph import CycleError, Graph, Node, Ref
from ..ir.types import Dim, TensorType
from ..models.decoder import NeedsTrace
from ..models.registry import ARCHS, foreign_keys
from ..ops import registry
from ..ops.contract import BindContext, ContractError, OpDef, build as build_dims, dim_of, match
from ..spec.document import GraphSpec, ModelSpec
from .model_arch import resolve_archs


@attrs.frozen
class ModelInfo:
    spec: ModelSpec
    config: Mapping[str, Any]      # with dim expressions evaluated
    dims: Any                      # the arch's Dims object

    def component_owner(self, comp: str) -> str:
        """'target.lm_head' for a component this model takes from another through `shares`."""
        return self.spec.shares.get(comp, f"{self.spec.name}.{comp}")


@attrs.frozen
class GraphContext:
    """Everything about a graph that is not its nodes: dims, devices, models. Shared by every rewrite of it."""
    spec: GraphSpec
    env: DimEnv = attrs.field(eq=False)
    models: Mapping[str, ModelInfo]
    _placements: dict = attrs.field(factory=dict, init=False, eq=False, repr=False)

    def loc(self, node: Node, *sub: str | int) -> Location:
        if node.spec_index is not None:
            return self.spec.node_loc(_spec_node(self.spec, node.spec_index), *sub)
        return Location(self.spec.file, None, f"node '{node.id}' (made by a rewrite)")

    def devices_of(self, placement: str) -> tuple[str, ...]:
        hit = self._placements.get(placement)
        if hit is None:
            hit = self._placements[placement] = self.spec.placement(placement)
        return hit


def _spec_node(spec: GraphSpec, index: int):
    return next(n for n in spec.nodes if n.index == index)


class NodeCache:
    """Per node, values derived from the node and its types alone (its cost: analysis/memory._cached_cost). A
    persistent map (NOTE [Inference of a change]): a rewrite's typed graph shares its parent's entries, and an
    entry added later to one is not seen by the other."""
    __slots__ = ("map",)

    def __init__(self, m: immutables.Map | None = None):
        self.map = m if m is not None else immutables.Map()

    def setdefault(self, nid: str, default: dict) -> dict:
        got = self.map.get(nid)
        if got is None:
            got = default
            self.map = self.map.set(nid, default)
        return got

    def get(self, nid: str, default=None):
        return self.map.get(nid, default)

    def __contains__(self, nid: str) -> bool:
        return nid in self.map

    def __getitem__(self, nid: str) -> dict:
        return self.map[nid]


@attrs.frozen
class Typed:
    """A graph with a type for every output it produces."""
    graph: Graph
    ctx: GraphContext
    types: Mapping[Ref, TensorType]
    params: Mapping[str, Mapping[str, Any]]   # per node: params with defaults filled and dims evaluated
    cache: dict = attrs.field(factory=dict, eq=False, repr=False)   # derived values of the whole typed graph
    # derived values of one node that depend only on the node and its input and output types (its cost): a
    # rewrite's re-inference hands them on for every node it leaves as it was (NOTE [Incremental inference])
    node_cache: "NodeCache" = attrs.field(factory=lambda: NodeCache(), eq=False, repr=False)

    def outputs_of(self, nid: str) -> dict[str, TensorType]:
        return dict(self._outputs_index().get(nid, {}))

    def _outputs_index(self) -> dict[str, dict[str, TensorType]]:
        index = self.cache.get("_outputs_of")
        if index is None:
            index = {}
            for r, t in self.types.items():
                index.setdefault(r.node, {})[r.output] = t
            self.cache["_outputs_of"] = index
        return index

    def _handles(self) -> frozenset[Ref]:
        """The outputs typed 'handle' (a forward's taps): their readers are always inferred again."""
        if "_handles" not in self.cache:
            self.cache["_handles"] = frozenset(r for r, t in self.types.items() if t.dtype == "handle")
        return self.cache["_handles"]

    def inputs_of(self, nid: str) -> dict[str, TensorType]:
        return {p: self.types[r] for p, r in self.graph[nid].inputs}


# -- building ------------------------------------------------------------------------------------------------

# NOTE [Layer bound]: a body forward's layers are folded (ops/costs.py, NOTE [Layer folding]; analysis/allocator.py,
# NOTE [Folded replay]): check replays a stretch of identical layers in time that does not grow with its length.
# What still grows with the layer count is per layer and cheap: loading the weights (one block per layer, as the
# allocator sees them) and the arch's per-layer tables. benchmarks/check_scaling.py, graphs/qwen27b.toml widened,
# CPU s in compile_graph on the shared 2-core machine: 0.61 at 64 layers, 0.82 at 10,000, 1.16 at 16,384; the
# whole `dflash-graph check` process (imports included) 1.73 CPU s at 64 layers and 1.87 at 10,000 under load. So a
# model may have up to MAX_LAYERS layers (80 times the deepest released model, Llama 3.1 405B's 126), and a larger
# count is refused with this bound named (10**12 layers never finished).
# A hooked layer is not folded (its output is a tap that lives on), and it splits the stretch it is in: a forward
# with h hooked layers writes at most about (h + 1) * 4 * p layers out, p the period of its layer types
# (Qwen3.5: 4). MAX_LAYER_REPLAYS bounds the sum of those over the nodes that run decoder layers, per device
# they run on: the 27B graph writes out at most 97 layers per target GPU, 679 in all; a fuzzed graph with 400
# copies of its forward took minutes before folding.
MAX_LAYERS = 10000
MAX_NODES = 5000
MAX_LAYER_REPLAYS = 4096


def _hooked(spec: GraphSpec) -> dict[str, int]:
    """For each node, how many layers hook nodes capture from it (through its outputs)."""
    out: dict[str, int] = {}
    for ns in spec.nodes:
        op = registry.get(ns.op)
        if op is None or not any(p.kind == "layer_ids" for p in op.params):
            continue
        try:
            n = len(op.layer_ids(ns.params))
        except (TypeError, ValueError, OverflowError):
            continue
        refs = ns.inputs.values() if isinstance(ns.inputs, Mapping) else ns.inputs
        for r in refs:
            if isinstance(r, str):
                node = r.partition(".")[0]
                out[node] = out.get(node, 0) + n
    return out


def written_layers(dims: Any, hooked: int) -> int:
    """At most how many of a forward's layers the memory model writes out (NOTE [Layer bound])."""
    from ..ops.costs import MAX_PERIOD, _layer_period

    n = getattr(dims, "num_hidden_layers", 0)
    n = n if isinstance(n, int) else 0
    types = getattr(dims, "layer_types", None)
    p = _layer_period(tuple(types)) if types is not None else None
    if p is None:
        return n
    return min(n, (hooked + 1) * 4 * min(p, MAX_PERIOD) + 1)


def build(spec: GraphSpec) -> tuple[Graph, GraphContext]:
    problems: list[Problem] = []
    env = DimEnv(spec.dims, {name: m.config for name, m in spec.models.items()})
    for name in spec.dims:
        try:
            env.value(name)
        except DimError as e:
            problems.append(Problem(str(e), spec.loc("dims", name),
                                    hint="dims must be positive integers or expressions of other dims and model.config_key"))
    models: dict[str, ModelInfo] = {}
    spec, found = resolve_archs(spec)   # NOTE [Arch from model_type]
    problems += found
    for name, m in spec.models.items():
        if m.arch is None:
            continue
        problems += _unread_model_keys(spec, m)
        known = ARCHS[m.arch].config_keys
        for k in m.config:   # an inline config is checked key by key; a config.json only for keys --set added
            if m.config_file is None or (spec.lines.flag_of(("models", name, "config", k)) and k not in known):
                if k not in known and not foreign_keys(ARCHS[m.arch], {k: None}):   # those: resolve_archs
                    problems.append(Problem(f"unknown config key '{k}' for arch '{m.arch}'"
                                            f"{did_you_mean(k, sorted(known))}", spec.loc("models", name, "config", k),
                                            hint="valid keys: " + ", ".join(sorted(known))))
        cfg = {}
        for k, v in m.config.items():
            if isinstance(v, str) and _is_dim_expr(v, env, spec):
                try:
                    v = env.eval_text(v)[1]
                except DimError as e:
                    problems.append(Problem(str(e), spec.loc("models", name, "config", k)))
            cfg[k] = v
        big = next((k for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_DIM), None)
        if big is not None:
            problems.append(Problem(f"config key '{big}' = {short(cfg[big])} is over the bound of 2**48 for a size",
                                    spec.loc("models", name, "config", big)))
            continue
        layers = cfg.get("num_hidden_layers")   # before the arch builds per-layer tables of that length
        if isinstance(layers, int) and layers > MAX_LAYERS:
            problems.append(Problem(f"model '{name}' has {layers:,} layers, over the bound of {MAX_LAYERS:,} that check "
                                    "answers in about a second", spec.loc("models", name, "config", "num_hidden_layers"),
                                    hint="the largest released models have about 130 layers; is this a typo?"))
            continue
        try:
            dims = ARCHS[m.arch].dims(cfg)
        except (ValueError, TypeError, KeyError, ArithmeticError) as e:
            if isinstance(e, NeedsTrace):   # the command to derive a program names the config's file (not one
                # whose key --set changed: the file does not hold that value)
                e.config = None if spec.lines.flag_of(("models", name, "config", e.key)) else m.config_file
                problems.append(Problem(f"invalid {m.arch} config for model '{name}': {e}",
                                        spec.loc("models", name, "config"),
                                        expected=f"{e.key} = {json.dumps(e.want)}, or a program derived for "
                                                 f"{e.key} = {json.dumps(e.value, default=str)}",
                                        actual=f"{e.key} = {json.dumps(e.value, default=str)}, and no program "
                                               "derived for it in the user program directory",
                                        hint="trace-model traces transformers' own model under fake tensors and "
                                             "writes the program where check reads it (docs/memory-programs.md, "
                                             "\"Programs for one config: trace-model\")"))
                continue
            problems.append(Problem(f"invalid {m.arch} config for model '{name}': {short(str(e), 300)[1:-1]}",
                                    spec.loc("models", name, "config"),
                                    hint=f"see docs/toml-reference.md for arch '{m.arch}'"))
            continue
        if hasattr(dims, "with_forward"):   # how transformers runs this model's forward (models.<name>.packing, ...)
            try:
                dims = dims.with_forward(*(m.forward.get(k) for k in ("attn_implementation", "packing", "linear_kernels")))
            except ValueError as e:
                if isinstance(e, NeedsTrace):
                    e.config = None if spec.lines.flag_of(("models", name, "config", e.key)) else m.config_file
                key = "packing" if "packing" in m.forward else "attn_implementation"
                problems.append(Problem(f"model '{name}': {e}", spec.loc("models", name, key),
                                        hint="see docs/memory-qwen3_5.md, \"The declared forward\""))
                continue
        elif m.forward:
            key = next(iter(m.forward))
            problems.append(Problem(f"model '{name}' (arch '{m.arch}') does not take '{key}'",
                                    spec.loc("models", name, key), hint="only a qwen3_5 target declares its forward"))
            continue
        models[name] = ModelInfo(m, cfg, dims)
    problems += _check_model_links(spec, models)
    if any(m.weights is not None and not ARCHS[m.arch].target for m in spec.models.values() if m.arch):
        from .drafter_weights import checkpoint_problems     # only a drafter with `weights` reads a checkpoint

        problems += checkpoint_problems(spec, models)   # a drafter's published checkpoint against its config
    replays = 0
    hooked = _hooked(spec)
    for ns in spec.nodes:
        op = registry.get(ns.op)
        if op is not None and "layers" in op.components and ns.model in models:
            replays += written_layers(models[ns.model].dims, hooked.get(ns.id, 0)) * len(spec.placement(ns.device))
    if replays > MAX_LAYER_REPLAYS:
        problems.append(Problem(f"the graph's nodes write out {replays:,} decoder layers per step (hooked layers and "
                                f"those around them are not folded), over the bound of {MAX_LAYER_REPLAYS:,} that "
                                "check replays in seconds", spec.loc("nodes"),
                                hint="a training graph runs each model's layers a few times per step and hooks a few "
                                     "of them; is it generated?"))
    if len(spec.nodes) > MAX_NODES:
        problems.append(Problem(f"the graph has {len(spec.nodes):,} nodes, over the bound of {MAX_NODES:,}",
                                spec.loc("nodes"), hint="a training graph has tens of nodes; is it generated?"))
    if problems:
        raise GraphError(problems)
    ctx = GraphContext(spec, env, models)
    nodes = []
    for ns in spec.nodes:
        op = registry.get(ns.op)
        node_loc = spec.node_loc(ns, "op")
        if op is None:
            problems.append(Problem(f"unknown op '{ns.op}'{did_you_mean(ns.op, list(registry.all_ops()))}", node_loc,
                                    node=ns.id, hint="valid ops: " + ", ".join(sorted(registry.all_ops()))))
            continue
        if isinstance(ns.inputs, tuple):
            if op.variadic_input:
                ports = [f"{op.variadic_input}{i}" for i in range(len(ns.inputs))]
            else:
                ports = [p.name for p in op.input_ports(ns.params)]
                if len(ns.inputs) > len(ports):
                    problems.append(Problem(f"op '{op.name}' takes {len(ports)} inputs ({', '.join(ports) or 'none'}), "
                                            f"got {len(ns.inputs)}", spec.node_loc(ns, "inputs"), node=ns.id))
                    continue
            inputs = tuple((p, Ref.parse(r)) for p, r in zip(ports, ns.inputs))
        else:
            inputs = tuple((p, Ref.parse(r)) for p, r in ns.inputs.items())
        nodes.append(Node(ns.id, ns.op, inputs, dict(ns.params), ns.device, ns.model, spec_index=ns.index))
    if problems:
        raise GraphError(problems)
    ids = {n.id for n in nodes}
    for n in nodes:
        for port, r in n.inputs:
            if r.node not in ids:
                problems.append(Problem(f"input '{port}' reads '{r}', but there is no node '{r.node}'"
                                        f"{did_you_mean(r.node, sorted(ids))}", ctx.loc(n, "inputs", port), node=n.id,
                                        hint="inputs are written as \"node_id.output\""))
    if problems:
        raise GraphError(problems)
    try:
        graph = Graph(nodes)
    except CycleError as e:
        by_id = {n.id: n for n in nodes}
        where = ", ".join(f"'{c}' (line {ctx.loc(by_id[c]).line})" for c in e.cycle[:-1])
        raise GraphError(Problem(f"the graph has a cycle: {' -> '.join(e.cycle)}", ctx.loc(by_id[e.cycle[0]], "inputs"),
                                 node=e.cycle[0], hint=f"nodes on the cycle: {where}; a dataflow graph must be acyclic")) from None
    return graph, ctx


def _unread_model_keys(spec: GraphSpec, m: ModelSpec) -> list[Problem]:
    """A model key that `run` would not act on for this arch is refused, never ignored: `weights` where the arch
    loads none (`Arch.loads_weights`), `trainable = true` where the trainer cannot
    train the arch (check would count gradients and AdamW state that run never makes)."""
    arch = ARCHS[m.arch]
    problems = []
    if m.weights is not None and not arch.loads_weights:
        problems.append(Problem(f"model '{m.name}' (arch '{m.arch}') cannot load weights yet: `run` would ignore "
                                f"{short(m.weights)} and train from random initialisation",
                                spec.loc("models", m.name, "weights"),
                                hint="remove `weights` to train from scratch, or continue a run of this graph with "
                                     "`dflash-graph run GRAPH --resume RUN_DIR`"))
    if m.trainable and not arch.trains:
        trainable = [a for a, x in ARCHS.items() if x.trains]
        problems.append(Problem(f"model '{m.name}' (arch '{m.arch}') is declared trainable, but `run` trains only "
                                f"models of arch {', '.join(repr(a) for a in trainable)}: check would count gradients "
                                "and AdamW state that run never makes", spec.loc("models", m.name, "trainable"),
                                hint="set trainable = false (the target stays frozen; the drafter trains)"))
    return problems


def _check_model_links(spec: GraphSpec, models: Mapping[str, ModelInfo]) -> list[Problem]:
    """What one model says about another: `shares` name a component the other model's arch has, and a drafter's
    `target_layer_ids` are layers the model it reads from has (that model: the one it shares components with, or
    the only other model with layers)."""
    problems = []
    for name, info in models.items():
        for comp, target in info.spec.shares.items():
            other, part = target.split(".", 1)
            if other in models and part not in ARCHS[models[other].spec.arch].components:
                have = ARCHS[models[other].spec.arch].components
                problems.append(Problem(f"share '{comp}' = '{target}': model '{other}' (arch "
                                        f"'{models[other].spec.arch}') has no component '{part}'{did_you_mean(part, have)}",
                                        spec.loc("models", name, "shares", comp), hint="components: " + ", ".join(have)))
        ids = getattr(info.dims, "target_layer_ids", None)
        if not ids:
            continue
        sources = {t.split(".", 1)[0] for t in info.spec.shares.values()} & set(models)
        if not sources:
            sources = {o for o, i in models.items() if o != name and hasattr(i.dims, "num_hidden_layers")}
        if len(sources) != 1:
            continue
        src = sources.pop()
        n = getattr(models[src].dims, "num_hidden_layers", None)
        bad = [i for i in ids if isinstance(n, int) and not 0 <= i < n]
        if bad:
            problems.append(Problem(f"target_layer_ids {list(ids)} name layer(s) {bad} that model '{src}' does not have",
                                    spec.loc("models", name, "config", "target_layer_ids"),
                                    expected=f"layer ids in 0..{n - 1} (model '{src}' has {n} layers)",
                                    actual=str(list(ids)), hint="use the layers the hook nodes capture"))
    return problems


def _is_dim_expr(v: str, env: DimEnv, spec: GraphSpec) -> bool:
    from ..ir.dims import names_in, parse_expr

    try:
        names = names_in(parse_expr(v))
    except DimError:
        return False
    known = set(spec.dims) | {f"{m}.{k}" for m, ms in spec.models.items() for k in ms.config}
    return bool(names) and all(n in known for n in names)


# -- inference -----------------------------------------------------------------------------------------------

# NOTE [Incremental inference]: a node's types and params depend only on the node itself (op, inputs, params,
# device, model), the types of its inputs and the context, so after a rewrite (`prev` is the graph before it) a
# node that is its old self (the same object, or equal with equal params) and reads no output whose type changed
# keeps its old result without being inferred again: only the nodes a rule made or rewired, and downstream of
# them the nodes whose inputs now have other types, are inferred (`changed` holds the nodes whose outputs are
# not what they were). Skipping a node costs a set lookup per input, and the result's outputs_of index is built
# on the way. The exception: a node reading a handle (a forward's taps), whose legality depends on its sibling
# hook nodes, is always inferred again. A node cost (node_cache) is handed on with the node; a forward's cost,
# which its hook nodes decide, is keyed by them (analysis/memory._cached_cost). The result is the same as
# inferring the graph from scratch, in the same order (tests/test_rewrite_properties.py checks it on random
# graphs; `rewrite(verify=True)` checks it after every rewrite).

def _record(nid: str, p, outs, params, types, handles, index, reinferred: list) -> None:
    """A node just inferred: its params, its outputs' types (and which are handles), its row of the outputs_of
    index, and that it was inferred again (both inference paths)."""
    params[nid] = p
    reinferred.append(nid)
    for name, t in outs.items():
        r = Ref(nid, name)
        types[r] = t
        if t.dtype == "handle":
            handles[r] = None
    index[nid] = dict(outs)


def infer(graph: Graph, ctx: GraphContext, prev: Typed | None = None) -> Typed:
    if prev is not None and prev.ctx is ctx and graph._change is not None and graph.parent() is prev.graph:
        return _infer_changed(graph, ctx, prev)
    types: dict[Ref, TensorType] = {}
    params: dict[str, Mapping[str, Any]] = {}
    node_cache: dict[str, dict] = {}
    index: dict[str, dict[str, TensorType]] = {}      # the result's outputs_of, built on the way
    handles: dict[Ref, None] = {}                      # outputs typed 'handle' (a forward's taps)
    problems: list[Problem] = []
    failed: set[str] = set()
    reinferred: list[str] = []                         # nodes inferred again (analysis/memory: NOTE [Live curve])
    old = prev.graph if prev is not None and prev.ctx is ctx else None
    if old is not None:
        old_by_id = old._by_id
        prev_index = prev._outputs_index()
        prev_handles = prev._handles()
        # nodes whose outputs are not what they were: removed ones, and (below) those inferred again to other types
        changed: set[str] = {i for i in old_by_id if i not in graph._by_id}
    for node in graph.nodes:
        nid, inputs = node.id, node.inputs
        if failed and any(r.node in failed for _, r in inputs):
            failed.add(nid)
            continue
        was = old_by_id.get(nid) if old is not None else None
        if was is not None and (was is node or (was == node and dict(was.params) == dict(node.params))) \
                and nid in prev.params and not any(r.node in changed or r in prev_handles for _, r in inputs):
            outs = prev_index.get(nid, {})
            params[nid] = prev.params[nid]
            for name, t in outs.items():
                r = Ref(nid, name)
                types[r] = t
                if r in prev_handles:
                    handles[r] = None
            index[nid] = outs
            if nid in prev.node_cache:   # a forward's cost is keyed by its hooks (memory._cached_cost)
                node_cache[nid] = prev.node_cache[nid]
            continue
        try:
            p, outs = _infer_node(node, graph, ctx, types)
        except _NodeProblem as e:
            problems.append(e.problem)
            failed.add(nid)
            continue
        _record(nid, p, outs, params, types, handles, index, reinferred)
        if old is not None and (was is None or prev_index.get(nid) != outs):
            changed.add(nid)
    if problems:
        raise GraphError(problems)
    typed = Typed(graph, ctx, types, params, node_cache=NodeCache(immutables.Map(node_cache)))
    typed.cache["_outputs_of"] = index
    typed.cache["_handles"] = frozenset(handles)
    if old is not None:
        typed.cache["_reinferred"] = frozenset(reinferred)
    if prev is None:        # the graph as built; a rewrite keeps what each input holds
        problems = _check_layer_reads(typed) + _check_owned_components(typed)
        if problems:
            raise GraphError(problems)
    return typed


# NOTE [Layer provenance]: a drafter's `target_layer_ids` say which target layers its context holds, in order;
# they go into the export (the serving stack hooks those layers) and size its fc. The graph's hook nodes say
# which layers are captured, and concat nodes in which order. Both are declared, so they are checked against each
# other: each output's feature axis is traced to the layers it holds, through the ops' declared `Traits.captures`
# and `Traits.features` (never an op's name); an input declared `Traits.reads_layers` must hold exactly the layers
# its model's config lists. An input whose provenance cannot be traced (an op that declares none) is not checked.

def layer_sources(typed: Typed) -> dict[Ref, tuple[tuple[str, int], ...]]:
    """For each output whose feature axis is known to hold decoder-layer outputs: ((model, layer id), ...) in
    order along that axis."""
    out: dict[Ref, tuple[tuple[str, int], ...]] = {}
    for node in typed.graph.nodes:
        op = registry.get(node.op)
        tr = op.traits
        if tr.captures is not None:
            for port, layer in tr.captures(typed.params[node.id]).items():
                out[Ref(node.id, port)] = ((node.model, layer),)
            continue
        if tr.features is None or not node.inputs:
            continue
        if tr.features == "concat":
            parts = [out.get(r) for _, r in node.inputs]
            if all(p is not None for p in parts):
                src = tuple(x for p in parts for x in p)
            else:
                continue
        else:                                   # "kept": the first input's, if the op selects along another axis
            port, r = node.inputs[0]
            src = out.get(r)
            axis_param = (tr.selection.axis_param if tr.selection else tr.remap.axis_param if tr.remap else None)
            if src is None or (axis_param is not None and
                               typed.params[node.id].get(axis_param) in (-1, len(typed.types[r].shape) - 1)):
                continue
        for name in typed.outputs_of(node.id):
            out[Ref(node.id, name)] = src
    return out


def _check_owned_components(typed: Typed) -> list[Problem]:
    """A node whose op says a trainable model upstream must own a component (Traits.trains_own: a loss whose
    objective trains the drafter's own final norm) is refused where that model shares the component instead."""
    spec, models = typed.ctx.spec, typed.ctx.models
    problems = []
    nodes = {n.id: n for n in typed.graph.nodes}
    for node in typed.graph.nodes:
        own = registry.get(node.op).traits.trains_own
        need = own(typed.params[node.id]) if own else {}
        if not need:
            continue
        seen, stack, trained = set(), [node.id], set()
        while stack:        # the trainable models upstream of the node
            n = nodes[stack.pop()]
            if n.id in seen:
                continue
            seen.add(n.id)
            if n.model in models and models[n.model].spec.trainable:
                trained.add(n.model)
            stack += [r.node for _, r in n.inputs if r.node in nodes]
        for name in sorted(trained):
            for comp, why in need.items():
                if comp in models[name].spec.shares:
                    problems.append(Problem(
                        f"node '{node.id}' declares {why}, but model '{name}' shares {comp} = "
                        f"'{models[name].spec.shares[comp]}' (frozen)", spec.loc("models", name, "shares", comp),
                        node=node.id, expected=f"model '{name}' with its own {comp} (no '{comp}' in shares)",
                        actual=f"shares {comp} = '{models[name].spec.shares[comp]}'",
                        hint=f"remove {comp} from models.{name}.shares (its own {comp} starts at weight 1 and "
                             f"trains: graphs/tiny_specforge.toml), or set objective = \"own\" on node "
                             f"'{node.id}' and choose each param"))
    return problems


def _check_layer_reads(typed: Typed) -> list[Problem]:
    readers = [(n, registry.get(n.op).traits.reads_layers) for n in typed.graph.nodes]
    readers = [(n, rl) for n, rl in readers if rl is not None and n.model in typed.ctx.models]
    if not readers:
        return []
    sources = layer_sources(typed)
    spec = typed.ctx.spec
    problems = []
    for node, rl in readers:
        ref = dict(node.inputs).get(rl.port)
        src = sources.get(ref) if ref is not None else None
        declared = getattr(typed.ctx.models[node.model].dims, rl.config_key, None)
        if src is None or declared is None:
            continue
        hooked = [layer for _, layer in src]
        if tuple(hooked) == tuple(declared):
            continue
        models = sorted({m for m, _ in src if m})
        problems.append(Problem(
            f"model '{node.model}' declares {rl.config_key} = {list(declared)}, but node '{node.id}' reads on "
            f"'{rl.port}' the outputs of layers {hooked} of model {', '.join(repr(m) for m in models) or '?'} (through "
            f"{ref}): the drafter would be exported for layers it was not trained on",
            spec.loc("models", node.model, "config", rl.config_key), node=node.id,
            expected=f"{rl.config_key} = {hooked} (the hooked layers, in the order they are concatenated)",
            actual=f"{rl.config_key} = {list(declared)}",
            hint=f"set {rl.config_key} = {hooked}, or hook and concatenate the layers {list(declared)}"))
    return problems


# NOTE [Inference of a change]: when `graph` is `prev.graph` patched by Graph.replace (NOTE [Incremental
# replace]), what it changed is known (`graph._change`), so incremental inference starts from prev's tables
# and visits, in order (a heap of order keys), only: the nodes the rewrite made or rewired; the readers of a
# handle whose readers it changed or reordered (their legality depends on the sibling hooks); and, downstream,
# the readers of every node whose outputs came out other than they were (or that failed: its readers fail with
# it). A node it does not visit reads what it read, with the same types, and is its old self: NOTE [Incremental
# inference]'s pass keeps its result too. The tables (types, params, the outputs_of index, the handles, the
# node cache) are persistent maps (immutables.Map, a HAMT: NOTE [Persistent tables] in ir/graph.py): the new
# ones share prev's and cost what the rewrite changed times log N, not a copy of every table per candidate. A
# persistent map has no order, so types and params are _InOrder tables, which iterate in the graph's order
# (as inferring from scratch builds them; tests/test_rewrite_properties.py, property g, compares them in order).

class _InOrder(Mapping):
    """A persistent map that iterates in the order of a graph's nodes (NOTE [Inference of a change]); lookups
    are immutables.Map's."""
    __slots__ = ("_map", "_order", "_keys")

    def __init__(self, m: immutables.Map, order: Callable[[], list]):
        self._map, self._order, self._keys = m, order, None

    def _in_order(self) -> list:
        if self._keys is None:
            self._keys = self._order()
        return self._keys

    def __getitem__(self, k):
        return self._map[k]

    def get(self, k, default=None):
        return self._map.get(k, default)

    def __contains__(self, k) -> bool:
        return k in self._map

    def __len__(self) -> int:
        return len(self._map)

    def keys(self):
        return list(self._in_order())

    def __iter__(self):
        return iter(self._in_order())

    def items(self):
        get = self._map.__getitem__
        return [(k, get(k)) for k in self._in_order()]

    def values(self):
        get = self._map.__getitem__
        return [get(k) for k in self._in_order()]

    def __reduce__(self):
        return dict, (dict(self.items()),)


def _persistent(typed: Typed, name: str, table: Any) -> immutables.Map:
    """A table of `typed` as a persistent map: its own when it was patched, else made once (a graph inferred
    from scratch has plain dicts: every candidate rewrite of it starts from the same map)."""
    if type(table) is _InOrder:
        return table._map
    if isinstance(table, immutables.Map):
        return table
    key = f"_map_{name}"
    hit = typed.cache.get(key)
    if hit is None:
        hit = typed.cache[key] = immutables.Map(table.items()) if isinstance(table, Mapping) else \
            immutables.Map((k, None) for k in table)
    return hit


def _infer_changed(graph: Graph, ctx: GraphContext, prev: Typed) -> Typed:
    import heapq

    change = graph._change
    types = _persistent(prev, "types", prev.types).mutate()
    params = _persistent(prev, "params", prev.params).mutate()
    prev_index = prev._outputs_index()
    index = _persistent(prev, "index", prev_index).mutate()
    node_cache = prev.node_cache.map.mutate()
    prev_handles = prev._handles()
    handles = _persistent(prev, "handles", prev_handles).mutate()
    by_id, key, consumers = graph._by_id, graph._key, graph._consumers
    old_by_id = prev.graph._by_id

    def drop(nid: str) -> None:
        for k in index.pop(nid, ()):
            r = Ref(nid, k)
            del types[r]
            handles.pop(r, None)
        params.pop(nid, None)
        node_cache.pop(nid, None)

    for n in change.gone:
        drop(n.id)
    todo = {n.id for n in change.made}
    for nid in (*(n.id for n in change.gone), *(n.id for n in change.made), *change.moved):
        n = by_id.get(nid) or old_by_id[nid]
        for _, r in n.inputs:
            if r in prev_handles or r in handles:
                todo.update(c for c, _ in consumers.get(r, ()))
    for n in change.gone:
        if n.id not in by_id:          # what read a removed node (unless rewired) is inferred again: it fails
            for k in prev_index.get(n.id, ()):
                todo.update(c for c, _ in consumers.get(Ref(n.id, k), ()))
    todo = {i for i in todo if i in by_id}
    heap = [(key[nid], nid) for nid in todo]
    heapq.heapify(heap)
    problems: list[Problem] = []
    failed: set[str] = set()
    reinferred: list[str] = []

    def readers_of(nid: str, outs) -> None:
        for k in outs:
            for c, _ in consumers.get(Ref(nid, k), ()):
                if c not in todo:
                    todo.add(c)
                    heapq.heappush(heap, (key[c], c))

    while heap:
        _, nid = heapq.heappop(heap)
        node = by_id[nid]
        if failed and any(r.node in failed for _, r in node.inputs):
            failed.add(nid)
            readers_of(nid, prev_index.get(nid, ()))
            continue
        try:
            p, outs = _infer_node(node, graph, ctx, types)
        except _NodeProblem as e:
            problems.append(e.problem)
            failed.add(nid)
            readers_of(nid, prev_index.get(nid, ()))
            continue
        drop(nid)
        _record(nid, p, outs, params, types, handles, index, reinferred)
        if nid not in old_by_id or prev_index.get(nid) != outs:
            readers_of(nid, set(outs) | set(prev_index.get(nid, ())))
    if problems:
        raise GraphError(problems)
    nodes = graph.nodes
    index, params = index.finish(), params.finish()
    typed = Typed(graph, ctx,
                  _InOrder(types.finish(), lambda: [Ref(n.id, k) for n in nodes for k in index.get(n.id, ())]),
                  _InOrder(params, lambda: [n.id for n in nodes if n.id in params]),
                  node_cache=NodeCache(node_cache.finish()))
    typed.cache["_outputs_of"] = index
    typed.cache["_handles"] = handles.finish()
    typed.cache["_reinferred"] = frozenset(reinferred)
    return typed


class _NodeProblem(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem


def _infer_node(node: Node, graph: Graph, ctx: GraphContext, types: Mapping[Ref, TensorType]):
    spec = ctx.spec
    op = registry.get(node.op)

    def fail(msg: str, *sub: str | int, **kw) -> _NodeProblem:
        return _NodeProblem(Problem(msg, ctx.loc(node, *sub), node=node.id, **kw))

    if op is None:
        raise fail(f"unknown op '{node.op}'", "op")
    # device
    if node.device not in spec.devices and node.device not in spec.groups:
        choices = [*spec.devices, *spec.groups]
        raise fail(f"unknown device '{node.device}'{did_you_mean(node.device, choices)}", "device",
                   hint="devices and groups: " + ", ".join(choices))
    # model
    model = None
    if op.model_arch:
        if node.model is None:
            raise fail(f"op '{op.name}' needs a model", "model", hint="models: " + ", ".join(ctx.models))
        model = ctx.models.get(node.model)
        if model is None:
            raise fail(f"unknown model '{node.model}'{did_you_mean(node.model, list(ctx.models))}", "model",
                       hint="models: " + (", ".join(ctx.models) or "(none: add [models.<name>])"))
        if model.spec.arch not in op.model_arch:
            raise fail(f"op '{op.name}' needs a model of arch {' or '.join(op.model_arch)}, but '{node.model}' is "
                       f"'{model.spec.arch}'", "model")
    elif node.model is not None:
        raise fail(f"op '{op.name}' does not use a model, but model = '{node.model}' is set", "model")
    # params
    p = _check_params(node, op, ctx, fail)
    p["_n_inputs"] = len(node.inputs)
    # inputs
    ports = op.input_ports(p, len(node.inputs))
    names = [x.name for x in ports]
    given = dict(node.inputs)
    for port in given:
        if port not in names:
            raise fail(f"op '{op.name}' has no input '{port}'{did_you_mean(port, names)}", "inputs", port,
                       hint="inputs: " + (", ".join(names) or "(none)"))
    for port in names:
        if port not in given:
            raise fail(f"missing input '{port}' for op '{op.name}'", "inputs",
                       hint="inputs: " + ", ".join(f"{x.name} [{x.dims}]" for x in ports))
    in_types: dict[str, TensorType] = {}
    for port in ports:
        r = given[port.name]
        if Ref(r.node, r.output) not in types:
            outs = sorted(o.output for o in types if o.node == r.node)
            raise fail(f"input '{port.name}' reads '{r}', but node '{r.node}' has no output '{r.output}'"
                       f"{did_you_mean(r.output, outs)}", "inputs", port.name, hint="its outputs: " + ", ".join(outs))
        in_types[port.name] = types[r]
    # devices joined
    out_device = node.device
    for port, t in in_types.items():
        if op.device_rule == "node" and t.device != node.device:
            producer = given[port].node
            raise fail(f"input '{port}' comes from '{producer}' on device '{t.device}', but this node runs on "
                       f"'{node.device}': two devices joined without a transfer", "inputs", port,
                       expected=f"device {node.device}", actual=f"device {t.device} ({given[port]})",
                       hint=f"add a transfer node: {{ id = \"{producer}_to_{node.device}\", op = \"transfer\", "
                            f"inputs = {{ x = \"{given[port]}\" }}, device = \"{node.device}\" }}")
    # a handle (a forward's taps) is read by a node of the same model, and a layer is hooked by one node only
    for port in ports:
        if port.dtype == "handle":
            producer = graph[given[port.name].node]
            if producer.model != node.model:
                raise fail(f"input '{port.name}' reads the taps of '{producer.id}' (model '{producer.model}'), but "
                           f"this node names model '{node.model}'", "model", expected=f"model {producer.model}",
                           actual=f"model {node.model}", hint=f"set model = \"{producer.model}\"")
            for other, _ in graph.consumers(given[port.name]):
                if other != node.id and other in graph:
                    theirs = registry.get(graph[other].op).layer_ids(graph[other].params)
                    both = set(op.layer_ids(p)) & set(theirs)
                    if both and graph.before(other, node.id):
                        raise fail(f"layer(s) {sorted(both)} of '{producer.id}' are already hooked by '{other}'",
                                   "params", hint="hook each layer once and read it from there")
    # dtypes
    mdtype = model.spec.dtype if model else None
    for port in ports:
        t = in_types[port.name]
        want = _dtype(port.dtype, mdtype, in_types)
        ok = (t.dtype in ("float32", "bfloat16", "float16", "float64")) if want == "float" else (want is None or t.dtype == want)
        if not ok:
            raise fail(f"input '{port.name}' has dtype {t.dtype}, but op '{op.name}' expects {want}", "inputs", port.name,
                       expected=f"{want} [{port.dims}]", actual=f"{t.dtype} {t.sym_str()} from {given[port.name]}",
                       hint="check the producer's model dtype, or convert upstream")
    # shapes
    bctx = _bind_ctx(p, model, ctx)
    binds: dict[str, Any] = {}
    try:
        if op.bind:
            for k, (sym, val) in op.bind(bctx).items():
                binds[k] = dim_of(sym, val)
    except (DimError, KeyError, ValueError) as e:
        raise fail(f"cannot bind the dims of op '{op.name}': {e}", "params")
    out_shapes: dict[str, tuple[Dim, ...]] = {}
    for port in ports:
        t = in_types[port.name]
        try:
            match(port.dims, t.shape, binds)
        except ContractError as e:
            producer = given[port.name]
            raise fail(f"shape mismatch on input '{port.name}' (from '{producer}'): {e}", "inputs", port.name,
                       expected=f"[{port.dims}]" + (f" ({e.expected})" if e.expected else ""),
                       actual=f"{t.sym_str()} = {t.concrete_str()}",
                       context=ctx.env.bindings_text() + "  bound: " + _binds_text(binds),
                       hint=f"'{producer.node}' produces {t.sym_str()}; make the dims agree or insert the op that "
                            "converts between them") from None
    for need in op.requires:
        small, large = binds.get(need.small), binds.get(need.large)
        if small is not None and large is not None and small.value > large.value:
            def named(k: str, d) -> str:
                return f"{k} = {d.value:,}" if d.sym == k else f"{k} ({d.sym} = {d.value:,})"

            raise fail(f"{named(need.small, small)} is larger than {named(need.large, large)}: {need.why}", "params",
                       expected=f"{need.small} <= {need.large}", actual=f"{small.value:,} > {large.value:,}",
                       context=ctx.env.bindings_text(),
                       hint=f"lower {_dim_ref(small, ctx)} or raise {_dim_ref(large, ctx)} (in the graph file or "
                            "with --set)")
    out_ports = op.output_ports(p)
    try:
        if op.shape_fn:
            out_shapes = dict(op.shape_fn(bctx, in_types))
        for port in out_ports:
            if port.name not in out_shapes:
                out_shapes[port.name] = build_dims(port.dims, binds)
    except ContractError as e:
        raise fail(f"cannot infer the output shape of op '{op.name}': {e}", "params",
                   expected=e.expected, actual=e.actual) from None
    if op.device_rule == "any_input":
        out_device = node.device
    outs = {}
    for port in out_ports:
        dt = _dtype(port.dtype, mdtype, in_types) or "float32"
        outs[port.name] = TensorType(out_shapes[port.name], dt, out_device)
    return p, outs


def _dtype(rule: str, model_dtype: str | None, in_types: Mapping[str, TensorType]) -> str | None:
    if rule == "model":
        return model_dtype
    if rule.startswith("like:"):
        t = in_types.get(rule[5:])
        return t.dtype if t else None
    return rule


def _dim_ref(d: Dim, ctx: GraphContext) -> str:
    """'dims.seq' for a dim of the graph's [dims], else its expression."""
    return f"dims.{d.sym}" if d.sym in ctx.spec.dims else d.sym


def _binds_text(binds: Mapping[str, Any]) -> str:
    out = []
    for k, v in binds.items():
        if isinstance(v, tuple):
            out.append(f"*{k}=(" + ",".join(str(d.value) for d in v) + ")")
        else:
            out.append(f"{k}={v.value}")
    return " ".join(out)


def _bind_ctx(p: Mapping[str, Any], model: ModelInfo | None, ctx: GraphContext) -> BindContext:
    def model_ref(key: str):
        if model is None:
            raise KeyError(f"no model to read '{key}' from")
        if key in model.config:
            return ctx.env.ref(model.spec.name, key) if not isinstance(model.config[key], str) else ctx.env.eval_text(model.config[key])
        v = getattr(model.dims, key)
        alias = ctx.env.alias_of_ref.get(f"{model.spec.name}.{key}")
        return ctx.env.get(alias) if alias else (IntPoly.of(v), v)

    return BindContext(params=p,
                       model_config=model.config if model else None, model_dims=model.dims if model else None,
                       dim=ctx.env.eval_text, model_ref=model_ref)


_KIND_OK = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
    "dim": lambda v: isinstance(v, (int, str)) and not isinstance(v, bool),
    "list[int]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in v),
}
_KIND_OK["layer_ids"] = _KIND_OK["list[int]"]


def _param_within(x: float, prm) -> bool:
    """A number param is finite, at most 2**48 in magnitude, and within its declared bounds."""
    import math

    if not math.isfinite(x) or abs(x) > MAX_DIM:
        return False
    if prm.low is not None and (x < prm.low or (prm.open_low and x == prm.low)):
        return False
    return prm.high is None or x <= prm.high


def _check_params(node: Node, op: OpDef, ctx: GraphContext, fail) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = [x.name for x in op.params]
    for k in node.params:
        if k.startswith("_"):
            continue
        if op.param(k) is None:
            raise fail(f"op '{op.name}' has no param '{k}'{did_you_mean(k, names)}", "params", k,
                       hint="params: " + (", ".join(names) or "(none)"))
    dim_params = []
    for prm in op.params:
        if prm.name in node.params:
            v = node.params[prm.name]
        elif prm.required:
            raise fail(f"op '{op.name}' needs param '{prm.name}'", "params", hint=f"{prm.name}: {prm.doc}")
        else:
            v = prm.default
        if not _KIND_OK[prm.kind](v):
            raise fail(f"param '{prm.name}' must be {prm.kind}, got {short(v)}", "params", prm.name, hint=prm.doc)
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, (int, float)) and not isinstance(x, bool) and not _param_within(x, prm):
                lo = "" if prm.low is None else f"{prm.low:g} {'<' if prm.open_low else '<='} "
                hi = "" if prm.high is None else f" <= {prm.high:g}"
                raise fail(f"param '{prm.name}' = {short(x)} is out of range: {lo}{prm.name}{hi}", "params", prm.name,
                           hint=prm.doc)
        if prm.choices and v not in prm.choices:
            raise fail(f"param '{prm.name}' = {v!r} is not one of {', '.join(prm.choices)}", "params", prm.name)
        if prm.kind == "dim":
            try:
                sym, val = ctx.env.eval_text(v)
            except DimError as e:
                raise fail(f"param '{prm.name}': {e}", "params", prm.name) from None
            if val <= 0:
                raise fail(f"param '{prm.name}' = {v!r} evaluates to {val}, which is not a positive size", "params", prm.name)
            v = (sym, val)
            dim_params.append(prm.name)
        out[prm.name] = v
    for prm in op.params:
        if prm.kind != "layer_ids" or node.model not in ctx.models:
            continue
        ids, n_layers = list(out[prm.name]), getattr(ctx.models[node.model].dims, "num_hidden_layers", None)
        for i in ids:
            if n_layers is not None and not 0 <= i < n_layers:
                raise fail(f"layer {i} does not exist: model '{node.model}' has layers 0..{n_layers - 1}",
                           "params", prm.name)
        if len(set(ids)) != len(ids):
            raise fail(f"{prm.name} {ids} lists a layer twice", "params", prm.name)
    if op.validate is not None:
        try:
            op.validate(out)
        except ValueError as e:
            raise fail(f"the params of node '{node.id}' contradict each other: {e}", "params") from None
    out["_dim_params"] = tuple(dim_params)
    return out
