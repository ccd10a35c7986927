"""Anchors as they should be, on random packings (Hypothesis): drawn per document at loss tokens whose next token
is a loss token of the same document, blocks free to run past their document's end and past the row's end (their
indices clamped to the row, where the rewritten verifier gather is exact), never overlapping within a document and never scoring a token twice, scored slots exactly the anchor's own run of loss
tokens, every loss token after a loss token reached at slot 1 (the ends of documents included), and a drafter
whose output and loss for an anchor do not move when anything it must not see (another document, the anchor's own
future, another block) changes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflash_graph.models.dflash import DFlashDims
from types import SimpleNamespace

from dflash_graph.models.nn.dflash import (
    DFlashDrafter,
    anchor_grid,
    block_positions,
    dflash_attention_mask,
    document_ids,
    eligible_anchors,
    sample_anchors,
    slot_reach,
    slot_valid,
)
from dflash_graph.ops import torch_impl
from dflash_graph.ops.torch_impl import acceptance_counts
from dflash_graph.train.metrics import coverage


@st.composite
def packings(draw, max_tokens: int = 160, row_end: bool = False):
    """(position_ids, loss_mask, block, count, seed): whole documents, then padding as its own document without
    loss, as train/data.py packs them; loss masks dense (text), sparse or in spans (chat turns). `row_end`: no
    padding, and the row's last tokens are loss tokens (a row filled to its end by an answer)."""
    lengths = draw(st.lists(st.integers(1, 48), min_size=1, max_size=8))
    total, kept = 0, []
    for n in lengths:
        if total + n > max_tokens:
            break
        kept.append(n)
        total += n
    kept = kept or [min(lengths[0], max_tokens)]
    pad = 0 if row_end else draw(st.integers(0, 12))
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
    if row_end:
        mask[t - draw(st.integers(1, 10)):] = True
    block = draw(st.integers(1, 8))
    count = draw(st.integers(0, 24))
    return pos, mask, block, count, seed


def _docs(pos):
    doc = document_ids(pos)
    ends = torch.cumsum(torch.bincount(doc), 0)[doc]
    return doc, ends


def _eligible(mask, pos, block):
    """The anchor rule, spelled out per position: p and p+1 are loss tokens of one document (the block may run
    past the document's end and past the row's)."""
    doc, _ = _docs(pos)
    t = pos.numel()
    return {p for p in range(t - 1) if mask[p] and mask[p + 1] and doc[p + 1] == doc[p]}


def _run(mask, doc, p, block):
    """How many slots of a block anchored at p are scored: the loss tokens p+1, p+2, ... of p's document."""
    k = 0
    while k + 1 < block and p + k + 1 < mask.numel() and mask[p + k + 1] and doc[p + k + 1] == doc[p]:
        k += 1
    return k


@settings(max_examples=60)
@given(packings())
def test_anchors_are_loss_tokens_and_block_indices_stay_in_the_row(p):
    pos, mask, block, count, seed = p
    doc, ends = _docs(pos)
    t = pos.numel()
    anchors = sample_anchors(mask, pos, block, count, torch.Generator().manual_seed(seed))
    a = anchors.tolist()
    assert a == sorted(set(a)) and len(a) <= count
    assert set(a) <= _eligible(mask, pos, block)
    assert set(torch.nonzero(eligible_anchors(mask, pos, block)).view(-1).tolist()) == _eligible(mask, pos, block)
    for x in a:
        assert mask[x] and mask[x + 1] and doc[x + 1] == doc[x], "anchor and first draft: loss tokens, one document"
    raw = block_positions(anchors, block)
    idx = block_positions(anchors, block, t)
    assert bool(((idx >= 0) & (idx < t)).all()), "the graph's block indices stay in the row (the gathers are exact)"
    assert torch.equal(idx[raw < t], raw[raw < t]), "clamped only past the row's end"
    for d in set(doc[anchors].tolist()):
        mine = raw[doc[anchors] == d].reshape(-1).tolist()
        assert len(mine) == len(set(mine)), "blocks of one document never overlap"
    v = slot_valid(mask, anchors, len(a), block, pos)
    scored = idx[:, 1:][v[:, 1:]].tolist()
    assert len(scored) == len(set(scored)), "no token is scored twice in one draw"
    assert not bool(v[raw >= t].any()), "a slot past the row's end is never scored"
    if a:
        assert bool((doc[idx][v] == doc[anchors][:, None].expand_as(idx)[v]).all()), "never scores another document"


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
def test_scored_slots_are_the_anchors_own_run_of_loss_tokens(p):
    pos, mask, block, count, seed = p
    doc, _ = _docs(pos)
    drawn = sample_anchors(mask, pos, block, count, torch.Generator().manual_seed(seed))
    n = drawn.numel()
    anchors = torch.cat([drawn, torch.zeros(count - n, dtype=torch.int64)])
    v = slot_valid(mask, anchors, n, block, pos)
    assert v.shape == (count, block)
    assert not v[n:].any(), "padding anchors score nothing"
    for i, x in enumerate(drawn.tolist()):
        k = _run(mask, doc, x, block)
        assert v[i].tolist() == [True] * (k + 1) + [False] * (block - 1 - k), (x, k)


