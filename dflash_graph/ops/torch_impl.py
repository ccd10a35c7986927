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
from torch.utils.checkpoint import checkpoint


def token_input(c) -> dict[str, Tensor]:
    b = c.batch()
    return {"input_ids": b["input_ids"].to(c.device), "position_ids": b["position_ids"].to(c.device),
            "loss_mask": b["loss_mask"].to(c.device)}


def _forward(c, input_ids: Tensor, position_ids: Tensor, logits: bool) -> dict[str, Tensor]:
    from ..models.nn.qwen3_5 import body_forward as run_body, final_norm, lm_head

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
    return {"anchors": anchors, "valid": slot_valid(loss_mask, anchors, n, block)}


def block_positions(c, anchors):
    block = c.params["block"]
    return {"index": anchors.unsqueeze(-1) + torch.arange(block, device=anchors.device)}


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
    return {"hidden": c.module("drafter")(context, input_ids, position_ids, anchors)}


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


def _chunk_loss(kind: str, s: Tensor, t: Tensor) -> Tensor:
    """Per-row divergence of student logits `s` from target logits `t`, [rows, V] -> [rows], in fp32."""
    ls = F.log_softmax(_up(s), dim=-1)
    lt = F.log_softmax(_up(t), dim=-1)
    if kind == "ce":   # cross-entropy on the verifier's argmax
        return -ls.gather(-1, lt.argmax(-1, keepdim=True)).squeeze(-1)
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


class _ChunkDivergence(torch.autograd.Function):
    """KL(p_t || p_s) or cross-entropy on the target's argmax for one chunk of rows, with a closed-form backward:
    d/ds = p_s - q (q = p_t for KL, one-hot(argmax t) for CE). Saves only its inputs, like checkpointing would,
    without recomputing the forward in backward."""

    @staticmethod
    def forward(ctx, s: Tensor, t: Tensor, kind: str) -> Tensor:
        ctx.save_for_backward(s, t)
        ctx.kind = kind
        with torch.no_grad():
            return _chunk_loss(kind, s, t)

    @staticmethod
    def backward(ctx, g: Tensor):
        s, t = ctx.saved_tensors
        ps = torch.softmax(_up(s), dim=-1)
        if ctx.kind == "kl":
            ps.sub_(torch.softmax(_up(t), dim=-1))
        else:
            ps.scatter_add_(-1, t.argmax(-1, keepdim=True),
                            torch.full((ps.shape[0], 1), -1.0, device=ps.device, dtype=ps.dtype))
        return (ps.mul_(g[:, None])).to(s.dtype), None, None


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


def loss(c, logits, target, valid):
    """Decayed per-slot loss over scored slots (`valid` [A, B]), computed `chunk` rows at a time; each chunk is
    recomputed in backward (torch.utils.checkpoint), so only one chunk's [chunk, vocab] fp32 temporaries ever
    exist. Also per-slot accuracy and the acceptance counts of greedy verification (`acceptance_counts`)."""
    a, b, v = logits.shape
    kind, chunk = c.params["kind"], max(1, min(int(c.params.get("chunk", 1024)), a * b))
    target = target.detach()
    valid = valid.to(torch.bool)
    w = slot_weights(b, c.params["gamma"], logits.device)[None, :] * valid.float()   # [A, B]
    s2, t2 = logits.reshape(a * b, v), target.reshape(a * b, v)
    per_row, hits = [], []
    for i in range(0, a * b, chunk):
        si, ti = s2[i:i + chunk], t2[i:i + chunk]
        if torch.is_grad_enabled() and si.requires_grad:
            if kind in ("kl", "ce"):
                per_row.append(_ChunkDivergence.apply(si, ti, kind))
            else:
                per_row.append(checkpoint(_chunk_loss, kind, si, ti, use_reentrant=False))
        else:
            per_row.append(_chunk_loss(kind, si, ti))
        with torch.no_grad():   # per chunk: an argmax over bf16 on CPU upcasts its whole input
            hits.append(si.argmax(-1) == ti.argmax(-1))
    rows = torch.cat(per_row).view(a, b)
    total = (rows * w).sum() / w.sum().clamp_min(1e-9)
    with torch.no_grad():
        hit = torch.cat(hits).view(a, b)                                  # [A, B]
        vf = valid.float()
        acc = (hit.float() * vf).sum(0) / vf.sum(0).clamp_min(1.0)
        accepted = acceptance_counts(hit, valid)
    return {"loss": total, "slot_acc": acc, "accepted": accepted}
