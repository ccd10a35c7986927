"""Per-op cost: transient workspace, bytes saved for backward, FLOPs. Output bytes come from the inferred types.

Each formula names what allocates. Architecture-specific formulas live with the architecture
(models/qwen3_5.py, models/dflash.py) and are checked there against torch's MemTracker.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs

from ..ir.graph import Node
from ..ir.types import TensorType
from .objective import resolve_objective


@attrs.frozen
class NodeCost:
    workspace_bytes: int = 0   # transient while the node runs, freed when it returns
    saved_bytes: int = 0       # internal tensors autograd keeps for backward (trainable paths only)
    flops: int = 0
    saved_inputs: tuple[str, ...] = ()  # input ports autograd keeps alive until backward (trainable paths only)
    # The order in which the node allocates and frees, when it matters to the caching allocator (a body forward
    # allocates per layer, and hooked layer outputs land between its temporaries). Steps are
    # ("alloc", key, bytes) / ("free", key, 0); key "out:<port>" allocates that output. None: workspace, then
    # outputs, then the workspace is freed.
    program: tuple[tuple[str, str, int], ...] | None = None
    # A trainable model's backward in the order autograd runs it, one step per part of the model (NOTE [Layered
    # backward]); () : the node's weight gradients are made whole at its backward, its saved bytes freed after.
    backward: tuple["BackwardUnit", ...] = ()
    # the saved bytes no backward unit frees (held to the end of the node's backward), tensor by tensor; () : one
    # block
    saved_tensors: tuple[int, ...] = ()


@attrs.frozen
class BackwardUnit:
    """One part of a node's backward (NOTE [Layered backward]): the weight gradients of `components` (of its
    layer `layer` when not None: the component's parameters split evenly over the model's layers) are made, with
    `workspace_bytes` of activation gradients on top, then `saved_bytes` of what the forward saved are freed.
    Under FSDP2 it is one fully_shard unit's backward (analysis/memory.py NOTE [Data-parallel memory]).
    `tensors`: (component, elements) of each parameter whose gradient the unit makes, in the order autograd makes
    them (one .grad tensor each, one allocator request each: NOTE [Layered backward]); () : one tensor per
    component."""
    components: tuple[str, ...]
    layer: int | None
    saved_bytes: int
    workspace_bytes: int
    tensors: tuple[tuple[str, int], ...] = ()
    # `saved_bytes` tensor by tensor, in the order the forward makes them; () : one block
    saved_tensors: tuple[int, ...] = ()


# NOTE [Layered backward]: autograd runs a model's backward op by op, its last layer first: a layer's weight
# gradients appear as its ops' backwards run, and each op's saved tensors are freed when its backward ends. A
# node whose cost lists `backward` units is replayed that way (analysis/memory.py): per unit, its weight
# gradients and its workspace are allocated on top of the live set, the workspace is freed, then the unit's
# share of the saved bytes. Putting a unit's gradients before its frees makes each unit an upper bound of its
# own backward (autograd frees part of the saved tensors before the last gradient appears). Without units, a
# model's weight gradients were all allocated at its first backward node: on tiny_dp's drafter 1,313,792 B at
# once, against the 457,984 B its layer-by-layer backward adds at most (tests/test_dp.py).
# The granularity is autograd's, for the caching allocator's sake: AccumulateGrad
# (torch/csrc/autograd/functions/accumulate_grad.h accumulateGrad) makes each parameter's .grad, one tensor and
# one allocator request, when its gradient is first computed (BackwardUnit.tensors); each tensor the forward
# saves was its own request (BackwardUnit.saved_tensors, NodeCost.saved_tensors); the trainer makes one fp32
# gradient per master and AdamW's foreach step one temporary per parameter (analysis/memory.py). The allocator
# (c10/cuda/CUDACachingAllocator.cpp) serves a request from the smallest cached free block at least that large
# in its pool (get_free_block), splitting it when the rest is over 1 MiB (large pool); a request of 10 MiB or
# more that finds none gets a segment of its own size (alloc_block, get_allocation_size); freed blocks merge only
# with free neighbours of the same segment (try_merge_blocks). So what the replay frees and requests as one
# block, and in which sizes, decides reserved. Measured on the event sequence of qwen3_8b's gpu1 and qwen27b's
# gpu7 (`python -m dflash_graph check graphs/qwen3_8b.toml`, `... graphs/qwen27b.toml`), allocated / reserved:
# - one saved block per node, weight gradients one block per model (before the layered backward): the 11.3 GiB
#   saved block, freed whole, took the fp32 gradients and AdamW's temporaries: 31.06 / 31.86 and 71.80 / 73.31 GiB;
# - saved per layer, gradients and optimizer one block per model (1310fe7): neither the drafter layers' fp32
#   gradients (3.59 GiB on qwen3_8b) nor AdamW's temporaries (3.91 GiB) fit a freed layer's block (1.8-2.0 GiB, a
#   segment each), two new segments: 29.79 / 38.10 and 71.80 / 85.06 GiB;
# - every request autograd and AdamW make (now): 29.79 / 30.03 and 71.80 / 74.77 GiB. qwen27b's gpu7 is 1.46 GiB
#   above the first row because no freed block is as large as some requests: the context stream's backward
#   bound (1.25 GiB), in the second step the loss's chunk (1.42 GiB) and a few saved tensors, and five optimizer
#   requests, an MLP weight's fp32 gradient or AdamW temporary ([17,408, 5,120] fp32, 340 MiB), larger than any
#   MLP activation its layers saved and freed ([8,192, 17,408] bf16, 272 MiB), each make a segment.
# No GPU has measured these reserved figures; the live bytes, which do not depend on the granularity, are the
# tracker's (tests/test_dp.py, tests/test_run.py).


@attrs.frozen
class CostContext:
    node: Node
    inputs: Mapping[str, TensorType]
    outputs: Mapping[str, TensorType]
    model_dims: Any            # the arch's Dims object, or None
    dtype_bytes: int           # the node's model dtype width (2 for bf16), or of its first input
    grad: bool                 # autograd records this node (it feeds a trainable model's loss)
    taps: frozenset[int] = frozenset()   # a forward's layers that hook_capture nodes ask for
    owner_dims: Mapping[str, Any] = attrs.field(factory=dict)   # a component -> its owner's dims (`shares`)



# NOTE [Layer folding]: a body forward's program is per layer (64 layers of Qwen3.5-27B: 13,434 steps), and
# checking a deep model replays every layer: 512 layers took 1.8 CPU s, and 10,000 were refused. But the layers
# of a model repeat: without a cache every layer after the first of its type allocates the same tensors in the
# same order (models/qwen3_5.py), and layer_types repeat with a period (Qwen3.5: three linear_attention layers,
# then a full_attention one). So _body_steps writes a stretch of identical periods once, as a Repeat step:
# repetition 0's steps, whose keys are templates (format, layer, number), and how many times they repeat.
# Repetition j's key is format.format(layer + j * layers, number + j * span): exactly the key the literal
# program has there (expand_program gives the literal program back, step for step; tests/test_layer_folding.py).
# A period is folded only when it is proven to repeat: _body_steps writes two periods of a stretch, and folds the
# rest when the second is the first shifted by one period (the same steps, sizes and keys, and the same tensors
# alive after it, shifted). The writer is shift-equivariant (what it writes for a layer depends only on the layer
# type, the tensors alive and the previous layer's output, each shifted alike), so every later period of the
# stretch is the first shifted too. A hooked layer (its output is a tap, owned by a hook node), the last layer
# when the forward hands its output on, and layer 0 (it reads the embeddings) are never folded: they break a
# stretch. analysis/memory.py carries a Repeat through to the allocator model as one marker (allocator.Repeat),
# which replays repetitions until the allocator's state repeats and then skips the rest (NOTE [Folded replay]).


@attrs.frozen
class Repeat:
    """`times` repetitions of the program steps `steps` (repetition 0), `layers` layers and `span` literal steps
    each (NOTE [Layer folding]). A key is a template (format, layer, number): repetition j's key is
    format.format(layer + j * layers, number + j * span)."""
    steps: tuple[tuple[str, tuple[str, int, int], int], ...]
    times: int
    layers: int
    span: int

    def key(self, template: tuple[str, int, int], j: int) -> str:
        fmt, layer, number = template
        return fmt.format(layer + j * self.layers, None if number is None else number + j * self.span)

    def expand(self, j: int) -> tuple[tuple[str, str, int], ...]:
        """Repetition j's steps, with literal keys."""
        return tuple((kind, self.key(tpl, j), size) for kind, tpl, size in self.steps)