@settings(max_examples=60)
@given(packings())
def test_reach_is_every_slot_an_eligible_anchor_scores(p):
    """slot_reach[t, k]: some eligible anchor p = t - k scores slot k; so every loss token whose predecessor is a
    loss token of its document is reached at slot 1, the last tokens of a document and of the row included
    (before issue 23 a document's last B - 2 never were; until blocks could run past the row, its last B - 2)."""
    pos, mask, block, _, _ = p
    doc, ends = _docs(pos)
    t = pos.numel()
    elig = _eligible(mask, pos, block)
    reach = slot_reach(mask, pos, block)
    want = [[k >= 1 and t - k >= 0 and (x - k) in elig and _run(mask, doc, x - k, block) >= k
             for k in range(block)] for x in range(t)]
    assert reach.tolist() == want
    if block >= 2:
        for x in range(1, t):
            if mask[x] and mask[x - 1] and doc[x - 1] == doc[x]:
                assert reach[x, 1], x
        last = [int(e) - 1 for e in torch.unique(ends) if int(e) >= 2 and mask[int(e) - 1] and mask[int(e) - 2]
                and doc[int(e) - 2] == doc[int(e) - 1]]
        assert all(reach[x, 1] for x in last), "a document's last loss token is drafted at slot 1"
        if t >= 2 and mask[t - 1] and mask[t - 2] and doc[t - 2] == doc[t - 1]:
            assert reach[t - 1, 1], "the row's last loss token is drafted at slot 1"


def test_coverage_is_the_share_of_loss_tokens_per_slot():
    # a chat-like row: two answers of 6 and 3 tokens after prompts, then padding; block 4
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 0, 1, 2])
    reach = slot_reach(mask, pos, 4) & mask[:, None]
    # slot 1: every answer token but each answer's first (the prefill's token, an anchor only): 5 + 2 of 9
    # slot 2: tokens 4..7 and 12: an anchor at t-2 with t-1 and t in its run; slot 3: 5..7 (12: its anchor 9 is
    # not a loss token)
    assert reach.sum(0).tolist() == [0, 7, 5, 3]
    c = coverage(reach.sum(0).tolist(), [0, 2, 2, 1], int(mask.sum()))
    assert c == {"slot_reach": [0.0, round(7 / 9, 4), round(5 / 9, 4), round(3 / 9, 4)],
                 "slot_scored": [0.0, round(2 / 9, 4), round(2 / 9, 4), round(1 / 9, 4)]}
    assert coverage([0, 0], None, 0) == {"slot_reach": [None, None]}


def test_every_eligible_position_is_drawn_at_the_same_rate():
    """The grid's phase is uniform: over many draws each eligible position of a long document is an anchor
    about equally often (the per-document quota is fixed, the grid moves)."""
    pos = torch.cat([torch.arange(64), torch.arange(40)])
    mask = pos != 0
    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(pos.numel())
    for _ in range(1500):
        hits[sample_anchors(mask, pos, 4, 6, g)] += 1
    doc, _ = _docs(pos)
    elig = torch.zeros(pos.numel(), dtype=torch.bool)
    elig[sorted(_eligible(mask, pos, 4))] = True
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


def _small_drafter(block: int, seed: int) -> tuple[DFlashDrafter, torch.nn.Linear]:
    d = DFlashDims(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=block,
                   mask_token_id=1, target_layer_ids=(0, 1), target_hidden_size=16, vocab_size=40)
    torch.manual_seed(seed)
    embed = torch.nn.Embedding(40, 16).double()
    head = torch.nn.Linear(16, 40, bias=False).double()
    return DFlashDrafter(d, embed, dtype=torch.float64), head


