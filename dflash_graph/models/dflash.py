"""DFlash drafter: configuration and pure-Python cost formulas.

This module must not import torch: the static checker imports it to price the
drafter-forward node without torch's import time or any weights.

The torch module that these formulas describe is
``dflash_graph.models.nn.dflash.DFlashDrafter``; docs/drafter.md describes the
architecture. Notation used in every formula below:

    T  = ctx_tokens            packed sequence length (context tokens)
    A  = anchors               number of anchor blocks
    B  = block_size            slots per block
    Q  = A * B                 query tokens (block slots)
    K  = T + Q                 key/value tokens (context, then blocks)
    H  = hidden_size           drafter hidden (== target hidden: shared embedding)
    C  = n * Ht                concatenated captured target features
    I  = intermediate_size
    nh, nkv, hd                query heads, key/value heads, head dim
    b  = dtype_bytes           parameter / activation dtype (4 = fp32, 2 = bf16)

Each RMSNorm computes in float32 (Qwen3RMSNorm: ``x.to(fp32)``), so some
tensors below are 4 bytes per element whatever ``b`` is; where ``b == 4`` the
casts are no-ops and share storage, which the simulation models exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "ATTENTION_PATHS",
    "CONFIG_KEYS",
    "DFlashDims",
    "component_params",
    "default_target_layer_ids",
    "forward_flops",
    "forward_program",
    "forward_saved_bytes",
    "forward_saved_parts",
    "layer_param_tensors",
    "forward_workspace_bytes",
    "layer_backward_workspace_bytes",
    "context_backward_workspace_bytes",
]


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------

_INT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "block_size",
    "mask_token_id",
    "target_hidden_size",
    "vocab_size",
)
_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")


@attrs.frozen
class DFlashDims:
    """Dimensions of a DFlash drafter (all that the module and the costs need).

    ``target_layer_ids`` are decoder-layer indices of the target whose OUTPUTS
    are captured (HF ``hidden_states[i + 1]``); their count ``n`` sets the fc
    input width ``n * target_hidden_size``. ``target_hidden_size`` must equal
    ``hidden_size`` because the drafter reuses the target's embedding, final
    norm and lm_head.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...] = attrs.field(converter=tuple)
    target_hidden_size: int
    vocab_size: int

    def __attrs_post_init__(self) -> None:
        _validate(self)

    @property
    def num_target_features(self) -> int:
        """n: how many captured target layers are concatenated."""
        return len(self.target_layer_ids)

    @property
    def fc_in_features(self) -> int:
        """C = n * Ht, the width of the ``context`` input."""
        return len(self.target_layer_ids) * self.target_hidden_size

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, strict: bool = False) -> DFlashDims:
        """Build from a plain mapping (a TOML table or an HF-style config dict).

        Every key of ``CONFIG_KEYS`` is required, except that ``rope_theta``
        may come as ``rope_parameters = {rope_type = "default", rope_theta = ...}``
        (the transformers >= 5 spelling). Other keys are ignored (an HF config
        carries runtime keys such as ``hidden_act``), or rejected with
        ``strict=True``. Bad or missing values raise ``ValueError`` naming the key.
        """
        if not isinstance(cfg, Mapping):
            raise ValueError(f"DFlash config must be a mapping, got {type(cfg).__name__}")
        cfg = dict(cfg)
        rope = cfg.get("rope_parameters")
        if rope is not None:
            if not isinstance(rope, Mapping):
                raise ValueError(f"rope_parameters: expected a mapping, got {rope!r}")
            rope_type = rope.get("rope_type", "default")
            if rope_type != "default":
                raise ValueError(
                    f"rope_parameters.rope_type: only 'default' RoPE is implemented, got {rope_type!r}"
                )
            if "rope_theta" in rope:
                if "rope_theta" in cfg and cfg["rope_theta"] != rope["rope_theta"]:
                    raise ValueError(
                        f"rope_theta: {cfg['rope_theta']!r} disagrees with "
                        f"rope_parameters.rope_theta {rope['rope_theta']!r}"
                    )
                cfg["rope_theta"] = rope["rope_theta"]
        if strict:
            unknown = sorted(set(cfg) - CONFIG_KEYS - {"rope_parameters"})
            if unknown:
                raise ValueError(
                    f"unknown DFlash config key(s) {unknown}; valid keys: {sorted(CONFIG_KEYS)}"
                )
        missing = sorted(CONFIG_KEYS - set(cfg))
        if missing:
            raise ValueError(f"missing DFlash config key(s) {missing}" + "".join(
                f"; {MISSING_HELP[k]}" for k in missing if k in MISSING_HELP))
        kw: dict[str, Any] = {}
        for key in _INT_KEYS:
            kw[key] = _as_int(key, cfg[key])
        for key in _FLOAT_KEYS:
            kw[key] = _as_float(key, cfg[key])
        ids = cfg["target_layer_ids"]
        if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"target_layer_ids: expected a list of ints, got {ids!r}")
        kw["target_layer_ids"] = tuple(
            _as_int(f"target_layer_ids[{i}]", v) for i, v in enumerate(ids)
        )
        return cls(**kw)


