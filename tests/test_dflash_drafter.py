"""DFlash drafter: config, index helpers, mask, torch module, cost formulas.

The memory formulas are held against torch's MemTracker (the DESIGN's
measuring stick, +-10%); at these small CPU dims they agree to the byte.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash_graph.models.dflash import (
    CONFIG_KEYS,
    DFlashDims,
    _replay,
    _saved_closed_form,
    component_params,
    default_target_layer_ids,
    forward_flops,
    forward_program,
    forward_saved_bytes,
    forward_workspace_bytes,
)
from dflash_graph.models.nn.dflash import (
    DFlashDrafter,
    attention_bias,
    block_positions,
    block_token_ids,
    dflash_attention_mask,
    document_ids,
    sample_anchors,
)

REPO = Path(__file__).resolve().parents[1]

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    block_size=4,
    mask_token_id=3,
    target_layer_ids=(1, 2, 3),
    target_hidden_size=64,
    vocab_size=100,
)


def dims(**over) -> DFlashDims:
    return DFlashDims(**{**BASE, **over})


def packed_positions(*lengths: int) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def make(d: DFlashDims, t: int, doc_lengths, n_anchors: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    embed = nn.Embedding(d.vocab_size, d.hidden_size, dtype=dtype)
    model = DFlashDrafter(d, embed, dtype=dtype)
    context = torch.randn(t, d.fc_in_features, generator=g).to(dtype)
    input_ids = torch.randint(0, d.vocab_size, (t,), generator=g)
    pos = packed_positions(*doc_lengths)
    assert pos.numel() == t
    anchors = sample_anchors(torch.ones(t, dtype=torch.bool), pos, d.block_size, n_anchors, g)
    assert anchors.numel() == n_anchors
    return model, embed, context, input_ids, pos, anchors


# ---------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------


def test_default_target_layer_ids():
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B DFlash drafter
    assert default_target_layer_ids(64, 1) == (32,)
    for n_layers, n in [(64, 2), (64, 3), (28, 4), (48, 6), (10, 7)]:
        ids = default_target_layer_ids(n_layers, n)
        assert len(ids) == n and ids[0] == 1 and ids[-1] == n_layers - 3
        assert all(a < b for a, b in zip(ids, ids[1:]))
    with pytest.raises(ValueError, match="num_draft_layers"):
        default_target_layer_ids(64, 0)
    with pytest.raises(ValueError, match="num_target_layers"):
        default_target_layer_ids(5, 4)


def test_from_config_round_trip_and_errors():
    cfg = {**BASE, "target_layer_ids": [1, 2, 3], "rope_theta": 10000}
    d = DFlashDims.from_config(cfg)
    assert d == dims() and isinstance(d.rope_theta, float)
    assert CONFIG_KEYS == set(BASE)
    missing = dict(cfg)
    del missing["head_dim"]
    with pytest.raises(ValueError, match="head_dim"):
        DFlashDims.from_config(missing)
    # HF runtime keys are ignored, unless strict
    assert DFlashDims.from_config({**cfg, "hidden_act": "silu"}) == d
    with pytest.raises(ValueError, match="block_sizes"):
        DFlashDims.from_config({**cfg, "block_sizes": 16}, strict=True)
    # transformers >= 5 spells rope_theta inside rope_parameters
    hf = {k: v for k, v in cfg.items() if k != "rope_theta"}
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    assert DFlashDims.from_config(hf).rope_theta == 500.0
    with pytest.raises(ValueError, match="rope_type"):
        DFlashDims.from_config({**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})
    for key, bad in [
        ("hidden_size", "64"),
        ("block_size", 0),
        ("num_key_value_heads", 3),  # does not divide 4 heads
        ("mask_token_id", 100),  # not below vocab_size
        ("target_hidden_size", 32),  # shared embedding needs equal widths
        ("target_layer_ids", []),
        ("rms_norm_eps", True),
    ]:
        with pytest.raises(ValueError, match=key):
            DFlashDims.from_config({**cfg, key: bad})
    with pytest.raises(ValueError, match=r"target_layer_ids\[1\]"):
        DFlashDims.from_config({**cfg, "target_layer_ids": [1, "x"]})


def test_cost_module_does_not_import_torch():
    code = (
        "import sys; import dflash_graph.models.dflash as m; "
        "m.forward_workspace_bytes(m.DFlashDims(**%r), 100, 4, 2); "
        "assert 'torch' not in sys.modules, 'torch imported'" % (BASE,)
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# ---------------------------------------------------------------------------
# index helpers
# ---------------------------------------------------------------------------


def test_document_ids():
    pos = packed_positions(3, 1, 4)
    assert document_ids(pos).tolist() == [0, 0, 0, 1, 2, 2, 2, 2]


def test_block_token_ids_and_positions():
    ids = torch.arange(100, 120)
    anchors = torch.tensor([2, 7, 15])
    blk = block_token_ids(ids, anchors, 4, mask_token_id=5)
    assert blk.tolist() == [[102, 5, 5, 5], [107, 5, 5, 5], [115, 5, 5, 5]]
    assert block_positions(anchors, 4).tolist() == [
        [2, 3, 4, 5],
        [7, 8, 9, 10],
        [15, 16, 17, 18],
    ]
    # the graph's indices are clamped to a row of 17 tokens: the last block's slots past its end read token 16
    assert block_positions(anchors, 4, 17).tolist()[2] == [15, 16, 16, 16]


def test_sample_anchors_rules():
    """The rules on a fixed packing (tests/test_anchor_properties.py checks them on random ones)."""
    lengths, block = (30, 5, 40, 25), 8
    pos = packed_positions(*lengths)
    t = pos.numel()
    loss_mask = torch.rand(t, generator=torch.Generator().manual_seed(1)) > 0.3
    doc = document_ids(pos)
    # p is a loss token (decoding's anchor is a token the target produced) and drafts p+1 first: a loss token
    # of p's document; the block may run past p's document's end and past the row's
    eligible = {p for p in range(t - 1) if loss_mask[p] and loss_mask[p + 1] and doc[p + 1] == doc[p]}
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        a = sample_anchors(loss_mask, pos, block, 6, g)
        assert a.dtype == torch.int64 and 1 <= a.numel() <= 6
        assert a.tolist() == sorted(set(a.tolist()))  # sorted, without replacement
        assert set(a.tolist()) <= eligible
        for x, y in zip(a.tolist(), a.tolist()[1:]):
            assert doc[x] != doc[y] or y - x >= block  # blocks of one document never overlap
        seen |= set(a.tolist())
    assert seen == eligible  # every eligible position turns up
    # the 5-token document is shorter than a block of 8, and its loss tokens are still drafted
    assert {p for p in range(30, 34) if loss_mask[p] and loss_mask[p + 1]} <= seen
    assert sample_anchors(torch.zeros(t, dtype=torch.bool), pos, block, 8, g).numel() == 0
    # the generator makes it reproducible
    a1 = sample_anchors(loss_mask, pos, block, 6, torch.Generator().manual_seed(7))
    a2 = sample_anchors(loss_mask, pos, block, 6, torch.Generator().manual_seed(7))
    assert torch.equal(a1, a2)


# ---------------------------------------------------------------------------
# mask
# ---------------------------------------------------------------------------


def test_mask_semantics():
    block = 4
    pos = packed_positions(20, 13, 31)
    t = pos.numel()
    doc = document_ids(pos).tolist()
    anchors = torch.tensor([0, 5, 19, 20, 25, 33, 40, 59])
    m = dflash_attention_mask(pos, anchors, block)
    a_n = anchors.numel()
    assert m.dtype == torch.bool and m.shape == (a_n * block, t + a_n * block)
    for qi in range(a_n * block):
        a = qi // block
        p = int(anchors[a])
        row = m[qi]
        ctx, blocks = row[:t], row[t:].view(a_n, block)
        # sees all of its own block, and no other block
        assert blocks[a].all()
        assert not blocks[torch.arange(a_n) != a].any()
        # context: exactly the same document, strictly before the anchor
        visible = set(torch.nonzero(ctx).flatten().tolist())
        assert visible == {j for j in range(t) if doc[j] == doc[p] and j < p}
        assert not ctx[p:].any()  # never at or after its anchor
    # additive form: 0 where allowed, -inf elsewhere
    bias = attention_bias(pos, anchors, block, torch.float32)
    assert torch.equal(bias == 0, m) and torch.isneginf(bias[~m]).all()


# ---------------------------------------------------------------------------
# module
# ---------------------------------------------------------------------------


def test_output_shape_and_parameters():
    d = dims()
    model, embed, context, ids, pos, anchors = make(d, 60, (35, 25), 6)
    out = model(context, ids, pos, anchors)
    assert out.shape == (6, d.block_size, d.hidden_size) and out.dtype == torch.float32
    # the shared embedding is not the drafter's: not a parameter, not in its checkpoint
    assert all(p is not embed.weight for p in model.parameters())
    assert not any("embed" in k for k in model.state_dict())
    empty = model(context, ids, pos, torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0, d.block_size, d.hidden_size)


@pytest.mark.parametrize(
    "over",
    [
        {},
        dict(num_key_value_heads=4),
        dict(num_hidden_layers=1, target_layer_ids=(5,), head_dim=8, intermediate_size=40),
        dict(hidden_size=48, target_hidden_size=48, num_attention_heads=6, num_key_value_heads=1),
    ],
)
@pytest.mark.parametrize("own_norm", [False, True])
def test_component_params_match_module(over, own_norm):
    """component_params counts the drafter's own final norm; a drafter that shares the target's has none."""
    d = dims(**over)
    model = DFlashDrafter(d, nn.Embedding(d.vocab_size, d.hidden_size), own_norm=own_norm)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    parts = component_params(d)
    assert sum(v for k, v in parts.items() if own_norm or k != "norm") == trainable
    assert parts["fc"] == model.fc.weight.numel()
    assert parts["hidden_norm"] == model.hidden_norm.weight.numel()
    assert parts["layers"] == sum(p.numel() for p in model.layers.parameters())
    if own_norm:
        assert parts["norm"] == model.norm.weight.numel() and bool((model.norm.weight == 1).all())


def test_causality_through_module():
    """A block's output depends only on its document's context strictly before
    its anchor, and on its own block tokens."""
    d = dims()
    lengths = (30, 40, 26)
    model, _, context, ids, pos, _ = make(d, sum(lengths), lengths, 1)
    anchors = torch.tensor([10, 45, 52, 80])
    out = model(context, ids, pos, anchors)
    doc = document_ids(pos)
    for a, p in enumerate(anchors.tolist()):
        j = torch.arange(pos.numel())
        hidden = (doc != doc[p]) | (j >= p)  # other documents, at/after the anchor
        ctx2, ids2 = context.clone(), ids.clone()
        ctx2[hidden] = torch.randn(int(hidden.sum()), d.fc_in_features)
        tok_hidden = hidden & (j != p)  # the anchor token itself is block slot 0
        ids2[tok_hidden] = (ids2[tok_hidden] + 1) % d.vocab_size
        out2 = model(ctx2, ids2, pos, anchors)
        torch.testing.assert_close(out2[a], out[a], rtol=0, atol=1e-6)
        # positive control: the visible prefix does matter (unless it is empty)
        if int(pos[p]) > 0:
            ctx3 = context.clone()
            ctx3[p - 1] += 1.0
            assert not torch.allclose(model(ctx3, ids, pos, anchors)[a], out[a])
        ids4 = ids.clone()
        ids4[p] = (ids4[p] + 1) % d.vocab_size
        assert not torch.allclose(model(context, ids4, pos, anchors)[a], out[a])


def test_gradients_reach_drafter_not_embedding():
    d = dims()
    model, embed, context, ids, pos, anchors = make(d, 48, (48,), 5)
    embed.weight.requires_grad_(True)  # even if the target's weight asks for grad
    model(context, ids, pos, anchors).square().mean().backward()
    assert embed.weight.grad is None
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def _reference_forward(model: DFlashDrafter, context, input_ids, pos, anchors):
    """The same drafter, assembled from transformers' Qwen3 pieces and eager
    attention over the dense boolean mask."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3MLP,
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    d = model.dims
    cfg = Qwen3Config(
        hidden_size=d.hidden_size,
        intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
        rms_norm_eps=d.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": d.rope_theta},
        num_hidden_layers=d.num_hidden_layers,
        vocab_size=d.vocab_size,
    )

    def norm(src, dim):
        n = Qwen3RMSNorm(dim, eps=d.rms_norm_eps)
        n.weight.data.copy_(src.weight)
        return n

    b, t = d.block_size, pos.numel()
    nq = anchors.numel() * b
    h = model.embed(block_token_ids(input_ids, anchors, b, d.mask_token_id).view(-1))
    ctx = norm(model.hidden_norm, d.hidden_size)(context @ model.fc.weight.T)
    all_pos = torch.cat([pos, (pos[anchors][:, None] + torch.arange(b)).view(-1)])
    cos, sin = Qwen3RotaryEmbedding(cfg)(h, all_pos[None])
    allowed = dflash_attention_mask(pos, anchors, b)
    nh, nkv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    for layer in model.layers:
        x = norm(layer.input_layernorm, d.hidden_size)(h)
        q = norm(layer.q_norm, hd)((x @ layer.q_proj.weight.T).view(nq, nh, hd))
        k = torch.cat([ctx, x]) @ layer.k_proj.weight.T
        v = torch.cat([ctx, x]) @ layer.v_proj.weight.T
        k = norm(layer.k_norm, hd)(k.view(t + nq, nkv, hd))
        q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, heads, len, hd]
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        q, _ = apply_rotary_pos_emb(q, q, cos[:, t:], sin[:, t:])
        rep = nh // nkv
        k = k.repeat_interleave(rep, 1)
        v = v.view(t + nq, nkv, hd).transpose(0, 1)[None].repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) * hd**-0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(nq, nh * hd)
        h = h + o @ layer.o_proj.weight.T
        mlp = Qwen3MLP(cfg)
        mlp.gate_proj.weight.data.copy_(layer.gate_proj.weight)
        mlp.up_proj.weight.data.copy_(layer.up_proj.weight)
        mlp.down_proj.weight.data.copy_(layer.down_proj.weight)
        h = h + mlp(norm(layer.post_attention_layernorm, d.hidden_size)(h))
    return h.view(anchors.numel(), b, d.hidden_size)


