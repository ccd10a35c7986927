"""ce's work on one chunk of drafter logits, past the GEMMs, two ways side by side in one process (one thread):

    before  log_softmax, the loss gathered from it, argmax for the hit, exp in place for the gradient
            (ops/torch_impl._score_chunk until the fused op stopped making slot 0)
    now     one max over the raw logits (value and index: the hit and log-sum-exp's anchor), one softmax, the
            loss as s[m] - log p[m] - s[y] (ops/torch_impl._ce_rows); the gradient is p itself

Both give the same losses (printed: the largest difference) and hits, and leave p = softmax(s) for the gradient.

    python benchmarks/ce_chunk_kernels.py [--rows 120] [--vocab 32000] [--repeats 20]

Time: process CPU time (time.process_time) of each way over `--repeats` chunks, the rounds interleaved; the
median per way and the ratio now / before. Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_graph.ops.torch_impl import _ce_rows  # noqa: E402


def before(s: torch.Tensor, y: torch.Tensor):
    ls = F.log_softmax(s, dim=-1)
    rows = -ls.gather(-1, y[:, None]).squeeze(-1)
    hit = s.argmax(-1) == y
    return rows, hit, ls.exp_()


def now(s: torch.Tensor, y: torch.Tensor):
    rows = torch.empty(s.shape[0], dtype=s.dtype)
    hit = torch.empty(s.shape[0], dtype=torch.bool)
    p = _ce_rows(s, y, rows, hit)
    return rows, hit, p


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=120, help="rows per chunk (h512's: 8 blocks of 15 scored slots)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    s = torch.randn(a.rows, a.vocab, generator=g) * 3.0
    y = torch.randint(0, a.vocab, (a.rows,), generator=g)
    rb, hb, pb = before(s, y)
    rn, hn, pn = now(s, y)
    assert torch.equal(hb, hn)
    diff = {"loss": float((rb - rn).abs().max()), "softmax": float((pb - pn).abs().max())}
    ways = {"before": before, "now": now}
    times = {w: [] for w in ways}
    for r in range(a.repeats):
        for w in (("before", "now") if r % 2 == 0 else ("now", "before")):
            t0 = time.process_time()
            ways[w](s, y)
            times[w].append(time.process_time() - t0)
    med = {w: statistics.median(t) for w, t in times.items()}
    print(f"ce on one chunk [{a.rows}, {a.vocab}] fp32, one thread, median of {a.repeats}: "
          f"before {med['before'] * 1e3:.2f} ms, now {med['now'] * 1e3:.2f} ms, now / before "
          f"{med['now'] / med['before']:.3f}; largest difference: loss {diff['loss']:.1e}, softmax "
          f"{diff['softmax']:.1e}; hits equal")
    return {"median_s": med, "ratio": med["now"] / med["before"], "max_diff": diff}


if __name__ == "__main__":
    main()