def expand_program(program) -> tuple[tuple[str, str, int], ...]:
    """A program with its Repeat steps written out (NOTE [Layer folding])."""
    out: list = []
    for st in program:
        if st[0] == "repeat":
            for j in range(st[1].times):
                out.extend(st[1].expand(j))
        else:
            out.append(st)
    return tuple(out)


def program_steps(program) -> int:
    """How many allocations a program makes, its Repeats counted in full."""
    return sum(st[1].times * sum(1 for s in st[1].steps if s[0] == "alloc") if st[0] == "repeat"
               else st[0] == "alloc" for st in program)


def program_peak(program) -> int:
    """The most bytes a program holds at once (its temporaries and the outputs it has made so far). A Repeat's
    repetitions start from the same live bytes and hold the same ones (NOTE [Layer folding]): its first stands
    for all, and the keys it leaves alive are renamed to its last's."""
    sizes: dict[str, int] = {}
    live = peak = 0
    for st in program:
        if st[0] == "repeat":
            rep = st[1]
            made = set()
            for kind, tpl, size in rep.steps:
                key = rep.key(tpl, 0)
                if kind == "alloc":
                    sizes[key] = size
                    made.add(tpl)
                    live += size
                    peak = max(peak, live)
                elif key in sizes:
                    live -= sizes.pop(key)
            for tpl in made:
                key = rep.key(tpl, 0)
                if key in sizes:
                    sizes[rep.key(tpl, rep.times - 1)] = sizes.pop(key)
            continue
        kind, key, size = st
        if kind == "alloc":
            sizes[key] = size
            live += size
            peak = max(peak, live)
        elif key in sizes:
            live -= sizes.pop(key)
    return peak