@settings(max_examples=10)
@given(p=packings(max_tokens=80), seed=st.integers(0, 10_000), kind=st.sampled_from(["kl", "ce"]))
def test_a_block_past_its_documents_end_never_reads_or_scores_the_next(one_thread, p, seed, kind):
    """The graph's training step for one anchor whose block runs past its document's end (the drafter, the
    verifier targets as tiny.toml gathers them: roll by 1, then the block's positions, and the loss op with the
    anchor op's `valid`): its loss and its gradients are the same whatever the next documents hold (tokens,
    context features, the verifier's logits), and they change when a scored target of its own changes."""
    pos, mask, block, _, _ = p
    block = max(block, 2)
    doc, ends = _docs(pos)
    t = pos.numel()
    past = [x for x in sorted(_eligible(mask, pos, block)) if x + block > ends[x]]
    assume(past)
    x = past[seed % len(past)]
    anchors = torch.tensor([x])
    valid = slot_valid(mask, anchors, 1, block, pos)
    model, head = _small_drafter(block, seed)
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(t, 32, dtype=torch.float64, generator=g)
    ids = torch.randint(2, 40, (t,), generator=g)
    verifier = torch.randn(t, 40, dtype=torch.float64, generator=g)
    c = SimpleNamespace(params={"kind": kind, "gamma": 7.0})

    def step(ctx, ids, verifier):
        model.zero_grad()
        logits = head(model(ctx, ids, pos, anchors))                                   # [1, B, V]
        target = torch.roll(verifier, 1, 0)[block_positions(anchors, block).clamp_max(t - 1)]
        out = torch_impl.loss(c, logits, target, valid)
        out["loss"].backward()
        return out["loss"].detach(), [q.grad.clone() for q in model.parameters()]

    base, grads = step(ctx, ids, verifier)
    other = doc != doc[x]
    assert bool(other[int(ends[x]):x + block].all()), "the block's tail lies in the next document"
    ctx2, ids2, ver2 = ctx.clone(), ids.clone(), verifier.clone()
    n = int(other.sum())
    ctx2[other] = torch.randn(n, 32, dtype=torch.float64)
    ids2[other] = torch.randint(2, 40, (n,))
    ver2[other] = 100 * torch.randn(n, 40, dtype=torch.float64)
    got, grads2 = step(ctx2, ids2, ver2)
    torch.testing.assert_close(got, base, rtol=0, atol=1e-12)
    for a, b in zip(grads2, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    ver3 = verifier.clone()
    ver3[x, (int(verifier[x].argmax()) + 1) % 40] = verifier[x].max() + 10   # slot 1's target (row p + 1 - 1), a
                                                                             # new argmax: scored, so it counts
    assert not torch.allclose(step(ctx, ids, ver3)[0], base)


@settings(max_examples=40)
@given(p=packings(row_end=True), seed=st.integers(0, 10_000), kind=st.sampled_from(["kl", "ce"]))
def test_a_block_past_the_rows_end_reads_nothing_beyond_it(p, seed, kind):
    """The graph's ops on a row whose last blocks run past its end (anchor_sample, block_positions with the row's
    length, the verifier targets gathered as tiny.toml writes them and as gather_through_remap rewrites them):
    every index is in [0, T), so the rewritten gather's range check passes and both read the same rows; no slot
    past the end is scored; and what sits in those slots does not move the loss or its gradient."""
    pos, mask, block, count, pseed = p
    block = max(block, 2)
    t = pos.numel()
    c = SimpleNamespace(params={"count": max(count, 1), "block": block},
                        generator=torch.Generator().manual_seed(pseed))
    drawn = torch_impl.anchor_sample(c, mask, pos)["anchors"][: max(count, 1)]
    elig = _eligible(mask, pos, block)
    tail = {x for x in elig if x + block > t}                       # every block that runs past the row's end
    assume(tail)
    anchors = torch.tensor(sorted(tail | (set(drawn.tolist()) & elig)), dtype=torch.int64)
    valid = slot_valid(mask, anchors, anchors.numel(), block, pos)
    raw = anchors[:, None] + torch.arange(block)
    past = raw >= t
    ctx = lambda **kw: SimpleNamespace(params=kw)                   # noqa: E731
    idx = torch_impl.block_positions(ctx(block=block, seq=t), anchors)["index"]
    assert bool(((idx >= 0) & (idx < t)).all()) and torch.equal(idx[~past], raw[~past])
    assert not bool(valid[past].any()), "a slot past the row's end is never scored"
    g = torch.Generator().manual_seed(seed)
    verifier = torch.randn(t, 24, dtype=torch.float64, generator=g)
    as_written = torch_impl.gather(ctx(axis=0), torch_impl.roll(ctx(shift=1, axis=0), verifier)["out"], idx)["out"]
    shifted = torch_impl.index_shift(ctx(shift=t - 1, modulo=t, check_range=True), idx)["out"]
    rewritten = torch_impl.gather(ctx(axis=0), verifier, shifted)["out"]
    assert torch.equal(as_written, rewritten)
    logits = torch.randn(anchors.numel(), block, 24, dtype=torch.float64, generator=g, requires_grad=True)
    lc = SimpleNamespace(params={"kind": kind, "gamma": 7.0})

    def step(target):
        logits.grad = None
        loss = torch_impl.loss(lc, logits, target, valid)["loss"]
        loss.backward()
        return loss.detach(), logits.grad.clone()

    base, grad = step(as_written)
    other = as_written.clone()
    other[past] = 100 * torch.randn(int(past.sum()), 24, dtype=torch.float64, generator=g)
    got, grad2 = step(other)
    torch.testing.assert_close(got, base, rtol=0, atol=0)
    torch.testing.assert_close(grad2, grad, rtol=0, atol=0)
    assert not bool(grad[past].any()), "no gradient reaches a slot past the row's end"


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
