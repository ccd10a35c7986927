"""Anchors as they should be, on random packings (Hypothesis): drawn per document within loss-masked positions,
blocks inside their document and never overlapping, scored slots exactly the loss tokens, and a drafter whose
output for an anchor does not move when anything it must not see (another document, the anchor's own future,
another block) changes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_graph.models.dflash import DFlashDims
from dflash_graph.models.nn.dflash import (
    DFlashDrafter,
    anchor_grid,
    block_positions,
    dflash_attention_mask,
    document_ids,
    sample_anchors,
    slot_valid,
)
from dflash_graph.ops.torch_impl import acceptance_counts


@st.composite
def packings(draw, max_tokens: int = 160):
    """(position_ids, loss_mask, block, count, seed): whole documents, then padding as its own document without
    loss, as train/data.py packs them; loss masks dense (text), sparse or in spans (chat turns)."""
    lengths = draw(st.lists(st.integers(1, 48), min_size=1, max_size=8))
    total, kept = 0, []
    for n in lengths:
        if total + n > max_tokens:
            break
        kept.append(n)
        total += n
    kept = kept or [min(lengths[0], max_tokens)]
    pad = draw(st.integers(0, 12))
    pos = torch.cat([torch.arange(n) for n in kept] + ([torch.arange(pad)] if pad else []))
    style = draw(st.sampled_from(["dense", "random", "spans"]))
    t = pos.numel()
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if style == "dense":
        mask = pos != 0
    elif style == "random":
        mask = torch.rand(t, generator=g) < draw(st.floats(0.05, 0.95))
    else:
        mask = torch.zeros(t, dtype=torch.bool)
        for _ in range(draw(st.integers(0, 5))):
            a = draw(st.integers(0, t - 1))
            mask[a: a + draw(st.integers(1, 30))] = True
    if pad:
        mask[t - pad:] = False
    block = draw(st.integers(1, 8))
    count = draw(st.integers(0, 24))
    return pos, mask, block, count, seed


def _docs(pos):
    doc = document_ids(pos)
    ends = torch.cumsum(torch.bincount(doc), 0)[doc]
    return doc, ends


@settings(max_examples=60)
@given(packings())
def test_anchors_per_document_within_loss_positions_never_overlapping(p):
    pos, mask, block, count, seed = p
    doc, ends = _docs(pos)
    anchors = sample_anchors(mask, pos, block, count, torch.Generator().manual_seed(seed))
    a = anchors.tolist()
    assert a == sorted(set(a)) and len(a) <= count
    for x in a:
        assert x + 1 < ends[x] and mask[x + 1], "the first drafted token is a loss token of the anchor's document"
        assert x + block <= ends[x], "the block fits inside the anchor's document"
    idx = block_positions(anchors, block)
    if a:
        assert bool((doc[idx] == doc[anchors][:, None]).all()), "a block never crosses a document boundary"
    covered = idx.reshape(-1).tolist()
    assert len(covered) == len(set(covered)), "blocks never overlap"


@settings(max_examples=60)
@given(packings())
def test_each_document_gets_its_proportional_share(p):
    """Per document, not per row: with C grid candidates (c_d in document d) and A < C, document d gets
    floor(A c_d / C) or that plus one; all candidates when A >= C."""
    pos, mask, block, count, seed = p
    doc, _ = _docs(pos)
    cand = anchor_grid(mask, pos, block, torch.Generator().manual_seed(seed))      # the same first draw
    anchors = sample_anchors(mask, pos, block, count, torch.Generator().manual_seed(seed))
    assert set(anchors.tolist()) <= set(cand.tolist())
    c = cand.numel()
    assert anchors.numel() == min(count, c)
    if c > count:
        per_doc = torch.bincount(doc[cand], minlength=int(doc[-1]) + 1)
        got = torch.bincount(doc[anchors], minlength=per_doc.numel())
        floor = (count * per_doc) // c
        assert bool(((got == floor) | (got == floor + 1)).all()), (got, floor)


@settings(max_examples=60)
@given(packings())
def test_scored_slots_are_the_loss_tokens(p):
    pos, mask, block, count, seed = p
    drawn = sample_anchors(mask, pos, block, count, torch.Generator().manual_seed(seed))
    n = drawn.numel()
    anchors = torch.cat([drawn, torch.zeros(count - n, dtype=torch.int64)])
    v = slot_valid(mask, anchors, n, block)
    assert v.shape == (count, block)
    assert not v[n:].any(), "padding anchors score nothing"
    for i, x in enumerate(drawn.tolist()):
        assert v[i, 0]
        assert v[i, 1:].tolist() == mask[x + 1: x + block].tolist()


def test_every_eligible_position_is_drawn_at_the_same_rate():
    """The grid's phase is uniform: over many draws each eligible position of a long document is an anchor
    about equally often (the per-document quota is fixed, the grid moves)."""
    pos = torch.cat([torch.arange(64), torch.arange(40)])
    mask = pos != 0
    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(pos.numel())
    for _ in range(1500):
        hits[sample_anchors(mask, pos, 4, 6, g)] += 1
    doc, ends = _docs(pos)
    idx = torch.arange(pos.numel())
    elig = (idx + 4 <= ends) & (idx + 1 < ends)
    rate = hits[elig] / 1500
    for d in (0, 1):       # within a document, every eligible position alike (within sampling noise)
        r = rate[doc[elig] == d]
        assert float(r.max() - r.min()) < 0.1, r


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)      # small float64 matmuls: threads only contend on a loaded machine
    yield
    torch.set_num_threads(n)


@settings(max_examples=12)
@given(p=packings(max_tokens=96), seed=st.integers(0, 10_000))
def test_the_drafter_never_sees_another_document_or_the_future(one_thread, p, seed):
    pos, mask, block, count, pseed = p
    block = max(block, 2)
    mask = pos != 0
    drawn = sample_anchors(mask, pos, block, max(count, 1), torch.Generator().manual_seed(pseed))
    if drawn.numel() == 0:
        return
    d = DFlashDims(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=block,
                   mask_token_id=1, target_layer_ids=(0, 1), target_hidden_size=32, vocab_size=50)
    torch.manual_seed(seed)
    embed = torch.nn.Embedding(50, 32)
    model = DFlashDrafter(d, embed, dtype=torch.float64)
    embed.double()
    t = pos.numel()
    ctx = torch.randn(t, 64, dtype=torch.float64)
    ids = torch.randint(2, 50, (t,))
    with torch.no_grad():
        base = model(ctx, ids, pos, drawn)
    doc = document_ids(pos)
    m = dflash_attention_mask(pos, drawn, block)                      # [A*B, T + A*B]
    for i, x in list(enumerate(drawn.tolist()))[:3]:
        hidden = (doc != doc[x]) | (torch.arange(t) >= x)             # what anchor x must not see as context
        assert not m[i * block:(i + 1) * block, :t][:, hidden].any()
        other = hidden.clone()
        other[x] = False                                               # its own token enters as slot 0
        ctx2, ids2 = ctx.clone(), ids.clone()
        ctx2[hidden] = torch.randn(int(hidden.sum()), 64, dtype=torch.float64)
        ids2[other] = torch.randint(2, 50, (int(other.sum()),))       # also the other blocks' anchor tokens
        with torch.no_grad():
            out = model(ctx2, ids2, pos, drawn)
        torch.testing.assert_close(out[i], base[i], rtol=0, atol=1e-10)
        seen = ~hidden & (torch.arange(t) < x)
        if seen.any():                                                 # and the test can fail: what it may see matters
            ctx3 = ctx.clone()
            ctx3[seen] += 1.0
            with torch.no_grad():
                assert not torch.allclose(model(ctx3, ids, pos, drawn)[i], base[i])


def test_acceptance_counts_follow_greedy_verification():
    # anchor 0: slots 1, 2 hit, 3 misses -> 2 accepted; anchor 1: all hit -> 3; anchor 2: slot 1 misses -> 0;
    # anchor 3: slot 2 not scored (past the loss span) -> the run stops at 1; anchor 4: padding
    hit = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    n = acceptance_counts(hit, valid)
    assert n.tolist() == [4, 3, 2, 1]
    from dflash_graph.train.metrics import acceptance

    m = acceptance(n.tolist())
    assert m["tau"] == 1 + (3 + 2 + 1) / 4 == 2.5                       # mean of 1 + accepted: (3 + 4 + 1 + 2) / 4
    assert m["slot_accept"] == [0.75, round(2 / 3, 4), 0.5]