def no_workspace(c: CostContext) -> NodeCost:
    return NodeCost()


def _rows(t: TensorType) -> int:
    return t.numel // t.sizes[-1] if t.shape else 1


def norm(c: CostContext) -> NodeCost:
    # Qwen3_5RMSNorm.forward (transformers 5.23), in allocation order: x.float() [A, fp32 copy; none when x is
    # fp32], x.pow(2) [B] freed after .mean(), x * rsqrt(...) [C], A freed, C * (1 + w.float()) [D], C freed,
    # .type_as(x) [the output; D itself when x is fp32], D freed. Peak: two fp32 [*, hidden] tensors.
    # Measured by tests/test_op_memory.py.
    x = c.inputs["x"]
    fp32 = x.numel * 4
    out = c.outputs["out"].nbytes
    # an arch whose final norm is a derived program (models/decoder.py) gives its own allocation order
    owner = c.owner_dims.get("norm")
    derived = owner.norm_program(_rows(x), x.nbytes // max(1, x.numel), out) if hasattr(owner, "norm_program") else None
    if derived is not None:
        program = derived
    elif x.dtype == "float32":
        program = (("alloc", "B", fp32), ("free", "B", 0), ("alloc", "C", fp32), ("alloc", "out:out", out),
                   ("free", "C", 0))
    else:
        program = (("alloc", "A", fp32), ("alloc", "B", fp32), ("free", "B", 0), ("alloc", "C", fp32),
                   ("free", "A", 0), ("alloc", "D", fp32), ("free", "C", 0), ("alloc", "out:out", out),
                   ("free", "D", 0))
    # backward of x * rsqrt(mean(x^2)) * (1 + w) keeps the fp32 upcast of x and the per-row rsqrt
    saved = (x.numel * 4 * (x.dtype != "float32") + _rows(x) * 4) if c.grad else 0
    return NodeCost(workspace_bytes=2 * fp32, saved_bytes=saved, flops=6 * x.numel, program=program,
                    saved_inputs=("x",) if c.grad else ())


def lm_head(c: CostContext) -> NodeCost:
    # nn.Linear without bias: one GEMM straight into the output; cuBLAS workspace is outside the allocator's
    # tensors (device.outside_allocator). FLOPs 2*rows*hidden*vocab (matmul FLOP count, PaLM appendix B).
    x, y = c.inputs["x"], c.outputs["logits"]
    # backward of a frozen Linear needs only grad_out @ W, but autograd still saves x (F.linear saves its input
    # whenever any input requires grad)
    return NodeCost(flops=2 * _rows(x) * x.sizes[-1] * y.sizes[-1], saved_inputs=("x",) if c.grad else ())


def transfer(c: CostContext) -> NodeCost:
    # The received tensor is the output. A queue of q incoming batches keeps q - 1 more buffers of the same size
    # on the receiver (accounted by the memory analysis on the receiving device).
    return NodeCost()


def _body(c: CostContext) -> tuple[int, int]:
    """The body forward's workspace and FLOPs, as the model's arch computes them (its dims object:
    models/qwen3_5.py's hand mirror, or models/decoder.py's derived program)."""
    seq = c.inputs["input_ids"].sizes[0]
    d = c.model_dims
    return d.body_workspace_bytes(seq, c.dtype_bytes), d.body_flops(seq)


FOLD_LAYERS = True      # NOTE [Layer folding]; tests turn it off to compare with the literal replay


def _body_program(c: CostContext, ws: int, logits: bool) -> tuple[tuple[str, str, int], ...]:
    """The body forward's allocations in order, layer by layer, from the arch's events (models/body.py); hooked
    layer outputs are allocated where the layer makes them, between its temporaries, as on a GPU. A layer output
    no one captured is freed once the next layer has consumed it."""
    captured = c.taps
    return _body_steps(c.model_dims, c.inputs["input_ids"].sizes[0], c.dtype_bytes, captured, "hidden" in c.outputs,
                       c.outputs["logits"].nbytes if logits else 0, FOLD_LAYERS)


MAX_PERIOD = 16     # the longest period of layer_types looked for (NOTE [Layer folding])


def _layer_period(types: tuple[str, ...]) -> int | None:
    """The smallest p <= MAX_PERIOD with types[i] == types[i - p] for every layer i > p (layer 0 reads the
    embeddings and is never folded), or None."""
    n = len(types)
    for p in range(1, min(MAX_PERIOD, n) + 1):
        if types[1 + p:] == types[1:n - p]:
            return p
    return None


def _esc(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _shift(key, layers: int, span: int):
    """A key `layers` layers and `span` literal steps later (NOTE [Layer folding]): templates move, plain keys
    (the prologue's, an output's, a tap's) stay."""
    if type(key) is tuple:
        fmt, layer, number = key
        return (fmt, layer + layers, None if number is None else number + span)
    return key


def _literal(key) -> str:
    if type(key) is tuple:
        fmt, layer, number = key
        return fmt.format(layer, number)
    return key


_ENDS: dict[tuple, int] = {}     # _body_steps' arguments less the logits -> the frees its program ends with


@functools.lru_cache(maxsize=256)
def _body_steps(d, seq: int, dtype_bytes: int, captured: frozenset[int], has_hidden: bool,
                logits_bytes: int, fold: bool = True) -> tuple:
    """The body forward's program; with `fold`, identical periods of layers as Repeat steps (NOTE [Layer
    folding]); expand_program(fold=True's) == fold=False's. With logits (a causal LM's forward), the program
    without them, their allocation put before the frees it ends with: one program written per body, whether
    the graph as written reads its logits and the rewritten one does not."""
    if logits_bytes:
        base = _body_steps(d, seq, dtype_bytes, captured, has_hidden, 0, fold)
        at = len(base) - _ENDS[(d, seq, dtype_bytes, captured, has_hidden, fold)]
        return (*base[:at], ("alloc", "out:logits", logits_bytes), *base[at:])
    h = seq * d.hidden_size * dtype_bytes
    ev = d.body_events(seq, dtype_bytes)
    prologue, chunks, final = ev.prologue, ev.layers, ev.final
    types = d.layer_types
    n_layers = d.num_hidden_layers
    last = n_layers - 1
    steps: list = [("alloc", "embeds", h)]   # keys: plain strings, or templates (format, layer, number)
    written = 1                              # literal steps so far (a Repeat counts all its repetitions)
    alive: dict[str, object] = {}            # event name -> key
    labels: dict[str, str] = {}              # event name -> its label (the same for every layer)
    prev: object = "embeds"                  # the previous layer's output

    def owned(key) -> bool:      # a node's output, or the embedding output of a forward that keeps it to the end
        return type(key) is str and (key.startswith(("out:", "tap:")) or (ev.embeds_to_end and key == "embeds"))

    def replay(events, layer: int | None, prefix: str, out_key, into: list) -> None:
        nonlocal written, prev
        for event, size in events:
            kind, name = event[0], event[1:]
            if name in ("h_in",) or event == "-h_out":
                continue
            if event == "-@embeds":
                into.append(("free", "embeds", 0))
                written += 1
            elif event == "-@prev":
                if prev is not None and not owned(prev):
                    into.append(("free", prev, 0))
                    written += 1
                prev = None
            elif event == "+h_out":
                into.append(("alloc", out_key, h))
                written += 1
            elif kind == "+":
                # unique: a renamed tensor keeps its own key; [heads, seq, seq] tensors named by shape for an OOM
                label = labels.get(name)
                if label is None:
                    label = labels[name] = ev.label(name)
                if layer is None:
                    key = f"{prefix}{name}#{written}" if label == name else f"{prefix}{label} #{written}"
                else:
                    key = (f"l{{0}}.{_esc(name)}#{{1}}" if label == name else f"layer {{0}} {_esc(label)} #{{1}}",
                           layer, written)
                alive[name] = key
                into.append(("alloc", key, size))
                written += 1
            elif kind == "-":
                into.append(("free", alive.pop(name), 0))
                written += 1
            elif kind == "~":
                old, new = name.split(">")
                alive[new] = alive.pop(old)

    def layer(i: int, into: list) -> None:
        nonlocal prev, written
        if i in captured:
            cur = f"tap:{i}"       # allocated here, owned by the hook_capture node that asked for it
        elif i == last and has_hidden:
            cur = "out:hidden"
        else:
            cur = ("l{0}.out", i, None)
        replay(chunks[(types[i], i > 0)], i, f"l{i}.", cur, into)
        if not owned(prev):
            into.append(("free", prev, 0))
            written += 1
        prev = cur

    def foldable(i: int) -> bool:
        return i > 0 and i not in captured and not (i == last and has_hidden)

    replay(prologue, None, "pro.", None, steps)
    p = _layer_period(types) if fold else None
    i = 0
    while i < n_layers:
        if p is None or not foldable(i):
            layer(i, steps)
            i += 1
            continue
        end = i
        while end < n_layers and foldable(end):
            end += 1
        before = None        # the last period written literally: (steps, its span, alive and prev after it)
        while i + p <= end:
            start = written
            buf: list = []
            for k in range(i, i + p):
                layer(k, buf)
            span = written - start
            after = (list(alive.items()), prev)
            reps = (end - i) // p
            if before is not None and reps > 1 and _repeats(before, buf, span, after, p):
                steps.append(("repeat", Repeat(tuple(buf), reps, p, span), 0))
                # the state after the last repetition: every template alive moves on by reps - 1 periods
                more = reps - 1
                alive = {name: _shift(key, more * p, more * span) for name, key in alive.items()}
                prev = _shift(prev, more * p, more * span)
                written += more * span
                i += reps * p
                break
            steps.extend(buf)
            before = (buf, span, after)
            i += p
        while i < end:
            layer(i, steps)
            i += 1
    # the body ends with the final norm: its temporaries and the normed [seq, hidden] state
    replay(final, None, "norm.", None, steps)
    body = len(steps)       # (a causal LM's logits are allocated here: see the top)
    for key in list(alive.values()):
        steps.append(("free", key, 0))
    if prev is not None and not owned(prev):
        steps.append(("free", prev, 0))
    _ENDS[(d, seq, dtype_bytes, captured, has_hidden, fold)] = len(steps) - body
    return tuple(st if st[0] == "repeat" else (st[0], _literal(st[1]), st[2]) for st in steps)


def _repeats(before, buf: list, span: int, after, p: int) -> bool:
    """Whether the period just written (`buf`, `span` literal steps, leaving `after` alive) is the one before it
    shifted by one period, steps and the tensors alive after it alike (NOTE [Layer folding]); and only template
    keys, so that each repetition names its own tensors."""
    steps0, span0, (alive0, prev0) = before
    if span != span0 or len(buf) != len(steps0):
        return False
    for (k0, key0, s0), (k1, key1, s1) in zip(steps0, buf):
        if k0 != k1 or s0 != s1 or type(key1) is not tuple or _shift(key0, p, span) != key1:
            return False
    alive1, prev1 = after
    return [(name, _shift(key, p, span)) for name, key in alive0] == alive1 and _shift(prev0, p, span) == prev1


def body_forward(c: CostContext) -> NodeCost:
    ws, flops = _body(c)
    return NodeCost(workspace_bytes=ws, flops=flops, program=_body_program(c, ws, logits=False))


def causal_lm_forward(c: CostContext) -> NodeCost:
    # *ForCausalLM.forward: body -> last_hidden_state (normed, [seq, hidden]) -> lm_head -> logits. While the
    # logits are allocated, the normed hidden state is alive (it is the GEMM's input).
    ws, flops = _body(c)
    seq = c.inputs["input_ids"].sizes[0]
    normed = seq * c.model_dims.hidden_size * c.dtype_bytes
    return NodeCost(workspace_bytes=max(ws, normed), flops=flops + c.model_dims.lm_head_flops(seq),
                    program=_body_program(c, ws, logits=True))


def hook_capture(c: CostContext) -> NodeCost:
    # Nothing of its own: the layer outputs it names are allocated by the forward it reads, at their layers
    # (the forward's program steps "tap:<i>", see _body_steps), and freed after their last reader.
    return NodeCost(program=())


def drafter_forward(c: CostContext) -> NodeCost:
    from ..models import dflash

    ctx = c.inputs["context"].sizes[0]
    anchors = c.inputs["anchors"].sizes[0]
    d = c.model_dims
    backward: tuple[BackwardUnit, ...] = ()
    if c.grad:
        # NOTE [Layered backward]: the layers in reverse, each freeing its own saved tensors, then the context
        # stream (fc, hidden_norm); what that saved (the context stream's, RoPE's and the mask's) is freed with the
        # node's other saved bytes, at its end
        shared, layers = dflash.forward_saved_parts(d, ctx, anchors, c.dtype_bytes)
        ws = dflash.layer_backward_workspace_bytes(d, ctx, anchors, c.dtype_bytes)
        per_layer = tuple(("layers", n) for _, n in dflash.layer_param_tensors(d))
        backward = (*(BackwardUnit(("layers",), i, sum(layers[i]), ws, per_layer, layers[i])
                      for i in reversed(range(d.num_hidden_layers))),
                    BackwardUnit(("fc", "hidden_norm"), None, 0,
                                 dflash.context_backward_workspace_bytes(d, ctx, c.dtype_bytes),
                                 (("hidden_norm", d.hidden_size), ("fc", d.fc_in_features * d.hidden_size))))
    return NodeCost(
        backward=backward,
        saved_tensors=shared if c.grad else (),
        workspace_bytes=dflash.forward_workspace_bytes(d, ctx, anchors, c.dtype_bytes),
        saved_bytes=dflash.forward_saved_bytes(d, ctx, anchors, c.dtype_bytes) if c.grad else 0,
        flops=dflash.forward_flops(d, ctx, anchors),
        # fc (the projection of the concatenated target features) keeps its input [rows, n_layers*hidden] for
        # backward (torch.nn.functional.linear saves its input for the weight's gradient): alive from here until
        # the drafter's backward, like any saved input
        saved_inputs=("context",) if c.grad else (),
    )


def loss(c: CostContext) -> NodeCost:
    # ops/torch_impl.loss_chunks, in allocation order: when autograd records the node, the gradient with respect to
    # the logits ([rows, vocab] in their dtype, made chunk by chunk in forward and kept for backward: saved_bytes;
    # the logits and the target are not saved, so they die after forward); the per-row losses and hits ([rows]);
    # then per chunk _chunk_loss's fp32 buffers (LOSS_CHUNK_BUFFERS, measured), freed before the next chunk
    # (chunk_grad, which runs after it, holds fewer). Backward only scales the kept gradient into the logits'
    # gradient (counted by the analysis). Measured with MemTracker by tests/test_op_memory.py.
    x = c.inputs["logits"]
    v = x.sizes[-1]
    rows = x.numel // v
    obj = resolve_objective(c.node.params)      # the node's choices, with its preset's values
    chunk = min(int(c.node.params.get("chunk") or 0) or loss_chunk(rows), rows)
    chunk = min(block_chunk(chunk, x.sizes[-2], obj["weighting"]), rows)
    width = x.nbytes // max(x.numel, 1)
    cd = max(width, 4)
    same, upcast = LOSS_CHUNK_BUFFERS[obj["kind"]]
    n = same if width >= 4 else upcast
    per_row = rows * cd + rows          # losses and hits
    program = (("alloc", "rows", per_row), ("alloc", "chunk", n * chunk * v * cd), ("free", "chunk", 0),
               *(("alloc", f"out:{k}", t.nbytes) for k, t in c.outputs.items()), ("free", "rows", 0))
    return NodeCost(saved_bytes=x.nbytes if c.grad else 0, flops=12 * x.numel, program=program)


# NOTE [Chunk floor]: both chunked ops floor their chunk at 32 rows. Below it a chunk's GEMMs (a [2c, hidden] by
# [hidden, vocab] product in the fused op, one read of W for both heads) fall off the CPU's and GPU's efficient
# shapes, and per-chunk overhead grows; above it the chunk's [chunk, vocab] buffers grow. Measured by
# benchmarks/verifier_path.py (V 62,080, 1,024 rows, one thread): fused at 32 rows 0.88x the pushdown's time,
# at 64 rows 0.99x, with 14.3x and 7.4x less peak memory.
MIN_CHUNK_ROWS = 32
LOSS_CHUNK_SHARE = 32

# NOTE [ce chunk floor]: the fused op floors a ce chunk at 128 rows. Past its GEMMs a ce chunk does one
# log-softmax over the drafter's rows (LOSS_CHUNK_BUFFERS: one [chunk, vocab] buffer, where kl has five), so the
# GEMMs set its time, and a GEMM's time per row grows as its rows shrink (each call packs all of W again). Measured
# on one CPU thread at H 512, V 32,000, 1,024 rows: both heads' [2c, hidden] x [hidden, vocab] took 1.5x, and the
# gradient's [c, vocab] x [vocab, hidden] 1.6x, as long at c = 32 as at c = 128, which is as fast as one GEMM over
# all the rows; the whole step at H 512 / T 2,048 / 64 x 16 (benchmarks/reference_peers.py) went from 1.05x
# speculators' CPU time to below it (benchmarks/README.md). The other kinds keep NOTE [Chunk floor]'s 32 rows.
HEAD_CE_MIN_CHUNK_ROWS = 128


def loss_chunk(rows: int) -> int:
    """Rows per chunk for the loss op when its `chunk` param is 0: a power of two near rows / LOSS_CHUNK_SHARE,
    so that the chunk's fp32 buffers (at most six [chunk, vocab], LOSS_CHUNK_BUFFERS) stay under a fifth of one
    fp32 [rows, vocab] logits tensor, which the op's inputs and its kept gradient already are (three of them);
    floored at MIN_CHUNK_ROWS rows (NOTE [Chunk floor]), capped at the rows there are. 1,024 rows -> 32;
    qwen27b.toml's 8,192 -> 256. (A chunk of all 1,024 rows at V 62,080 also ran 9x slower on one CPU thread
    than 64-row chunks: five fresh 243 MiB buffers per pass.)"""
    c = max(1, rows // LOSS_CHUNK_SHARE)
    return max(1, min(max(1 << (c.bit_length() - 1), MIN_CHUNK_ROWS), rows))


def head_chunk(rows: int, hidden: int, vocab: int, kind: str = "kl") -> int:
    """Rows per chunk for fused_head_loss when its `chunk` param is 0: Liger Kernel's rule, which keeps a
    [chunk, vocab] block about the size of the [rows, hidden] input (liger_kernel/ops/fused_linear_jsd.py and
    fused_linear_cross_entropy.py: inc_factor = cdiv(V, H); chunk_size = next_power_of_2(cdiv(BT, inc_factor))),
    with a floor of MIN_CHUNK_ROWS rows (HEAD_CE_MIN_CHUNK_ROWS for ce: NOTE [ce chunk floor]), capped at the
    rows there are. The floor (NOTE [Chunk floor]): every
    chunk's GEMMs read all of W, so a chunk of a few rows (the rule gives 2 at 1,024 rows, H 256, V 248,320)
    re-reads W hundreds of times; Liger's current code floors at 512 rows under a 2 GiB budget for four fp32
    [chunk, V] buffers.
    qwen27b.toml: 8,192 rows, H 5,120, V 248,320 -> cdiv 49 -> 168 -> 256."""
    inc = -(-vocab // hidden)
    c = -(-rows // inc)
    floor = HEAD_CE_MIN_CHUNK_ROWS if kind == "ce" else MIN_CHUNK_ROWS
    return max(1, min(max(1 << (c - 1).bit_length(), floor), rows))


def block_chunk(chunk: int, block: int, weighting: str) -> int:
    """The chunk the loss ops use: D-PACE weighs a slot by the losses of its whole block, so its chunks hold whole
    blocks (rounded down to a multiple of the block, at least one block); other weightings take the chunk as is."""
    if weighting != "dpace":
        return chunk
    return max(block, chunk - chunk % block)


# [chunk, vocab] buffers in the compute dtype (fp32, or fp64 for fp64 logits) that torch_impl._chunk_loss holds
# at its peak, per kind: (inputs already in the compute dtype, inputs upcast from bf16/fp16). Measured with
# MemTracker by tests/test_fused_head_loss.py::test_memory_formula; chunk_grad and the argmax of chunk_hits, which
# run after it, hold fewer. kl: log_softmax of each side, exp, difference, product; jsd adds the mixture; ce: the
# drafter's log_softmax only (the label is the verifier's argmax on its raw logits, or the data's token).
LOSS_CHUNK_BUFFERS = {"ce": (1, 2), "kl": (5, 5), "rkl": (5, 5), "jsd": (6, 6), "tv": (5, 5)}


def fused_chunk(chunk: int, anchors: int, block: int, hidden: int, vocab: int, kind: str) -> int:
    """Rows per chunk of fused_head_loss: whole blocks' slots 1..B-1 (slot 0 is never made: NOTE [Slot 0 is never
    scored] in ops/torch_impl.py). The `chunk` param, else head_chunk over the A (B - 1) rows, capped at them and
    rounded down to whole blocks of B - 1 rows, at least one (D-PACE weighs a slot by its whole block; the other
    objectives take the same chunks). 0 when B is 1: nothing is scored."""
    n = block - 1
    if n <= 0 or anchors <= 0:
        return 0
    rows = anchors * n
    c = min(chunk or head_chunk(rows, hidden, vocab, kind), rows)
    return max(n, c - c % n)


def fused_head_loss(c: CostContext) -> NodeCost:
    # ops/torch_impl.head_loss_chunks, in allocation order, over slots 1..B-1 of each block only (slot 0, the
    # anchor, is never scored and never made: NOTE [Slot 0 is never scored]): the per-row losses and hits and the
    # slots' weights and mask ([A, B-1]), the gradient with respect to x when autograd records the node
    # ([A, B, hidden] in x's dtype, made in forward, kept for backward: saved_bytes), then per chunk (fused_chunk
    # rows, whole blocks) the rows both heads read ([heads * chunk, hidden], one copy), the drafter's and the
    # verifier's [chunk, vocab] logits in the model dtype (F.linear, as lm_head makes them) and _chunk_loss's
    # buffers; all freed before the next chunk; then the losses, hits (and D-PACE's weights) in the [A, B] layout
    # the loss op sums in. Backward only scales
    # the kept gradient into the input's gradient (counted by the analysis). Nothing [rows, vocab] exists.
    # FLOPs, forward only as for every op: the two heads' GEMMs (2 * A (B-1) * hidden * vocab each) and the loss's
    # ~12 per logit (the gradient's GEMM, made here in forward, is the one the unfused graph makes in backward).
    # A trainable W (not in the DFlash graphs: the drafter's head is the target's, frozen) adds its [vocab, hidden]
    # gradient accumulator in at least fp32, which this formula does not count.
    x = c.inputs["x"]
    h = x.sizes[-1]
    b = x.sizes[-2]
    a = x.numel // (h * b)
    v = c.model_dims.vocab_size
    obj = resolve_objective(c.node.params)      # the node's choices, with its preset's values
    kind = obj["kind"]
    chunk = fused_chunk(int(c.node.params.get("chunk") or 0), a, b, h, v, kind)
    rows = a * (b - 1)
    cd = max(c.dtype_bytes, 4)
    same, upcast = LOSS_CHUNK_BUFFERS[kind]
    n = same if c.dtype_bytes >= 4 else upcast
    heads = 1 if "labels" in c.inputs else 2     # labels = 'data': the drafter's head only, no verifier rows
    logits = heads * chunk * (v + h) * c.dtype_bytes
    per_row = rows * (cd + 1) + rows * (4 + 1)   # losses and hits; the slots' weights (fp32) and mask
    full = a * b * (cd + 1) + (a * b * 4 if obj["weighting"] == "dpace" else 0)   # [A, B] losses, hits, weights
    program = (("alloc", "rows", per_row), ("alloc", "chunk", logits + n * chunk * v * cd), ("free", "chunk", 0),
               ("alloc", "full", full), *(("alloc", f"out:{k}", t.nbytes) for k, t in c.outputs.items()),
               ("free", "rows", 0), ("free", "full", 0))
    gemm = 2 * rows * h * v
    return NodeCost(saved_bytes=x.nbytes if c.grad else 0, flops=heads * gemm + 12 * rows * v,
                    program=program)
