"""Cost formulas for the Qwen3.5 / 3.6 text model (pure Python, no torch import).

Everything here is arithmetic on the dims of an HF ``config.json`` so that the
static checker can price a 27B target in microseconds, without torch or weights.

Reference implementation that every formula is read from (line numbers are for
that file, transformers 5.23.0; "mq L563" means modeling_qwen3_5.py line 563):

    transformers/models/qwen3_5/modeling_qwen3_5.py   (mq)
    transformers/models/qwen3_5/configuration_qwen3_5.py (cq)
    transformers/masking_utils.py                      (masking_utils)
    transformers/integrations/sdpa_attention.py        (sdpa_attention)

Memory model
------------
``body_forward_workspace_bytes`` replays, tensor by tensor, the allocations and
frees that ``Qwen3_5TextModel.forward`` (``model.model(...)``) makes under
``torch.no_grad()``, in program order, and returns the running maximum of live
bytes.  It counts what torch's ``MemTracker`` counts: the storages of tensors
that aten ops return (views are free, ``F.pad``/``clone``/``cat``/matmul outputs
are not), alive from the op that makes them until the last Python reference
drops.  Not counted: the input hidden state [seq, hidden] (the embedding
output / ``inputs_embeds``: it stays referenced by ``inputs_embeds`` in
``Qwen3_5TextModel.forward`` for the whole call), parameters and buffers,
scratch memory inside fused kernels (flash-attention tiles, cuBLAS/LAPACK
workspaces), and the caching allocator's rounding and fragmentation.

The peak is per layer, not per model (no_grad keeps nothing between layers
except the running hidden state), unless ``use_cache=True``: then the
DynamicCache keeps K/V of every full-attention layer and the Gated DeltaNet
conv/recurrent states, and the peak grows with depth.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "ATTENTION_MODES",
    "ATTN_IMPLEMENTATIONS",
    "LINEAR_KERNELS",
    "PACKINGS",
    "forward_assumptions",
    "forward_kwargs",
    "installed_linear_kernels",
    "kernel_notes",
    "CONFIG_KEYS",
    "IGNORED_CONFIG_KEYS",
    "LAYER_TYPES",
    "Qwen35Dims",
    "body_forward_flops",
    "body_forward_flops_breakdown",
    "body_forward_output_bytes",
    "body_forward_peak_bytes",
    "body_forward_workspace_breakdown",
    "body_forward_workspace_bytes",
    "cache_bytes",
    "component_params",
    "layer_params",
    "lm_head_flops",
    "logits_bytes",
    "max_seq_within",
    "total_params",
]

LAYER_TYPES = ("linear_attention", "full_attention")

#: chunk size of ``torch_chunk_gated_delta_rule`` (mq L292, default used at mq L632)
DELTA_RULE_CHUNK = 64

#: Attention kernels that ``F.scaled_dot_product_attention`` can pick (sdpa_attention L193).
#:  - "flash":     CUDA flash (or cuDNN) kernel: no [seq, seq] tensor; output laid out
#:                 [batch, seq, heads, dim], so transformers' ``.transpose(1, 2).contiguous()``
#:                 (sdpa_attention L206) is free.  GQA via ``enable_gqa`` (no repeat_kv).
#:                 With a materialised mask (``packed=True``) CUDA cannot use flash and takes
#:                 the memory-efficient kernel instead; see ``_sdpa``.
#:  - "cpu_flash": ``aten._scaled_dot_product_flash_attention_for_cpu`` (what CPU and fake CPU
#:                 tensors take, measured): no [seq, seq] tensor, but the output is laid out
#:                 [batch, heads, seq, dim], so ``.contiguous()`` copies it once.
#:  - "math":      ``aten._scaled_dot_product_attention_math`` (forced with
#:                 ``sdpa_kernel(SDPBackend.MATH)``, or the fallback when no fused kernel
#:                 accepts the inputs, e.g. fake CUDA tensors): materialises [heads, seq, seq].
ATTENTION_MODES = ("flash", "cpu_flash", "math")

#: ``config._attn_implementation`` values a graph may declare (``models.<name>.attn_implementation``).
#: transformers' default is "sdpa" whenever torch has ``scaled_dot_product_attention``
#: (modeling_utils.py ``PreTrainedModel._check_and_adjust_attn_implementation``); flash_attention_2
#: is used only when asked for, and needs the flash-attn package.
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")

#: How a packed sequence (several documents, position_ids restarting at 0) reaches the model
#: (``models.<name>.packing``):
#:  - "documents":  one forward per document (what ``dflash-graph run`` does); the prediction is
#:                  for the longest possible document, the whole sequence.
#:  - "mask":       one forward over the packed row with its position_ids: transformers' sdpa and
#:                  eager paths build a dense [seq, seq] mask (masking_utils.py
#:                  ``find_packed_sequence_indices``, ``sdpa_mask``, ``eager_mask``).
#:  - "cu_seqlens": one forward over the packed row; flash_attention_2 turns position_ids into
#:                  cu_seqlens (modeling_flash_attention_utils.py ``_prepare_from_posids``): no mask.
PACKINGS = ("documents", "mask", "cu_seqlens")

#: Kernels of the Gated DeltaNet layers (``models.<name>.linear_kernels``): "torch" = transformers'
#: reference code (``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn`` in modeling_qwen3_5.py);
#: "fla" = flash-linear-attention's ``chunk_gated_delta_rule`` and causal-conv1d's
#: ``causal_conv1d_fn``, which transformers picks up whenever they import
#: (integrations/hub_kernels.py ``use_kernel_func_from_hub_with_fallback``).
LINEAR_KERNELS = ("torch", "fla")

#: the versions whose Python wrappers the "fla" program (pinned: read from the wheel and the sdist)
#: and the flash_attention_2 program (flash-attn 2's interface; its 2.8.3 sdist cannot be unpacked
#: without CUDA here, so no line numbers) were read from.  Not yet measured on a GPU:
#: tools/gpu_check.py measures them when one is lent.
KERNEL_VERSIONS = {"fla-core": "0.6.0", "causal-conv1d": "1.7.0", "flash-attn": "2"}

F32 = 4  # bytes of float32: every upcast (RMSNorm, delta rule, rotary) is to fp32

# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------

# HF defaults: Qwen3_5TextConfig field defaults (cq L82-L106); partial_rotary_factor from
# cq L111; full_attention_interval from cq L113.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
}

_INT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)

#: keys that ``Qwen35Dims.from_config`` reads (they change a cost).
CONFIG_KEYS: frozenset[str] = frozenset(
    _INT_KEYS
    + (
        "tie_word_embeddings",
        "attention_bias",
        "partial_rotary_factor",
        "rope_parameters",
        "full_attention_interval",
        "layer_types",
    )
)

#: keys of a Qwen3.5 ``config.json`` (text_config or top level) that are accepted and have
#: no effect on any cost here (numerics, token ids, bookkeeping, MTP head that transformers
#: drops at load: ``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`` mq L918).
IGNORED_CONFIG_KEYS: frozenset[str] = frozenset(
    {
        "architectures",
        "attention_dropout",
        "attn_output_gate",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "hidden_act",
        "image_token_id",
        "initializer_range",
        "mamba_ssm_dtype",
        "max_position_embeddings",
        "model_type",
        "mtp_num_hidden_layers",
        "mtp_use_dedicated_embeddings",
        "pad_token_id",
        "rms_norm_eps",
        "rope_scaling",
        "rope_theta",
        "text_config",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "video_token_id",
        "vision_config",
        "vision_end_token_id",
        "vision_start_token_id",
    }
)


def _positive_int(key: str, value: Any) -> int:
    # bool is an int subclass in Python; HF's strict dataclass rejects it too.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


@attrs.frozen
class Qwen35Dims:
    """Every dim the cost formulas need, read from an HF config dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool
    attention_bias: bool = False
    partial_rotary_factor: float = 0.25
    # how transformers runs the forward (declared on the graph's model, not in config.json)
    attn_implementation: str = "sdpa"
    packing: str = "documents"
    linear_kernels: str = "torch"

    def with_forward(
        self, attn_implementation: str | None, packing: str | None, linear_kernels: str | None
    ) -> Qwen35Dims:
        """These dims with the forward a graph declares; ``None`` keeps the default (sdpa, documents,
        the linear-attention kernels that are installed: ``installed_linear_kernels()``)."""
        attn = attn_implementation or "sdpa"
        pack = packing or "documents"
        lin = linear_kernels or installed_linear_kernels()
        problem = forward_problem(attn, pack, lin)
        if problem:
            raise ValueError(problem)
        return attrs.evolve(self, attn_implementation=attn, packing=pack, linear_kernels=lin)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, strict: bool = False) -> Qwen35Dims:
        """Build from ``config.json`` keys, with Qwen3_5TextConfig's defaults for missing ones.

        A multimodal ``Qwen3_5Config`` (``{"text_config": {...}, "tie_word_embeddings": ...}``)
        is accepted too: the text config is used, with the top-level ``tie_word_embeddings``
        when the text config does not set it.  ``layer_types`` defaults to every
        ``full_attention_interval``-th layer being full attention (cq L112-L117).  Bad values
        raise ``ValueError`` naming the key.  With ``strict=True`` keys outside
        ``CONFIG_KEYS | IGNORED_CONFIG_KEYS`` are rejected as well.
        """
        if not isinstance(cfg, Mapping):
            raise ValueError(f"config must be a mapping, got {type(cfg).__name__}")
        text = cfg.get("text_config")
        if text is not None:
            if not isinstance(text, Mapping):
                raise ValueError(f"config key 'text_config' must be a mapping, got {text!r}")
            merged = dict(text)
            if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in merged:
                merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
            cfg = merged
        if strict:
            unknown = sorted(set(cfg) - CONFIG_KEYS - IGNORED_CONFIG_KEYS)
            if unknown:
                raise ValueError(
                    f"unknown config key(s) {unknown}; valid keys: {sorted(CONFIG_KEYS)}"
                )

        def get(key: str) -> Any:
            return cfg[key] if key in cfg else _DEFAULTS[key]

        ints = {k: _positive_int(k, get(k)) for k in _INT_KEYS}

        for key in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(get(key), bool):
                raise ValueError(f"config key {key!r} must be a bool, got {get(key)!r}")

        # partial_rotary_factor: rope_parameters wins over the legacy top-level key
        # (PreTrainedConfig rope standardisation; cq L111 supplies 0.25).
        prf = get("partial_rotary_factor")
        rope = cfg.get("rope_parameters")
        if rope is not None:
            if not isinstance(rope, Mapping):
                raise ValueError(f"config key 'rope_parameters' must be a mapping, got {rope!r}")
            prf = rope.get("partial_rotary_factor", prf)
        if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            raise ValueError(
                f"config key 'partial_rotary_factor' must be a number in (0, 1], got {prf!r}"
            )

        n_layers = ints["num_hidden_layers"]
        if cfg.get("layer_types") is not None:
            lt = cfg["layer_types"]
            if isinstance(lt, (str, bytes)) or not isinstance(lt, (list, tuple)):
                raise ValueError(f"config key 'layer_types' must be a list, got {lt!r}")
            bad = [t for t in lt if t not in LAYER_TYPES]
            if bad:
                raise ValueError(
                    f"config key 'layer_types' has entries {bad!r}; allowed: {list(LAYER_TYPES)}"
                )
            if len(lt) != n_layers:
                raise ValueError(
                    f"config key 'layer_types' has {len(lt)} entries but num_hidden_layers is "
                    f"{n_layers}"
                )
            layer_types = tuple(lt)
        else:
            interval = _positive_int("full_attention_interval", get("full_attention_interval"))
            # cq L114-L117
            layer_types = tuple(
                "linear_attention" if (i + 1) % interval else "full_attention"
                for i in range(n_layers)
            )

        if ints["num_attention_heads"] % ints["num_key_value_heads"]:
            raise ValueError(
                "config key 'num_key_value_heads' must divide num_attention_heads "
                f"({ints['num_key_value_heads']} does not divide {ints['num_attention_heads']})"
            )
        if ints["linear_num_value_heads"] % ints["linear_num_key_heads"]:
            # repeat_interleave(num_v_heads // num_k_heads) at mq L324 needs this
            raise ValueError(
                "config key 'linear_num_key_heads' must divide linear_num_value_heads "
                f"({ints['linear_num_key_heads']} does not divide "
                f"{ints['linear_num_value_heads']})"
            )
        return cls(
            **ints,
            layer_types=layer_types,
            tie_word_embeddings=get("tie_word_embeddings"),
            attention_bias=get("attention_bias"),
            partial_rotary_factor=float(prf),
        )

    # derived dims ------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        # compute_default_rope_parameters (mq L167-L172): dim = int(head_dim * prf), one
        # inverse frequency per even index; recomposition_frequencies cats it twice (mq L198).
        return 2 * math.ceil(int(self.head_dim * self.partial_rotary_factor) / 2)

    @property
    def linear_key_dim(self) -> int:  # mq L507
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # mq L508
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # mq L516
        return 2 * self.linear_key_dim + self.linear_value_dim

    def count(self, layer_type: str) -> int:
        return sum(1 for t in self.layer_types if t == layer_type)

    # what the cost code reads (ops/costs.py), as every target's dims answer it --------------------------------
    def body_events(self, seq: int, dtype_bytes: int):
        """The body's events: from the derived program (models/programs/, traced from transformers' own code)
        where one is stored for this forward (sdpa, the torch delta rule, documents or mask, bf16) and holds for
        these dims; from the hand mirror below otherwise (eager, flash_attention_2, fla kernels, cu_seqlens,
        other dtypes: forwards no program is derived for, since they need a GPU or kernels to trace)."""
        derived = self.derived_program(dtype_bytes)
        if derived is not None and seq > 1:     # one token runs other attention code (programs' `seq > 1`)
            from .decoder import program_body_events

            return program_body_events("qwen3_5", self.packing, derived, self.layer_types, seq)
        return body_events(self, seq, dtype_bytes)

    def derived_program(self, dtype_bytes: int) -> tuple[tuple[str, int], ...] | None:
        """The derived program's dims for this model (program dim -> value), or None where no stored program
        holds for its forward and dims."""
        return _derived_dims(self, dtype_bytes)

    def body_workspace_bytes(self, seq: int, dtype_bytes: int) -> int:
        ws = body_forward_workspace_bytes(self, seq, dtype_bytes, **forward_kwargs(self))   # the declared forward
        # Qwen3_5TextModel.forward applies the final norm to the last hidden state before returning it, even
        # though body_forward hands back the pre-norm output: that normed copy and the norm's fp32 temporaries
        # are transient.
        return max(ws, seq * self.hidden_size * (dtype_bytes + 2 * 4))

    def body_flops(self, seq: int) -> int:
        return body_forward_flops(self, seq)

    def lm_head_flops(self, tokens: int) -> int:
        return lm_head_flops(self, tokens)


