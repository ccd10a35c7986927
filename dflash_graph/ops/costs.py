"""Per-op cost: transient workspace, bytes saved for backward, FLOPs. Output bytes come from the inferred types.

Each formula names what allocates. Architecture-specific formulas live with the architecture
(models/qwen3_5.py, models/dflash.py) and are checked there against torch's MemTracker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..ir.graph import Node
from ..ir.types import TensorType


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


@attrs.frozen
class CostContext:
    node: Node
    inputs: Mapping[str, TensorType]
    outputs: Mapping[str, TensorType]
    model_dims: Any            # the arch's Dims object, or None
    dtype_bytes: int           # the node's model dtype width (2 for bf16), or of its first input
    grad: bool                 # autograd records this node (it feeds a trainable model's loss)

    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs.values())


def no_workspace(c: CostContext) -> NodeCost:
    return NodeCost()


def _rows(t: TensorType) -> int:
    return t.numel // t.sizes[-1] if t.shape else 1


def norm(c: CostContext) -> NodeCost:
    # Qwen3_5RMSNorm.forward: x.float() [fp32 copy], x.pow(2) [fp32], x * rsqrt(...) [fp32], * (1 + w.float()) [fp32],
    # .type_as(x) [the output]. At most two fp32 [*, hidden] temporaries are alive at once (pow is freed after mean).
    x = c.inputs["x"]
    fp32 = x.numel * 4
    ws = 2 * fp32 if x.dtype != "float32" else fp32
    # backward of x * rsqrt(mean(x^2)) * (1 + w) keeps the fp32 upcast of x and the per-row rsqrt
    saved = (x.numel * 4 * (x.dtype != "float32") + _rows(x) * 4) if c.grad else 0
    return NodeCost(workspace_bytes=ws, saved_bytes=saved, flops=6 * x.numel,
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


def _qwen_body(c: CostContext) -> tuple[int, int]:
    from ..models import qwen3_5

    seq = c.inputs["input_ids"].sizes[0]
    d = c.model_dims
    ws = qwen3_5.body_forward_workspace_bytes(d, seq, c.dtype_bytes)
    # Qwen3_5TextModel.forward applies the final norm to the last hidden state before returning it, even though
    # body_forward hands back the pre-norm output: that normed copy and the norm's fp32 temporaries are transient.
    final_norm = seq * d.hidden_size * (c.dtype_bytes + 2 * 4)
    return max(ws, final_norm), qwen3_5.body_forward_flops(d, seq)


def _body_program(c: CostContext, ws: int, logits: bool) -> tuple[tuple[str, str, int], ...]:
    """Per layer: the layer's temporaries (the two [seq, intermediate] MLP projections first, the rest after),
    then its output [seq, hidden], then the temporaries are freed; a layer output no one captured is freed once
    the next layer has consumed it. Hooked outputs are thereby allocated between big temporaries, as on a GPU."""
    d = c.model_dims
    seq = c.inputs["input_ids"].sizes[0]
    h = seq * d.hidden_size * c.dtype_bytes
    mlp = seq * d.intermediate_size * c.dtype_bytes
    pieces = [mlp, mlp, max(ws - 2 * mlp, 0)] if ws > 2 * mlp else [ws]
    captured = {int(k[5:]) for k in c.outputs if k.startswith("layer")}
    last = d.num_hidden_layers - 1
    steps: list[tuple[str, str, int]] = [("alloc", "embeds", h)]
    prev = "embeds"
    for i in range(d.num_hidden_layers):
        for j, b in enumerate(pieces):
            if b:
                steps.append(("alloc", f"l{i}.t{j}", b))
        cur = f"out:layer{i}" if i in captured else ("out:hidden" if i == last and "hidden" in c.outputs else f"l{i}.out")
        if i == last and i in captured and "hidden" in c.outputs:
            cur = f"out:layer{i}"  # the same tensor; 'hidden' aliases it below
        steps.append(("alloc", cur, h))
        for j, b in enumerate(pieces):
            if b:
                steps.append(("free", f"l{i}.t{j}", 0))
        if not prev.startswith("out:"):
            steps.append(("free", prev, 0))
        prev = cur
    # Qwen3_5TextModel.forward: the final norm's fp32 temporaries and its [seq, hidden] result
    steps += [("alloc", "norm.fp32", 2 * seq * d.hidden_size * 4), ("alloc", "normed", h), ("free", "norm.fp32", 0)]
    if logits:
        steps.append(("alloc", "out:logits", c.outputs["logits"].nbytes))
    steps.append(("free", "normed", 0))
    if not prev.startswith("out:"):
        steps.append(("free", prev, 0))
    return tuple(steps)


def body_forward(c: CostContext) -> NodeCost:
    ws, flops = _qwen_body(c)
    return NodeCost(workspace_bytes=ws, flops=flops, program=_body_program(c, ws, logits=False))


def causal_lm_forward(c: CostContext) -> NodeCost:
    # Qwen3_5ForCausalLM.forward: body -> last_hidden_state (normed, [seq, hidden]) -> lm_head -> logits. While
    # the logits are allocated, the normed hidden state is alive (it is the GEMM's input).
    from ..models import qwen3_5

    ws, flops = _qwen_body(c)
    seq = c.inputs["input_ids"].sizes[0]
    normed = seq * c.model_dims.hidden_size * c.dtype_bytes
    return NodeCost(workspace_bytes=max(ws, normed), flops=flops + qwen3_5.lm_head_flops(c.model_dims, seq),
                    program=_body_program(c, ws, logits=True))


def drafter_forward(c: CostContext) -> NodeCost:
    from ..models import dflash

    ctx = c.inputs["context"].sizes[0]
    anchors = c.inputs["anchors"].sizes[0]
    d = c.model_dims
    return NodeCost(
        workspace_bytes=dflash.forward_workspace_bytes(d, ctx, anchors, c.dtype_bytes),
        saved_bytes=dflash.forward_saved_bytes(d, ctx, anchors, c.dtype_bytes) if c.grad else 0,
        flops=dflash.forward_flops(d, ctx, anchors),
    )


def loss(c: CostContext) -> NodeCost:
    # ops/torch_impl.loss works on `chunk` rows of [anchors*block, vocab] at a time and recomputes each chunk in
    # backward (activation checkpointing), so only one chunk's fp32 temporaries exist at once: the student's
    # upcast and log_softmax, the target's upcast and log_softmax/softmax, and the divergence terms: 6 fp32
    # [chunk, vocab] tensors at the peak (measured by tests/test_memory_vs_memtracker.py). Backward of a chunk
    # adds the chunk's gradient (fp32) and the [chunk, vocab] grad in the logits dtype is written into one
    # full-size gradient of the logits (counted by the analysis as the input's gradient).
    x = c.inputs["logits"]
    v = x.sizes[-1]
    rows = x.numel // v
    chunk = min(int(c.node.params.get("chunk", 1024)), rows)
    ws = 6 * chunk * v * 4
    return NodeCost(workspace_bytes=ws, flops=12 * x.numel, saved_inputs=("logits", "target") if c.grad else ())
