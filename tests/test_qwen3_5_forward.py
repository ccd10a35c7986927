"""The forward a Qwen3.5 target declares (attn_implementation, packing, linear_kernels): each memory program
against torch's MemTracker, byte for byte, on small and 27B-wide configs; the packed-mask figures; check's printed
assumption, its errors and the eager OOM; and the run path running the declared packing.

Reference: transformers 5.25 Qwen3_5TextModel, torch 2.13 MemTracker. Small configs run real CPU tensors; the
27B-wide ones run over fake tensors (tools/memtrack_qwen27b.py, the tool docs/memory-qwen3_5.md quotes).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import pathlib

import pytest

from dflash_graph.cli.main import main
from dflash_graph.models import qwen3_5 as Q

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState  # noqa: E402
from transformers import Qwen3_5TextConfig, Qwen3_5TextModel  # noqa: E402
from dflash_graph.models.trace.memtrack import no_backward_hooks  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
ROOT = pathlib.Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location("memtrack_qwen27b", ROOT / "tools" / "memtrack_qwen27b.py")
TOOL = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TOOL)
QWEN35_27B = TOOL.QWEN35_27B

SMALL = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
# the 27B ratios at 1/16 width, one KV head (repeat_kv stays a view)
SCALED_27B = dict(SMALL, hidden_size=320, intermediate_size=1088, num_attention_heads=6, num_key_value_heads=1,
                  linear_num_value_heads=6)


def _real_measure(cfg, seq, dtype, impl, docs):
    """MemTracker over real CPU tensors: the whole forward's activation peak and each module kind's."""
    config = Qwen3_5TextConfig(**cfg, attn_implementation=impl)
    model = Qwen3_5TextModel(config).eval().to(dtype)
    x = torch.randn(1, seq, config.hidden_size, dtype=dtype)
    pos = TOOL.packed_positions(seq, docs) if docs > 1 else None
    mt = MemTracker()
    mt.track_external(model)
    with torch.no_grad(), no_backward_hooks(), mt:
        model(inputs_embeds=x, use_cache=False, position_ids=pos)
    snap = mt.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    out = {"total": snap[dev][_MemRefType.ACT] + snap[dev][_MemRefType.TEMP]}

    def peak(mod):
        return max(s[dev][_MemRefType.ACT] for s in mt.memory_tracking[mod].snapshots[_ModState.PEAK_FW])

    for i, layer in enumerate(model.layers):
        kind = config.layer_types[i]
        mixer = layer.linear_attn if kind == "linear_attention" else layer.self_attn
        for name, mod in ((kind, mixer), ("mlp", layer.mlp), ("input_layernorm", layer.input_layernorm),
                          ("post_attention_layernorm", layer.post_attention_layernorm)):
            out[name] = max(out.get(name, 0), peak(mod))
    out["final_norm"] = peak(model.norm)
    return out


def _predicted(cfg, seq, b, impl, packed):
    d = Q.Qwen35Dims.from_config(cfg)
    kw = {"attention": "cpu_flash", "packed": packed, "attn_implementation": impl}
    pred = Q.body_forward_workspace_breakdown(d, seq, b, **kw)
    pred["total"] = Q.body_forward_workspace_bytes(d, seq, b, **kw)
    return pred


CASES = [
    # (id, cfg, seq, dtype, attn_implementation, packed documents)
    ("sdpa-mask-small-256-bf16", SMALL, 256, torch.bfloat16, "sdpa", 8),
    ("eager-small-256-fp32", SMALL, 256, torch.float32, "eager", 1),
    ("eager-mask-small-256-bf16", SMALL, 256, torch.bfloat16, "eager", 8),
    ("eager-mask-scaled27b-384-bf16", SCALED_27B, 384, torch.bfloat16, "eager", 8),
    ("eager-scaled27b-320-fp32", SCALED_27B, 320, torch.float32, "eager", 1),
]


@pytest.mark.parametrize("cfg,seq,dtype,impl,docs", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_program_matches_memtracker_byte_for_byte(cfg, seq, dtype, impl, docs):
    torch.manual_seed(0)
    measured = _real_measure(cfg, seq, dtype, impl, docs)
    predicted = _predicted(cfg, seq, torch.finfo(dtype).bits // 8, impl, docs > 1)
    assert {k: predicted.get(k) for k in measured} == measured


@pytest.mark.parametrize("variant", ["packed", "eager"])
def test_27b_width_program_matches_memtracker_over_fake_tensors(variant):
    """27B dims (5,120 hidden, 24 heads, 4 KV heads), 4 layers, a short packed sequence: exact."""
    cfg = dict(QWEN35_27B, num_hidden_layers=4)
    seq = 256
    impl, packed, _ = TOOL.VARIANTS[variant]
    measured = TOOL.measure(cfg, seq, torch.bfloat16, variant, docs=4)
    predicted = _predicted(cfg, seq, 2, impl, packed)
    assert {k: predicted.get(k) for k in measured} == measured


@pytest.mark.slow
@pytest.mark.parametrize("seq", [16384])
def test_27b_packed_mask_costs_seq_squared_bytes_measured(seq):
    """The figures of issue 14 at 27B width, measured: 8 packed documents add one [seq, seq] bool mask to the
    activation peak (+256 MiB at 16,384; tools/memtrack_qwen27b.py --seq 65536 gives +4.00 GiB, about 25 min)."""
    cfg = dict(QWEN35_27B, num_hidden_layers=4)
    plain = TOOL.measure(cfg, seq, torch.bfloat16, "plain")
    packed = TOOL.measure(cfg, seq, torch.bfloat16, "packed", docs=8)
    assert packed["total"] - plain["total"] == seq * seq
    assert plain["total"] == _predicted(cfg, seq, 2, "sdpa", False)["total"]
    assert packed["total"] == _predicted(cfg, seq, 2, "sdpa", True)["total"]


@pytest.mark.parametrize("seq", [16384, 65536])
def test_packed_mask_adds_seq_squared_bytes_at_27b(seq):
    """The program's side of the figures above: the whole-forward peak grows by exactly seq^2 bytes (4.00 GiB at
    65,536, 256 MiB at 16,384) because the peak stays in a Gated DeltaNet layer, where only the bool mask is
    alive; 64 layers give the same as 4 (no cache)."""
    d = Q.Qwen35Dims.from_config(QWEN35_27B)
    plain = Q.body_forward_peak_bytes(d, seq, 2, attention="cpu_flash")
    packed = Q.body_forward_peak_bytes(d, seq, 2, attention="cpu_flash", packed=True)
    assert packed - plain == seq * seq
    d4 = Q.Qwen35Dims.from_config(dict(QWEN35_27B, num_hidden_layers=4))
    assert packed == Q.body_forward_peak_bytes(d4, seq, 2, attention="cpu_flash", packed=True)


def test_eager_holds_heads_seq_seq_scores():
    d = Q.Qwen35Dims.from_config(QWEN35_27B)
    s = 4096
    eager = Q.body_forward_workspace_bytes(d, s, 2, attn_implementation="eager")
    # scores, scaled scores and the fp32 softmax input and output coexist at some point: at least 2 bf16 + 1 fp32
    assert eager > d.num_attention_heads * s * s * (2 + 2 + 4)
    assert Q.body_forward_workspace_breakdown(d, s, 2, attn_implementation="eager")["full_attention"] == eager


# --------------------------------------------------------------------------------------
# declared choices, defaults and errors
# --------------------------------------------------------------------------------------


def test_defaults_follow_transformers_and_what_is_installed(monkeypatch):
    d = Q.Qwen35Dims.from_config(SMALL)
    monkeypatch.setattr(Q, "installed_linear_kernels", lambda: "torch")
    base = d.with_forward(None, None, None)
    assert (base.attn_implementation, base.packing, base.linear_kernels) == ("sdpa", "documents", "torch")
    assert Qwen3_5TextModel(Qwen3_5TextConfig(**SMALL)).config._attn_implementation == "sdpa"
    monkeypatch.setattr(Q, "installed_linear_kernels", lambda: "fla")
    assert d.with_forward(None, None, None).linear_kernels == "fla"
    assert d.with_forward(None, None, "torch").linear_kernels == "torch"


def test_installed_linear_kernels_looks_packages_up(monkeypatch):
    found = {"fla", "causal_conv1d"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in found else None)
    assert Q.installed_linear_kernels() == "fla"
    found.discard("causal_conv1d")
    assert Q.installed_linear_kernels() == "torch"


@pytest.mark.parametrize("attn,packing,word", [("sdpa", "cu_seqlens", "flash path"),
                                               ("eager", "cu_seqlens", "flash path"),
                                               ("flash_attention_2", "mask", "never builds a mask")])
def test_impossible_combinations(attn, packing, word):
    assert word in Q.forward_problem(attn, packing, "torch")
    with pytest.raises(ValueError, match=word):
        Q.Qwen35Dims.from_config(SMALL).with_forward(attn, packing, "torch")


def test_check_prints_the_assumption(in_repo, capsys):
    assert main(["check", "graphs/qwen27b.toml"]) == 0
    out = capsys.readouterr().out
    assert ("model target: attention sdpa (declared), packed with a [seq, seq] mask (declared), linear attention: "
            "torch reference kernels (declared)") in out
    main(["check", "graphs/qwen27b.toml", "--set", "models.target.linear_kernels=fla",
          "--set", "models.target.attn_implementation=flash_attention_2", "--set", "models.target.packing=cu_seqlens"])
    out = capsys.readouterr().out
    assert "flash-linear-attention + causal-conv1d (declared)" in out and "not yet measured" in out


def test_eager_at_65536_is_an_oom_naming_the_scores(in_repo, capsys):
    assert main(["check", "graphs/qwen27b.toml", "--set", "models.target.attn_implementation=eager"]) == 1
    out = capsys.readouterr().out
    assert "OOM on gpu0..gpu6 (7 devices) at node 'target'" in out      # one block for the seven targets
    assert "Tried to allocate 192.00 GiB" in out
    assert "allocating layer 3 [24, 65,536, 65,536] bfloat16 (eager_attention_forward" in out


@pytest.mark.parametrize("sets,where", [
    (["models.target.packing=cu_seqlens"], "models.target.packing"),
    (["models.target.attn_implementation=flash"], "models.target.attn_implementation"),
    (["models.drafter.packing=mask"], "models.drafter.packing"),
])
def test_bad_declarations_exit_2_at_the_key(in_repo, capsys, sets, where):
    args = ["check", "graphs/qwen27b.toml"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert where in err and "Traceback" not in err


# --------------------------------------------------------------------------------------
# the run path runs the declared packing
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_run_path_packed_mask_is_transformers_forward(impl):
    from dflash_graph.models.nn.target import body_forward, build_target

    torch.manual_seed(0)
    model = build_target(dict(SMALL, model_type="qwen3_5_text"), None, torch.float32, "cpu",
                         attn_implementation=impl)
    assert model.config._attn_implementation == impl
    ids = torch.randint(0, 1000, (96,))
    pos = torch.cat([torch.arange(40), torch.arange(56)])
    with torch.no_grad():
        _, packed = body_forward(model, ids, pos, [1, 2], packing="mask")
        _, docs = body_forward(model, ids, pos, [1, 2], packing="documents")
        ref = model.model(input_ids=ids[None], position_ids=pos[None], use_cache=False, output_hidden_states=True)
    assert torch.equal(packed[1], ref.hidden_states[2][0])
    assert torch.equal(packed[2], ref.hidden_states[3][0])
    # the first document is the same either way; the second is not: the reference Gated DeltaNet kernels carry
    # state across the boundary of a packed row (which is why "documents" is the default)
    assert torch.allclose(packed[2][:40], docs[2][:40], atol=1e-5)
    assert not torch.allclose(packed[2][40:], docs[2][40:], atol=1e-3)


def test_gpu_check_forward_measurement_runs_on_cpu():
    """tools/gpu_check.py's per-forward measurement (what a lent GPU runs) on CPU: MemTracker equals the program."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    for impl, packing in (("eager", "mask"), ("sdpa", "documents")):
        rec = gc.measure_forward(gc.FORWARD_SMALL, 128, 4, impl, packing, "cpu")
        assert rec["measured_bytes"] == rec["predicted_bytes"], rec
    assert "skipped" in gc.measure_forward(gc.FORWARD_SMALL, 128, 4, "flash_attention_2", "cu_seqlens", "cpu") or \
        importlib.util.find_spec("flash_attn") is not None