# --------------------------------------------------------------------------------------
# The declared forward: attention implementation, packing, linear-attention kernels
# --------------------------------------------------------------------------------------


def installed_linear_kernels() -> str:
    """"fla" when flash-linear-attention and causal-conv1d are importable here (transformers then
    uses them: hub_kernels.py ``use_kernel_func_from_hub_with_fallback`` imports the package and
    falls back to the torch function only when that fails), else "torch".  Looks the packages up
    without importing them (``check`` never imports torch)."""
    import importlib.util

    def have(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    return "fla" if have("fla") and have("causal_conv1d") else "torch"


def forward_problem(attn_implementation: str, packing: str, linear_kernels: str) -> str | None:
    """Why transformers cannot run this combination, or None."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        return f"attn_implementation must be one of {list(ATTN_IMPLEMENTATIONS)}, got {attn_implementation!r}"
    if packing not in PACKINGS:
        return f"packing must be one of {list(PACKINGS)}, got {packing!r}"
    if linear_kernels not in LINEAR_KERNELS:
        return f"linear_kernels must be one of {list(LINEAR_KERNELS)}, got {linear_kernels!r}"
    if packing == "cu_seqlens" and attn_implementation != "flash_attention_2":
        return (f"packing 'cu_seqlens' is transformers' flash path; with attn_implementation "
                f"{attn_implementation!r} a packed row gets a dense mask: use packing = \"mask\" "
                f"(or attn_implementation = \"flash_attention_2\")")
    if packing == "mask" and attn_implementation == "flash_attention_2":
        return ("flash_attention_2 never builds a mask: transformers turns packed position_ids into "
                "cu_seqlens (modeling_flash_attention_utils.py _prepare_from_posids): use packing = "
                "\"cu_seqlens\"")
    return None


def forward_kwargs(d: Qwen35Dims) -> dict[str, Any]:
    """The replay arguments for the forward ``d`` declares, on a CUDA device: sdpa without a mask
    reaches the flash kernel, with a mask the memory-efficient kernel (see ATTENTION_MODES)."""
    return {
        "attention": "flash",
        "packed": d.packing != "documents",
        "attn_implementation": d.attn_implementation,
        "linear_kernels": d.linear_kernels,
    }


def forward_assumptions(d: Qwen35Dims, declared: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """How the prediction assumes transformers runs this model's forward, as data (check --json `models`): per
    key its value, what that means, and where it comes from (declared in the graph, or the default and why); and
    the parts derived from kernel packages but not yet measured."""
    declared = declared or {}

    def src(key: str, default_note: str) -> str:
        return "declared" if declared.get(key) is not None else default_note

    pack = {
        "documents": "documents one by one",
        "mask": "packed with a [seq, seq] mask",
        "cu_seqlens": "packed with cu_seqlens",
    }[d.packing]
    lin = ("flash-linear-attention + causal-conv1d" if d.linear_kernels == "fla"
           else "torch reference kernels")
    lin_src = src("linear_kernels", "installed here" if d.linear_kernels == "fla"
                  else "default: flash-linear-attention/causal-conv1d not installed here")
    unmeasured = []
    if d.linear_kernels == "fla":
        unmeasured.append(f"fla-core {KERNEL_VERSIONS['fla-core']} / causal-conv1d "
                          f"{KERNEL_VERSIONS['causal-conv1d']} wrappers")
    if d.attn_implementation == "flash_attention_2":
        unmeasured.append(f"flash-attn {KERNEL_VERSIONS['flash-attn']} wrapper")
    return {
        "attn_implementation": {"value": d.attn_implementation, "means": f"attention {d.attn_implementation}",
                                "source": src("attn_implementation", "default: transformers")},
        "packing": {"value": d.packing, "means": pack,
                    "source": src("packing", "default: as dflash-graph run does")},
        "linear_kernels": {"value": d.linear_kernels, "means": f"linear attention: {lin}", "source": lin_src},
        "not_measured": unmeasured,
    }


def kernel_notes(models: Mapping[str, Any]) -> list[str]:
    """A note for each qwen3_5 model with linear-attention layers whose kernels in the prediction (declared, or
    what was installed where the graph was checked) are not the ones transformers will run here, where
    ``installed_linear_kernels()`` decides; nothing when they agree, or for a model without linear layers."""
    here = installed_linear_kernels()
    what = {"fla": "flash-linear-attention + causal-conv1d", "torch": "PyTorch's reference kernels"}
    out = []
    for name, m in models.items():
        d = getattr(m, "dims", None)
        if not isinstance(d, Qwen35Dims) or "linear_attention" not in d.layer_types or d.linear_kernels == here:
            continue
        why = "they are installed here" if here == "fla" else "flash-linear-attention/causal-conv1d are not installed here"
        out.append(f"note: model {name}: the memory prediction assumed its linear attention on "
                   f"{what[d.linear_kernels]} (models.{name}.linear_kernels), but transformers runs it on "
                   f"{what[here]} ({why}): measured memory may differ from the prediction")
    return out


_DTYPE_NAMES = {1: "int8", 2: "bfloat16", 4: "float32", 8: "float64"}


def tensor_label(d: Qwen35Dims, seq: int, dtype_bytes: int, name: str) -> str:
    """What a replayed tensor is, for an OOM message: the [heads, seq, seq] ones by shape and the
    transformers line that makes them; other names as they are."""
    nh, s = d.num_attention_heads, f"{seq:,}"
    dt = _DTYPE_NAMES.get(dtype_bytes, f"{dtype_bytes}-byte")
    where = {
        "eager.qk": (dt, "eager_attention_forward: torch.matmul(query, key_states.transpose(2, 3))"),
        "eager.scaled": (dt, "eager_attention_forward: scores * scaling"),
        "eager.masked": (dt, "eager_attention_forward: scores + attention_mask"),
        "eager.in32": ("float32", "eager_attention_forward: softmax(dtype=float32) input"),
        "eager.soft": ("float32", "eager_attention_forward: softmax(dtype=float32)"),
        "eager.weights": (dt, "eager_attention_forward: attn_weights"),
        "math.attn0": ("float32", "sdpa math kernel: q @ k^T"),
        "math.attn1": ("float32", "sdpa math kernel: + mask"),
        "math.attn": ("float32", "sdpa math kernel: softmax"),
    }
    if name in where:
        t, src = where[name]
        return f"[{nh}, {s}, {s}] {t} ({src})"
    if name in ("causal_mask", "mask.causal", "mask.same_doc", "mask.and1", "sdpa.float_mask"):
        return f"{name} [{s}, {s}]"
    return name


# --------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------


def layer_params(d: Qwen35Dims, layer_type: str) -> int:
    """Parameters of one Qwen3_5DecoderLayer (mq L854-L865)."""
    h = d.hidden_size
    # Qwen3_5MLP gate/up/down, no bias (mq L823-L825)
    n = 3 * h * d.intermediate_size
    # input_layernorm + post_attention_layernorm, weight [hidden] (mq L864-L865, L838)
    n += 2 * h
    if layer_type == "full_attention":
        qo = d.num_attention_heads * d.head_dim
        kv = d.num_key_value_heads * d.head_dim
        bias = 1 if d.attention_bias else 0
        n += (h + bias) * 2 * qo  # q_proj: query and output gate (mq L754-L756)
        n += 2 * (h + bias) * kv  # k_proj, v_proj (mq L757-L762)
        n += qo * h + bias * h  # o_proj (mq L763-L765)
        n += 2 * d.head_dim  # q_norm, k_norm (mq L766-L767)
    elif layer_type == "linear_attention":
        vd, nv = d.linear_value_dim, d.linear_num_value_heads
        n += d.conv_dim * d.linear_conv_kernel_dim  # depthwise conv1d, no bias (mq L517-L524)
        n += 2 * nv  # dt_bias, A_log (mq L528, L532)
        n += d.linear_value_head_dim  # Qwen3_5RMSNormGated weight (mq L534, L206)
        n += vd * h  # out_proj (mq L535)
        n += h * d.conv_dim  # in_proj_qkv (mq L539)
        n += h * vd  # in_proj_z (mq L540)
        n += 2 * h * nv  # in_proj_b, in_proj_a (mq L541-L542)
    else:
        raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {layer_type!r}")
    return n


def component_params(d: Qwen35Dims) -> dict[str, int]:
    """Parameter counts of Qwen3_5ForCausalLM by component.

    ``lm_head`` is 0 when ``tie_word_embeddings`` (mq L1651 ties it to embed_tokens, and
    ``model.parameters()`` yields a shared Parameter once).
    """
    embed = d.vocab_size * d.hidden_size  # nn.Embedding (mq L1208)
    return {
        "embed": embed,
        "layers": sum(layer_params(d, t) for t in d.layer_types),
        "norm": d.hidden_size,  # final Qwen3_5RMSNorm (mq L1212)
        "lm_head": 0 if d.tie_word_embeddings else embed,  # nn.Linear(H, V, bias=False) (mq L1662)
    }


def total_params(d: Qwen35Dims) -> int:
    return sum(component_params(d).values())


# --------------------------------------------------------------------------------------
# Live-tensor replay
# --------------------------------------------------------------------------------------


class _Live:
    """Replays allocations/frees and keeps the running peak (what MemTracker reports)."""

    __slots__ = ("cur", "peak", "sizes", "events", "phase", "phase_peak")

    def __init__(self, record: bool = False) -> None:
        self.cur = 0
        self.peak = 0
        self.sizes: dict[str, int] = {}
        self.events: list[tuple[str, str, int, int]] | None = [] if record else None
        self.phase = ""
        self.phase_peak: dict[str, int] = {}

    def alloc(self, name: str, nbytes: int) -> None:
        if name in self.sizes:
            raise AssertionError(f"tensor {name!r} allocated twice")
        self.sizes[name] = nbytes
        self.cur += nbytes
        if self.cur > self.peak:
            self.peak = self.cur
        if self.cur > self.phase_peak.get(self.phase, -1):
            self.phase_peak[self.phase] = self.cur
        if self.events is not None:
            self.events.append((self.phase, "+" + name, nbytes, self.cur))

    def free(self, *names: str) -> None:
        for name in names:
            self.cur -= self.sizes.pop(name)
            if self.events is not None:
                self.events.append((self.phase, "-" + name, 0, self.cur))

    def drop(self, *names: str) -> None:
        """free() for names that may be aliases (never allocated in this dtype)."""
        for name in names:
            if name in self.sizes:
                self.free(name)

    def rename(self, old: str, new: str) -> None:
        if new in self.sizes:
            raise AssertionError(f"tensor {new!r} allocated twice")
        self.sizes[new] = self.sizes.pop(old)
        if self.events is not None:
            self.events.append((self.phase, f"~{old}>{new}", 0, self.cur))

    def live_at_peak(self) -> dict[str, int]:
        """Live tensors at the first moment the peak is reached (needs record=True)."""
        if self.events is None:
            raise ValueError("replay was not recorded")
        sizes: dict[str, int] = {}
        for _, ev, n, cur in self.events:
            if ev[0] == "+":
                sizes[ev[1:]] = n
                if cur == self.peak:
                    return sizes
            elif ev[0] == "-":
                sizes.pop(ev[1:])
            else:
                old, new = ev[1:].split(">")
                sizes[new] = sizes.pop(old)
        return sizes

    def live(self, name: str) -> bool:
        return name in self.sizes


def _rmsnorm(lv: _Live, tag: str, rows: int, cols: int, b: int, out: str) -> None:
    """Qwen3_5RMSNorm.forward (mq L840-L848) on a [rows, cols] input of dtype size b.

    Result tensor ``out`` (dtype b) stays live.  Every step is fp32 (mq L844).
    """
    n = rows * cols
    up = b != F32
    if up:
        lv.alloc(f"{tag}.xf", F32 * n)  # x.float() (mq L844); a no-op for fp32 input
    lv.alloc(f"{tag}.pow", F32 * n)  # x.pow(2) (mq L841)
    lv.alloc(f"{tag}.var", F32 * rows)  # .mean(-1, keepdim=True)
    lv.free(f"{tag}.pow")
    lv.alloc(f"{tag}.eps", F32 * rows)  # + eps
    lv.free(f"{tag}.var")
    lv.alloc(f"{tag}.rsqrt", F32 * rows)  # torch.rsqrt
    lv.free(f"{tag}.eps")
    lv.alloc(f"{tag}.normed", F32 * n)  # x * rsqrt(...)
    lv.free(f"{tag}.rsqrt")
    lv.drop(f"{tag}.xf")  # _norm returns: the x.float() temporary dies
    lv.alloc(f"{tag}.w1", F32 * cols)  # 1.0 + self.weight.float() (mq L847)
    lv.alloc(f"{tag}.scaled", F32 * n)  # output * (1 + w)
    lv.free(f"{tag}.w1", f"{tag}.normed")
    if up:
        lv.alloc(out, b * n)  # .type_as(x) (mq L848)
        lv.free(f"{tag}.scaled")
    else:
        lv.rename(f"{tag}.scaled", out)  # type_as is a no-op for fp32


def _mlp(lv: _Live, d: Qwen35Dims, s: int, b: int, out: str) -> None:
    """Qwen3_5MLP.forward (mq L828-L830): down(act(gate(x)) * up(x))."""
    si = s * d.intermediate_size * b
    lv.alloc("mlp.gate", si)  # gate_proj(x)
    lv.alloc("mlp.act", si)  # silu(...)
    lv.free("mlp.gate")
    lv.alloc("mlp.up", si)  # up_proj(x)
    lv.alloc("mlp.prod", si)  # act * up
    lv.free("mlp.act", "mlp.up")
    lv.alloc(out, s * d.hidden_size * b)  # down_proj
    lv.free("mlp.prod")


def _delta_rule(lv: _Live, d: Qwen35Dims, s: int, b: int, use_cache: bool) -> str:
    """torch_chunk_gated_delta_rule (mq L286-L424), chunk 64, on views of the conv output.

    Returns the name of the tensor it leaves live (the [seq, v_heads, v_dim] output).
    """
    up = b != F32
    c = DELTA_RULE_CHUNK
    nk, nv = d.linear_num_key_heads, d.linear_num_value_heads
    dk, dv = d.linear_key_head_dim, d.linear_value_head_dim
    sp = -(-s // c) * c  # padded length (mq L341-L345)
    n_chunks = sp // c
    qk = nv * s * dk  # elements of q or k once expanded to the value heads
    vv = nv * s * dv
    qk_p, vv_p = nv * sp * dk, nv * sp * dv
    pair = nv * sp * c  # [v_heads, chunks, 64, 64]
    tile, state = nv * c * dv, nv * dk * dv
    pre = "dr."
    mark = set(lv.sizes)

    # mq L323-L325: repeat_interleave copies when key heads != value heads
    rep = nv != nk
    if rep:
        lv.alloc(pre + "q_rep", b * qk)
        lv.alloc(pre + "k_rep", b * qk)
    # mq L328-L331: .to(float32, memory_format=contiguous_format) copies only when the dtype
    # changes (Tensor.to aliases when dtype matches: suggest_memory_format() is "contiguous"
    # for a transposed tensor).  decay (g) is already fp32: always an alias.
    if up:
        lv.alloc(pre + "q32", F32 * qk)
        lv.alloc(pre + "k32", F32 * qk)
        lv.alloc(pre + "v32", F32 * vv)
        lv.alloc(pre + "beta32", F32 * nv * s)
        lv.drop(pre + "q_rep", pre + "k_rep")  # names rebound after the list is built
    else:
        if rep:
            lv.rename(pre + "q_rep", pre + "q32")
            lv.rename(pre + "k_rep", pre + "k32")
    # l2norm(query), l2norm(key) (mq L333-L335, L279-L282)
    for x in ("q", "k"):
        lv.alloc(pre + x + ".xx", F32 * qk)  # x * x
        lv.alloc(pre + x + ".sum", F32 * nv * s)  # .sum(-1, keepdim)
        lv.free(pre + x + ".xx")
        lv.alloc(pre + x + ".eps", F32 * nv * s)
        lv.free(pre + x + ".sum")
        lv.alloc(pre + x + ".rsqrt", F32 * nv * s)
        lv.free(pre + x + ".eps")
        lv.alloc(pre + x + "n", F32 * qk)  # x * inv_norm
        lv.free(pre + x + ".rsqrt")
        lv.drop(pre + x + "32")  # rebinding query/key; an alias of the conv output stays
    lv.alloc(pre + "qs", F32 * qk)  # query * scaling (mq L338)
    lv.free(pre + "qn")
    # F.pad copies even when pad_size == 0 (mq L342); olds die after all three
    lv.alloc(pre + "q_p", F32 * qk_p)
    lv.alloc(pre + "k_p", F32 * qk_p)
    lv.alloc(pre + "v_p", F32 * vv_p)
    lv.free(pre + "qs", pre + "kn")
    lv.drop(pre + "v32")
    lv.alloc(pre + "beta_p", F32 * nv * sp)  # mq L343
    lv.alloc(pre + "decay_p", F32 * nv * sp)
    lv.drop(pre + "beta32")
    lv.alloc(pre + "v_beta", F32 * vv_p)  # mq L350
    lv.alloc(pre + "k_beta", F32 * qk_p)  # mq L351
    lv.alloc(pre + "mask1", c * c)  # torch.ones(c, c, bool) (mq L360)
    lv.alloc(pre + "mask", c * c)  # .triu(1)
    lv.free(pre + "mask1")
    lv.alloc(pre + "cum", F32 * nv * sp)  # decay.cumsum (mq L364)
    lv.alloc(pre + "pw0", F32 * pair)  # cum_i - cum_j (mq L369)
    lv.alloc(pre + "pw1", F32 * pair)  # masked_fill (mq L370)
    lv.free(pre + "pw0")
    lv.alloc(pre + "pw", F32 * pair)  # exp (mq L371)
    lv.free(pre + "pw1")
    # (k_beta @ key^T) * pairwise and (query @ key^T) * pairwise (mq L374-L375): matmul on
    # 5-d operands expands + reshapes both into bmm operands, which clones them.
    for name in ("ut", "intra"):
        lv.alloc(pre + name + ".a", F32 * qk_p)
        lv.alloc(pre + name + ".bT", F32 * qk_p)
        lv.alloc(pre + name + ".mm", F32 * pair)
        lv.free(pre + name + ".a", pre + name + ".bT")
        lv.alloc(pre + name, F32 * pair)  # * pairwise_decay
        lv.free(pre + name + ".mm")
    lv.alloc(pre + "cexp", F32 * nv * sp)  # cum_decay.exp() (mq L376)
    lv.alloc(pre + "dkb", F32 * qk_p)  # decayed_k_beta
    lv.free(pre + "cexp")
    lv.alloc(pre + "new_values", F32 * vv_p)  # solve_triangular (mq L385)
    lv.alloc(pre + "k_cumdecay", F32 * qk_p)  # solve_triangular (mq L386)
    lv.alloc(pre + "state", F32 * state)  # zeros (mq L397)
    lv.alloc(pre + "core", F32 * vv_p)  # zeros_like(new_values) (mq L400)
    lv.alloc(pre + "cexp", F32 * nv * sp)  # mq L403
    lv.alloc(pre + "q_dec", F32 * qk_p)
    lv.free(pre + "cexp", pre + "q_p")
    lv.alloc(pre + "csub", F32 * nv * sp)  # mq L404
    lv.alloc(pre + "cexp", F32 * nv * sp)
    lv.free(pre + "csub")
    lv.alloc(pre + "k_dec", F32 * qk_p)
    lv.free(pre + "cexp", pre + "k_p")
    lv.alloc(pre + "chunk_decay", F32 * nv * n_chunks)  # mq L405
    # the scan (mq L408-L415): per-chunk tiles [v_heads, 64, v_dim], seq-independent.  The
    # first iteration and one steady-state iteration bound every later one.
    for it in range(min(n_chunks, 2)):
        lv.alloc(pre + "kcS", F32 * tile)  # k_cumdecay[:, :, i] @ state
        lv.alloc(pre + "v_new'", F32 * tile)  # new_values[:, :, i] - ...
        lv.free(pre + "kcS")
        lv.drop(pre + "v_new")
        lv.rename(pre + "v_new'", pre + "v_new")
        lv.alloc(pre + "inter'", F32 * tile)  # query[:, :, i] @ state (mq L412)
        lv.drop(pre + "inter")
        lv.rename(pre + "inter'", pre + "inter")
        lv.alloc(pre + "iv", F32 * tile)  # intra[:, :, i] @ v_new (mq L413)
        lv.alloc(pre + "sum", F32 * tile)  # + ; copied into core_attn_out in place
        lv.free(pre + "iv", pre + "sum")
        lv.alloc(pre + "sd", F32 * state)  # state * chunk_decay (mq L415)
        lv.alloc(pre + "kv", F32 * state)  # key^T @ v_new
        lv.alloc(pre + "state'", F32 * state)
        lv.free(pre + "sd", pre + "kv", pre + "state")
        lv.rename(pre + "state'", pre + "state")
    if not use_cache:
        lv.free(pre + "state")  # last_recurrent_state = None (mq L418)
    # mq L420: solve_triangular returns column-major matrices, zeros_like keeps that layout,
    # so the reshape to [.., padded_seq, v_dim] copies.
    lv.alloc(pre + "core_c", F32 * vv_p)
    lv.free(pre + "core")
    # mq L423: transpose + .to(initial_dtype): a copy only when the dtype changes
    if up:
        lv.alloc("gdn.core_out", b * vv)
        lv.free(pre + "core_c")
    else:
        lv.rename(pre + "core_c", pre + "core_out_view")
    # return: every local of the function dies
    keep = {"gdn.core_out", pre + "core_out_view"} | ({pre + "state"} if use_cache else set())
    lv.free(*[k for k in list(lv.sizes) if k not in mark and k not in keep])
    if use_cache:
        lv.rename(pre + "state", "cache.recurrent_state")
    if not up:
        # mq L650: reshape(-1, v_dim) of the transposed fp32 view copies
        lv.alloc("gdn.core_out", b * vv)
        lv.free(pre + "core_out_view")
    return "gdn.core_out"


def _gated_norm(lv: _Live, rows: int, n: int, b: int) -> None:
    """Qwen3_5RMSNormGated(core, z) (mq L210-L219) on [seq * v_heads, v_dim]: leaves ``gn.out``."""
    up = b != F32
    if up:
        lv.alloc("gn.hf", F32 * n)  # .to(float32)
    lv.alloc("gn.pow", F32 * n)
    lv.alloc("gn.var", F32 * rows)  # variance, live to the end of forward
    lv.free("gn.pow")
    lv.alloc("gn.eps", F32 * rows)
    lv.alloc("gn.rsqrt", F32 * rows)
    lv.free("gn.eps")
    lv.alloc("gn.hn", F32 * n)
    lv.free("gn.rsqrt")
    lv.drop("gn.hf")
    if up:
        lv.alloc("gn.hb", b * n)  # hidden_states.to(input_dtype) (mq L216)
        lv.alloc("gn.hw", b * n)  # weight * ...
        lv.free("gn.hb", "gn.hn")
    else:
        lv.alloc("gn.hw", F32 * n)
        lv.free("gn.hn")
    if up:
        lv.alloc("gn.gf", F32 * n)  # gate.to(float32) (mq L217)
    lv.alloc("gn.silu", F32 * n)
    lv.drop("gn.gf")
    lv.alloc("gn.hg", F32 * n)  # hidden * silu(gate): fp32
    lv.free("gn.silu", "gn.hw")
    if up:
        lv.alloc("gn.out", b * n)  # .to(input_dtype) (mq L219)
        lv.free("gn.hg")
    else:
        lv.rename("gn.hg", "gn.out")
    lv.free("gn.var")


def _gated_deltanet(lv: _Live, d: Qwen35Dims, s: int, b: int, use_cache: bool, out: str) -> None:
    """Qwen3_5GatedDeltaNet.forward (mq L545-L656), no padding mask, prefill, torch reference kernels."""
    up = b != F32
    h, nv = d.hidden_size, d.linear_num_value_heads
    cd, vd, k = d.conv_dim, d.linear_value_dim, d.linear_conv_kernel_dim
    lv.alloc("gdn.qkv", b * s * cd)  # in_proj_qkv (mq L563)
    lv.alloc("gdn.z", b * s * vd)  # in_proj_z (mq L566)
    lv.alloc("gdn.b", b * s * nv)  # in_proj_b (mq L569)
    lv.alloc("gdn.a", b * s * nv)  # in_proj_a (mq L570)
    if use_cache:
        lv.alloc("cache.conv_state", b * cd * k)  # lazy zeros [1, conv_dim, K] (cache_utils)
    # causal_conv1d_fn (mq L262-L274): conv1d with padding K-1, then silu
    lv.alloc("gdn.conv", b * cd * (s + k - 1))
    lv.alloc("gdn.qkv_act", b * s * cd)
    lv.free("gdn.conv", "gdn.qkv")  # mixed_qkv rebound (mq L587)
    lv.alloc("gdn.beta", b * s * nv)  # b.sigmoid() (mq L614)
    # g = -A_log.float().exp() * softplus(a.float() + dt_bias) (mq L616), fp32
    if up:
        lv.alloc("gdn.af", F32 * s * nv)
    lv.alloc("gdn.a_dt", F32 * s * nv)
    lv.drop("gdn.af")
    lv.alloc("gdn.softplus", F32 * s * nv)
    lv.free("gdn.a_dt")
    lv.alloc("gdn.g", F32 * s * nv)
    lv.free("gdn.softplus")
    core = _delta_rule(lv, d, s, b, use_cache)  # mq L632
    _gated_norm(lv, s * nv, s * vd, b)  # Qwen3_5RMSNormGated(core, z)
    lv.free(core)  # core_attn_out rebound (mq L652)
    lv.alloc(out, b * s * h)  # out_proj (mq L655)
    # return: locals die
    lv.free("gn.out", "gdn.qkv_act", "gdn.z", "gdn.b", "gdn.a", "gdn.beta", "gdn.g")


def _rotary_half(lv: _Live, tag: str, heads: int, s: int, r: int, b: int) -> None:
    """(x_rot * cos) + (rotate_half(x_rot) * sin) (mq L696-L697, rotate_half mq L659-L663)."""
    e = heads * s
    lv.alloc(tag + ".xc", b * e * r)  # x_rot * cos
    lv.alloc(tag + ".neg", b * e * (r // 2))  # -x2
    lv.alloc(tag + ".rot", b * e * r)  # cat((-x2, x1))
    lv.free(tag + ".neg")
    lv.alloc(tag + ".xs", b * e * r)  # * sin
    lv.free(tag + ".rot")
    lv.alloc(tag + ".emb_rot", b * e * r)  # +
    lv.free(tag + ".xc", tag + ".xs")


def _sdpa(
    lv: _Live, d: Qwen35Dims, s: int, b: int, attention: str, masked: bool, out: str
) -> None:
    """sdpa_attention_forward (sdpa_attention L95-L208) + the aten kernel it reaches."""
    nh, nkv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    rep = nh != nkv
    if masked and rep and nkv > 1:
        # a mask disables enable_gqa (use_gqa_in_sdpa, sdpa_attention L43-L52): repeat_kv
        # (sdpa_attention L20-L29) expands + reshapes K and V to all heads, a copy each
        # (with a single KV head the reshape of the expand is still a view).
        lv.alloc("sdpa.k_rep", b * nh * s * hd)
        lv.alloc("sdpa.v_rep", b * nh * s * hd)
    if masked:
        # scaled_dot_product_attention turns a bool attn_mask into an additive mask of q's
        # dtype before picking a kernel (convert_boolean_attn_mask; measured on CPU).  On
        # CUDA that mask also rules out flash: the memory-efficient kernel runs instead
        # (no [heads, seq, seq] either).
        lv.alloc("sdpa.float_mask", b * s * s)
    if attention == "math":
        # aten._scaled_dot_product_attention_math (CompositeImplicit: every step is an aten
        # op).  Low-precision inputs are upcast to fp32 first, and everything runs in fp32.
        up = b != F32
        if up:
            lv.alloc("math.qf", F32 * nh * s * hd)
            lv.alloc("math.kf", F32 * (nh if masked and rep else nkv) * s * hd)
            lv.alloc("math.vf", F32 * (nh if masked and rep else nkv) * s * hd)
        lv.alloc("math.q", F32 * nh * s * hd)  # q * sqrt(scale)
        if not masked:  # (a given mask is added as it is: sdpa.float_mask above)
            lv.alloc("math.ones", s * s)  # is_causal: ones(L, S, bool).tril()
            lv.alloc("math.tril", s * s)
            lv.free("math.ones")
            lv.alloc("math.bias", F32 * s * s)  # where(tril, 0, -inf)
            lv.free("math.tril")
        if rep and not masked:
            lv.alloc("math.k_rep", F32 * nh * s * hd)  # enable_gqa: repeat_interleave K, V
            lv.alloc("math.v_rep", F32 * nh * s * hd)
        lv.alloc("math.kT", F32 * nh * s * hd)  # k.transpose(-2, -1) * sqrt(scale)
        lv.alloc("math.attn0", F32 * nh * s * s)  # q @ kT
        lv.free("math.kT")
        lv.alloc("math.attn1", F32 * nh * s * s)  # + attn_bias (or the float mask)
        lv.free("math.attn0")
        lv.alloc("math.attn", F32 * nh * s * s)  # _safe_softmax
        lv.free("math.attn1")
        if up:
            lv.alloc("math.attn_b", b * nh * s * s)  # softmax result cast back
        lv.alloc("math.o32", F32 * nh * s * hd)  # attn @ v
        if up:
            lv.alloc(out, b * nh * s * hd)  # cast back to the input dtype
            lv.free("math.o32")
        else:
            lv.rename("math.o32", out)
        lv.free(*[k for k in list(lv.sizes) if k.startswith("math.")])
        copy_out = True  # [batch, heads, seq, dim] -> .transpose(1, 2).contiguous() copies
    else:
        lv.alloc(out, b * nh * s * hd)  # attention output
        lv.alloc("sdpa.lse", F32 * nh * s)  # logsumexp, dropped by the composite
        lv.free("sdpa.lse")
        copy_out = attention == "cpu_flash"
    lv.drop("sdpa.float_mask")
    lv.drop("sdpa.k_rep", "sdpa.v_rep")
    if copy_out:
        lv.alloc(out + "'", b * s * nh * hd)  # .transpose(1, 2).contiguous() (sdpa_attention L206)
        lv.free(out)
        lv.rename(out + "'", out)


def _eager(lv: _Live, d: Qwen35Dims, s: int, b: int, out: str) -> None:
    """eager_attention_forward (modeling_qwen3_5.py, transformers 5.24.0 L717-L742) with repeat_kv
    (L705-L714), on the dense mask ``causal_mask`` [1, 1, s, s] that eager_mask built (dtype b).

    Materialises [heads, seq, seq] scores several times over, and returns the softmaxed weights as
    ``attn_weights``: Qwen3_5DecoderLayer.forward keeps them in ``_`` (5.24.0 L892) until it
    returns, through the MLP.
    """
    nh, nkv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    rep = nh != nkv
    hss = nh * s * s
    if rep and nkv > 1:
        # expand + reshape of [b, kv, n_rep, s, d] copies (with one KV head it stays a view)
        lv.alloc("eager.k_rep", b * nh * s * hd)
        lv.alloc("eager.v_rep", b * nh * s * hd)
    lv.alloc("eager.qk", b * hss)  # torch.matmul(query, key_states.transpose(2, 3)) (L730)
    lv.alloc("eager.scaled", b * hss)  # * scaling
    lv.free("eager.qk")
    lv.alloc("eager.masked", b * hss)  # + attention_mask (L732)
    lv.free("eager.scaled")
    # softmax(dim=-1, dtype=float32) (L734): aten converts the input first when it is not fp32
    if b != F32:
        lv.alloc("eager.in32", F32 * hss)
    lv.alloc("eager.soft", F32 * hss)
    lv.drop("eager.in32")
    lv.free("eager.masked")
    if b != F32:
        lv.alloc("eager.weights", b * hss)  # .to(query.dtype)
        lv.free("eager.soft")
    else:
        lv.rename("eager.soft", "eager.weights")
    # dropout(p=0.0, training=False) returns its input (L735)
    lv.alloc(out, b * nh * s * hd)  # torch.matmul(attn_weights, value_states) (L736)
    lv.alloc(out + "'", b * s * nh * hd)  # .transpose(1, 2).contiguous() (L737)
    lv.free(out)
    lv.rename(out + "'", out)
    lv.drop("eager.k_rep", "eager.v_rep")


def _flash2(lv: _Live, d: Qwen35Dims, s: int, b: int, packed: bool, out: str) -> None:
    """flash_attention_forward (integrations/flash_attention.py, transformers 5.24.0 L26-L104) ->
    _flash_attention_forward (modeling_flash_attention_utils.py L745-L867) -> flash-attn's
    flash_attn_func / flash_attn_varlen_func.  Derived from the wrappers, NOT measured: flash-attn
    needs CUDA (tools/gpu_check.py measures it when a GPU is lent).

    Packed (position_ids restart): _is_packed_sequence (L564-L580) in every layer, then
    _prepare_from_posids (L526-L561): query and key, transposed views of contiguous
    [b, heads, s, d] tensors, are copied by ``.contiguous()``; value (a view of v_proj's output)
    already is contiguous.  cu_seqlens are a few int32 per document.  The kernel returns out
    [s, heads, d] and the fp32 softmax_lse [heads, s] (flash-attn 2 flash_attn_interface.py
    _flash_attn_varlen_forward / _flash_attn_forward: maybe_contiguous copies only a tensor whose
    last stride is not 1, then varlen_fwd / fwd return out, softmax_lse, S_dmask, rng_state), which
    the Python wrapper drops (no grad).
    """
    nh, nkv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    # _is_packed_sequence: arange + min, - position_ids, abs, sum, bool (every layer, both cases)
    lv.alloc("fa.arange", 8 * s)
    lv.alloc("fa.min", 8)
    lv.alloc("fa.inc", 8 * s)
    lv.free("fa.arange", "fa.min")
    lv.alloc("fa.sub", 8 * s)
    lv.free("fa.inc")
    lv.alloc("fa.abs", 8 * s)
    lv.free("fa.sub")
    lv.alloc("fa.sum", 8)
    lv.free("fa.abs")
    lv.alloc("fa.bool", 1)
    lv.free("fa.sum", "fa.bool")
    if packed:
        lv.alloc("fa.q", b * s * nh * hd)  # query.contiguous() (L555)
        lv.alloc("fa.k", b * s * nkv * hd)  # key.contiguous() (L556)
    lv.alloc(out, b * s * nh * hd)  # out [(b,) s, heads, d]: already the layout reshape wants
    lv.alloc("fa.lse", F32 * nh * s)  # softmax_lse
    lv.free("fa.lse")
    lv.drop("fa.q", "fa.k")


def _gated_deltanet_fla(lv: _Live, d: Qwen35Dims, s: int, b: int, use_cache: bool, out: str) -> None:
    """Qwen3_5GatedDeltaNet.forward (mq 5.24.0 L547-L656) with causal-conv1d's causal_conv1d_fn and
    flash-linear-attention's chunk_gated_delta_rule in place of the torch reference functions.

    Derived from the Python wrappers of the pinned versions, NOT measured (CUDA/Triton only;
    tools/gpu_check.py measures them when a GPU is lent):
      causal-conv1d 1.7.0  causal_conv1d/causal_conv1d_interface.py CausalConv1dFn.forward L11-L60:
          x (mixed_qkv.transpose(1, 2), channel-last: stride(1) == 1) is not copied (L23-L24);
          causal_conv1d_fwd_function allocates one output like x (cpp_functions.py L103),
          silu fused.
      fla-core 0.6.0  fla/ops/gated_delta_rule/chunk.py ChunkGatedDeltaRuleFunction.forward
          (L253-L335), under @input_guard (fla/utils/decorators.py L97-L133: every tensor
          argument made contiguous -- q, k, v are strided views of the conv output: copies);
          l2norm_fwd (fla/modules/norm/l2norm.py L112-L128): y like x, fp32 rstd per row;
          chunk_local_cumsum (fla/ops/utils/cumsum.py L276-L278): fp32 g like g;
          chunk_gated_delta_rule_fwd_intra (chunk_fwd.py L385): A [s, v_heads, 64] in k's dtype;
          recompute_w_u_fwd (wy_fast.py L273-L274): w [s, v_heads, k_dim], u like v;
          chunk_gated_delta_rule_fwd_h (fla/ops/common/chunk_delta_h.py L722-L725):
          h [chunks, v_heads, k_dim, v_dim] in k's dtype, v_new like u;
          chunk_fwd_o (fla/ops/common/chunk_o.py L565): o like v.  Key heads are not repeated to
          the value heads (the kernels index k by i_h // (HV // H), chunk_fwd.py L88).
    """
    h, nv, nk = d.hidden_size, d.linear_num_value_heads, d.linear_num_key_heads
    dk, dv = d.linear_key_head_dim, d.linear_value_head_dim
    cd, vd = d.conv_dim, d.linear_value_dim
    c = DELTA_RULE_CHUNK
    n_chunks = -(-s // c)
    lv.alloc("gdn.qkv", b * s * cd)  # in_proj_qkv (mq L563)
    lv.alloc("gdn.z", b * s * vd)  # in_proj_z
    lv.alloc("gdn.b", b * s * nv)  # in_proj_b
    lv.alloc("gdn.a", b * s * nv)  # in_proj_a
    if use_cache:
        lv.alloc("cache.conv_state", b * cd * d.linear_conv_kernel_dim)
    lv.alloc("gdn.qkv_act", b * s * cd)  # causal_conv1d_fn: conv + silu in one kernel
    lv.free("gdn.qkv")
    lv.alloc("gdn.beta", b * s * nv)  # b.sigmoid()
    if b != F32:
        lv.alloc("gdn.af", F32 * s * nv)
    lv.alloc("gdn.a_dt", F32 * s * nv)
    lv.drop("gdn.af")
    lv.alloc("gdn.softplus", F32 * s * nv)
    lv.free("gdn.a_dt")
    lv.alloc("gdn.g", F32 * s * nv)
    lv.free("gdn.softplus")
    # chunk_gated_delta_rule
    lv.alloc("fla.q", b * s * nk * dk)  # input_guard: q.contiguous()
    lv.alloc("fla.k", b * s * nk * dk)
    lv.alloc("fla.v", b * s * vd)
    lv.alloc("fla.qn", b * s * nk * dk)  # l2norm_fwd(q)
    lv.alloc("fla.q_rstd", F32 * s * nk)
    lv.alloc("fla.kn", b * s * nk * dk)  # l2norm_fwd(k)
    lv.alloc("fla.k_rstd", F32 * s * nk)
    lv.alloc("fla.gcum", F32 * s * nv)  # chunk_local_cumsum
    lv.alloc("fla.A", b * s * nv * c)
    lv.alloc("fla.w", b * s * nv * dk)
    lv.alloc("fla.u", b * s * vd)
    lv.alloc("fla.h", b * n_chunks * nv * dk * dv)
    lv.alloc("fla.v_new", b * s * vd)
    if use_cache:
        lv.alloc("cache.recurrent_state", F32 * nv * dk * dv)  # final_state (chunk_delta_h.py L723)
    lv.alloc("gdn.core_out", b * s * vd)  # o (chunk_o.py L565); o.to(q.dtype) is a no-op
    lv.free(*[k for k in list(lv.sizes) if k.startswith("fla.")])
    # Qwen3_5RMSNormGated on [seq * v_heads, v_dim] (mq L210-L219): unchanged
    _gated_norm(lv, s * nv, vd * s, b)
    lv.free("gdn.core_out")  # core_attn_out rebound (mq L652)
    lv.alloc(out, b * s * h)  # out_proj (mq L655)
    lv.free("gn.out", "gdn.qkv_act", "gdn.z", "gdn.b", "gdn.a", "gdn.beta", "gdn.g")


def _full_attention(
    lv: _Live,
    d: Qwen35Dims,
    s: int,
    b: int,
    attention: str,
    masked: bool,
    use_cache: bool,
    layer: int,
    out: str,
    impl: str = "sdpa",
) -> None:
    """Qwen3_5Attention.forward (mq L769-L814); ``impl`` is config._attn_implementation, the
    attention interface it calls (mq 5.24.0 L798: ALL_ATTENTION_FUNCTIONS.get_interface)."""
    nh, nkv, hd, r = d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.rotary_dim
    qo, kv = nh * hd, nkv * hd
    lv.alloc("att.q_proj", b * s * 2 * qo)  # q_proj: query and gate (mq L781)
    lv.alloc("att.gate", b * s * qo)  # gate.reshape of a strided chunk copies (mq L783)
    _rmsnorm(lv, "att.qn", s * nh, hd, b, "att.q")  # q_norm (mq L785)
    lv.free("att.q_proj")  # query_states rebound: the projection dies
    lv.alloc("att.k_proj", b * s * kv)  # mq L786
    _rmsnorm(lv, "att.kn", s * nkv, hd, b, "att.k")  # k_norm
    lv.free("att.k_proj")
    lv.alloc("att.v", b * s * kv)  # v_proj (mq L787)
    # apply_rotary_pos_emb (mq L667-L702)
    _rotary_half(lv, "rq", nh, s, r, b)
    _rotary_half(lv, "rk", nkv, s, r, b)
    lv.alloc("att.q_emb", b * s * qo)  # cat([q_embed, q_pass]) (mq L700)
    lv.free("rq.emb_rot")
    lv.alloc("att.k_emb", b * s * kv)  # mq L701
    lv.free("rk.emb_rot")
    lv.free("att.q", "att.k")  # query_states/key_states rebound (mq L790)
    if use_cache:
        # DynamicLayer.update: keys = cat([keys, key_states]) (cache_utils L136-L137)
        lv.alloc(f"cache.k{layer}", b * s * kv)
        lv.alloc(f"cache.v{layer}", b * s * kv)
        lv.free("att.k_emb", "att.v")
        k_name, v_name = None, None
    else:
        k_name, v_name = "att.k_emb", "att.v"
    if impl == "eager":
        _eager(lv, d, s, b, "att.o")  # mq L799
    elif impl == "flash_attention_2":
        _flash2(lv, d, s, b, masked, "att.o")
    else:
        _sdpa(lv, d, s, b, attention, masked, "att.o")  # mq L799
    lv.alloc("att.sig", b * s * qo)  # torch.sigmoid(gate) (mq L811)
    lv.alloc("att.gated", b * s * qo)  # attn_output * sigmoid(gate)
    lv.free("att.sig", "att.o")
    lv.alloc(out, b * s * d.hidden_size)  # o_proj (mq L813)
    lv.free("att.gated")
    lv.free("att.q_emb", "att.gate")  # return: locals die
    lv.drop(*(x for x in (k_name, v_name) if x))


def _check_args(d: Qwen35Dims, seq: int, dtype_bytes: int, attention: str) -> None:
    if not isinstance(d, Qwen35Dims):
        raise TypeError(f"expected Qwen35Dims, got {type(d).__name__}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise ValueError(f"seq must be a positive int, got {seq!r}")
    if dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {dtype_bytes!r}")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")


def _replay(
    d: Qwen35Dims,
    seq: int,
    dtype_bytes: int,
    attention: str,
    use_cache: bool,
    packed: bool,
    record: bool = False,
    attn_implementation: str = "sdpa",
    linear_kernels: str = "torch",
    position_ids_given: bool = False,
) -> _Live:
    _check_args(d, seq, dtype_bytes, attention)
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
    if linear_kernels not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernels must be one of {LINEAR_KERNELS}, got {linear_kernels!r}")
    impl = attn_implementation
    s, b, h = seq, dtype_bytes, d.hidden_size
    lv = _Live(record)

    # ---- prologue: Qwen3_5TextModel.forward (mq L1231-L1270) ----
    lv.phase = "prologue"
    if not position_ids_given:
        # position_ids=None: made here (transformers 5.25.0's Qwen3_5TextModel.forward, L1323-L1326). Given
        # (models/nn/target.body_forward passes each document's slice of the packed row),
        # `position_ids[None, ...].expand(4, ...)`, [0] and [1:] are views.
        lv.alloc("arange", 8 * s)  # torch.arange(seq) int64 (mq L1243)
        lv.alloc("position_ids", 8 * s)  # + past_seen_tokens; expand/[0]/[1:] are views
        lv.free("arange")
    masked = False
    if not use_cache:
        # create_causal_mask -> _preprocess_mask_arguments -> find_packed_sequence_indices
        # (masking_utils L750-L779) runs when attention_mask and past_key_values are None.
        lv.alloc("pk.first", 8)  # position_ids[:, :1] - 1
        lv.alloc("pk.cat", 8 * (s + 1))  # torch.diff(prepend=...) concatenates
        lv.alloc("pk.diff", 8 * s)
        lv.free("pk.cat")
        lv.alloc("pk.ne", s)  # != 1
        lv.alloc("pk.seq", 8 * s)  # .cumsum(-1) int64
        lv.free("pk.ne", "pk.diff", "pk.first")
        if packed and impl != "flash_attention_2":
            # position_ids restart inside the sequence (or tensors are fake, where
            # is_tracing() keeps the packed path): sdpa_mask builds the mask with
            # and_masks(packed_sequence_mask_function, remapped causal) over a
            # [1, 1, seq, seq] broadcast (masking_utils L44-L55, L208-L222).
            lv.alloc("mask.ones", 1)  # q_idx.new_ones((), bool)
            lv.alloc("mask.same_doc", s * s)  # seq_id[q] == seq_id[kv]
            lv.alloc("mask.and1", s * s)  # result & same_doc
            lv.free("mask.same_doc", "mask.ones")
            lv.alloc("mask.causal", s * s)  # position_ids[kv] <= position_ids[q]
            lv.alloc("causal_mask", s * s)  # result & causal; lives for the whole forward
            lv.free("mask.causal", "mask.and1")
            masked = True
        elif impl == "eager":
            # eager_mask (masking_utils L552-L618) calls sdpa_mask with allow_is_causal_skip=False:
            # the causal [1, 1, seq, seq] bool mask (causal_mask_function L74-L78) is always built
            lv.alloc("causal_mask", s * s)
            masked = True
        if impl == "eager":
            # torch.where(mask, torch.zeros((), dtype), min_dtype) (masking_utils L617): the
            # additive mask in the model dtype, [1, 1, seq, seq], for the whole forward
            lv.alloc("mask.zero", b)
            lv.alloc("causal_mask_f", b * s * s)
            lv.free("mask.zero", "causal_mask")
            lv.rename("causal_mask_f", "causal_mask")
        masked = masked or (packed and impl == "flash_attention_2")  # flash: varlen, no mask
        lv.free("pk.seq")
    elif packed:
        raise ValueError("packed=True needs use_cache=False (transformers only detects "
                         "packed position_ids without a cache)")
    elif impl != "sdpa":
        raise ValueError(f"use_cache=True is modelled for sdpa only, not {impl!r}")
    # Qwen3_5TextRotaryEmbedding.forward (mq L177-L187), r/2 frequencies, 3 mrope rows
    half = d.rotary_dim // 2
    lv.alloc("rope.pos", F32 * 3 * s)  # position_ids[..., None].float()
    lv.alloc("rope.freqs", F32 * 3 * s * half)  # * inv_freq
    lv.free("rope.pos")
    for x in ("cos", "sin"):
        lv.alloc(f"rope.{x}0", F32 * 3 * s * half)  # freqs.cos() / .sin()
        lv.alloc(f"rope.{x}3", F32 * 3 * s * half)  # * attention_scaling
        lv.free(f"rope.{x}0")
    for x in ("sin", "cos"):  # recomposition_frequencies (mq L189-L198): in-place + cat
        lv.alloc(f"rope.{x}f", F32 * s * d.rotary_dim)
        lv.free(f"rope.{x}3")
    if b != F32:  # cos.to(x.dtype), sin.to(x.dtype) (mq L187)
        lv.alloc("cos", b * s * d.rotary_dim)
        lv.alloc("sin", b * s * d.rotary_dim)
        lv.free("rope.cosf", "rope.sinf")
    else:
        lv.rename("rope.cosf", "cos")
        lv.rename("rope.sinf", "sin")
    lv.free("rope.freqs")

    # ---- decoder layers (mq L1272-L1281, Qwen3_5DecoderLayer.forward mq L867-L907) ----
    # Layer 0 reads inputs_embeds (not counted: the live input); later layers read the
    # previous layer's output, which the loop variable keeps alive for the whole layer.
    # Without a cache every layer after the first of its type repeats the same live set,
    # so only those need replaying.
    seen: set[tuple[str, bool]] = set()
    for i, t in enumerate(d.layer_types):
        key = (t, i > 0)
        if not use_cache and key in seen:
            continue
        seen.add(key)
        lv.phase = "input_layernorm"
        hin = "h_in" if i > 0 else None
        if hin:
            lv.alloc(hin, b * s * h)
        _rmsnorm(lv, "ln1", s, h, b, "xn")  # input_layernorm (mq L878)
        lv.phase = t
        if t == "linear_attention":
            gdn = _gated_deltanet_fla if linear_kernels == "fla" else _gated_deltanet
            gdn(lv, d, s, b, use_cache, "mixer_out")  # mq L882
        else:
            _full_attention(lv, d, s, b, attention, masked, use_cache, i, "mixer_out", impl)
        lv.free("xn")  # hidden_states rebound to the mixer output
        if use_cache and t == "linear_attention":
            lv.rename("cache.conv_state", f"cache.conv{i}")
            lv.rename("cache.recurrent_state", f"cache.rec{i}")
        lv.phase = "residual"
        lv.alloc("h_mid", b * s * h)  # residual + hidden_states (mq L899)
        lv.free("mixer_out")
        lv.phase = "post_attention_layernorm"
        _rmsnorm(lv, "ln2", s, h, b, "xn2")  # post_attention_layernorm (mq L903)
        lv.phase = "mlp"
        _mlp(lv, d, s, b, "mlp_out")  # mq L904
        lv.phase = "residual"
        lv.free("xn2")
        lv.alloc("h_out", b * s * h)  # mq L905
        lv.free("mlp_out", "h_mid")
        lv.drop("eager.weights")  # `hidden_states, _ = self.self_attn(...)`: `_` dies on return
        if hin:
            lv.free(hin)
        lv.free("h_out")  # becomes the next layer's h_in

    # ---- final norm (mq L1283) ----
    lv.phase = "final_norm"
    if d.num_hidden_layers:
        lv.alloc("h_in", b * s * h)
    _rmsnorm(lv, "norm", s, h, b, "last_hidden_state")
    lv.drop("h_in")
    return lv


@functools.lru_cache(maxsize=64)
def _derived_dims(d: Qwen35Dims, dtype_bytes: int) -> tuple[tuple[str, int], ...] | None:
    from . import programs
    from .decoder import PROGRAM_DTYPE_BYTES, program

    if (d.attn_implementation, d.linear_kernels) != ("sdpa", "torch") or d.packing not in ("documents", "mask") \
            or dtype_bytes not in PROGRAM_DTYPE_BYTES.values() or d.partial_rotary_factor != 0.25 \
            or d.attention_bias or d.linear_conv_kernel_dim != 4:
        return None
    try:
        p = program("qwen3_5", d.packing)
    except programs.ProgramError:
        return None
    values = {n: getattr(d, key) for n, key in p["dims"].items() if n != "seq" and n not in p.get("derived", {})}
    try:
        programs.bind(p, values, 2)     # the conditions on the dims alone (seq 2 meets those on seq)
    except programs.ProgramError:
        return None
    return tuple(sorted(values.items()))


@functools.lru_cache(maxsize=64)
def body_events(d: Qwen35Dims, seq: int, dtype_bytes: int):
    """The body forward's events (models/body.py) from the replay: the prologue, one chunk per replayed layer kind
    (type, not the first layer), and the final norm, as models/nn/target.body_forward calls the body: with the
    position ids (a document's slice of the packed row: views, nothing allocated for them), and with the embedding
    output alive until the body returns, since ``Qwen3_5TextModel.forward`` keeps it in ``inputs_embeds``
    through every layer (``inputs_embeds = self.embed_tokens(input_ids)``, then ``hidden_states = inputs_embeds``:
    lines 1317 and 1351 of transformers 5.25.0's modeling_qwen3_5.py). Freed after layer 0, as it was, check
    predicted one [seq, hidden] state less than the live tracker (exec/memtrack.py) measures at the target's peak
    (tests/test_run.py)."""
    from .body import BodyEvents

    lv = _replay(d, seq, dtype_bytes, use_cache=False, record=True, position_ids_given=True, **forward_kwargs(d))
    prologue, chunks, cur = [], [], []
    in_layers = False
    for phase, ev, size, _ in lv.events:
        if phase == "prologue" and not in_layers:
            prologue.append((ev, size))
            continue
        in_layers = True
        if ev == "-h_out":
            chunks.append(tuple(cur))
            cur = []
            continue
        cur.append((ev, size))
    keys = list(dict.fromkeys((t, i > 0) for i, t in enumerate(d.layer_types)))
    cur.append(("-@embeds", 0))     # inputs_embeds dies as the body returns, after the final norm (5.25.0: L1365)
    return BodyEvents(prologue=tuple(prologue), layers=dict(zip(keys, chunks)), final=tuple(cur),
                      label=functools.partial(tensor_label, d, seq, dtype_bytes), embeds_to_end=True)


def body_forward_workspace_bytes(
    d: Qwen35Dims,
    seq: int,
    dtype_bytes: int,
    *,
    attention: str = "flash",
    use_cache: bool = False,
    packed: bool = False,
    attn_implementation: str = "sdpa",
    linear_kernels: str = "torch",
) -> int:
    """Peak transient bytes of ``model.model(...)`` under ``torch.no_grad()``, batch 1.

    Bytes ABOVE the live input hidden state [seq, hidden] (the embedding output /
    inputs_embeds).  Includes the output [seq, hidden] once it exists, the running
    hidden states, the per-layer peak of every layer type (MLP gate/up/act, attention
    q/k/v/gate projections, rotary, q/k norms, Gated DeltaNet projections + conv +
    the chunked delta rule at chunk 64 in fp32, RMSNorm fp32 upcasts), rotary cos/sin
    and the mask.  Weights are not included.

    attention: see ATTENTION_MODES ("flash" = CUDA, "cpu_flash" = CPU, "math").
    use_cache: transformers' default is ``config.use_cache`` (True): the DynamicCache then
        keeps K/V of every full-attention layer; pass ``use_cache=False`` to the model.
    packed: position_ids restart inside the sequence (packed documents): transformers then
        materialises a [seq, seq] bool mask and cannot use ``is_causal``.  With plain
        position_ids (or none) and no padding mask, ``create_causal_mask`` returns None and
        sdpa runs with ``is_causal=True``: no mask bytes at all.
    """
    return _replay(d, seq, dtype_bytes, attention, use_cache, packed,
                   attn_implementation=attn_implementation, linear_kernels=linear_kernels).peak


def body_forward_workspace_breakdown(
    d: Qwen35Dims,
    seq: int,
    dtype_bytes: int,
    *,
    attention: str = "flash",
    use_cache: bool = False,
    packed: bool = False,
    attn_implementation: str = "sdpa",
    linear_kernels: str = "torch",
) -> dict[str, int]:
    """Peak live bytes (same basis as the workspace) reached inside each phase, keyed like
    the modules MemTracker reports: "prologue" (positions, mask, rotary),
    "input_layernorm", "linear_attention" (Qwen3_5GatedDeltaNet), "full_attention"
    (Qwen3_5Attention), "residual" (the two adds), "post_attention_layernorm", "mlp",
    "final_norm"; each the maximum over the layers of that kind."""
    return dict(_replay(d, seq, dtype_bytes, attention, use_cache, packed,
                        attn_implementation=attn_implementation, linear_kernels=linear_kernels).phase_peak)


def body_forward_output_bytes(d: Qwen35Dims, seq: int, dtype_bytes: int) -> int:
    """last_hidden_state [seq, hidden] (mq L1283)."""
    return seq * d.hidden_size * dtype_bytes


def body_forward_peak_bytes(
    d: Qwen35Dims,
    seq: int,
    dtype_bytes: int,
    *,
    attention: str = "flash",
    use_cache: bool = False,
    packed: bool = False,
    attn_implementation: str = "sdpa",
    linear_kernels: str = "torch",
) -> int:
    """Live input hidden state + workspace: the activation peak of the body forward."""
    return seq * d.hidden_size * dtype_bytes + body_forward_workspace_bytes(
        d, seq, dtype_bytes, attention=attention, use_cache=use_cache, packed=packed,
        attn_implementation=attn_implementation, linear_kernels=linear_kernels,
    )


def max_seq_within(
    d: Qwen35Dims,
    budget_bytes: int,
    dtype_bytes: int,
    *,
    attention: str = "flash",
    use_cache: bool = False,
    packed: bool = False,
    attn_implementation: str = "sdpa",
    linear_kernels: str = "torch",
    limit: int = 1 << 26,
) -> int:
    """Largest seq whose body_forward_peak_bytes (input + workspace) fits in budget_bytes.

    The peak is non-decreasing in seq, so this is a bisection (about 50 evaluations);
    0 when not even one token fits, ``limit`` when ``limit`` tokens fit.
    """
    def fits(n: int) -> bool:
        peak = body_forward_peak_bytes(
            d, n, dtype_bytes, attention=attention, use_cache=use_cache, packed=packed,
            attn_implementation=attn_implementation, linear_kernels=linear_kernels,
        )
        return peak <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, min(2 * hi, limit)
    if hi == limit and fits(hi):
        return limit
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def cache_bytes(d: Qwen35Dims, seq: int, dtype_bytes: int) -> int:
    """What a DynamicCache holds after a prefill of ``seq`` tokens (use_cache=True).

    Full attention: K and V after rotary, [kv_heads, seq, head_dim] each (cache_utils
    DynamicLayer.update L136-L137).  Gated DeltaNet: conv state [conv_dim, K] in the model
    dtype and the fp32 recurrent state [v_heads, k_dim, v_dim] (mq L397, L647).
    """
    kv = 2 * seq * d.num_key_value_heads * d.head_dim * dtype_bytes
    lin = (
        d.conv_dim * d.linear_conv_kernel_dim * dtype_bytes
        + F32 * d.linear_num_value_heads * d.linear_key_head_dim * d.linear_value_head_dim
    )
    return d.count("full_attention") * kv + d.count("linear_attention") * lin


def logits_bytes(d: Qwen35Dims, tokens: int, dtype_bytes: int) -> int:
    """lm_head output [tokens, vocab] (mq L1662)."""
    return tokens * d.vocab_size * dtype_bytes


# --------------------------------------------------------------------------------------
# FLOPs (matmul-class work only: 2 FLOPs per multiply-add; elementwise ops, norms,
# softmax, exp are not counted)
# --------------------------------------------------------------------------------------


def body_forward_flops_breakdown(d: Qwen35Dims, seq: int) -> dict[str, int]:
    """Matmul-class FLOPs of the body forward by kind, summed over all layers.

    2 FLOPs per multiply-add.  Keys: "mlp" (gate/up/down), "linear_proj" (in_proj_qkv/z/b/a,
    out_proj), "conv" (depthwise causal conv1d), "delta_rule" (the chunked delta rule's
    matmuls on the 64-padded length), "delta_rule_solve" (its two unit-lower-triangular
    solves, c^2/2 multiply-adds per right-hand column), "attention_proj" (q with gate, k, v,
    o), "attention" (QK^T and PV over the seq*(seq+1)/2 causal pairs).
    """
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise ValueError(f"seq must be a positive int, got {seq!r}")
    s, h, c = seq, d.hidden_size, DELTA_RULE_CHUNK
    n_lin, n_full = d.count("linear_attention"), d.count("full_attention")
    nv, dk, dv = d.linear_num_value_heads, d.linear_key_head_dim, d.linear_value_head_dim
    nh, hd = d.num_attention_heads, d.head_dim
    chunks = -(-s // c)
    # per 64-token chunk and value head (mq L374-L415)
    dr = (
        2 * c * c * dk  # k_beta @ key^T (mq L374)
        + 2 * c * c * dk  # query @ key^T (mq L375)
        + 2 * c * dk * dv  # k_cumdecay[:, :, i] @ state (mq L411)
        + 2 * c * dk * dv  # query[:, :, i] @ state (mq L412)
        + 2 * c * c * dv  # intra_chunk_attn[:, :, i] @ v_new (mq L413)
        + 2 * dk * c * dv  # key^T @ v_new (mq L415)
    )
    solve = c * c * (dv + dk)  # solve_triangular x2 (mq L385-L386)
    return {
        "mlp": d.num_hidden_layers * 2 * s * h * d.intermediate_size * 3,  # mq L829
        "linear_proj": n_lin
        * (2 * s * h * (d.conv_dim + d.linear_value_dim + 2 * nv) + 2 * s * d.linear_value_dim * h),
        # depthwise conv1d with padding K-1 computes seq + K - 1 outputs, then slices (mq L265)
        "conv": n_lin * 2 * (s + d.linear_conv_kernel_dim - 1) * d.conv_dim * d.linear_conv_kernel_dim,
        "delta_rule": n_lin * nv * chunks * dr,
        "delta_rule_solve": n_lin * nv * chunks * solve,
        "attention_proj": n_full
        * (2 * s * h * (2 * nh * hd + 2 * d.num_key_value_heads * hd) + 2 * s * nh * hd * h),
        "attention": n_full * 4 * nh * hd * (s * (s + 1) // 2),
    }


def body_forward_flops(d: Qwen35Dims, seq: int) -> int:
    """Matmul-class FLOPs of the body forward (embedding lookup, norms, elementwise,
    softmax and exp are not counted); see body_forward_flops_breakdown."""
    return sum(body_forward_flops_breakdown(d, seq).values())


def lm_head_flops(d: Qwen35Dims, tokens: int) -> int:
    """[tokens, hidden] @ [hidden, vocab]."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
    return 2 * tokens * d.hidden_size * d.vocab_size
