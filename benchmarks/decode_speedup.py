"""Speculative decoding against target-only decoding, both with the target's KV cache (train/speculative.py,
`measure`), side by side in one process on the CPU: the trained drafter of a run, greedy and sampled, and beside it
an oracle of the same cost (the drafter runs, then its proposals are replaced by the target's own greedy
continuation: every draft is accepted, tau = B), which is the most this decoder can gain on this machine. Times are
CPU seconds (time.process_time: a shared machine's load stretches wall time, not the CPU a process uses), and the
figures are ratios measured in the same run.

    python -m dflash_graph run graphs/tiny.toml --out /tmp/runs-tiny        # the trained drafter (2-3 min)
    python benchmarks/decode_speedup.py --checkpoint /tmp/runs-tiny         # 16 held-out prompts, 48 new tokens
    python benchmarks/decode_speedup.py --checkpoint /tmp/runs-tiny --prompts 4 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, type=Path, help="a run's --out directory (graphs/tiny.toml's)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7, help="the sampled row's temperature (default 0.7)")
    args = ap.parse_args()

    import torch

    from dflash_graph.cli.evaluate import _plan
    from dflash_graph.train.data import load_data
    from dflash_graph.train.speculative import GREEDY, Decoder, held_out_prompts, measure
    from dflash_graph.train.trained import Trained

    torch.set_num_threads(1)
    plan = _plan(None, [], args.checkpoint)
    spec = plan.typed.ctx.spec
    tr = Trained(plan, args.checkpoint, "cpu")
    _, held = load_data(spec.data, Path(spec.data.get("_base", ".")), 1 << 20, int(spec.train["seed"]),
                        int(tr.dims.vocab_size), spec.loc)
    prompts = held_out_prompts(held, args.prompts, args.prompt_tokens)
    layers, block = tr.dims.target_layer_ids, int(tr.dims.block_size)

    class Oracle(Decoder):
        """The drafter's forward, then the target's greedy continuation in place of its proposals."""

        truths: dict[tuple[int, ...], list[int]] = {}

        def speculative(self, prompt, max_new, sampling=GREEDY, generator=None):
            self._truth, self._start = self.truths[tuple(prompt)], len(prompt)
            return super().speculative(prompt, max_new, sampling, generator)

        def propose(self, ctx, anchor_token, anchor, sampling, generator):
            super().propose(ctx, anchor_token, anchor, sampling, generator)
            i = anchor + 1 - self._start
            return (self._truth[i: i + self.block - 1] + [0] * self.block)[: self.block - 1], None

    dec = Decoder(tr.target, tr.drafter, layers, block, held.eos)
    oracle = Oracle(tr.target, tr.drafter, layers, block, held.eos)
    Oracle.truths = {tuple(p): dec.greedy(p, args.max_new_tokens) for p in prompts}
    rows = [("trained, greedy", dec, 0.0), (f"trained, T={args.temperature}", dec, args.temperature),
            ("oracle (tau = B), greedy", oracle, 0.0)]
    print(f"{spec.name}: {len(prompts)} held-out prompts, up to {args.max_new_tokens} new tokens, block {block}, "
          f"torch {torch.__version__}, 1 thread, CPU seconds")
    print(f"{'drafter':<26} {'tau':>7} {'tok/fwd':>8} {'spec tok/s':>11} {'target tok/s':>13} {'decode x':>9} "
          f"{'whole x':>8} {'lossless':>9}")
    for name, d, t in rows:
        r = measure(d, prompts, args.max_new_tokens, temperature=t, clock=time.process_time)
        print(f"{name:<26} {r['tau']:>7} {r['tokens_per_target_forward']:>8} "
              f"{r['speculative_decode_tokens_per_s']:>11} {r['greedy_decode_tokens_per_s']:>13} {r['decode_speedup']:>9} {r['speedup']:>8} "
              f"{str(r['lossless']):>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
