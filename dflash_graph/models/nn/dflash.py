"""DFlash drafter as a torch module, plus the anchor/block/mask helpers.

Architecture (docs/drafter.md; DFlash paper, z-lab; vllm-project/speculators
``src/speculators/models/dflash/{core,model_definitions,attention,utils}.py``;
sgl-project/SpecForge ``specforge/modeling/draft/dflash.py``):

    context [T, n*Ht] --fc (no bias)--> [T, H] --hidden_norm--> ctx [T, H]
    block ids [A, B]  --target embedding (shared, frozen)--> h [A*B, H]
    per layer (Qwen3 decoder layer, queries from block tokens only):
        x  = input_layernorm(h)
        q  = q_norm(q_proj(x))                       # [A*B, nh, hd]
        k  = k_norm(cat(k_proj(ctx), k_proj(x)))     # [T + A*B, nkv, hd]
        v  =        cat(v_proj(ctx), v_proj(x))
        q, k = RoPE(q, k)   # ctx tokens: position_ids; slot k of anchor p: position_ids[p] + k
        h  = h + o_proj(SDPA(q, k, v, mask))
        h  = h + down(silu(gate(post_attention_layernorm(h))) * up(...))
    return h as [A, B, H]    (no final norm: the target's norm + lm_head are
                              separate graph nodes)

The context stream ``ctx`` goes into k_proj / v_proj directly, WITHOUT the
layer's input_layernorm (as in both references: ``k_proj(target_hidden)``);
it is normalised once, by ``hidden_norm``. k_norm applies to context and block
keys alike.

This module's memory and FLOPs are priced, without torch, by
``dflash_graph.models.dflash``; keep the two in step (tests compare them with
torch's MemTracker).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_graph.models.dflash import DFlashDims

__all__ = [
    "ContextCache",
    "DFlashDrafter",
    "DFlashLayer",
    "RMSNorm",
    "attention_bias",
    "block_positions",
    "block_token_ids",
    "dflash_attention_mask",
    "document_ids",
    "anchor_grid",
    "eligible_anchors",
    "sample_anchors",
    "slot_reach",
    "slot_valid",
]


# ---------------------------------------------------------------------------
# Index helpers (pure functions of the packed batch)
# ---------------------------------------------------------------------------


def _as_1d_long(x: Tensor, name: str) -> Tensor:
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
    if x.dtype.is_floating_point or x.dtype.is_complex:
        raise ValueError(f"{name}: expected an integer tensor, got {x.dtype}")
    return x.to(torch.long)


def document_ids(position_ids: Tensor) -> Tensor:
    """[T] document index of every token of a packed sequence.

    A new document starts at token 0 and wherever ``position_ids`` does not
    continue the previous token's position by +1 (in a well-formed packing that
    is exactly where it restarts at 0). Treating any discontinuity as a
    boundary can only hide context, never leak it.
    """
    pos = _as_1d_long(position_ids, "position_ids")
    if pos.numel() == 0:
        return pos.clone()
    start = torch.ones_like(pos, dtype=torch.bool)
    start[1:] = pos[1:] != pos[:-1] + 1
    return torch.cumsum(start.to(torch.long), 0) - 1


def _document_starts(doc: Tensor) -> Tensor:
    """[T] index of the first token of each token's document."""
    if doc.numel() == 0:
        return doc.clone()
    counts = torch.bincount(doc)
    return (torch.cumsum(counts, 0) - counts)[doc]


def _loss_runs(loss_mask: Tensor, doc: Tensor) -> Tensor:
    """[T] for each position p: how many tokens from p+1 on are loss tokens of p's document without a break
    (0 when p+1 is not one). Slot k of a block anchored at p is scored exactly when k <= run[p]."""
    t = doc.numel()
    dev = doc.device
    idx = torch.arange(t, device=dev)
    brk = ~loss_mask.to(torch.bool)
    if t:
        brk = brk.clone()
        brk[1:] |= doc[1:] != doc[:-1]                              # a document's first token ends every run
    at = torch.where(brk, idx, torch.full_like(idx, t))
    nxt = torch.flip(torch.cummin(torch.flip(at, [0]), 0).values, [0]) if t else at   # first break at or after i
    run = torch.zeros(t, dtype=torch.long, device=dev)
    if t > 1:
        run[:-1] = nxt[1:] - idx[1:]
    return run


