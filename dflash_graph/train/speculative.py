"""Real speculative decoding with the target and a trained drafter, against target-only decoding with the same
KV cache: greedy or sampled verification (train/sampling.py), the graph's block size.

Each round (as z-lab's ``dflash_generate``, z-lab/dflash ``dflash/model.py``): the last verified token is the
anchor, slot 0 of a block whose other B-1 slots hold the mask token; the drafter, attending to its cached context
(the target's captured features of every position before the anchor, projected once into each layer's K/V:
``ContextCache`` in models/nn/dflash.py), proposes B-1 tokens in one forward; the target runs once over the block
``[anchor, drafts]`` on top of its KV cache; verification accepts a prefix of the drafts and gives the next token
(greedy: while each draft is the target's argmax; sampling: the speculative-sampling rule). The target's cache is
then cut back to the anchor and the accepted drafts, and the features of those positions join the drafter's context.
A round yields ``accepted + 1`` tokens for one target forward.

NOTE [The target's cache after a rejection]: attention layers' K/V are cropped (transformers' ``Cache.crop``). A
Gated DeltaNet layer (Qwen3.5) keeps a recurrent state and a convolution window instead, which hold every token the
verify forward saw, rejected drafts included, and cannot be cut. We keep per-position states: the cache records the
recurrent state after each of the block's B tokens and the convolution inputs of the block
(``activate_past_recording(recurrent_states_to_keep=B)``, transformers' ``LinearAttentionLayer``: the verify
forward then runs the block through the step-by-step recurrent kernel, which returns each state), and ``crop`` puts
back the state after the last accepted token. Recording B states, not B-1: with B-1 the first token of the block
runs through the chunked kernel, whose state is not recorded, so a round that accepts no draft would be cut back to
the state before the anchor (measured: wrong logits from then on). Recording starts after the prefill, which then
runs exactly as target-only decoding's. Recomputing from the last accepted position instead would cost a second
target forward in every round with a rejection.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from ..errors import GraphError, Location, Problem
from .sampling import Sampling, draw, verify_greedy, verify_sampling

GREEDY = Sampling()


def check_sampling(temperature: float, top_p: float, seed: int) -> Sampling:
    """The eval flags --temperature, --top-p and --seed, validated: a located error (exit 2) names the flag."""
    for flag, value, ok, want, example in (
            ("--temperature", temperature, math.isfinite(temperature) and temperature >= 0,
             "a finite number >= 0 (0: greedy)", "0.7"),
            ("--top-p", top_p, math.isfinite(top_p) and 0 < top_p <= 1, "a number in (0, 1] (1: no nucleus cut)",
             "0.95"),
            ("--seed", seed, seed >= 0, "an integer >= 0", "0")):
        if not ok:
            raise GraphError(Problem("out of range", Location(flag=f"{flag} {value}"), expected=want,
                                     actual=str(value), hint=f"e.g. {flag} {example}"))
    return Sampling(temperature, top_p)


class Decoder:
    """The target (its arch's transformers causal LM), its final norm and lm_head, and the drafter (DFlashDrafter).
    ``forwards`` counts the target's forwards (prefill included) since it was last set to 0."""

    def __init__(self, target, drafter, layer_ids, block: int, eos: int | None):
        from ..models.nn.target import final_norm, lm_head

        self.target, self.drafter = target, drafter
        self.norm, self.head = final_norm(target), lm_head(target)
        # the drafter's own final norm where it trained one, else the target's (the graph's `norm` node either way)
        own = getattr(drafter, "norm", None)
        self.draft_norm = self.norm if own is None else own
        self.layer_ids, self.block, self.eos = list(layer_ids), block, eos
        self.forwards = 0
        self.prefill_seconds = 0.0              # of the last decode: the prompt's forward, before the first token
        self.clock = time.perf_counter
        # Gated DeltaNet (linear attention) layers: their state is recorded per position to be cut back
        self.recurrent = "linear_attention" in (getattr(target.config, "layer_types", None) or ())
        params = inspect.signature(target.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"    # transformers >= 5.2x: `cache`

    # ------------------------------------------------------------------ the target, cached
    def new_cache(self):
        """The target's own cache (``DynamicCache`` with its config: attention layers, and Gated DeltaNet layers
        for Qwen3.5)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.target.config)

    def _start_recording(self, cache) -> None:
        """Make ``cache`` croppable after a verify forward (NOTE [The target's cache after a rejection])."""
        if not self.recurrent:
            return
        if not hasattr(cache, "activate_past_recording"):
            raise RuntimeError("this transformers cannot roll a Gated DeltaNet state back after a rejected draft; "
                               "speculative decoding of a Qwen3.5 target needs transformers >= 5.25")
        cache.activate_past_recording(recurrent_states_to_keep=self.block)

    def _cut(self, cache, rejected: int) -> None:
        """Remove the last ``rejected`` tokens from the cache. With recorded states a crop of 0 is still needed: it
        drops the recorded history and trims the convolution window back to its kernel."""
        if rejected or self.recurrent:
            cache.crop(-rejected)

    def _target(self, ids: list[int], start: int, cache, features: bool, last_only: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """Logits [T, V] (the last row only with ``last_only``) of tokens ``ids`` at positions start.., after the
        cached ones, and their captured features [T, n*H] (the drafter's context) when ``features``."""
        dev = self.head.weight.device
        layers = self.target.model.layers
        got: dict[int, Tensor] = {}

        def hook(i):
            def f(_m, _a, out):
                got[i] = (out[0] if isinstance(out, tuple) else out)[0]
            return f

        handles = [layers[i].register_forward_hook(hook(i)) for i in self.layer_ids] if features else []
        try:
            x = torch.tensor([ids], dtype=torch.int64, device=dev)
            out = self.target(input_ids=x, position_ids=torch.arange(start, start + len(ids), device=dev)[None],
                              use_cache=True, logits_to_keep=1 if last_only else 0, **{self._cache_kw: cache})
        finally:
            for h in handles:
                h.remove()
        self.forwards += 1
        feats = torch.cat([got[i] for i in self.layer_ids], -1) if features else None
        return out.logits[0], feats

    # ------------------------------------------------------------------ the drafter, cached
    def propose(self, ctx, anchor_token: int, anchor: int, sampling: Sampling,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        """The drafter's B-1 proposals after the anchor (at position ``anchor``), from its context cache ``ctx``
        (every position before the anchor): the argmax of each slot, or a draw from each slot's q (returned too)."""
        h = self.drafter.block_hidden(ctx, anchor_token, anchor)                   # [B, H]
        logits = self.head(self.draft_norm(h[1:]))                                # [B-1, V]
        if sampling.greedy:
            return logits.argmax(-1).tolist(), None
        q = sampling.probs(logits)
        return draw(q, generator).tolist(), q

    # ------------------------------------------------------------------ the two decoders
    def _pick(self, logits: Tensor, sampling: Sampling, generator) -> int:
        return int(logits.argmax()) if sampling.greedy else int(draw(sampling.probs(logits), generator))

    @torch.no_grad()
    def target_only(self, prompt: list[int], max_new: int, sampling: Sampling = GREEDY,
                    generator: torch.Generator | None = None) -> list[int]:
        """Target-only decoding with the KV cache: the prompt's forward, then one forward per token."""
        cache = self.new_cache()
        t0 = self.clock()
        logits, _ = self._target(list(prompt), 0, cache, False, last_only=True)
        ids = list(prompt) + [self._pick(logits[-1], sampling, generator)]
        self.prefill_seconds = self.clock() - t0
        while len(ids) - len(prompt) < max_new and ids[-1] != self.eos:
            logits, _ = self._target(ids[-1:], len(ids) - 1, cache, False)
            ids.append(self._pick(logits[-1], sampling, generator))
        return ids[len(prompt):]

    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        """Target-only greedy decoding."""
        return self.target_only(prompt, max_new)

    @torch.no_grad()
    def speculative(self, prompt: list[int], max_new: int, sampling: Sampling = GREEDY,
                    generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
        """(new tokens, accepted drafts per round). The prefill forward gives the first token and the context."""
        B = self.block
        cache, ctx = self.new_cache(), self.drafter.new_cache()
        t0 = self.clock()
        logits, feats = self._target(list(prompt), 0, cache, True, last_only=True)
        ids = list(prompt) + [self._pick(logits[-1], sampling, generator)]
        self.prefill_seconds = self.clock() - t0
        self._start_recording(cache)
        dev = feats.device
        new_pos = torch.arange(len(prompt), device=dev)               # positions whose features join the context
        accepted: list[int] = []
        while len(ids) - len(prompt) < max_new and ids[-1] != self.eos:
            anchor = len(ids) - 1                                     # the last verified token, not yet in any cache
            self.drafter.extend_context(ctx, feats, new_pos)
            drafts, q = self.propose(ctx, ids[anchor], anchor, sampling, generator)
            logits, feats = self._target([ids[anchor], *drafts], anchor, cache, True)   # [B, V], [B, n*H]
            if sampling.greedy:
                n, nxt = verify_greedy(drafts, logits)
            else:
                n, nxt = verify_sampling(torch.tensor(drafts, device=dev), sampling.probs(logits), q, generator)
            accepted.append(n)
            ids += drafts[:n] + [nxt]
            self._cut(cache, B - 1 - n)                               # keep the anchor and the accepted drafts
            feats, new_pos = feats[: n + 1], torch.arange(anchor, anchor + n + 1, device=dev)
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


def _rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 2) if seconds > 0 else None


class Turns(Protocol):
    """A prompt asked over several turns (train/bench.py's ``Chat``): ``ids(answers)`` is the prompt of turn
    len(answers) + 1 after the token ids decoded for the earlier turns."""
    turns: int

    def ids(self, answers: Sequence[Sequence[int]]) -> list[int]: ...


def _asked(item: Sequence[int] | Turns) -> tuple[int, Callable[[list[list[int]]], list[int]]]:
    """(turns, the prompt of the next turn given the earlier answers) of a prompt (token ids: one turn) or a
    dialogue."""
    if isinstance(item, (list, tuple)):
        return 1, lambda _answers: list(item)
    return item.turns, item.ids


def measure(dec: Decoder, prompts: Sequence[Sequence[int] | Turns], max_new: int, temperature: float = 0.0,
            top_p: float = 1.0, seed: int = 0, clock=time.perf_counter) -> dict[str, Any]:
    """Speculative and target-only decoding of every prompt, side by side, both with the target's KV cache:
    acceptance length, tokens per target forward, wall time and decode tokens/s, and losslessness.

    A prompt is token ids (one turn) or a dialogue (``Turns``): its turns are decoded in order, each side asking
    turn k + 1 after the answer it decoded itself for turn k (train/bench.py, NOTE [Multi-turn]); every figure
    counts every turn. Greedy decoding is lossless, so both sides ask the same turn k + 1 (asserted while their
    answers are equal); if their answers to turn k differ, that is reported in ``divergences`` ({"prompt",
    "turn"}, 1-based turn) and each side goes on with its own conversation, whose later turns do not count as
    identical. Sampled, each side always goes on with its own.

    ``greedy_*`` keys are target-only decoding's (greedy at temperature 0, sampled above). Prompt i is decoded by
    both with generators seeded ``seed + i`` (one per side, through its turns). ``turns``: the decodes per side.
    ``lossless``: at temperature 0, every turn's output equals target-only greedy decoding
    (``identical_to_greedy`` of ``turns``); above it, None: sampled outputs are equal to target-only sampling only
    in distribution, not token for token (the two consume the generator differently), so there is nothing to
    compare per prompt; the chi-square test in tests/test_speculative.py is the proof. ``lossless_per_prompt``:
    each prompt's turns all identical. ``*_decode_tokens_per_s``: tokens after the first of each turn over the time
    after each turn's prompt forward; ``decode_speedup``: their ratio; ``speedup``: the whole decodes' wall times'
    ratio. ``clock``: what times them (wall time; benchmarks/decode_speedup.py passes ``time.process_time``,
    steadier on a shared CPU)."""
    sampling = Sampling(temperature, top_p)
    dev = dec.head.weight.device
    dec.clock = clock
    accepted: list[int] = []
    spec_tokens = tgt_tokens = spec_forwards = tgt_forwards = decodes = identical = 0
    spec_s = tgt_s = spec_decode_s = tgt_decode_s = 0.0
    same: list[bool | None] = []
    divergences: list[dict[str, int]] = []
    for i, item in enumerate(prompts):
        turns, ask = _asked(item)
        gen_s, gen_t = torch.Generator(dev).manual_seed(seed + i), torch.Generator(dev).manual_seed(seed + i)
        answers_s: list[list[int]] = []
        answers_t: list[list[int]] = []
        agree = True                                  # greedy: every answer so far equal on both sides
        for k in range(turns):
            p_s, p_t = ask(answers_s), ask(answers_t)
            if sampling.greedy and agree and p_s != p_t:
                raise AssertionError(f"prompt {i}, turn {k + 1}: equal answers rendered as different prompts")
            dec.forwards = 0
            t0 = clock()
            out_s, acc = dec.speculative(p_s, max_new, sampling, gen_s)
            spec_s += (dt := clock() - t0)
            spec_decode_s += dt - dec.prefill_seconds
            spec_forwards += dec.forwards
            dec.forwards = 0
            t0 = clock()
            out_t = dec.target_only(p_t, max_new, sampling, gen_t)
            tgt_s += (dt := clock() - t0)
            tgt_decode_s += dt - dec.prefill_seconds
            tgt_forwards += dec.forwards
            accepted += acc
            spec_tokens += len(out_s)
            tgt_tokens += len(out_t)
            decodes += 1
            answers_s.append(out_s)
            answers_t.append(out_t)
            if sampling.greedy and agree:
                if out_s == out_t:
                    identical += 1
                else:
                    agree = False
                    divergences.append({"prompt": i, "turn": k + 1})
        same.append(agree if sampling.greedy else None)
    B = dec.block
    counts = [len(accepted)] + [sum(1 for a in accepted if a >= k) for k in range(1, B)]
    from .metrics import acceptance

    m = acceptance(counts)
    spec_rate = _rate(spec_tokens - decodes, spec_decode_s)
    tgt_rate = _rate(tgt_tokens - decodes, tgt_decode_s)
    return {"prompts": len(prompts), "turns": decodes, "rounds": len(accepted), "tau": m["tau"],
            "slot_accept": m["slot_accept"],
            "tokens": spec_tokens, "tokens_per_target_forward": round(spec_tokens / max(spec_forwards, 1), 4),
            "greedy_tokens_per_target_forward": round(tgt_tokens / max(tgt_forwards, 1), 4),
            "speculative_seconds": round(spec_s, 3), "greedy_seconds": round(tgt_s, 3),
            "speedup": round(tgt_s / spec_s, 3) if spec_s > 0 else None,
            "speculative_decode_tokens_per_s": spec_rate, "greedy_decode_tokens_per_s": tgt_rate,
            "decode_speedup": round(spec_rate / tgt_rate, 3) if spec_rate and tgt_rate else None,
            "identical_to_greedy": identical if sampling.greedy else None,
            "lossless": (identical == decodes) if sampling.greedy else None, "lossless_per_prompt": same,
            "divergences": divergences,
            "temperature": temperature, "top_p": top_p, "seed": seed, "kv_cache": True, "block": B}
