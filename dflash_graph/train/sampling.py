"""Token choice for decoding, and the verification rules of speculative decoding (train/speculative.py).

Greedy (temperature 0): the argmax; a drafted token is accepted while it equals the target's argmax at its slot.

Sampling (temperature T > 0, nucleus top-p): every distribution is ``softmax(logits / T)`` restricted to its
top-p nucleus and renormalised, the target's (p) and the drafter's (q) alike, and verification is the standard
lossless speculative-sampling rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"): the drafted token
x of slot i is accepted with probability min(1, p_i(x) / q_i(x)); at the first rejection the slot's token is drawn
from the residual norm(max(0, p_i - q_i)) and the block ends; when every draft is accepted, a bonus token is drawn
from the target's distribution after the last one. Applied to DFlash's parallel block as z-lab's reference decoder
does (z-lab/dflash ``dflash/model.py``: ``dflash_generate`` draws every slot's draft at once from the drafter's
per-slot distributions, then ``_rejection_sample`` runs this rule over the block, with ``_sampling_probs`` applying
the temperature and top-p to both sides). Every slot's draft is drawn from a distribution fixed before any of them
is (the block is drafted in one forward), which the rule allows: conditioned on the accepted prefix, slot i's token
is still drawn from q_i, so each emitted token is distributed as the target's p_i, whatever q is.
tests/test_speculative.py checks that in distribution, against target-only sampling, with a chi-square test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: ``temperature`` 0 is greedy (``top_p`` then unused)."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """[..., V] float32 probabilities: softmax(logits / T), cut to the top-p nucleus (the most likely tokens
        whose mass before them is below top_p: the first token always stays) and renormalised."""
        p = torch.softmax(logits.float() / self.temperature, -1)
        if self.top_p < 1:
            sp, order = p.sort(-1, descending=True)
            sp = sp.masked_fill(sp.cumsum(-1) - sp >= self.top_p, 0.0)          # outside the nucleus
            p = torch.zeros_like(p).scatter(-1, order, sp)
            p = p / p.sum(-1, keepdim=True)
        return p


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [..., V] (int64 [...])."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def verify_greedy(drafts: list[int], target_logits: Tensor) -> tuple[int, int]:
    """(accepted, next token): drafts [k] against the target's logits [k+1, V] at the block's slots (row i: the
    target's distribution after slot i). Accepts while each draft equals the target's argmax; the next token is the
    target's argmax after the last accepted draft."""
    post = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == post[n]:
        n += 1
    return n, post[n]


def verify_sampling(drafts: Tensor, p: Tensor, q: Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """(accepted, next token) by the speculative-sampling rule (module docstring): drafts int64 [k] drawn from the
    drafter's q [k, V]; the target's p [k+1, V]. Draft i is accepted when u_i * q_i(x_i) < p_i(x_i), u_i uniform
    in [0, 1): probability min(1, p_i(x_i) / q_i(x_i)), and q_i(x_i) > 0 since x_i was drawn from q_i."""
    k = drafts.numel()
    idx = drafts.view(k, 1)
    px = p[:k].gather(-1, idx)[:, 0]
    qx = q.gather(-1, idx)[:, 0]
    u = torch.rand(k, generator=generator, device=p.device)
    ok = (u * qx < px).to(torch.int64)
    n = int(ok.cumprod(0).sum())
    if n == k:
        return k, int(draw(p[k], generator))
    residual = (p[n] - q[n]).clamp_min(0)
    total = residual.sum()
    # total is 0 only when p_n == q_n, where the rejection has probability 0; p_n is then the exact answer
    return n, int(draw(residual / total if total > 0 else p[n], generator))