def eligible_anchors(loss_mask: Tensor, position_ids: Tensor, block_size: int) -> Tensor:
    """bool [T]: positions ``p`` that may anchor a block, before the grid and the draw.

    ``loss_mask[t]`` marks the tokens the drafter learns to predict (every token after a document's first for
    text; the assistant's tokens for chat data). ``p`` qualifies when it is itself a loss token and the token it
    drafts first, ``p + 1``, is a loss token of p's own document. The block ``p .. p+B-1`` may run past the end
    of p's document and past the end of the packed row: the slots past either are not scored (``slot_valid``)
    and see nothing of the next document nor anything beyond the row (NOTE [Blocks past a document's end]).

    The anchor is a loss token because decoding's anchor is always a token the target produced (the first
    token of an answer comes from the prefill forward, and each round's anchor is the last verified token):
    the first token of an assistant turn is an anchor, never a drafted slot, as in decoding.
    """
    if block_size < 1:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    if loss_mask.dim() != 1 or loss_mask.shape != position_ids.shape:
        raise ValueError(
            f"loss_mask {tuple(loss_mask.shape)} and position_ids "
            f"{tuple(position_ids.shape)} must be the same 1-D shape"
        )
    doc = document_ids(position_ids)
    return loss_mask.to(torch.bool) & (_loss_runs(loss_mask, doc) >= 1)


def _rand(n: int, generator: torch.Generator | None, device) -> Tensor:
    dev = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, device=dev).to(device)


def anchor_grid(loss_mask: Tensor, position_ids: Tensor, block_size: int,
                generator: torch.Generator | None = None) -> Tensor:
    """Steps 1-2 of ``sample_anchors``: the eligible positions on each document's grid of stride B (a random
    phase per document, the generator's first draw), sorted int64 [C]."""
    ok = eligible_anchors(loss_mask, position_ids, block_size)
    doc = document_ids(position_ids)
    t = doc.numel()
    if t == 0:
        return doc.clone()
    dev = doc.device
    idx = torch.arange(t, device=dev)
    nd = int(doc[-1]) + 1
    phase = torch.floor(_rand(nd, generator, dev) * block_size).to(torch.long).clamp_max(block_size - 1)
    on_grid = torch.remainder(idx - _document_starts(doc) - phase[doc], block_size) == 0
    return idx[ok & on_grid]


