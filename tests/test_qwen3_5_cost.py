"""Checks of dflash_graph.models.qwen3_5 against transformers and torch's MemTracker.

Reference: transformers 5.23 Qwen3_5ForCausalLM / Qwen3_5TextModel, torch 2.13 MemTracker
(torch.distributed._tools.mem_tracker).  All model runs are CPU, small dims, a few seconds.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import pathlib
import time

import pytest

from dflash_graph.models import qwen3_5 as Q

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3_5TextModel  # noqa: E402
from dflash_graph.models.trace.memtrack import no_backward_hooks  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

MODULE = pathlib.Path(Q.__file__)

# the 27B dims, from the graph that describes the crashed run (one source for the graph, tests and tools)
QWEN35_27B = {k: v for k, v in json.loads(
    (pathlib.Path(__file__).resolve().parent.parent / "graphs" / "qwen27b" / "target_config.json").read_text()
).items() if k not in ("model_type", "rms_norm_eps", "tie_word_embeddings")}   # tie: the default (untied)

# hidden 256, 4 layers (3 linear + 1 full), GQA in both mixers
SMALL = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
# the 27B ratios at 1/16 width (MLP 3.4x, q 1.2x, value heads 3x key heads), one KV head
SCALED_27B = {
    "vocab_size": 1000,
    "hidden_size": 320,
    "intermediate_size": 1088,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
# key heads == value heads (no repeat_interleave), full attention without GQA, wide MLP
WIDE_MLP = dict(SMALL, intermediate_size=1536, num_key_value_heads=4, linear_num_value_heads=2,
                num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "full_attention"])
ALL_FULL = dict(SMALL, num_hidden_layers=3, layer_types=["full_attention"] * 3)


# --------------------------------------------------------------------------------------
# static properties of the module
# --------------------------------------------------------------------------------------


def test_module_imports_no_torch():
    tree = ast.parse(MODULE.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    # its own package's modules (relative imports: the derived programs, models/body.py) are pure too, and
    # tests/test_layers.py and the fresh-interpreter check of `check` hold them to it
    assert names <= {"__future__", "math", "collections", "typing", "attrs", "importlib", "functools"}, names


def test_27b_formulas_are_fast():
    d = Q.Qwen35Dims.from_config(QWEN35_27B)
    t0 = time.perf_counter()
    for _ in range(10):
        Q.component_params(d)
        Q.body_forward_workspace_bytes(d, 65536, 2)
        Q.body_forward_workspace_bytes(d, 65536, 2, use_cache=True, attention="math")
        Q.body_forward_flops(d, 65536)
    assert (time.perf_counter() - t0) / 10 < 0.05


# --------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------


def test_defaults_match_hf_config():
    hf = Qwen3_5TextConfig()
    d = Q.Qwen35Dims.from_config({})
    for key in Q._INT_KEYS + ("tie_word_embeddings", "attention_bias"):
        assert getattr(d, key) == getattr(hf, key), key
    assert list(d.layer_types) == list(hf.layer_types)
    assert d.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]


@pytest.mark.parametrize("n_layers,interval", [(64, 4), (5, 2), (3, 1), (7, 8)])
def test_layer_types_follow_full_attention_interval(n_layers, interval):
    cfg = {"num_hidden_layers": n_layers, "full_attention_interval": interval}
    assert list(Q.Qwen35Dims.from_config(cfg).layer_types) == Qwen3_5TextConfig(**cfg).layer_types


def test_rotary_dim_matches_hf_cos():
    for cfg in ({}, {"partial_rotary_factor": 0.5}, {"rope_parameters": {"rope_type": "default",
                "rope_theta": 1e7, "partial_rotary_factor": 1.0}}, {"head_dim": 100}):
        hf = Qwen3_5TextModel(Qwen3_5TextConfig(**dict(SMALL, **cfg)))
        x = torch.zeros(1, 3, SMALL["hidden_size"])
        cos, _ = hf.rotary_emb(x, torch.arange(3).view(1, 1, -1).expand(3, 1, -1))
        assert Q.Qwen35Dims.from_config(dict(SMALL, **cfg)).rotary_dim == cos.shape[-1], cfg


def test_text_config_nesting_and_top_level_tie():
    d = Q.Qwen35Dims.from_config({"text_config": dict(QWEN35_27B), "tie_word_embeddings": True,
                                  "model_type": "qwen3_5"})
    assert d.hidden_size == 5120 and d.tie_word_embeddings is True


@pytest.mark.parametrize(
    "cfg,key",
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_size": True}, "hidden_size"),
        ({"vocab_size": "248320"}, "vocab_size"),
        ({"head_dim": None}, "head_dim"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"full_attention_interval": 0}, "full_attention_interval"),
        ({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 2}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 32}, "layer_types"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_key_value_heads"),
        ({"linear_num_key_heads": 5}, "linear_num_key_heads"),
        ({"rope_parameters": {"partial_rotary_factor": 0}}, "partial_rotary_factor"),
        ({"rope_parameters": []}, "rope_parameters"),
    ],
)
def test_bad_values_raise_naming_the_key(cfg, key):
    with pytest.raises(ValueError, match=key):
        Q.Qwen35Dims.from_config(cfg)


def test_strict_rejects_unknown_keys_and_lists_valid_ones():
    Q.Qwen35Dims.from_config(dict(QWEN35_27B, rms_norm_eps=1e-6, model_type="qwen3_5_text"), strict=True)
    with pytest.raises(ValueError, match="hiden_size.*valid keys.*hidden_size"):
        Q.Qwen35Dims.from_config({"hiden_size": 5120}, strict=True)
    assert Q.Qwen35Dims.from_config({"hiden_size": 5120}).hidden_size == 4096  # lenient default
    assert {"hidden_size", "layer_types", "full_attention_interval", "tie_word_embeddings"} <= Q.CONFIG_KEYS


# --------------------------------------------------------------------------------------
# 1. parameters: exact against the meta-device model
# --------------------------------------------------------------------------------------


def _hf_params(cfg):
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg))
    return model, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "cfg",
    [
        QWEN35_27B,
        SMALL,
        dict(SMALL, tie_word_embeddings=True),
        dict(SCALED_27B, tie_word_embeddings=False),
        dict(WIDE_MLP, attention_bias=True, tie_word_embeddings=True),
        dict(SMALL, num_hidden_layers=6, full_attention_interval=2, linear_conv_kernel_dim=3),
        ALL_FULL,
    ],
    ids=["27b", "small", "small-tied", "scaled27b", "bias-tied", "interval2", "all-full"],
)
def test_param_count_matches_meta_model(cfg):
    model, n = _hf_params(cfg)
    d = Q.Qwen35Dims.from_config(cfg)
    parts = Q.component_params(d)
    assert sum(parts.values()) == n == Q.total_params(d)
    inner = model.model
    assert parts["embed"] == inner.embed_tokens.weight.numel()
    assert parts["norm"] == inner.norm.weight.numel()
    assert parts["layers"] == sum(p.numel() for p in inner.layers.parameters())
    assert parts["lm_head"] == (0 if d.tie_word_embeddings else model.lm_head.weight.numel())
    for i, t in enumerate(d.layer_types):
        assert Q.layer_params(d, t) == sum(p.numel() for p in inner.layers[i].parameters())
    if cfg is QWEN35_27B:
        assert n == 26_895_998_464


def test_layer_params_rejects_unknown_type():
    with pytest.raises(ValueError, match="layer_type"):
        Q.layer_params(Q.Qwen35Dims.from_config(SMALL), "sliding_attention")


# --------------------------------------------------------------------------------------
# 2. activation peak against MemTracker
# --------------------------------------------------------------------------------------


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_cpu_sdpa_takes_the_cpu_flash_kernel_without_a_mask():
    """The CPU check runs attention='cpu_flash': sdpa with is_causal and GQA goes to
    aten._scaled_dot_product_flash_attention_for_cpu, no [heads, seq, seq] tensor."""
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**ALL_FULL, attn_implementation="sdpa")).eval()
    rec = _OpNames()
    with torch.no_grad(), rec:
        model(inputs_embeds=torch.randn(1, 128, ALL_FULL["hidden_size"]), use_cache=False)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in rec.names
    assert not any("attention_math" in n for n in rec.names)


def test_create_causal_mask_is_none_without_padding_or_packing():
    """sdpa + no padding + plain positions: no mask tensor, sdpa gets is_causal=True.
    Packed positions (restarting) build a dense [1, 1, seq, seq] bool mask."""
    from transformers.masking_utils import create_causal_mask

    config = Qwen3_5TextConfig(**SMALL, attn_implementation="sdpa")
    x = torch.zeros(1, 64, SMALL["hidden_size"])
    kw = {"config": config, "inputs_embeds": x, "attention_mask": None, "past_key_values": None}
    assert create_causal_mask(**kw, position_ids=torch.arange(64)[None]) is None
    assert create_causal_mask(**kw, position_ids=None) is None
    packed = torch.cat([torch.arange(20), torch.arange(44)])[None]
    mask = create_causal_mask(**kw, position_ids=packed)
    assert mask.shape == (1, 1, 64, 64) and mask.dtype == torch.bool


def _measure(cfg, seq, dtype, *, math=False, use_cache=False, packed=False):
    """MemTracker activation peak (whole forward and per module kind) of the body forward.

    inputs_embeds is created outside the tracker: it is the live input the formula leaves out.
    """
    config = Qwen3_5TextConfig(**cfg, attn_implementation="sdpa")
    model = Qwen3_5TextModel(config).eval().to(dtype)
    x = torch.randn(1, seq, config.hidden_size, dtype=dtype)
    pos = torch.cat([torch.arange(seq // 3), torch.arange(seq - seq // 3)])[None] if packed else None
    mt = MemTracker()
    mt.track_external(model)
    ctx = sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()
    with torch.no_grad(), no_backward_hooks(), mt, ctx:
        model(inputs_embeds=x, use_cache=use_cache, position_ids=pos)
    snap = mt.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    out = {"total": snap[dev][_MemRefType.ACT] + snap[dev][_MemRefType.TEMP]}

    def peak(mod):
        return max(s[dev][_MemRefType.ACT] for s in mt.memory_tracking[mod].snapshots[_ModState.PEAK_FW])

    for i, layer in enumerate(model.layers):
        kind = config.layer_types[i]
        mixer = layer.linear_attn if kind == "linear_attention" else layer.self_attn
        for name, mod in ((kind, mixer), ("mlp", layer.mlp), ("input_layernorm", layer.input_layernorm)):
            out[name] = max(out.get(name, 0), peak(mod))
    out["final_norm"] = peak(model.norm)
    return out


CASES = [
    # (id, cfg, seq, dtype, attention mode, flags)
    ("small-512-fp32", SMALL, 512, torch.float32, "cpu_flash", {}),
    ("small-2048-fp32", SMALL, 2048, torch.float32, "cpu_flash", {}),
    ("small-1024-bf16", SMALL, 1024, torch.bfloat16, "cpu_flash", {}),
    ("scaled27b-1000-fp32", SCALED_27B, 1000, torch.float32, "cpu_flash", {}),
    ("scaled27b-1536-bf16", SCALED_27B, 1536, torch.bfloat16, "cpu_flash", {}),
    ("widemlp-1536-bf16", WIDE_MLP, 1536, torch.bfloat16, "cpu_flash", {}),
    ("allfull-1024-fp32", ALL_FULL, 1024, torch.float32, "cpu_flash", {}),
    ("math-small-1024-fp32", SMALL, 1024, torch.float32, "math", {}),
    ("math-scaled27b-768-bf16", SCALED_27B, 768, torch.bfloat16, "math", {}),
    ("math-packed-small-768-bf16", SMALL, 768, torch.bfloat16, "math", {"packed": True}),
    ("packed-allfull-1024-bf16", ALL_FULL, 1024, torch.bfloat16, "cpu_flash", {"packed": True}),
    ("packed-small-1000-fp32", SMALL, 1000, torch.float32, "cpu_flash", {"packed": True}),
    ("cache-small-1024-bf16", SMALL, 1024, torch.bfloat16, "cpu_flash", {"use_cache": True}),
    ("cache-allfull-512-fp32", ALL_FULL, 512, torch.float32, "cpu_flash", {"use_cache": True}),
]


@pytest.mark.parametrize("cfg,seq,dtype,attention,flags", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_workspace_matches_memtracker(cfg, seq, dtype, attention, flags):
    torch.manual_seed(0)
    measured = _measure(cfg, seq, dtype, math=attention == "math", **flags)
    d = Q.Qwen35Dims.from_config(cfg)
    b = torch.finfo(dtype).bits // 8
    predicted = Q.body_forward_workspace_breakdown(d, seq, b, attention=attention, **flags)
    predicted["total"] = Q.body_forward_workspace_bytes(d, seq, b, attention=attention, **flags)
    for key, m in measured.items():
        assert predicted[key] == pytest.approx(m, rel=0.10), (key, m, predicted[key])
    # peak = live input + workspace
    assert Q.body_forward_peak_bytes(d, seq, b, attention=attention, **flags) == (
        seq * d.hidden_size * b + predicted["total"]
    )


def test_cache_bytes_match_dynamic_cache():
    cfg = dict(SMALL, num_hidden_layers=8)
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**cfg)).eval().to(torch.bfloat16)
    with torch.no_grad():
        out = model(inputs_embeds=torch.randn(1, 300, cfg["hidden_size"], dtype=torch.bfloat16), use_cache=True)
    cache = out.past_key_values
    seen = {}
    for t in cache.layers:  # DynamicLayer: keys/values; LinearAttentionLayer: dicts of states
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            v = getattr(t, name, None)
            for x in (v.values() if isinstance(v, dict) else [v]):
                if isinstance(x, torch.Tensor):
                    seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    assert len(seen) == 2 * len(cache.layers)
    assert sum(seen.values()) == Q.cache_bytes(Q.Qwen35Dims.from_config(cfg), 300, 2)


# --------------------------------------------------------------------------------------
# the CUDA prediction and the 27B figures
# --------------------------------------------------------------------------------------


def test_mode_ordering_and_monotonic_in_seq():
    d = Q.Qwen35Dims.from_config(QWEN35_27B)
    prev = 0
    for seq in (1, 63, 64, 65, 1000, 4096, 65536):
        ws = {m: Q.body_forward_workspace_bytes(d, seq, 2, attention=m) for m in Q.ATTENTION_MODES}
        assert ws["flash"] <= ws["cpu_flash"] <= ws["math"]
        assert ws["flash"] >= prev
        prev = ws["flash"]
    # 27B at 65,536 bf16: per-layer peak in the Gated DeltaNet, about 20.6 GiB, the same
    # for 4 layers as for 64 (no cache); measured with tools/memtrack_qwen27b.py
    d4 = Q.Qwen35Dims.from_config(dict(QWEN35_27B, num_hidden_layers=4))
    ws = Q.body_forward_workspace_bytes(d, 65536, 2)
    assert ws == Q.body_forward_workspace_bytes(d4, 65536, 2, attention="cpu_flash")
    assert 20.5 * 2**30 < ws < 20.7 * 2**30
    assert max(Q.body_forward_workspace_breakdown(d, 65536, 2).items(), key=lambda kv: kv[1])[0] == (
        "linear_attention"
    )
    # the dense packed mask is seq^2 bytes; math attention would need [24, seq, seq] fp32 tensors
    assert Q.body_forward_workspace_bytes(d, 65536, 2, packed=True) > ws + 65536**2 - 1
    assert Q.body_forward_workspace_bytes(d, 65536, 2, attention="math") > 2 * 24 * 65536**2 * 4
    # the default use_cache=True keeps K/V of 16 full layers: about 4.1 GiB at the end; the
    # peak (layer 62, a Gated DeltaNet) already carries 15 of them and 46 linear states
    assert Q.cache_bytes(d, 65536, 2) == 16 * 2 * 65536 * 4 * 256 * 2 + 48 * (10240 * 4 * 2 + 48 * 128 * 128 * 4)
    d62 = Q.Qwen35Dims.from_config(dict(QWEN35_27B, num_hidden_layers=62))
    assert Q.body_forward_workspace_bytes(d, 65536, 2, use_cache=True) == (
        ws + Q.cache_bytes(d62, 65536, 2) + 10240 * 4 * 2
    )


def test_max_seq_within_is_the_boundary():
    d = Q.Qwen35Dims.from_config(QWEN35_27B)
    budget = 30 * 2**30
    n = Q.max_seq_within(d, budget, 2)
    assert Q.body_forward_peak_bytes(d, n, 2) <= budget < Q.body_forward_peak_bytes(d, n + 1, 2)
    assert 65536 < n < 131072
    assert Q.max_seq_within(d, 10, 2) == 0
    assert Q.max_seq_within(d, 2**60, 2, limit=1000) == 1000


def test_bad_arguments():
    d = Q.Qwen35Dims.from_config(SMALL)
    with pytest.raises(ValueError, match="attention"):
        Q.body_forward_workspace_bytes(d, 16, 2, attention="sdpa")
    with pytest.raises(ValueError, match="seq"):
        Q.body_forward_workspace_bytes(d, 0, 2)
    with pytest.raises(ValueError, match="dtype_bytes"):
        Q.body_forward_workspace_bytes(d, 16, 3)
    with pytest.raises(ValueError, match="packed"):
        Q.body_forward_workspace_bytes(d, 16, 2, packed=True, use_cache=True)
    with pytest.raises(ValueError, match="tokens"):
        Q.lm_head_flops(d, -1)


# --------------------------------------------------------------------------------------
# FLOPs against torch's FlopCounterMode
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [512, 1000])
def test_flops_match_flop_counter(seq):
    from torch.utils.flop_counter import FlopCounterMode

    d = Q.Qwen35Dims.from_config(SMALL)
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**SMALL, attn_implementation="sdpa")).eval()
    x = torch.randn(1, seq, SMALL["hidden_size"])
    br = Q.body_forward_flops_breakdown(d, seq)
    assert Q.body_forward_flops(d, seq) == sum(br.values())
    # the CPU flash kernel and solve_triangular have no FLOP formula in the counter
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), no_backward_hooks(), counter:
        model(inputs_embeds=x, use_cache=False)
    got = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert got["aten.mm"] == br["mlp"] + br["linear_proj"] + br["attention_proj"]
    assert got["aten.bmm"] == br["delta_rule"]
    assert got["aten.convolution"] == br["conv"]
    # math attention: QK^T and PV over all seq^2 pairs (the formula counts the causal half)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), no_backward_hooks(), counter, sdpa_kernel(SDPBackend.MATH):
        model(inputs_embeds=x, use_cache=False)
    bmm = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}["aten.bmm"]
    full_pairs = br["attention"] * seq * seq // (seq * (seq + 1) // 2)
    assert bmm - br["delta_rule"] == full_pairs


def test_lm_head_flops():
    from torch.utils.flop_counter import FlopCounterMode

    d = Q.Qwen35Dims.from_config(SMALL)
    head = torch.nn.Linear(d.hidden_size, d.vocab_size, bias=False)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        head(torch.randn(37, d.hidden_size))
    assert counter.get_total_flops() == Q.lm_head_flops(d, 37)
    assert Q.logits_bytes(Q.Qwen35Dims.from_config(QWEN35_27B), 65536, 2) == 65536 * 248320 * 2
