"""The torch implementation of every op in ops/catalog.py. Imported only by exec/ (never by `check`).

Each function takes the interpreter's context (exec/interpreter.py `ExecContext`: params, device, modules, batch)
and the node's inputs by port name and returns its outputs by name.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor


def token_input(c) -> dict[str, Tensor]:
    b = c.batch()
    return {"input_ids": b["input_ids"].to(c.device), "position_ids": b["position_ids"].to(c.device),
            "loss_mask": b["loss_mask"].to(c.device)}


def _forward(c, input_ids: Tensor, position_ids: Tensor, logits: bool) -> dict[str, Tensor]:
    from ..models.nn.target import body_forward as run_body, final_norm, lm_head

    model = c.module("body")
    capture = list(c.params.get("_taps", ()))   # the layers hook_capture nodes ask for (exec/interpreter.py)
    last, captured = run_body(model, input_ids, position_ids, capture,
                              packing=getattr(model, "dflash_packing", "documents"))   # the model's declared packing
    out = {"hidden": last, "taps": captured}
    if logits:
        out["logits"] = lm_head(model)(final_norm(model)(last))
    return {k: v for k, v in out.items() if k in c.wanted}


def causal_lm_forward(c, input_ids, position_ids):
    return _forward(c, input_ids, position_ids, logits=True)


def body_forward(c, input_ids, position_ids):
    return _forward(c, input_ids, position_ids, logits=False)


def hook_capture(c, taps):
    return {f"layer{i}": taps[i] for i in c.params["layers"]}


def concat(c, **xs):
    return {"out": torch.cat([xs[f"x{i}"] for i in range(len(xs))], dim=-1)}


def transfer(c, x):
    return {"out": c.send(x)}


def anchor_sample(c, loss_mask, position_ids):
    from ..models.nn.dflash import sample_anchors, slot_valid

    count, block = c.params["count"], c.params["block"]
    a = sample_anchors(loss_mask, position_ids, block, count, c.generator)
    n = a.numel()
    pad = torch.zeros(count - n, dtype=torch.int64, device=a.device)  # position 0: masked out by `valid`
    anchors = torch.cat([a, pad])
    return {"anchors": anchors, "valid": slot_valid(loss_mask, anchors, n, block, position_ids)}


def block_positions(c, anchors):
    block, seq = c.params["block"], c.params["seq"]
    # clamped to the row: a block may run past its end (NOTE [Blocks past a document's end]); those slots weigh 0
    return {"index": (anchors.unsqueeze(-1) + torch.arange(block, device=anchors.device)).clamp_max_(seq - 1)}


def gather(c, x, index):
    axis = c.params["axis"]
    n = x.shape[axis]
    flat = index.reshape(-1)
    out = torch.index_select(x, axis, flat.clamp(0, n - 1))
    return {"out": out.reshape(*x.shape[:axis], *index.shape, *x.shape[axis + 1:])}


def roll(c, x):
    return {"out": torch.roll(x, c.params["shift"], c.params["axis"])}


def index_shift(c, index):
    m = c.params["modulo"]
    if c.params.get("check_range"):
        # NOTE [In-range gathers]: gather_through_remap is exact only for 0 <= idx < n (gather clamps, the shifted
        # index wraps); rewrite/proofs.py finds that condition. On CUDA the check is asynchronous (no host sync).
        bad = (index < 0) | (index >= m)
        msg = (f"index_shift (gather_through_remap): an index is outside [0, {m}), where the rewritten gather "
               f"would wrap while the gather as written clamps; fix the index, or run with --no-rewrite")
        if index.is_cuda:
            torch._assert_async(~bad.any(), msg)
        elif bad.any():
            at = tuple(int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{msg} (index {index[at].item()} at {list(at)})")
    return {"out": torch.remainder(index + c.params["shift"], m)}


def norm(c, x):
    return {"out": c.module("norm")(x)}


def lm_head(c, x):
    return {"logits": c.module("lm_head")(x)}


def drafter_forward(c, context, input_ids, position_ids, anchors):
    return {"hidden": c.module("trainable")(context, input_ids, position_ids, anchors)}


def output(c, x):
    return {}


@functools.lru_cache(maxsize=16)
def _slot_weights(block: int, gamma: float, device: str) -> Tensor:
    k = torch.arange(block, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def slot_weights(block: int, gamma: float, device) -> Tensor:
    """Slot k of a block predicts token p+k; weight exp(-(k-1)/gamma) for k >= 1, slot 0 (the anchor) masked."""
    return _slot_weights(block, float(gamma), str(device))


def _up(x: Tensor) -> Tensor:
    """At least float32 (bf16/fp16 logits are upcast; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunk_loss(kind: str, s: Tensor, t: Tensor | None = None, y: Tensor | None = None) -> Tensor:
    """Per-row divergence of student logits `s` from target logits `t`, [rows, V] -> [rows], in fp32. ce scores
    the labels `y` [rows] when given (the data's next token), else the verifier's argmax, taken on its raw logits:
    ce never makes a log-softmax over the verifier's rows."""
    ls = F.log_softmax(_up(s), dim=-1)
    if kind == "ce":   # cross-entropy on the labels: the verifier's argmax or the data's tokens
        y = t.argmax(-1) if y is None else y
        return -ls.gather(-1, y[:, None]).squeeze(-1)
    lt = F.log_softmax(_up(t), dim=-1)
    if kind == "kl":   # KL(p_t || p_s)
        return (lt.exp() * (lt - ls)).sum(-1)
    if kind == "rkl":  # KL(p_s || p_t)
        return (ls.exp() * (ls - lt)).sum(-1)
    if kind == "jsd":
        m = torch.logaddexp(ls, lt) - math.log(2.0)
        return 0.5 * ((ls.exp() * (ls - m)).sum(-1) + (lt.exp() * (lt - m)).sum(-1))
    if kind == "tv":
        return 0.5 * (ls.exp() - lt.exp()).abs().sum(-1)
    raise ValueError(kind)


def acceptance_counts(hit: Tensor, valid: Tensor) -> Tensor:
    """float32 [B]: entry k counts the real anchors whose slots 1..k were all drafted as the verifier's argmax
    (entry 0: the real anchors). Greedy verification accepts exactly that run, so the mean acceptance length is
    tau = 1 + sum(n[1:]) / n[0] and slot k's conditional acceptance rate is n[k] / n[k-1]
    (train/metrics.py). An unscored slot (past the end of the loss span) ends the run.

    hit, valid: bool [A, B] (slot 0 of `valid` marks a real anchor; slot 0 of `hit` is ignored)."""
    ok = (hit & valid).clone()
    ok[:, 0] = valid[:, 0]
    run = torch.cumprod(ok.to(torch.int32), dim=1)                       # [A, B]: 1 while every slot so far hit
    return run.sum(0).to(torch.float32)


# -- the objective (ops/objective.py resolve_objective: labels, normalisation, per-slot weighting) ------------------

def objective(params) -> Objective:
    from .objective import resolve_objective

    return Objective(**resolve_objective(params))


class Objective:
    """The loss node's objective, resolved from its params and preset (ops/objective.py resolve_objective)."""

    def __init__(self, kind: str, gamma: float, labels: str, normalize: str, weighting: str, dpace_alpha: float):
        self.kind, self.gamma, self.labels = kind, float(gamma), labels
        self.normalize, self.weighting, self.dpace_alpha = normalize, weighting, float(dpace_alpha)


def scored_slots(valid: Tensor) -> Tensor:
    """bool [A, B]: the slots the loss scores, a real anchor's slots 1.. inside its loss span (slot 0 is the
    anchor itself, never scored)."""
    m = valid.to(torch.bool).clone()
    m[:, 0] = False
    return m


def row_weights(block: int, gamma: float, valid: Tensor, weighting: str = "decay") -> Tensor:
    """The weight of each block slot of each anchor, [A, B], a new tensor: zero for slot 0 and for slots that are
    not scored (`valid` [A, B]), else exp(-(k-1)/gamma) (decay) or 1 (uniform, and dpace, whose per-block factor
    (dpace_weights) multiplies it once the slot losses are known)."""
    m = scored_slots(valid).float()
    if weighting == "decay":
        return slot_weights(block, gamma, valid.device)[None, :] * m
    return m


def dpace_weights(ce: Tensor, mask: Tensor, alpha: float) -> Tensor:
    """D-PACE's per-slot weights [a, B] from the slots' cross-entropies `ce` [a, B] and the scored slots `mask`
    [a, B] (float), no gradient: q = exp(-ce) the drafter's probability of the label, smoothed to
    (1 - alpha) q + alpha (1 at unscored slots), prefix products along the block, and the weight of slot k the sum
    of the prefix products of the scored slots k.. (vllm-project/speculators `src/speculators/losses/utils.py`
    `dpace_loss_decay`, SpecForge `algorithms/common/dflash_family_model.py` `OnlineDFlashModel._dpace_weight`)."""
    with torch.no_grad():
        q = torch.exp(-(ce * mask)).float()
        smooth = (1.0 - alpha) * q + alpha
        smooth = torch.where(mask > 0, smooth, torch.ones_like(smooth))
        prefix = torch.cumprod(smooth, dim=-1)
        w = torch.flip(torch.cumsum(torch.flip(prefix * mask, dims=[-1]), dim=-1), dims=[-1])
        return w * mask


def denominator(w: Tensor, mask: Tensor, normalize: str) -> Tensor:
    """What the weighted sum of the slot losses is divided by: the sum of the weights, or the number of scored
    slots (speculators `losses/utils.py` `loss_function`); 1e-9 when nothing is scored."""
    d = w.sum() if normalize == "weights" else mask.sum().to(w.dtype)
    return d.clamp_min(1e-9)


def weighted_total(rows: Tensor, w: Tensor, denom: Tensor | None = None) -> Tensor:
    """The loss: per-row losses [A, B] weighted by the row weights, over `denom` (default: the weights' sum)."""
    return (rows * w).sum() / (w.sum().clamp_min(1e-9) if denom is None else denom)


def chunk_hits(s: Tensor, t: Tensor | None, y: Tensor | None = None) -> Tensor:
    """Per row of a chunk: the drafter's argmax equals the label (`y`) or the verifier's argmax. Per chunk: an
    argmax over bf16 on CPU upcasts its whole input."""
    with torch.no_grad():
        return s.argmax(-1) == (t.argmax(-1) if y is None else y)


def loss_metrics(hit: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """The loss op's metric outputs from the per-row hits [A, B] and the scored slots [A, B]: per-slot accuracy
    (slot 0's hit is not read: it is the anchor, 1 for every real anchor) and the acceptance counts of greedy
    verification. The fused head + loss op (fused_head_loss) returns exactly
    these too: a new metric is added here, and declared on the loss op."""
    with torch.no_grad():
        valid = valid.to(torch.bool)
        vf = valid.float()
        hit = hit.clone()
        hit[:, 0] = True    # slot 0 is the anchor, the verifier's own token: accepted as it is, never drafted (NOTE
        #                     [Slot 0 is never scored]); slot_acc[0] is 1 (0 when no anchor is real)
        acc = (hit.float() * vf).sum(0) / vf.sum(0).clamp_min(1.0)       # [B]
        accepted = acceptance_counts(hit, valid)
    return {"slot_acc": acc, "accepted": accepted}


def loss(c, logits, target=None, valid=None, labels=None):
    """The objective's loss over scored slots (`valid` [A, B]), computed `chunk` rows at a time (0: the memory
    model's default, ops/costs.loss_chunk), so only one chunk's [chunk, vocab] fp32 temporaries ever exist. When
    autograd records it, the gradient with respect to the logits is made chunk by chunk in forward (chunk_grad)
    and kept, in the logits' dtype; neither the logits nor the target are saved, so both die after forward, and
    backward recomputes nothing. Also per-slot accuracy and the acceptance counts of greedy verification
    (`acceptance_counts`)."""
    from .costs import block_chunk, loss_chunk

    obj = objective(c.params)
    a, b, v = logits.shape
    chunk = max(1, min(int(c.params.get("chunk") or 0) or loss_chunk(a * b), a * b))
    chunk = block_chunk(chunk, b, obj.weighting)
    w = row_weights(b, obj.gamma, valid, obj.weighting)   # [A, B]
    mask = scored_slots(valid)
    s2 = logits.reshape(a * b, v)
    t2 = None if target is None else target.detach().reshape(a * b, v)
    y = None if labels is None else labels.reshape(-1)
    args = (t2, y, w.reshape(-1), mask.reshape(-1), obj, b, chunk)
    if torch.is_grad_enabled() and logits.requires_grad:
        total, hit = _ChunkedLoss.apply(s2, *args)
    else:
        rows, hit, _, denom = loss_chunks(s2, *args, False)
        total = weighted_total(rows.view(a, b), w, denom)
    return {"loss": total, **loss_metrics(hit.view(a, b), valid)}


# -- the verifier head, the drafter head and the loss in one chunked node ----------------------------------------

def chunk_grad(kind: str, s: Tensor, t: Tensor | None, y: Tensor | None = None) -> Tensor:
    """d _chunk_loss(kind, s, t, y)[r] / d s[r], [rows, V], in at least fp32: the closed forms of the loss op's
    divergences (tests/test_fused_head_loss.py checks them against autograd of _chunk_loss). With p = softmax(s)
    and q = softmax(t): ce p - onehot(label); kl p - q; for rkl, jsd, tv the derivative d in p of the
    divergence, through the softmax: p * (d - <p, d>), with d = log p - log q (rkl), (log p - log m) / 2 with
    m = (p + q) / 2 (jsd), sign(p - q) / 2 (tv). At most four [rows, V] buffers at once (plus an fp32 copy of a
    low-precision input while it is normalised)."""
    ls = F.log_softmax(_up(s), dim=-1)
    if kind == "ce":
        return _ce_grad(ls, t.argmax(-1) if y is None else y)
    lt = F.log_softmax(_up(t), dim=-1)
    if kind == "kl":
        return ls.exp_().sub_(lt.exp_())
    p = ls.exp()
    if kind == "rkl":
        d = ls.sub_(lt)
    elif kind == "jsd":
        lm = torch.logaddexp(ls, lt).sub_(math.log(2.0))
        d = ls.sub_(lm).mul_(0.5)
        del lm
    elif kind == "tv":
        d = lt.exp_().neg_().add_(p).sign_().mul_(0.5)
    else:
        raise ValueError(kind)
    del lt
    d.sub_((p * d).sum(-1, keepdim=True))
    return d.mul_(p)


def _ce_grad(ls: Tensor, y: Tensor) -> Tensor:
    """softmax - onehot(y), in place of the log-softmax `ls`."""
    p = ls.exp_()
    return p.scatter_add_(-1, y[:, None], torch.full((p.shape[0], 1), -1.0, device=p.device, dtype=p.dtype))


def _ce_rows(s: Tensor, y: Tensor, rows: Tensor, hit: Tensor) -> Tensor:
    """ce on one chunk of drafter logits s [c, V] against the labels y [c]: the per-row losses into `rows` and
    the hits (s's argmax is y) into `hit`, from one softmax p = softmax(s) (in at least fp32) and one max over s:
    -log p[y] = log-sum-exp(s) - s[y], with log-sum-exp(s) = s[m] - log p[m] at the argmax m, where p[m] >= 1/V
    never underflows. Returns p, [c, V], from which the gradient (p - onehot(y)) is made in place. torch's softmax
    makes its one [c, V] buffer in a fraction of log_softmax's time on CPU, and the gradient then needs no exp
    pass (benchmarks/README.md, "ce's softmax")."""
    su = _up(s)
    smax, m = su.max(-1)                        # the first maximal index, as argmax takes it (chunk_hits)
    p = torch.softmax(su, dim=-1)
    lse = smax - p.gather(-1, m[:, None]).squeeze(-1).log()
    rows.copy_(lse - su.gather(-1, y[:, None]).squeeze(-1))
    hit.copy_(m == y)
    return p


def _score_chunk(obj: Objective, block: int, s: Tensor, t: Tensor | None, y: Tensor | None, mask: Tensor,
                 w: Tensor, rows: Tensor, hit: Tensor, scale: Tensor | None) -> Tensor | None:
    """One chunk of the loss: its per-row losses and hits written into `rows` and `hit` (views of the whole); for
    D-PACE the chunk's weights `w` (a view; the chunk holds whole blocks) multiplied by the blocks' D-PACE
    factor; and, when `scale` (1 / the denominator, or 1 when it is known only at the end) is given, the gradient
    of the loss with respect to `s` in fp32 (or fp64), [chunk, V]. ce takes the labels or the verifier's argmax
    and makes one log-softmax, over the drafter's rows only. The loss op and the fused op both score here."""
    if obj.kind == "ce":
        y = t.argmax(-1) if y is None else y       # the verifier's argmax: no log-softmax over its rows
        p = _ce_rows(s, y, rows, hit)
        if obj.weighting == "dpace":
            w.mul_(dpace_weights(rows.view(-1, block), mask.view(-1, block).to(rows.dtype),
                                 obj.dpace_alpha).view(-1).to(w.dtype))
        if scale is None:
            return None
        return p.scatter_add_(-1, y[:, None], torch.full((p.shape[0], 1), -1.0, device=p.device, dtype=p.dtype)
                              ).mul_((w.to(rows.dtype) / scale.to(rows.dtype))[:, None])
    rows.copy_(_chunk_loss(obj.kind, s, t))
    hit.copy_(chunk_hits(s, t))
    if scale is None:
        return None
    return chunk_grad(obj.kind, s, t).mul_((w.to(rows.dtype) / scale.to(rows.dtype))[:, None])


def _scales(w: Tensor, mask: Tensor, obj: Objective, grad: bool) -> tuple[Tensor | None, bool]:
    """What each chunk's gradient is divided by (the denominator when it is known before the chunks, as it is
    unless D-PACE weights are normalised by their own sum; else 1) and whether it is divided at the end instead."""
    if not grad:
        return None, False
    late = obj.weighting == "dpace" and obj.normalize == "weights"
    return (torch.ones((), device=w.device) if late else denominator(w, mask, obj.normalize)), late


def loss_chunks(s: Tensor, t: Tensor | None, y: Tensor | None, w: Tensor, mask: Tensor, obj: Objective,
                block: int, chunk: int, grad: bool):
    """The loss op's work on logits s [R, V] against the verifier's t [R, V] or the labels y [R], with row weights
    w [R] (D-PACE: filled in here) and scored slots mask [R], `chunk` rows at a time: the per-row losses [R], the
    per-row hits [R], when asked the gradient of the loss with respect to s ([R, V] in s's dtype, written chunk
    by chunk), and the denominator."""
    r = s.shape[0]
    rows = torch.empty(r, dtype=torch.promote_types(s.dtype, torch.float32), device=s.device)
    hit = torch.empty(r, dtype=torch.bool, device=s.device)
    gs = torch.empty_like(s) if grad else None
    scale, late = _scales(w, mask, obj, grad)
    with torch.no_grad():
        for i in range(0, r, chunk):
            j = slice(i, i + chunk)
            ds = _score_chunk(obj, block, s[j], None if t is None else t[j], None if y is None else y[j], mask[j],
                              w[j], rows[j], hit[j], scale)
            if ds is not None:
                gs[j].copy_(ds)
                del ds
        denom = denominator(w, mask, obj.normalize)
        if late:
            gs.div_(denom.to(gs.dtype))
    return rows, hit, gs, denom


class _ChunkedLoss(torch.autograd.Function):
    """The loss op when autograd records it (loss_chunks): the gradient with respect to the logits is made in
    forward and kept; the logits and the target are not saved. Backward only scales the kept gradient."""

    @staticmethod
    def forward(ctx, s, t, y, w, mask, obj, block, chunk):
        rows, hit, gs, denom = loss_chunks(s, t, y, w, mask, obj, block, chunk, True)
        ctx.save_for_backward(gs)       # freed by autograd after backward (kept only under retain_graph)
        ctx.mark_non_differentiable(hit)
        return weighted_total(rows, w, denom), hit

    @staticmethod
    def backward(ctx, g, _hit):
        (gs,) = ctx.saved_tensors
        return gs * g.to(gs.dtype), None, None, None, None, None, None, None


def head_loss_chunks(x: Tensor, tx: Tensor | None, y: Tensor | None, weight: Tensor, w: Tensor, mask: Tensor,
                     obj: Objective, chunk: int, grad_x: bool, grad_w: bool):
    """The loss of student logits x @ W.T against target logits tx @ W.T (or the labels y [A, B], when the
    objective's labels are the data: no verifier head at all), a few whole blocks at a time, without ever holding
    more than one chunk of either: x, tx [A, B, H], W [V, H], row weights w [A, B], scored slots mask [A, B].

    NOTE [Slot 0 is never scored]: slot 0 of a block is its anchor, whose token the drafter is given; its weight
    is 0 under every objective (`scored_slots`) and no metric reads its hit (`loss_metrics`), so its rows are not
    made at all: each chunk is `chunk // (B - 1)` blocks' slots 1..B-1 (at least one block), and slot 0's losses
    and gradients are 0. That is 1/B of the three vocabulary products (the two heads and the gradient) saved.

    Returns the per-row losses [A, B] and hits [A, B] (slot 0: 0 and False), the row weights [A, B] (with D-PACE's
    factors), when asked the gradient of the loss with respect to x ([A, B, H], in x's dtype) and to W ([V, H], accumulated per chunk in at
    least fp32), and the denominator. Each chunk's logits are made as lm_head makes them (F.linear in the weight's
    dtype), so values and rounding are the unfused graph's."""
    a, b, h = x.shape
    n = b - 1                                   # scored-able slots per block: 1 .. B-1
    nb = max(1, chunk // max(n, 1))             # whole blocks per chunk
    ws = w[:, 1:].contiguous()                  # [A, B-1]: D-PACE fills in its factors here
    ms = mask[:, 1:].contiguous()
    ys = None if y is None else y[:, 1:].contiguous()
    rows = torch.zeros(a, n, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    hit = torch.zeros(a, n, dtype=torch.bool, device=x.device)
    gx = torch.zeros_like(x) if grad_x else None
    gw = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                     device=weight.device) if grad_w else None
    scale, late = _scales(w, mask, obj, grad_x or grad_w)
    with torch.no_grad():
        for i in range(0, a if n else 0, nb):
            j = slice(i, i + nb)
            c = x[j].shape[0] * n               # rows in this chunk
            if tx is None:
                xi = xt = x[j, 1:].reshape(c, h)   # [c, H]: the drafter's rows only
                st = F.linear(xi, weight)       # [c, V]
                s, t = st, None
            else:
                xt = torch.cat([x[j, 1:], tx[j, 1:]]).view(2 * c, h)   # both heads' rows, one GEMM reads W once
                xi = xt[:c]
                st = F.linear(xt, weight)       # [2c, V]
                s, t = st[:c], st[c:]           # the drafter's logits for these rows, the verifier's
            ds = _score_chunk(obj, n, s, t, None if ys is None else ys[j].reshape(c), ms[j].reshape(c),
                              ws[j].view(c), rows[j].view(c), hit[j].view(c), scale)
            del t
            if ds is not None:
                ds = ds.to(s.dtype)             # as the loss op's backward hands it to lm_head's
                del s, st
                if gx is not None:
                    gx[j, 1:] = torch.mm(ds, weight).view(-1, n, h)
                if gw is not None:
                    gw.addmm_(ds.t().to(gw.dtype), xi.to(gw.dtype))
                del ds
            else:
                del s, st
            del xi, xt
        # the [A, B] layout the loss op sums in (slot 0: 0), so that the sums round as its do
        rows_f = torch.zeros(a, b, dtype=rows.dtype, device=x.device)
        rows_f[:, 1:] = rows
        hit_f = torch.zeros(a, b, dtype=torch.bool, device=x.device)
        hit_f[:, 1:] = hit
        if obj.weighting == "dpace":            # ws holds the D-PACE factors; slot 0 weighs 0 in both
            w = w.clone()
            w[:, 1:] = ws
        denom = denominator(w, mask, obj.normalize)
        if late:
            for g_ in (gx, gw):
                if g_ is not None:
                    g_.div_(denom.to(g_.dtype))
    return rows_f, hit_f, w, gx, gw, denom


class _FusedHeadLoss(torch.autograd.Function):
    """The weighted loss of the drafter's rows against the verifier's (or the data's labels) with the heads'
    logits made chunk by chunk (head_loss_chunks). The gradient is computed in forward, one chunk at a time, and
    kept ([R, H], and [V, H] for a trainable W): backward only scales it, nothing is recomputed and no logits are
    stored."""

    @staticmethod
    def forward(ctx, x, tx, y, weight, w, mask, obj, chunk):
        rows, hit, ws, gx, gw, denom = head_loss_chunks(x, tx, y, weight, w, mask, obj, chunk,
                                                        ctx.needs_input_grad[0], ctx.needs_input_grad[3])
        ctx.save_for_backward(gx, gw)   # freed by autograd after backward (kept only under retain_graph)
        total = weighted_total(rows, ws, denom)
        ctx.mark_non_differentiable(hit)
        return total, hit

    @staticmethod
    def backward(ctx, g, _hit):
        gx, gw = ctx.saved_tensors
        gx = None if gx is None else gx * g.to(gx.dtype)
        gw = None if gw is None else (gw * g).to(gw.dtype)
        return gx, None, None, gw, None, None, None, None


def fused_head_loss(c, x, target_x=None, valid=None, labels=None):
    """The loss op on lm_head(x) and lm_head(target_x) (or the data's labels), with one shared W, never making a
    [rows, vocab] logits tensor (ops/catalog.py fused_head_loss; the rule fuse_heads_into_loss makes it)."""
    from .costs import fused_chunk

    head = c.module("lm_head")
    if head.bias is not None:
        raise ValueError("fused_head_loss: the lm_head has a bias; the fused op computes x @ W.T only")
    weight = head.weight
    obj = objective(c.params)
    a, b, h = x.shape
    chunk = fused_chunk(int(c.params.get("chunk") or 0), a, b, h, weight.shape[0], obj.kind)
    w = row_weights(b, obj.gamma, valid, obj.weighting)
    mask = scored_slots(valid)
    t = None if target_x is None else target_x.detach()
    args = (w, mask, obj, chunk)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        total, hit = _FusedHeadLoss.apply(x, t, labels, weight, *args)
    else:
        rows, hit, ws, _, _, denom = head_loss_chunks(x, t, labels, weight, *args, False, False)
        total = weighted_total(rows, ws, denom)
    return {"loss": total, **loss_metrics(hit, valid)}