def sample_anchors(
    loss_mask: Tensor,
    position_ids: Tensor,
    block_size: int,
    max_anchors: int,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Up to ``max_anchors`` anchor positions, sorted, int64 [A], drawn per document, never overlapping.

    1. Eligible positions: ``eligible_anchors`` (the anchor and the first token it drafts are loss tokens of
       one document; the block may run past the document's end and past the row's).
    2. A grid per document: each document draws a phase ``o`` in ``[0, B)`` and keeps the eligible positions
       at ``o, o+B, o+2B, ...`` from its first token. Blocks on one grid tile the document, so no two blocks
       overlap (a last block past the document's end may overlap the next document's blocks only in slots that
       are not scored); over draws every eligible position is on the grid with probability 1/B.
    3. Quotas per document: with ``C`` grid candidates in all and ``c_d`` in document ``d``, document ``d``
       gets ``floor(A * c_d / C)`` anchors, and the ``A - sum`` left over go to the documents with the
       largest remainders (ties broken at random). So every document gets its proportional share, whatever
       else is packed into the row (the cap is on the row, the draw is per document).
    4. Within a document: its quota, uniformly without replacement among its candidates.

    All candidates come back when there are at most ``max_anchors`` (possibly none: shape [0]).
    """
    if max_anchors < 0:
        raise ValueError(f"max_anchors: must be >= 0, got {max_anchors}")
    cand = anchor_grid(loss_mask, position_ids, block_size, generator)
    c = cand.numel()
    if c <= max_anchors:
        return cand
    doc = document_ids(position_ids)
    dev = doc.device
    nd = int(doc[-1]) + 1
    cd = doc[cand]
    per_doc = torch.bincount(cd, minlength=nd)                      # c_d
    num = max_anchors * per_doc                                     # exact integer shares: A * c_d / C
    quota = num // c
    rem = num % c
    left = max_anchors - int(quota.sum())
    if left:
        tie = _rand(nd, generator, dev)
        order = torch.argsort(tie)
        order = order[torch.argsort(-rem[order], stable=True)]     # largest remainder first, random ties
        quota[order[:left]] += 1
    key = _rand(c, generator, dev)
    order = torch.argsort(key)
    order = order[torch.argsort(cd[order], stable=True)]           # by document, random within one
    first = torch.cumsum(per_doc, 0) - per_doc
    rank = torch.arange(c, device=dev) - first[cd[order]]
    chosen = order[rank < quota[cd[order]]]
    return torch.sort(cand[chosen]).values


def slot_valid(loss_mask: Tensor, anchors: Tensor, n_real: int, block_size: int,
               position_ids: Tensor | None = None) -> Tensor:
    """bool [A, B]: slot k of anchor a is scored. Slot 0 marks a real anchor (the first ``n_real``); slot
    k >= 1 also needs tokens ``anchors[a] + 1 .. anchors[a] + k`` to be loss tokens of the anchor's document,
    without a break: the scored slots of a block are a prefix of it, as the drafts decoding accepts are. A block
    running past the end of an assistant turn is not scored on the user's next words (nor on a later turn),
    and one running past the end of its document is not scored on the next document. ``position_ids`` [T]
    gives the documents (``document_ids``); without it the row is one document."""
    anchors = _as_1d_long(anchors, "anchors")
    a = anchors.numel()
    dev = anchors.device
    real = torch.arange(a, device=dev) < n_real
    t = loss_mask.numel()
    doc = document_ids(position_ids) if position_ids is not None else torch.zeros(t, dtype=torch.long, device=dev)
    run = _loss_runs(loss_mask, doc)
    k = torch.arange(block_size, device=dev)
    at = anchors.clamp(0, max(t - 1, 0))
    out = (k[None, :] <= run[at][:, None]) & real[:, None]       # [A, B]
    out[:, 0] = real
    return out


def slot_reach(loss_mask: Tensor, position_ids: Tensor, block_size: int) -> Tensor:
    """bool [T, B]: token t can be scored at slot k, i.e. ``t - k`` is an eligible anchor whose slot k is
    scored (``eligible_anchors``, ``slot_valid``). Column 0 is False (the anchor is never scored). Every eligible
    anchor is drawn with probability > 0, so a loss token whose row is False in column k is never scored at
    slot k, whatever the draw (docs/drafter.md, "Coverage")."""
    elig = eligible_anchors(loss_mask, position_ids, block_size)
    run = _loss_runs(loss_mask, document_ids(position_ids))
    t = elig.numel()
    out = torch.zeros(t, block_size, dtype=torch.bool, device=elig.device)
    for k in range(1, min(block_size, t)):
        out[k:, k] = elig[:-k] & (run[:-k] >= k)
    return out


def block_token_ids(input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[A, B] block inputs: slot 0 = ``input_ids[anchor]``, slots 1.. = mask id."""
    anchors = _as_1d_long(anchors, "anchors")
    out = torch.full(
        (anchors.numel(), block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    out[:, 0] = input_ids[anchors]
    return out


def block_positions(anchors: Tensor, block_size: int, seq: int | None = None) -> Tensor:
    """[A, B] indices into the packed sequence: ``anchor + arange(B)``, clamped to ``seq - 1`` when the row's
    length ``seq`` is given (a block's slots past the row's end read its last token, and weigh 0 there: NOTE
    [Blocks past a document's end])."""
    anchors = _as_1d_long(anchors, "anchors")
    idx = anchors[:, None] + torch.arange(block_size, device=anchors.device)[None, :]
    return idx if seq is None else idx.clamp_max_(seq - 1)


# NOTE [Blocks past a document's end]: a block is anchor + arange(B) in the packed row, and near the end of a
# document it runs past it (as decoding's last blocks run past the EOS). Nothing of the next document reaches it:
# its queries see context of the anchor's own document only (`_anchor_visibility`) and its own block, whose slots
# 1.. hold the mask token; its RoPE positions are position_ids[anchor] + k, computed from the anchor alone; and
# the slots past the end are not scored (`slot_valid`), so the verifier rows gathered there weigh 0 in the loss
# and its metrics. The packed row's end does not bound a block either (`eligible_anchors`), as in SpecForge
# (`_sample_anchor_positions` takes any loss token before the row's last): the graph's block indices are clamped
# to the row (`block_positions` with `seq`, the block_positions op), so a slot past the row's end gathers the
# row's last token, the verifier's row before it and the features there, all at weight 0 and never read beyond
# the row; every gathered index stays in [0, T), where the rewritten verifier gather is exact (NOTE [In-range
# gathers]). The drafter itself reads a block's anchor only (its token, its position, its document).


def _anchor_visibility(position_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """bool [A, T + A*B]: the mask row shared by all B query slots of each anchor."""
    anchors = _as_1d_long(anchors, "anchors")
    doc = document_ids(position_ids)
    t, a = doc.numel(), anchors.numel()
    if a and (int(anchors.min()) < 0 or int(anchors.max()) >= t):
        raise ValueError(f"anchors: out of range [0, {t})")
    j = torch.arange(t, device=doc.device)
    ctx = (doc[None, :] == doc[anchors][:, None]) & (j[None, :] < anchors[:, None])  # [A, T]
    own = torch.eye(a, dtype=torch.bool, device=doc.device).repeat_interleave(block_size, 1)
    return torch.cat([ctx, own], 1)


def dflash_attention_mask(position_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """bool [A*B, T + A*B], True = may attend.

    Keys are ``[T context tokens | A blocks of B slots]``. Every query slot of
    anchor ``a`` sees context token ``j`` iff ``j`` is in the anchor's document
    and ``j < anchors[a]`` (strictly before: the anchor token itself enters
    through slot 0 of the block), and every slot of its own block
    (bidirectional). Nothing else: no other block, no other document, no
    context at or after the anchor. Every row sees at least its own block, so
    no row is fully masked.
    """
    return _anchor_visibility(position_ids, anchors, block_size).repeat_interleave(block_size, 0)


def attention_bias(
    position_ids: Tensor, anchors: Tensor, block_size: int, dtype: torch.dtype
) -> Tensor:
    """The additive form of ``dflash_attention_mask``: [A*B, T + A*B] of
    ``dtype``, 0 where allowed and -inf elsewhere. Built per anchor row and
    only then repeated B times, so the only [A*B, T + A*B] tensor ever
    allocated is the result."""
    vis = _anchor_visibility(position_ids, anchors, block_size)
    rows = torch.zeros(vis.shape, dtype=dtype, device=vis.device)
    rows.masked_fill_(vis.logical_not_(), float("-inf"))
    del vis
    return rows.repeat_interleave(block_size, 0)


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: ``w * (x / rms(x))`` computed in float32, cast back before
    the weight (the plain ``w`` form, not Qwen3.5's ``1 + w``)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dt = x.dtype
        x32 = x.to(torch.float32)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(dt)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, HF ``rotate_half`` convention: x*cos + rot(x)*sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DFlashLayer(nn.Module):
    """One Qwen3-style draft decoder layer whose keys/values are
    ``cat(proj(context), proj(block))`` and whose queries are the block only."""

    def __init__(self, d: DFlashDims, dtype: torch.dtype) -> None:
        super().__init__()
        h, hd = d.hidden_size, d.head_dim
        self.nh, self.nkv, self.hd = d.num_attention_heads, d.num_key_value_heads, hd
        lin = dict(bias=False, dtype=dtype)
        self.input_layernorm = RMSNorm(h, d.rms_norm_eps, dtype)
        self.q_proj = nn.Linear(h, self.nh * hd, **lin)
        self.k_proj = nn.Linear(h, self.nkv * hd, **lin)
        self.v_proj = nn.Linear(h, self.nkv * hd, **lin)
        self.o_proj = nn.Linear(self.nh * hd, h, **lin)
        self.q_norm = RMSNorm(hd, d.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(hd, d.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, d.rms_norm_eps, dtype)
        self.gate_proj = nn.Linear(h, d.intermediate_size, **lin)
        self.up_proj = nn.Linear(h, d.intermediate_size, **lin)
        self.down_proj = nn.Linear(d.intermediate_size, h, **lin)

    def forward(self, h: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, bias: Tensor) -> Tensor:
        """h [Q, H] block stream; ctx [T, H] normed context; cos/sin [T+Q, hd];
        bias [Q, T+Q] additive attention mask."""
        h = h + self.attention(self.input_layernorm(h), ctx, cos, sin, bias)
        return h + self.mlp(self.post_attention_layernorm(h))

    def attention(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, bias: Tensor) -> Tensor:
        t, nq = ctx.shape[0], x.shape[0]
        nk = t + nq
        # queries: block tokens only; RoPE at the block slots' positions
        q = self.q_norm(self.q_proj(x).view(nq, self.nh, self.hd)).transpose(0, 1)
        q = _rope(q, cos[t:], sin[t:])  # [nh, Q, hd]
        # keys/values: context (already hidden_norm'ed; no input_layernorm) then block
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)]).view(nk, self.nkv, self.hd)
        k = _rope(self.k_norm(k).transpose(0, 1), cos, sin)  # [nkv, K, hd]
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)]).view(nk, self.nkv, self.hd).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=bias, enable_gqa=self.nh != self.nkv
        )  # [1, nh, Q, hd]
        del q, k, v
        return self.o_proj(o[0].transpose(0, 1).reshape(nq, self.nh * self.hd))

    def mlp(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The keys (k_norm, then RoPE) and values of normed context rows ctx [T, H]: [nkv, T, hd] each, exactly
        the context part of ``attention``'s keys and values."""
        t = ctx.shape[0]
        k = _rope(self.k_norm(self.k_proj(ctx).view(t, self.nkv, self.hd)).transpose(0, 1), cos, sin)
        return k, self.v_proj(ctx).view(t, self.nkv, self.hd).transpose(0, 1)

    def forward_cached(self, h: Tensor, k_ctx: Tensor, v_ctx: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``forward`` for one block h [B, H] whose context is every cached row (k_ctx, v_ctx [nkv, T, hd]):
        no mask, since every block slot sees the whole context (all before the anchor) and its own block;
        cos/sin [B, hd] at the block's positions."""
        x = self.input_layernorm(h)
        nq = x.shape[0]
        q = _rope(self.q_norm(self.q_proj(x).view(nq, self.nh, self.hd)).transpose(0, 1), cos, sin)
        kb, vb = self.context_kv(x, cos, sin)       # the block's own keys/values: same projections, same RoPE
        k, v = torch.cat([k_ctx, kb], 1), torch.cat([v_ctx, vb], 1)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=self.nh != self.nkv)
        h = h + self.o_proj(o[0].transpose(0, 1).reshape(nq, self.nh * self.hd))
        return h + self.mlp(self.post_attention_layernorm(h))


class ContextCache:
    """The drafter's context cache for one decoded sequence: per layer, the keys and values of every context
    position so far ([nkv, T, hd] each). A context row's K/V depend only on its own target features and position
    (the context stream is ``hidden_norm(fc(features))`` for every layer, not the layer's input), so rows once
    computed never change: decoding appends the rows of the tokens each round verified and never recomputes one,
    as z-lab's ``dflash_generate`` does with its draft ``DynamicCache`` (cropped back to the context after each
    block). Rejected drafts never enter it: only verified positions are context."""

    def __init__(self, n_layers: int) -> None:
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers

    def __len__(self) -> int:
        return 0 if self.k[0] is None else int(self.k[0].shape[1])

    def append(self, layer: int, k: Tensor, v: Tensor) -> None:
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k if old_k is None else torch.cat([old_k, k], 1)
        self.v[layer] = v if old_v is None else torch.cat([old_v, v], 1)


class DFlashDrafter(nn.Module):
    """The DFlash drafter (everything between the captured target features and
    the target's final norm).

    The target's embedding is shared and frozen. It is NOT registered: it is
    held in a plain tuple attribute (``self._embed_ref``), so it is absent from
    ``parameters()``, ``state_dict()`` and the optimizer set, and ``.to()`` does
    not move it (the caller places it on the drafter's device). Lookups use
    ``embed.weight.detach()``, so no gradient reaches it even if the target's
    weight has ``requires_grad=True``.

    Trainable parameters: ``fc``, ``hidden_norm``, ``layers`` and, with
    ``own_norm``, the final ``norm`` (counted by
    ``dflash_graph.models.dflash.component_params``). Linear weights are drawn
    from N(0, ``init_std``) as HF's ``_init_weights`` with
    ``initializer_range=0.02`` does; norm weights start at 1.
    """

    def __init__(
        self,
        dims: DFlashDims,
        embed: nn.Embedding,
        dtype: torch.dtype = torch.float32,
        init_std: float = 0.02,
        own_norm: bool = False,
    ) -> None:
        super().__init__()
        if embed.weight.shape != (dims.vocab_size, dims.hidden_size):
            raise ValueError(
                f"embed: weight shape {tuple(embed.weight.shape)} != "
                f"(vocab_size, hidden_size) = ({dims.vocab_size}, {dims.hidden_size})"
            )
        self.dims = dims
        self._embed_ref = (embed,)
        self.fc = nn.Linear(dims.fc_in_features, dims.hidden_size, bias=False, dtype=dtype)
        self.hidden_norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(DFlashLayer(dims, dtype) for _ in range(dims.num_hidden_layers))
        # the drafter's own trainable final norm (both references'), weight 1; the graph's `norm` node applies it
        # (forward returns the hidden states before it), and the export writes it as norm.weight
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype) if own_norm else None
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, init_std)

    @property
    def embed(self) -> nn.Embedding:
        return self._embed_ref[0]

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [K, hd] for integer ``positions`` [K], computed in float32
        exactly as Qwen3RotaryEmbedding (default rope type), then cast.
        (No inv_freq buffer: a module-wide ``.to(bfloat16)`` cannot degrade it.)"""
        hd = self.dims.head_dim
        exponent = torch.arange(0, hd, 2, dtype=torch.int64, device=positions.device).float() / hd
        inv_freq = 1.0 / (self.dims.rope_theta**exponent)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, context: Tensor, input_ids: Tensor, position_ids: Tensor, anchors: Tensor) -> Tensor:
        """context [T, n*Ht], input_ids [T], position_ids [T], anchors [A]
        (sorted int64 positions into the packed sequence) -> [A, B, H] hidden
        states of the block slots, BEFORE the final norm."""
        d = self.dims
        bs = d.block_size
        if context.dim() != 2 or context.shape[1] != d.fc_in_features:
            raise ValueError(
                f"context: expected [T, {d.fc_in_features}], got {tuple(context.shape)}"
            )
        t = context.shape[0]
        if input_ids.shape != (t,) or position_ids.shape != (t,):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and position_ids "
                f"{tuple(position_ids.shape)} must be [T]=[{t}]"
            )
        anchors = _as_1d_long(anchors, "anchors")
        pos = _as_1d_long(position_ids, "position_ids")
        dt = self.fc.weight.dtype

        # query stream: target embedding of [anchor token, mask, mask, ...]
        ids = block_token_ids(input_ids, anchors, bs, d.mask_token_id).view(-1)
        h = F.embedding(ids, self.embed.weight.detach()).to(dt)  # [Q, H]
        del ids
        # context stream: fc then hidden_norm, shared by every layer's K/V
        ctx = self.hidden_norm(self.fc(context.to(dt)))  # [T, H]
        # RoPE: context tokens at position_ids, slot k of anchor p at position_ids[p] + k
        cos, sin = self.rope(torch.cat([pos, block_positions(pos[anchors], bs).view(-1)]), dt)
        # one additive mask for all layers (a bool mask would be converted to
        # a new float tensor by SDPA in every layer, and saved by each)
        bias = attention_bias(pos, anchors, bs, dt)  # [Q, T+Q]

        for layer in self.layers:
            h = layer(h, ctx, cos, sin, bias)
        return h.view(anchors.numel(), bs, d.hidden_size)

    # ------------------------------------------------------------------ decoding with a context cache
    def new_cache(self) -> ContextCache:
        return ContextCache(len(self.layers))

    def extend_context(self, cache: ContextCache, features: Tensor, positions: Tensor) -> None:
        """Append the context rows of verified positions: features [n, n*Ht] (the target's captured layers at
        those positions), positions [n] (their position ids, consecutive after the cached rows)."""
        if features.dim() != 2 or features.shape[1] != self.dims.fc_in_features:
            raise ValueError(f"features: expected [n, {self.dims.fc_in_features}], got {tuple(features.shape)}")
        dt = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(features.to(dt)))                          # [n, H]
        cos, sin = self.rope(_as_1d_long(positions, "positions"), dt)
        for i, layer in enumerate(self.layers):
            cache.append(i, *layer.context_kv(ctx, cos, sin))

    def block_hidden(self, cache: ContextCache, anchor_token: int, anchor_position: int) -> Tensor:
        """[B, H] hidden states (before the final norm) of one block: slot 0 the anchor token at
        ``anchor_position``, slots 1.. the mask token, attending to every cached context row (the positions
        before the anchor) and to the whole block. Equals ``forward``'s block for that anchor with the same context
        (tests/test_speculative.py compares them)."""
        d = self.dims
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        ids = torch.full((d.block_size,), d.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = anchor_token
        h = F.embedding(ids, self.embed.weight.detach()).to(dt)                  # [B, H]
        cos, sin = self.rope(anchor_position + torch.arange(d.block_size, device=dev), dt)
        empty = h.new_zeros(self.layers[0].nkv, 0, self.layers[0].hd) if len(cache) == 0 else None
        for i, layer in enumerate(self.layers):
            k, v = (cache.k[i], cache.v[i]) if empty is None else (empty, empty)
            h = layer.forward_cached(h, k, v, cos, sin)
        return h
