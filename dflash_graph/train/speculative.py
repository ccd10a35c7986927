"""Real speculative decoding with the target and a trained drafter: greedy verification, the graph's block size.

Each round (as z-lab's `dflash_generate` with temperature 0, z-lab/dflash `dflash/model.py`): the last verified
token is the anchor, slot 0 of a block whose other B-1 slots hold the mask token; the drafter, given the target's
captured features of every earlier position as context, proposes B-1 tokens in one forward; the target runs once
over the sequence plus those drafts; the drafts are accepted while each equals the target's own argmax at its
position, and the target's argmax after the last accepted draft is the round's bonus token. A round yields
`accepted + 1` tokens for one target forward, and the output is exactly target-only greedy decoding.

Both decoders here recompute the target over the whole sequence at every forward (no KV cache): the wall-time
ratio compares like with like, and "tokens per target forward" is what a cached server would gain per forward.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor


class Decoder:
    """The target (its arch's transformers causal LM), its final norm and lm_head, and the drafter (DFlashDrafter)."""

    def __init__(self, target, drafter, layer_ids, block: int, eos: int | None):
        from ..models.nn.target import final_norm, lm_head

        self.target, self.drafter = target, drafter
        self.norm, self.head = final_norm(target), lm_head(target)
        self.layer_ids, self.block, self.eos = list(layer_ids), block, eos
        self.forwards = 0

    def _target(self, ids: list[int], features: bool) -> tuple[Tensor, Tensor | None]:
        from ..models.nn.target import body_forward

        dev = self.head.weight.device
        x = torch.tensor(ids, dtype=torch.int64, device=dev)
        last, cap = body_forward(self.target, x, torch.arange(len(ids), device=dev),
                                 self.layer_ids if features else [])
        self.forwards += 1
        logits = self.head(self.norm(last))                                    # [T, V]
        feats = torch.cat([cap[i] for i in self.layer_ids], -1) if features else None   # [T, n*H]
        return logits, feats

    def propose(self, ids: list[int], feats: Tensor, anchor: int) -> list[int]:
        """The drafter's B-1 greedy proposals after the anchor, from the target's features of positions < anchor."""
        dev = feats.device
        ctx = torch.cat([feats[:anchor], feats.new_zeros(1, feats.shape[1])])  # position `anchor`: masked anyway
        x = torch.tensor(ids, dtype=torch.int64, device=dev)
        h = self.drafter(ctx, x, torch.arange(len(ids), device=dev), torch.tensor([anchor], device=dev))
        return self.head(self.norm(h[0, 1:])).argmax(-1).tolist()

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        """Target-only greedy decoding: one target forward per token."""
        ids = list(prompt)
        for _ in range(max_new):
            logits, _ = self._target(ids, features=False)
            ids.append(int(logits[-1].argmax()))
            if ids[-1] == self.eos:
                break
        return ids[len(prompt):]

    @torch.no_grad()
    def speculative(self, prompt: list[int], max_new: int) -> tuple[list[int], list[int]]:
        """(new tokens, accepted drafts per round). The prefill forward gives the first token and the features."""
        B = self.block
        logits, feats = self._target(list(prompt), features=True)
        ids = list(prompt) + [int(logits[-1].argmax())]
        accepted: list[int] = []
        while len(ids) - len(prompt) < max_new and ids[-1] != self.eos:
            anchor = len(ids) - 1                                               # the last verified token
            drafts = self.propose(ids, feats, anchor)
            logits, feats = self._target(ids + drafts, features=True)
            post = logits[anchor: anchor + B].argmax(-1).tolist()               # target's argmax after each slot
            n = 0
            while n < B - 1 and drafts[n] == post[n]:
                n += 1
            accepted.append(n)
            ids += drafts[:n] + [post[n]]
            if self.eos in ids[anchor + 1:]:
                ids = ids[: ids.index(self.eos, anchor + 1) + 1]
        return ids[len(prompt):][:max_new], accepted


def held_out_prompts(held, count: int, prompt_tokens: int) -> list[list[int]]:
    """Prompts from the held-out documents: the first `prompt_tokens` tokens, extended to the first loss token
    after them (a chat document is cut where the assistant starts), so the decoder writes what the drafter was
    trained to draft."""
    out = []
    for d in held.docs[:count]:
        p = min(prompt_tokens, len(d) - 1)
        while p < len(d) - 1 and not d.loss[p]:
            p += 1
        if p >= 1:
            out.append(d.ids[:p])
    return out


def measure(dec: Decoder, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """Speculative and target-only greedy decoding of every prompt, side by side: acceptance length, tokens per
    target forward, wall time, and whether the two outputs are identical."""
    accepted: list[int] = []
    spec_tokens = greedy_tokens = 0
    spec_forwards = greedy_forwards = 0
    spec_s = greedy_s = 0.0
    identical = 0
    for p in prompts:
        dec.forwards = 0
        t0 = time.perf_counter()
        out_s, acc = dec.speculative(p, max_new)
        spec_s += time.perf_counter() - t0
        spec_forwards += dec.forwards
        dec.forwards = 0
        t0 = time.perf_counter()
        out_g = dec.greedy(p, max_new)
        greedy_s += time.perf_counter() - t0
        greedy_forwards += dec.forwards
        accepted += acc
        spec_tokens += len(out_s)
        greedy_tokens += len(out_g)
        identical += out_s == out_g
    B = dec.block
    counts = [len(accepted)] + [sum(1 for a in accepted if a >= k) for k in range(1, B)]
    from .metrics import acceptance

    m = acceptance(counts)
    return {"prompts": len(prompts), "rounds": len(accepted), "tau": m["tau"], "slot_accept": m["slot_accept"],
            "tokens": spec_tokens, "tokens_per_target_forward": round(spec_tokens / max(spec_forwards, 1), 4),
            "greedy_tokens_per_target_forward": round(greedy_tokens / max(greedy_forwards, 1), 4),
            "speculative_seconds": round(spec_s, 3), "greedy_seconds": round(greedy_s, 3),
            "speedup": round(greedy_s / spec_s, 3) if spec_s > 0 else None,
            "identical_to_greedy": identical, "block": B}