@pytest.mark.parametrize("over", [{}, dict(num_key_value_heads=4)])
def test_matches_transformers_qwen3_reference(over):
    d = dims(**over)
    model, _, context, ids, pos, anchors = make(d, 64, (40, 24), 6, seed=3)
    with torch.no_grad():
        # non-trivial norm weights, so a missing or misplaced norm shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        ours = model(context, ids, pos, anchors)
        ref = _reference_forward(model, context, ids, pos, anchors)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# cost formulas
# ---------------------------------------------------------------------------


def _measure(d: DFlashDims, t, doc_lengths, n_anchors, dtype, attention):
    from torch.distributed._tools.mem_tracker import MemTracker

    model, embed, context, ids, pos, anchors = make(d, t, doc_lengths, n_anchors, dtype)
    backend = {"fused": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[attention]
    mt = MemTracker()
    mt.track_external(model, embed, context, ids, pos, anchors)
    cpu = torch.device("cpu")
    with mt, sdpa_kernel([backend]):
        before = mt.get_tracker_snapshot()[cpu]["Total"]
        out = model(context, ids, pos, anchors)
        after = mt.get_tracker_snapshot()[cpu]["Total"]
    peak = mt.get_tracker_snapshot("peak")[cpu]["Total"]
    out_bytes = out.untyped_storage().nbytes()
    return after - before - out_bytes, peak - after


@pytest.mark.parametrize("attention", ["fused", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_memory_formulas_match_memtracker(attention, dtype, kv_heads):
    """On CPU the fused path is _scaled_dot_product_flash_attention_for_cpu
    (4-D inputs, additive mask, GQA); the math path materialises [nh, Q, K]."""
    d = dims(num_key_value_heads=kv_heads, hidden_size=96, target_hidden_size=96, intermediate_size=160)
    t, n_anchors, b = 320, 12, 4 if dtype == torch.float32 else 2
    saved, workspace = _measure(d, t, (190, 130), n_anchors, dtype, attention)
    p_saved = forward_saved_bytes(d, t, n_anchors, b, attention=attention)
    p_work = forward_workspace_bytes(d, t, n_anchors, b, attention=attention)
    assert abs(p_saved - saved) <= 0.10 * saved, (p_saved, saved)
    assert abs(p_work - workspace) <= 0.10 * workspace, (p_work, workspace)


def test_saved_closed_form_equals_replay():
    import random

    rng = random.Random(0)
    for _ in range(200):
        h = rng.choice([8, 16, 64, 96])
        nkv = rng.choice([1, 2, 4])
        d = dims(
            hidden_size=h,
            target_hidden_size=h,
            intermediate_size=rng.choice([8, 24, 100]),
            num_hidden_layers=rng.randint(1, 4),
            num_key_value_heads=nkv,
            num_attention_heads=nkv * rng.choice([1, 2, 3]),
            head_dim=rng.choice([2, 8, 16]),
            block_size=rng.choice([1, 4, 16]),
            target_layer_ids=tuple(range(rng.randint(1, 5))),
        )
        t, a = rng.randint(1, 500), rng.randint(0, 40)
        for b in (2, 4):
            for attention in ("fused", "math"):
                saved, peak, out = _replay(d, t, a, b, attention)
                assert saved == _saved_closed_form(d, t, a, b, attention)
                assert peak >= saved + out


def test_forward_program_is_consistent():
    d = dims()
    for attention in ("fused", "math"):
        prog = forward_program(d, 200, 10, 2, attention=attention)
        live, cur, peak = {}, 0, 0
        for kind, key, n in prog:
            if kind == "alloc":
                assert key not in live
                live[key] = n
                cur += n
                peak = max(peak, cur)
            else:
                assert kind == "free" and key.startswith("tmp:")
                cur -= live.pop(key)
        assert set(live) == {k for k in live if k.startswith("saved:")} | {"out:hidden"}
        out = live.pop("out:hidden")
        assert out == 10 * d.block_size * d.hidden_size * 2
        assert sum(live.values()) == forward_saved_bytes(d, 200, 10, 2, attention=attention)
        assert peak - cur == forward_workspace_bytes(d, 200, 10, 2, attention=attention)


def test_forward_flops_match_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    for over in ({}, dict(num_key_value_heads=4, num_hidden_layers=1)):
        d = dims(**over)
        model, _, context, ids, pos, anchors = make(d, 80, (50, 30), 7)
        # the math path runs the attention as bmm's, which the counter sees
        with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as fc:
            model(context, ids, pos, anchors)
        assert forward_flops(d, 80, 7) == fc.get_total_flops()


def test_cost_argument_checks():
    d = dims()
    with pytest.raises(ValueError, match="dtype_bytes"):
        forward_saved_bytes(d, 10, 2, 3)
    with pytest.raises(ValueError, match="attention"):
        forward_workspace_bytes(d, 10, 2, 2, attention="flex")
    with pytest.raises(ValueError, match="ctx_tokens"):
        forward_flops(d, -1, 2)