CONFIG_KEYS: frozenset[str] = frozenset(f.name for f in attrs.fields(DFlashDims))

# NOTE [No default mask token]: a wrong mask id trains a drafter that no server feeds the same block input, and
# the right one depends on the target's tokenizer, so a graph declares it; the message gives the rule
# (docs/drafter.md, "The mask token and the target layers").
MISSING_HELP = {   # short: check prints at most 300 characters of a config error
    "mask_token_id": "set mask_token_id to the target tokenizer <|mask|> id, else to a token no text uses "
                     "(docs/drafter.md: The mask token and the target layers)",
    "target_layer_ids": "set target_layer_ids: n ids evenly spaced from 1 to L - 3 for L target layers, n drafter "
                        "layers (docs/drafter.md)",
}


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: expected an int, got {value!r}")
    return value


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    return float(value)


def _validate(d: DFlashDims) -> None:
    for key in _INT_KEYS:
        v = getattr(d, key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{key}: expected an int, got {v!r}")
        if key == "mask_token_id":
            if v < 0:
                raise ValueError(f"mask_token_id: must be >= 0, got {v}")
        elif v <= 0:
            raise ValueError(f"{key}: must be positive, got {v}")
    for key in _FLOAT_KEYS:
        v = getattr(d, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{key}: must be a positive number, got {v!r}")
    if d.num_attention_heads % d.num_key_value_heads:
        raise ValueError(
            f"num_key_value_heads: {d.num_key_value_heads} must divide "
            f"num_attention_heads {d.num_attention_heads}"
        )
    if d.head_dim % 2:
        raise ValueError(f"head_dim: must be even for RoPE, got {d.head_dim}")
    if d.mask_token_id >= d.vocab_size:
        raise ValueError(
            f"mask_token_id: {d.mask_token_id} is not below vocab_size {d.vocab_size}"
        )
    if d.target_hidden_size != d.hidden_size:
        raise ValueError(
            f"target_hidden_size: {d.target_hidden_size} != hidden_size {d.hidden_size}; "
            "the drafter shares the target's embedding, norm and lm_head, so they must match"
        )
    ids = d.target_layer_ids
    if not ids:
        raise ValueError("target_layer_ids: must not be empty")
    for i, v in enumerate(ids):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"target_layer_ids[{i}]: expected an int >= 0, got {v!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids: duplicate ids in {list(ids)}")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Target layers to capture: ``num_draft_layers`` ids evenly spaced from 1
    to ``L - 3`` (one draft layer: the middle layer ``L // 2``).

    Same rule as z-lab's DFlash ``build_target_layer_ids`` (mirrored by
    speculators and SpecForge): ``round(1 + i * (L - 4) / (n - 1))`` with
    Python's ``round``. L=64, n=5 -> (1, 16, 31, 46, 61). Each id is the OUTPUT
    of that decoder layer, i.e. HF ``hidden_states[id + 1]``.
    """
    if isinstance(num_target_layers, bool) or not isinstance(num_target_layers, int):
        raise ValueError(f"num_target_layers: expected an int, got {num_target_layers!r}")
    if isinstance(num_draft_layers, bool) or not isinstance(num_draft_layers, int):
        raise ValueError(f"num_draft_layers: expected an int, got {num_draft_layers!r}")
    if num_draft_layers <= 0:
        raise ValueError(f"num_draft_layers: must be positive, got {num_draft_layers}")
    if num_draft_layers == 1:
        if num_target_layers < 1:
            raise ValueError(f"num_target_layers: must be positive, got {num_target_layers}")
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end - start + 1 < num_draft_layers:
        raise ValueError(
            f"num_target_layers: {num_target_layers} layers leave fewer than "
            f"{num_draft_layers} distinct ids in [1, {end}]"
        )
    span = end - start
    return tuple(
        int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)
    )


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------


def layer_params(d: DFlashDims) -> int:
    """Trainable parameters of one draft decoder layer (no biases, as Qwen3):
    q_proj H*nh*hd, k_proj and v_proj H*nkv*hd each, o_proj nh*hd*H,
    q_norm and k_norm hd each, input/post-attention norms H each, and the
    SwiGLU MLP gate/up/down 3*H*I."""
    h, hd = d.hidden_size, d.head_dim
    q = d.num_attention_heads * hd
    kv = d.num_key_value_heads * hd
    attn = h * q + 2 * h * kv + q * h + 2 * hd
    mlp = 3 * h * d.intermediate_size
    return attn + mlp + 2 * h


def layer_param_tensors(d: DFlashDims) -> tuple[tuple[str, int], ...]:
    """One draft layer's parameters as autograd sees them, one tensor each (models/nn/dflash.py _DraftLayer), in
    the order its backward makes their gradients: the MLP's down, up and gate projections, the post-attention
    norm, o_proj, v_proj, k_norm, k_proj, q_norm, q_proj, the input norm. Autograd's AccumulateGrad
    (torch/csrc/autograd/functions/accumulate_grad.h accumulateGrad) creates each parameter's .grad, its own
    tensor and so its own allocator request, when that parameter's gradient is first computed; a parameter used
    twice (k_proj, v_proj over the context and the block) has its two gradients summed before, one .grad.
    (name, elements); the elements sum to layer_params(d)."""
    h, hd, i = d.hidden_size, d.head_dim, d.intermediate_size
    q = d.num_attention_heads * hd
    kv = d.num_key_value_heads * hd
    return (("down_proj", i * h), ("up_proj", h * i), ("gate_proj", h * i), ("post_attention_layernorm", h),
            ("o_proj", q * h), ("v_proj", h * kv), ("k_norm", hd), ("k_proj", h * kv), ("q_norm", hd),
            ("q_proj", h * q), ("input_layernorm", h))


def component_params(d: DFlashDims) -> dict[str, int]:
    """Trainable parameters owned by the drafter, by component.

    ``fc``: Linear(n*Ht, H, bias=False); ``hidden_norm``: RMSNorm(H);
    ``layers``: ``num_hidden_layers * layer_params(d)``; ``norm``: RMSNorm(H),
    the drafter's own final norm, which exists only where the drafter's
    ``shares`` leave ``norm`` out (the memory model charges a component to the
    model that owns it: a shared norm is the target's). The embedding and
    lm_head are the target's (shared, frozen) and are not counted.
    """
    return {
        "fc": d.fc_in_features * d.hidden_size,
        "hidden_norm": d.hidden_size,
        "layers": d.num_hidden_layers * layer_params(d),
        "norm": d.hidden_size,
    }


# ---------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------


def forward_flops(d: DFlashDims, ctx_tokens: int, anchors: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one drafter forward.

    Counts: fc ``2*T*C*H``; per layer q_proj/o_proj ``2*Q*H*nh*hd`` each,
    k_proj/v_proj over context and block tokens ``2*K*H*nkv*hd`` each,
    attention scores and the probability-value product ``2*nh*Q*K*hd`` each
    (dense over the masked [Q, K] grid: SDPA with a dense mask computes every
    entry, masked or not), MLP ``3 * 2*Q*H*I``. Norms, RoPE, softmax, SiLU and
    residual adds (O(elements), not O(elements * width)) are not counted; the
    embedding lookup is a gather (0 FLOPs).
    """
    t, q = _check_sizes(ctx_tokens, anchors, d)
    k = t + q
    h, hd = d.hidden_size, d.head_dim
    nh, nkv = d.num_attention_heads, d.num_key_value_heads
    fc = 2 * t * d.fc_in_features * h
    proj = 2 * q * h * nh * hd * 2 + 2 * k * h * nkv * hd * 2
    attn = 2 * nh * q * k * hd * 2
    mlp = 2 * q * h * d.intermediate_size * 3
    return fc + d.num_hidden_layers * (proj + attn + mlp)


def _check_sizes(ctx_tokens: int, anchors: int, d: DFlashDims) -> tuple[int, int]:
    for name, v in (("ctx_tokens", ctx_tokens), ("anchors", anchors)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
    return ctx_tokens, anchors * d.block_size


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------
#
# What the forward allocates is modelled tensor by tensor, in the order
# ``DFlashDrafter.forward`` allocates and frees it, so that both the bytes that
# autograd keeps for backward ("saved") and the transient peak above them
# ("workspace") come out of one replay (``_replay``). ``forward_saved_bytes`` is
# also written in closed form (``_saved_closed_form``); tests hold the two
# equal and compare both with torch's MemTracker on CPU.
#
# Scope: tensors the forward itself allocates. Not counted: the inputs
# (context, input_ids, position_ids, anchors), the parameters and the shared
# embedding table, which autograd references but does not copy; kernel-
# internal scratch that never appears as an op output (e.g. the fused
# attention kernel's tile buffers, the internals of ``_safe_softmax``).
# Tensors the size of hd/2 (inv_freq) and 0-d scalars are ignored.
#
# Attention paths (argument ``attention``):
#   "fused": one fused SDPA kernel that never materialises [nh, Q, K] scores:
#            CPU ``_scaled_dot_product_flash_attention_for_cpu`` (what the CPU
#            runs for 4-D inputs, masks and GQA alike) and CUDA's memory-
#            efficient kernel (which supports an additive mask and GQA on
#            sm80+). It saves q, k, v (GQA-sized, not repeated), the output and
#            a float32 logsumexp [nh, Q] (CUDA pads Q up to a multiple of 32:
#            not modelled), plus the additive mask. CUDA's kernel also needs
#            the mask's last dim (K) aligned to 16 or it pads a copy per layer:
#            keep T + A*B a multiple of 16.
#   "math":  torch's reference composite (``_scaled_dot_product_attention_math``,
#            chosen when no fused kernel qualifies, or forced with
#            ``sdpa_kernel(SDPBackend.MATH)``): upcasts q, k, v to float32,
#            repeats k and v to nh heads for GQA, and materialises float32
#            scores [nh, Q, K] twice (scores, scores + mask) and the softmax
#            probabilities, which it saves. At the 27B scale that is tens of GiB
#            per layer; the static checker should flag it.

ATTENTION_PATHS: frozenset[str] = frozenset({"fused", "math"})

_F32 = 4  # float32: RMSNorm compute dtype, logsumexp, math-path attention
_I64 = 8  # int64 index tensors
_BOOL = 1


def _check_mem_args(d: DFlashDims, ctx_tokens: int, anchors: int, dtype_bytes: int, attention: str):
    t, q = _check_sizes(ctx_tokens, anchors, d)
    if isinstance(dtype_bytes, bool) or dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes: expected 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes!r}")
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"attention: expected one of {sorted(ATTENTION_PATHS)}, got {attention!r}")
    return t, q


def _saved_closed_form(d: DFlashDims, t: int, a: int, b: int, attention: str) -> int:
    """Bytes autograd saves in one drafter forward, as a sum of named tensors."""
    shared, layers = _saved_tensors(d, t, a, b, attention)
    return sum(shared) + sum(sum(layer) for layer in layers)


def _saved_tensors(d: DFlashDims, t: int, a: int, b: int,
                   attention: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """_saved_parts tensor by tensor, the bytes of each in the order the forward makes it: (the shared tensors,
    each layer's). Each is its own allocation when the forward makes it, which the caching allocator places and
    frees on its own (ops/costs.py NOTE [Layered backward])."""
    B = d.block_size
    q = a * B
    k = t + q
    h, hd, inter = d.hidden_size, d.head_dim, d.intermediate_size
    nh, nkv, L = d.num_attention_heads, d.num_key_value_heads, d.num_hidden_layers
    qd, kvd = nh * hd, nkv * hd

    def norm(n: int, dim: int) -> tuple[int, int, int]:
        # RMSNorm on an input that needs grad saves: x in float32 (pow and mul
        # backward; for fp32 this IS the input), rsqrt(var) [n, 1] float32,
        # and the normalised x cast back to b (for the weight's grad).
        return (_F32 * n * dim, _F32 * n, b * n * dim)

    shared = (
        *norm(t, h),  # hidden_norm(fc(context))
        b * t * h,  # ctx = hidden_norm output, input of every k_proj/v_proj
        b * k * hd, b * k * hd,  # RoPE cos, sin [K, hd] (saved by the q and k rotations)
    )
    if attention == "fused":
        shared += (b * q * k,)  # the additive mask [Q, K], one tensor for all layers

    def layer(i: int) -> tuple[int, ...]:
        # layer 0's input is the frozen embedding output: its input_layernorm
        # saves only the normalised x (no grad flows into the embedding)
        ts = (norm(q, h)[2:] if i == 0 else norm(q, h))  # input_layernorm(h)
        ts += (b * q * h,)  # its output x, input of q/k/v_proj
        ts += norm(q * nh, hd)  # q_norm(q_proj(x))
        ts += norm(k * nkv, hd)  # k_norm(cat(k_proj(ctx), k_proj(x)))
        if attention == "fused":
            ts += (
                b * q * qd,  # q after RoPE
                b * k * kvd, b * k * kvd,  # k after RoPE, v = cat(v_proj(ctx), v_proj(x))
                _F32 * nh * q,  # logsumexp [nh, Q]
            )  # (the output is the o_proj input below: same storage)
        else:
            ts += (
                _F32 * nh * q * hd,  # q * sqrt(scale), float32
                _F32 * nh * k * hd, _F32 * nh * k * hd,  # k^T * sqrt(scale), v: float32, repeated to nh heads
                _F32 * nh * q * k,  # softmax probabilities [nh, Q, K]
            )
        ts += (b * q * qd,)  # attention output [Q, nh*hd], input of o_proj
        ts += norm(q, h)  # post_attention_layernorm(h + attn)
        ts += (b * q * h,)  # its output, input of gate/up_proj
        ts += (b * q * inter,) * 4  # gate out (SiLU), SiLU out and up out (product), product (down_proj)
        return ts

    return shared, tuple(layer(i) for i in range(L))


def layer_backward_workspace_bytes(d: DFlashDims, ctx_tokens: int, anchors: int, dtype_bytes: int) -> int:
    """The activation gradients a draft layer's backward holds at once besides its weight gradients, as a bound:
    at the attention's backward, the gradient of its output [Q, nh*hd] and SDPA's gradients of q [Q, nh*hd] and
    of k and v [K, nkv*hd] (torch's CPU flash-attention backward returns them GQA-sized), and the gradient of the
    normed context [T, H], which autograd accumulates over every layer's k and v projections. The memory model
    puts the layer's weight gradients and this block on top of the layer's saved tensors before it frees them
    (autograd frees each op's saved tensors as the op's backward ends, during the layer): an upper bound of the
    layer's backward (ops/costs.py NOTE [Layered backward]; tests/test_dp.py measures it)."""
    t, q = _check_sizes(ctx_tokens, anchors, d)
    k = t + q
    qd, kvd = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    return dtype_bytes * (2 * q * qd + 2 * k * kvd + t * d.hidden_size)


def context_backward_workspace_bytes(d: DFlashDims, ctx_tokens: int, dtype_bytes: int) -> int:
    """The context stream's backward (fc, hidden_norm) besides its weight gradients: the gradient of the normed
    context and of fc's output, [T, H] each."""
    return 2 * dtype_bytes * ctx_tokens * d.hidden_size


def forward_saved_parts(
    d: DFlashDims, ctx_tokens: int, anchors: int, dtype_bytes: int, *, attention: str = "fused"
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """forward_saved_bytes split as the backward frees it, tensor by tensor: (what the backward keeps to its end,
    each layer's), the bytes of each saved tensor; they sum to forward_saved_bytes."""
    t, _ = _check_mem_args(d, ctx_tokens, anchors, dtype_bytes, attention)
    return _saved_tensors(d, t, anchors, dtype_bytes, attention)


class _Tape:
    """Replays allocations and frees; tracks the live total and its peak."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.saved: set[int] = set()
        self.cur = 0
        self.peak = 0
        self._next = 0
        self.events: list[tuple[str, int, int]] = []

    def alloc(self, nbytes: int) -> int:
        self._next += 1
        self.live[self._next] = nbytes
        self.cur += nbytes
        self.peak = max(self.peak, self.cur)
        self.events.append(("alloc", self._next, nbytes))
        return self._next

    def save(self, *ids: int) -> None:
        self.saved.update(ids)

    def release(self, *ids: int | None) -> None:
        """Drop the last Python reference: freed unless autograd saved it."""
        for i in ids:
            if i is not None and i in self.live and i not in self.saved:
                self.cur -= self.live.pop(i)
                self.events.append(("free", i, 0))


def _replay(d: DFlashDims, t: int, a: int, b: int, attention: str) -> tuple[int, int, int]:
    """(saved bytes, peak bytes, output bytes) of one forward, replayed."""
    tp, out_id = _run_tape(d, t, a, b, attention)
    out = tp.live[out_id]
    return tp.cur - out, tp.peak, out


def _run_tape(d: DFlashDims, t: int, a: int, b: int, attention: str) -> tuple[_Tape, int]:
    B = d.block_size
    q = a * B
    k = t + q
    h, hd, inter = d.hidden_size, d.head_dim, d.intermediate_size
    nh, nkv = d.num_attention_heads, d.num_key_value_heads
    qd, kvd = nh * hd, nkv * hd
    tp = _Tape()
    cast = b != _F32  # False: .to(float32) / .to(b) are no-ops sharing storage

    def norm(x: int, n: int, dim: int, grad: bool) -> int:
        # RMSNorm.forward: x32 = x.to(f32); y = x32 * rsqrt(x32.pow(2).mean(-1) + eps);
        # return w * y.to(b)
        x32 = tp.alloc(_F32 * n * dim) if cast else x
        pw = tp.alloc(_F32 * n * dim)  # x32.pow(2)
        mn = tp.alloc(_F32 * n)  # .mean(-1)
        tp.release(pw)
        ve = tp.alloc(_F32 * n)  # + eps
        tp.release(mn)
        r = tp.alloc(_F32 * n)  # rsqrt
        tp.release(ve)
        if grad:
            tp.save(x32, r)
        y32 = tp.alloc(_F32 * n * dim)  # x32 * r
        tp.release(r)
        yb = tp.alloc(b * n * dim) if cast else y32  # y.to(b)
        tp.save(yb)  # the weight's grad needs it
        out = tp.alloc(b * n * dim)  # w * y
        if cast:
            tp.release(y32, x32)
        return out

    def rope(x: int, n: int) -> int:
        # x*cos + cat(-x2, x1)*sin; cos/sin are saved (the globals below)
        t1 = tp.alloc(b * n)
        neg = tp.alloc(b * n // 2)
        rot = tp.alloc(b * n)
        tp.release(neg)
        t2 = tp.alloc(b * n)
        tp.release(rot)
        out = tp.alloc(b * n)
        tp.release(t1, t2)
        return out

    # -- block_token_ids, embedding ------------------------------------------
    ids = tp.alloc(_I64 * q)  # torch.full([A, B], mask id)
    tmp = tp.alloc(_I64 * a)  # input_ids[anchors]
    tp.release(tmp)
    hcur = tp.alloc(b * q * h)  # embedding of the block tokens (no grad)
    tp.release(ids)
    # -- context stream --------------------------------------------------------
    fco = tp.alloc(b * t * h)  # fc(context)
    ctx = norm(fco, t, h, grad=True)  # hidden_norm
    tp.release(fco)
    tp.save(ctx)  # input of every k_proj / v_proj
    # -- RoPE tables -----------------------------------------------------------
    pa = tp.alloc(_I64 * a)  # position_ids[anchors]
    ar = tp.alloc(_I64 * B)  # arange(B)
    bp = tp.alloc(_I64 * q)  # block positions
    tp.release(pa, ar)
    cp = tp.alloc(_I64 * k)  # cat(position_ids, block positions)
    tp.release(bp)
    pf = tp.alloc(_F32 * k)  # .to(float32)
    fr = tp.alloc(_F32 * k * hd // 2)  # positions x inv_freq
    tp.release(pf)
    emb = tp.alloc(_F32 * k * hd)  # cat(freqs, freqs)
    tp.release(fr)
    tables = []
    for _ in ("cos", "sin"):
        c32 = tp.alloc(_F32 * k * hd)
        c = tp.alloc(b * k * hd) if cast else c32
        if cast:
            tp.release(c32)
        tables.append(c)
    tp.release(emb, cp)
    tp.save(*tables)
    # -- additive attention mask -----------------------------------------------
    st = tp.alloc(_BOOL * t)  # document starts
    ad = tp.alloc(_I64 * t)  # pos[:-1] + 1 (T-1 elements, counted as T)
    ne = tp.alloc(_BOOL * t)
    tp.release(ad, ne)
    sl = tp.alloc(_I64 * t)  # starts.to(int64)
    cs = tp.alloc(_I64 * t)  # cumsum
    tp.release(sl)
    doc = tp.alloc(_I64 * t)  # - 1
    tp.release(cs, st)
    jj = tp.alloc(_I64 * t)  # arange(T)
    da = tp.alloc(_I64 * a)  # doc[anchors]
    eq = tp.alloc(_BOOL * a * t)  # same document
    lt = tp.alloc(_BOOL * a * t)  # strictly before the anchor
    cv = tp.alloc(_BOOL * a * t)  # and
    tp.release(eq, lt, da)
    ey = tp.alloc(_BOOL * a * a)  # eye(A)
    ow = tp.alloc(_BOOL * a * q)  # own block, repeated over its B slots
    tp.release(ey)
    vis = tp.alloc(_BOOL * a * k)  # cat -> visibility rows [A, K]
    tp.release(cv, ow, doc, jj)
    rows = tp.alloc(b * a * k)  # zeros + masked_fill(-inf)
    tp.release(vis)
    bias = tp.alloc(b * q * k)  # rows.repeat_interleave(B, 0): [Q, K]
    tp.release(rows)

    # -- layers ----------------------------------------------------------------
    for li in range(d.num_hidden_layers):
        x = norm(hcur, q, h, grad=li > 0)  # input_layernorm
        tp.save(x)  # input of q_proj, k_proj, v_proj
        # queries
        qp = tp.alloc(b * q * qd)  # q_proj(x)
        qn = norm(qp, q * nh, hd, grad=True)  # q_norm
        tp.release(qp)
        qr = rope(qn, q * qd)
        tp.release(qn)
        # keys
        kc = tp.alloc(b * t * kvd)  # k_proj(ctx)
        kb = tp.alloc(b * q * kvd)  # k_proj(x)
        kk = tp.alloc(b * k * kvd)  # cat
        tp.release(kc, kb)
        kn = norm(kk, k * nkv, hd, grad=True)  # k_norm
        kr = rope(kn, k * kvd)
        tp.release(kn, kk)  # `k = _rope(k_norm(k)...)`: the old k lives until then
        # values
        vc = tp.alloc(b * t * kvd)  # v_proj(ctx)
        vb = tp.alloc(b * q * kvd)  # v_proj(x)
        vv = tp.alloc(b * k * kvd)  # cat
        tp.release(vc, vb)
        # attention
        if attention == "fused":
            o = tp.alloc(b * q * qd)  # output [1, nh, Q, hd] (laid out [Q, nh, hd])
            lse = tp.alloc(_F32 * nh * q)  # logsumexp
            tp.save(qr, kr, vv, o, lse, bias)
            tp.release(qr, kr, vv)
            oin = o  # transpose + reshape: a view, no copy
        else:
            q32 = tp.alloc(_F32 * q * qd) if cast else qr  # .to(float32)
            k32 = tp.alloc(_F32 * k * kvd) if cast else kr
            v32 = tp.alloc(_F32 * k * kvd) if cast else vv
            qs = tp.alloc(_F32 * q * qd)  # q * sqrt(scale)
            gqa = nh != nkv
            kre = tp.alloc(_F32 * k * qd) if gqa else k32  # repeat_interleave to nh heads
            vre = tp.alloc(_F32 * k * qd) if gqa else v32
            kts = tp.alloc(_F32 * k * qd)  # k^T * sqrt(scale)
            sc = tp.alloc(_F32 * nh * q * k)  # q @ k^T
            sm = tp.alloc(_F32 * nh * q * k)  # + mask (out of place)
            tp.release(sc)
            pr = tp.alloc(_F32 * nh * q * k)  # _safe_softmax
            tp.release(sm)
            tp.save(qs, kts, vre, pr)
            prb = tp.alloc(b * nh * q * k) if cast else None  # weights cast back, discarded
            o32 = tp.alloc(_F32 * q * qd)  # probs @ v
            o = tp.alloc(b * q * qd) if cast else o32  # .to(b)
            if cast:
                tp.release(q32, k32, v32, prb, o32)
            tp.release(kre, qr, kr, vv)  # kre: GQA copy; q, k, v: `del q, k, v`
            oin = tp.alloc(b * q * qd)  # transpose + reshape: a copy
        tp.save(oin)  # input of o_proj
        op = tp.alloc(b * q * h)  # o_proj
        tp.release(o)
        hm = tp.alloc(b * q * h)  # h + attn
        tp.release(op)
        x2 = norm(hm, q, h, grad=True)  # post_attention_layernorm
        tp.save(x2)  # input of gate_proj, up_proj
        g = tp.alloc(b * q * inter)  # gate_proj
        s = tp.alloc(b * q * inter)  # silu
        u = tp.alloc(b * q * inter)  # up_proj
        p = tp.alloc(b * q * inter)  # silu * up
        tp.save(g, s, u, p)
        dn = tp.alloc(b * q * h)  # down_proj
        hn = tp.alloc(b * q * h)  # h + mlp
        tp.release(dn, hm)
        tp.release(hcur)  # the caller rebinds h
        hcur = hn
    tp.release(bias, ctx, *tables)  # forward returns: locals dropped (freed unless saved)
    leaked = [i for i in tp.live if i not in tp.saved and i != hcur]
    assert not leaked, f"replay leaked {leaked}"  # noqa: S101 (a bug in the replay itself)
    return tp, hcur


def forward_saved_bytes(
    d: DFlashDims, ctx_tokens: int, anchors: int, dtype_bytes: int, *, attention: str = "fused"
) -> int:
    """Bytes that autograd keeps alive from the drafter forward until backward
    (trainable drafter; frozen embedding), excluding inputs and parameters.

    Sum of (see ``_saved_closed_form`` for the per-tensor comments): the
    hidden_norm's float32 input, rsqrt and normalised output, and the normed
    context [T, H]; RoPE cos/sin [K, hd]; the additive mask [Q, K] (fused path
    only); per layer the three RMSNorms' saved tensors (input_layernorm,
    q_norm over [Q*nh, hd], k_norm over [K*nkv, hd], post_attention_layernorm),
    the inputs of q/k/v_proj, o_proj, gate/up_proj, down_proj, SiLU and the
    product, and what SDPA saves (fused: q, k, v, out, logsumexp; math: scaled
    q, k, repeated v, softmax probabilities [nh, Q, K], all float32).
    """
    t, _ = _check_mem_args(d, ctx_tokens, anchors, dtype_bytes, attention)
    return _saved_closed_form(d, t, anchors, dtype_bytes, attention)


def forward_workspace_bytes(
    d: DFlashDims, ctx_tokens: int, anchors: int, dtype_bytes: int, *, attention: str = "fused"
) -> int:
    """Transient peak of the drafter forward above its inputs, its output and
    what it saves: ``peak - (saved + output)``, so that the forward's peak is
    ``inputs + forward_saved_bytes + output + forward_workspace_bytes``.

    From a replay of every allocation and free of ``DFlashDrafter.forward``
    (``_replay``): the temporaries of each RMSNorm (float32 copies, x^2), of
    each RoPE rotation, the per-layer context K/V projections before their
    concatenation, the mask construction, and, on the math path, the float32
    [nh, Q, K] scores. The peak is usually reached in the last layer, when all
    but that layer's saved tensors already exist.
    """
    t, _ = _check_mem_args(d, ctx_tokens, anchors, dtype_bytes, attention)
    saved, peak, out = _replay(d, t, anchors, dtype_bytes, attention)
    return max(0, peak - saved - out)


def forward_program(
    d: DFlashDims, ctx_tokens: int, anchors: int, dtype_bytes: int, *, attention: str = "fused"
) -> tuple[tuple[str, str, int], ...]:
    """The replayed allocation order of one forward, for an allocator model:
    ``("alloc", key, bytes)`` / ``("free", key, 0)`` in program order. The
    output [A, B, H] is keyed ``"out:hidden"``; tensors autograd saves are
    keyed ``"saved:<n>"`` and are never freed here (they live until backward,
    and together they are ``forward_saved_bytes``); everything else is
    ``"tmp:<n>"`` and is freed before the forward returns.
    """
    t, _ = _check_mem_args(d, ctx_tokens, anchors, dtype_bytes, attention)
    tp, out_id = _run_tape(d, t, anchors, dtype_bytes, attention)

    def key(i: int) -> str:
        if i == out_id:
            return "out:hidden"
        return f"saved:{i}" if i in tp.saved else f"tmp:{i}"

    return tuple((kind, key(i), n) for kind, i, n in tp.events)
