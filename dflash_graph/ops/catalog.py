"""The built-in node kinds. Each op is declared once: contract, params, traits, cost, implementation.

This module declares them (`BUILTIN`, in declaration order); ops/registry.py registers them. It does not import the
registry: a declaration is data, and the registry is the one place that collects it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..ir.graph import Node, Ref
from ..models.registry import TARGET_ARCHS
from . import costs
from .objective import OBJECTIVE_DEFAULTS, OBJECTIVE_PRESETS, resolve_objective, trains_own
from .contract import (AtMost, BindContext, FusesHeads, IndexRemap, LinearHead, OpDef, Param, Port, PortsExample,
                       ReadsLayers, Selection, Traits)

IMPL = "dflash_graph.ops.torch_impl"

BUILTIN: list[OpDef] = []


def declare(op: OpDef) -> OpDef:
    BUILTIN.append(op)
    return op


def _hook_outputs(params: Mapping[str, Any]) -> tuple[Port, ...]:
    return tuple(Port(f"layer{i}", "seq hidden", optional=True, doc=f"output of decoder layer {i} (hooked)")
                 for i in params.get("layers", ()))


def _lm_bind(ctx: BindContext):
    return {"hidden": ctx.model_ref("hidden_size"), "vocab": ctx.model_ref("vocab_size")}


def _drop_layers(params: Mapping[str, Any], dropped: frozenset[str]) -> Mapping[str, Any]:
    return {**params, "layers": [i for i in params.get("layers", ()) if f"layer{i}" not in dropped]}


def _decompose_causal_lm(node: Node, fresh) -> tuple[list[Node], dict[str, Ref]]:
    """causal_lm_forward = body_forward -> norm -> lm_head (what every *ForCausalLM.forward does)."""
    body = node.evolve(op="body_forward", note="decompose_forward: body of " + node.id)
    norm_id, head_id = fresh(f"{node.id}_norm"), fresh(f"{node.id}_lm_head")
    norm = Node(norm_id, "norm", (("x", Ref(node.id, "hidden")),), {}, node.device, node.model,
                note=f"decompose_forward: final norm of {node.id}")
    head = Node(head_id, "lm_head", (("x", Ref(norm_id, "out")),), {}, node.device, node.model,
                note=f"decompose_forward: lm_head of {node.id}")
    return [body, norm, head], {"logits": Ref(head_id, "logits")}


_FORWARD_INPUTS = (Port("input_ids", "seq", "int64"), Port("position_ids", "seq", "int64",
                        doc="restart at 0 at each packed document"))
_TAPS = Port("taps", "seq", "handle", optional=True,
             doc="where hook_capture nodes attach: the layers they ask for are hooked during this forward")


declare(OpDef(
    name="token_input",
    doc="A packed sequence of `length` tokens from the data loader (one per replica on a group).",
    inputs=(),
    outputs=(Port("input_ids", "seq", "int64", optional=True), Port("position_ids", "seq", "int64", optional=True),
             Port("loss_mask", "seq", "bool", optional=True,
                  doc="tokens the drafter learns to predict (assistant tokens of chat data)")),
    params=(Param("length", "dim", "Tokens per packed sequence.", default="seq"),),
    bind=lambda c: {"seq": c.params["length"]},
    traits=Traits(pure=False),
    cost=costs.no_workspace,
    impl=f"{IMPL}:token_input",
))

declare(OpDef(
    name="causal_lm_forward",
    doc="What the target's `*ForCausalLM.forward()` does (Qwen3_5ForCausalLM, Qwen3ForCausalLM, ...): the body, then the final norm and lm_head over every position, "
        "so it produces [seq, vocab] logits whether or not anyone reads them.",
    inputs=_FORWARD_INPUTS,
    outputs=(Port("hidden", "seq hidden", optional=True, doc="last decoder layer output, before the final norm"),
             Port("logits", "seq vocab", optional=True), _TAPS),
    model_arch=TARGET_ARCHS,
    components=("embed", "layers", "norm", "lm_head"),
    bind=_lm_bind,
    traits=Traits(decompose=_decompose_causal_lm, modules=("body",)),
    cost=costs.causal_lm_forward,
    impl=f"{IMPL}:causal_lm_forward",
))

declare(OpDef(
    name="body_forward",
    doc="The transformer body only (`model.model(...)`): embedding and decoder layers, no lm_head.",
    inputs=_FORWARD_INPUTS,
    outputs=(Port("hidden", "seq hidden", optional=True, doc="last decoder layer output, before the final norm"),
             _TAPS),
    model_arch=TARGET_ARCHS,
    components=("embed", "layers", "norm"),   # the body model applies its final norm: its weight is resident
    bind=_lm_bind,
    traits=Traits(modules=("body",)),
    cost=costs.body_forward,
    impl=f"{IMPL}:body_forward",
))


declare(OpDef(
    name="hook_capture",
    doc="Capture the outputs of chosen decoder layers of a forward with forward hooks (layer i = output of "
        "decoder layer i = HF hidden_states[i+1]). Reads the forward's `taps`; the hooks are registered before "
        "that forward runs and its layer outputs are allocated while it runs, each at its layer.",
    inputs=(Port("taps", "seq", "handle"),),
    outputs=_hook_outputs,
    params=(Param("layers", "layer_ids", "Decoder layers to capture.", required=True),),
    example=PortsExample((("layers", (1, 3)),), "one `layer<i>` per layer in `layers`"),
    model_arch=TARGET_ARCHS,
    bind=lambda c: {"hidden": c.model_ref("hidden_size")},
    traits=Traits(drop_outputs=_drop_layers,
                  captures=lambda p: {f"layer{i}": i for i in p.get("layers", ())}),
    cost=costs.hook_capture,
    impl=f"{IMPL}:hook_capture",
))


def _concat_inputs(params: Mapping[str, Any], n: int) -> tuple[Port, ...]:
    return tuple(Port(f"x{i}", f"*batch d{i}", "like:x0") for i in range(n))


def _concat_outputs(params: Mapping[str, Any]) -> tuple[Port, ...]:
    n = int(params.get("_n_inputs", 1))
    return (Port("out", "*batch " + "+".join(f"d{i}" for i in range(n)), "like:x0"),)


declare(OpDef(
    name="concat",
    doc="Concatenate tensors on the last (feature) axis: the captured layers become the drafter's context.",
    inputs=_concat_inputs,
    outputs=_concat_outputs,
    variadic_input="x",
    traits=Traits(positionwise="batch", features="concat"),
    cost=costs.no_workspace,
    impl=f"{IMPL}:concat",
))

# the rewrites make these two (rewrite/rules.py): they name them by these declarations, not by a string
TRANSFER = declare(OpDef(
    name="transfer",
    doc="Copy a tensor to the node's device (`.to(device)` in one process, send/recv across processes). "
        "From a group to one device, the receiver gets one batch per replica.",
    inputs=(Port("x", "*shape", "like:x"),),
    outputs=(Port("out", "*shape", "like:x"),),
    params=(Param("queue", "int", "Incoming batches buffered on the receiving device (1 to 64).", default=1,
                  low=1, high=64),),
    device_rule="any_input",
    traits=Traits(positionwise="shape", movement=True, features="kept"),
    cost=costs.transfer,
    impl=f"{IMPL}:transfer",
))

declare(OpDef(
    name="anchor_sample",
    doc="Draw up to `count` anchors, sorted: per document (each gets its proportional share), on a grid of "
        "stride `block` with a random phase (a document's blocks never overlap), at loss tokens whose next token "
        "is a loss token of their document; a block may run past its document's end and past the row's end "
        "(docs/drafter.md). `valid[a, k]`: slot k of anchor a is scored (a real anchor, and tokens "
        "anchor+1 .. anchor+k are loss tokens of its document).",
    inputs=(Port("loss_mask", "seq", "bool"), Port("position_ids", "seq", "int64")),
    outputs=(Port("anchors", "anchors", "int64"), Port("valid", "anchors block", "bool", optional=True)),
    params=(Param("count", "dim", "Anchors per sequence (max_anchors).", default="anchors"),
            Param("block", "dim", "Block size.", default="block")),
    bind=lambda c: {"anchors": c.params["count"], "block": c.params["block"]},
    requires=(AtMost("block", "seq", "a block of block tokens starts at each anchor and is at most one sequence long"),),
    traits=Traits(pure=True, deterministic=False),   # draws from the run's generator: a copy samples others
    cost=costs.no_workspace,
    impl=f"{IMPL}:anchor_sample",
))

declare(OpDef(
    name="block_positions",
    doc="The packed positions of each anchor's block: anchor + arange(block), clamped to seq - 1 (a block may "
        "run past the row's end; its slots there are not scored, and every index stays in the row, where the "
        "gathers it feeds are exact).",
    inputs=(Port("anchors", "*a", "int64"),),
    outputs=(Port("index", "*a block", "int64"),),
    params=(Param("block", "dim", "Block size.", default="block"),
            Param("seq", "dim", "Tokens per packed sequence: the indices are clamped below it.", default="seq")),
    bind=lambda c: {"block": c.params["block"]},
    cost=costs.no_workspace,
    impl=f"{IMPL}:block_positions",
))


def _gather_shape(ctx: BindContext, types: Mapping[str, Any]):
    x, idx = types["x"].shape, types["index"].shape
    axis = ctx.params["axis"]
    if not 0 <= axis < len(x):
        from .contract import ContractError
        raise ContractError(f"axis {axis} is out of range for x of rank {len(x)}", expected=f"0 <= axis < {len(x)}", actual=str(axis))
    return {"out": (*x[:axis], *idx, *x[axis + 1:])}


declare(OpDef(
    name="gather",
    doc="Select positions along `axis`: out[*pre, *idx, *post] = x[*pre, index[*idx], *post] (anchor gather).",
    inputs=(Port("x", "*x", "like:x"), Port("index", "*idx", "int64")),
    outputs=(Port("out", "*out", "like:x"),),
    params=(Param("axis", "int", "Axis of x to select along.", default=0),),
    shape_fn=_gather_shape,
    traits=Traits(selection=Selection("x", "index", "axis"), features="kept"),   # along another axis than the last
    cost=costs.no_workspace,
    impl=f"{IMPL}:gather",
))


def _axis_ok(ctx: BindContext, types: Mapping[str, Any]):
    x = types["x"].shape
    if not 0 <= ctx.params["axis"] < len(x):
        from .contract import ContractError
        raise ContractError(f"axis {ctx.params['axis']} is out of range for x of rank {len(x)}")
    return {"out": x}


declare(OpDef(
    name="roll",
    doc="torch.roll(x, shift, axis): out[i] = x[(i - shift) mod n] along `axis`.",
    inputs=(Port("x", "*x", "like:x"),),
    outputs=(Port("out", "*x", "like:x"),),
    params=(Param("shift", "int", "Positions to roll by.", required=True),
            Param("axis", "int", "Axis to roll along.", default=0)),
    shape_fn=_axis_ok,
    traits=Traits(remap=IndexRemap("shift", "axis"), features="kept"),   # along another axis than the last
    cost=costs.no_workspace,
    impl=f"{IMPL}:roll",
))

def _index_shift_ref(t, p, index):
    def at(*ix):
        v = index.at(*ix)
        if p.get("check_range"):
            t.require(t.all(v >= 0, v < p["modulo"]), "index_shift: 0 <= index < modulo (check_range)")
        return (v + p["shift"]) % p["modulo"]
    return {"out": t.tensor(index.kinds, at, int)}


INDEX_SHIFT = declare(OpDef(
    name="index_shift",
    doc="Index arithmetic: (index + shift) mod modulo, elementwise.",
    inputs=(Port("index", "*i", "int64"),),
    outputs=(Port("out", "*i", "int64"),),
    params=(Param("shift", "int", "Added to every index.", required=True),
            Param("modulo", "int", "Result is taken modulo this (the length of the indexed axis).", required=True,
                  low=1),
            Param("check_range", "bool", "Raise unless every index is in [0, modulo) (set by gather_through_remap, "
                                         "which is exact only for in-range indices).", default=False)),
    traits=Traits(positionwise="i", reference=_index_shift_ref),
    cost=costs.no_workspace,
    impl=f"{IMPL}:index_shift",
))

declare(OpDef(
    name="norm",
    doc="The model's final RMSNorm over the last axis, as its arch defines it (Qwen3.5 multiplies by 1 + w, Qwen3 and Llama by w).",
    inputs=(Port("x", "*batch hidden"),),
    outputs=(Port("out", "*batch hidden"),),
    model_arch=(*TARGET_ARCHS, "dflash"),
    components=("norm",),
    bind=lambda c: {"hidden": c.model_ref("hidden_size")},
    traits=Traits(positionwise="batch"),
    cost=costs.norm,
    impl=f"{IMPL}:norm",
))

declare(OpDef(
    name="lm_head",
    doc="The model's output projection to the vocabulary: [*, hidden] -> [*, vocab].",
    inputs=(Port("x", "*batch hidden"),),
    outputs=(Port("logits", "*batch vocab"),),
    model_arch=(*TARGET_ARCHS, "dflash"),
    components=("lm_head",),
    bind=_lm_bind,
    traits=Traits(positionwise="batch", linear_head=LinearHead("x", "logits", "lm_head")),
    cost=costs.lm_head,
    impl=f"{IMPL}:lm_head",
))


def _drafter_bind(c: BindContext):
    return {"ctx": _ctx_width(c),
            "hidden": c.model_ref("hidden_size"), "block": c.model_ref("block_size")}


def _ctx_width(c: BindContext):
    sym, val = c.model_ref("target_hidden_size")
    n = len(c.model_dims.target_layer_ids)
    return sym * n, val * n


declare(OpDef(
    name="drafter_forward",
    doc="The DFlash drafter: fc + hidden_norm over the concatenated target features as context, block tokens "
        "(anchor token, then mask tokens) as queries, DFlash block mask. Returns hidden states before the final norm.",
    inputs=(Port("context", "seq ctx", doc="concatenated hooked target layers"), Port("input_ids", "seq", "int64"),
            Port("position_ids", "seq", "int64"), Port("anchors", "anchors", "int64")),
    outputs=(Port("hidden", "anchors block hidden"),),
    model_arch=("dflash",),
    components=("embed", "fc", "hidden_norm", "layers"),
    bind=_drafter_bind,
    traits=Traits(modules=("trainable",), reads_layers=ReadsLayers("context", "target_layer_ids")),
    cost=costs.drafter_forward,
    impl=f"{IMPL}:drafter_forward",
))

# -- the objective: labels, normalisation, per-slot weighting, as declared choices and presets (docs/drafter.md) --

def _labels_of(params: Mapping[str, Any]) -> str:
    try:
        return resolve_objective(params)["labels"]
    except (KeyError, ValueError):      # refused by the op's validate (_check_objective), located at the params
        return params.get("labels", "verifier")


def _check_objective(params: Mapping[str, Any]) -> None:
    resolve_objective(params)


_LABELS = Port("labels", "anchors block", "int64", doc="the data's token at each block slot (labels = 'data')")
_VALID = Port("valid", "anchors block", "bool")


def _loss_inputs(params: Mapping[str, Any], n: int = 0) -> tuple[Port, ...]:
    logits = Port("logits", "anchors block vocab", "float")
    if _labels_of(params) == "data":
        return logits, _LABELS, _VALID
    return logits, Port("target", "anchors block vocab", "float"), _VALID


def _fused_inputs(params: Mapping[str, Any], n: int = 0) -> tuple[Port, ...]:
    x = Port("x", "anchors block hidden", doc="the drafter's rows, the input of its lm_head")
    if _labels_of(params) == "data":
        return x, _LABELS, _VALID
    return x, Port("target_x", "anchors block hidden", "like:x", doc="the verifier's rows, the input of its lm_head"), \
        _VALID


_OBJECTIVE_PARAMS = (
    Param("objective", "str", "A preset that sets kind, gamma, labels, normalize, weighting and dpace_alpha to a "
          "reference's defaults: own (each param as given), speculators (ce on the verifier's argmax, D-PACE, over "
          "the scored-slot count), specforge (ce on the data's next token, unweighted, over the weights' sum). The "
          "final norm is the graph's: leave `norm` out of the drafter's shares for its own (docs/drafter.md).",
          default="own", choices=tuple(OBJECTIVE_PRESETS)),
    Param("labels", "str", "What a slot is scored against: verifier (its logits at the slot; the `target` input) or "
          "data (the corpus token, input_ids[anchor + k]; the `labels` input, no verifier head).",
          default="verifier", choices=("verifier", "data")),
    Param("normalize", "str", "The weighted sum of slot losses is divided by: weights (the weights' sum) or count "
          "(the number of scored slots, as speculators).", default="weights", choices=("weights", "count")),
    Param("weighting", "str", "Per-slot weight: decay (exp(-(k-1)/gamma)), dpace (D-PACE, speculators' "
          "dpace_loss_decay; needs kind ce) or uniform.", default="decay", choices=("decay", "dpace", "uniform")),
    Param("dpace_alpha", "float", "D-PACE's confidence smoothing, (1 - alpha) q + alpha.", default=0.5, low=0,
          open_low=True, high=1),
)

_LOSS = declare(OpDef(
    name="loss",
    doc="Drafter loss at each scored block slot, slot 0 masked: against the verifier (its distribution, or its "
        "argmax for ce) or the data's next token, weighted per slot (decay exp(-(k-1)/gamma), D-PACE or uniform) "
        "and divided by the weights' sum or the scored-slot count (params; `objective` presets them). Outputs the "
        "scalar loss, per-slot accuracy (drafter argmax == the label) and the acceptance counts of greedy "
        "verification (`accepted[k]`: real anchors whose slots 1..k all hit; tau = 1 + sum(accepted[1:]) / "
        "accepted[0]).",
    inputs=_loss_inputs,
    outputs=(Port("loss", "", "float32"), Port("slot_acc", "block", "float32", optional=True),
             Port("accepted", "block", "float32", optional=True)),
    params=(Param("kind", "str", "Loss: ce (cross-entropy on the label: the verifier's argmax or the data's "
                  "token), kl, rkl, jsd, tv.", default="kl", choices=("ce", "kl", "rkl", "jsd", "tv")),
            Param("gamma", "float", "Per-slot decay exp(-(k-1)/gamma) (weighting = decay); above 0.", default=7.0,
                  low=0, open_low=True, high=1e6),
            Param("chunk", "int", "Rows of [anchors*block, vocab] scored at once, their gradient made in forward; "
                  "0: a power of two near rows / 32, at least 32 (ops/costs.loss_chunk).",
                  default=0, low=0),
            *_OBJECTIVE_PARAMS),
    example=PortsExample((("labels", "verifier"),), "labels = 'data': the input `target` is `labels` "
                         "[anchors block] int64"),
    validate=_check_objective,
    traits=Traits(sink=True, pure=False, trains_own=trains_own,
                  fuses_heads=FusesHeads("logits", "target", "fused_head_loss", "x", "target_x",
                                         params=lambda p, rows, hidden, vocab: {
                                             **{k: p[k] for k in ("objective", *OBJECTIVE_DEFAULTS) if k in p},
                                             "chunk": costs.head_chunk(rows, hidden, vocab,
                                                                       resolve_objective(p)["kind"])})),
    cost=costs.loss,
    impl=f"{IMPL}:loss",
))

# the fused op has the loss op's outputs and loss params, declared once there (_LOSS)

declare(OpDef(
    name="fused_head_loss",
    doc="The loss op on lm_head(x) (the drafter) and lm_head(target_x) (the verifier) with one shared W, computed "
        "`chunk` rows at a time: neither [anchors*block, vocab] logits tensor is ever made, in forward or backward. "
        "Slot 0 of each block (the anchor, never scored) is not made at all: a chunk is whole blocks' slots "
        "1..block-1. ce against the verifier takes only its argmax (no log-softmax over its rows); labels = 'data' reads the "
        "`labels` input and makes no verifier head at all. The gradient with respect to x is made chunk by chunk "
        "in forward and kept ([rows, hidden]); backward recomputes nothing. Same outputs as the loss op. Made by "
        "the rule fuse_heads_into_loss.",
    inputs=_fused_inputs,
    outputs=_LOSS.outputs,
    params=(_LOSS.param("kind"), _LOSS.param("gamma"),
            Param("chunk", "int", "Rows per chunk, rounded down to whole blocks of block-1 scored slots (at least "
                  "one block: ops/costs.fused_chunk); 0: Liger's rule, [chunk, vocab] about the size of [rows, hidden] "
                  "(ops/costs.head_chunk). The rule writes the value it chose.", default=0, shown=True),
            *_OBJECTIVE_PARAMS),
    example=PortsExample((("labels", "verifier"),), "labels = 'data': the input `target_x` is `labels` "
                         "[anchors block] int64 (no verifier head)"),
    model_arch=(*TARGET_ARCHS, "dflash"),
    components=("lm_head",),
    bind=_lm_bind,
    validate=_check_objective,
    traits=Traits(sink=True, pure=False, trains_own=trains_own),
    cost=costs.fused_head_loss,
    impl=f"{IMPL}:fused_head_loss",
))

declare(OpDef(
    name="output",
    doc="Mark a tensor as a result of the graph (kept, returned by the interpreter); no outputs.",
    inputs=(Port("x", "*x", "like:x"),),
    outputs=(),
    traits=Traits(sink=True, pure=False),
    cost=costs.no_workspace,
    impl=f"{IMPL}:output",
))
