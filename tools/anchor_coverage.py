#!/usr/bin/env python3
"""How much of a corpus's loss tokens the anchor rule can score, per block slot: packs a corpus into rows (file
order, whole documents, then padding, as training packs them) and prints, for slot k = 1..B-1, the share of loss
tokens that some eligible anchor scores at slot k (`models/nn/dflash.slot_reach`), then the share never drafted
at slot 1 and the share never scored at any slot. Beside this project's rule it prints the same figures for:

* `inside`: the rule before issue 23 (a block had to lie inside its document);
* `speculators`: speculators 0.9.0, `models/dflash/utils.py:select_anchors` (an anchor is a loss token before the
  row's last B positions) and `models/dflash/core.py:_backbone_forward` (slot k is scored where loss_mask[p+k]);
* `specforge`: SpecForge 0.2.0, `algorithms/common/dflash_family_model.py:_sample_anchor_positions` (loss_mask[p]
  and loss_mask[p+1]) and its loss weights (loss_mask[p+k], p+k inside the row).

The references never look at document boundaries, so their blocks can score the next document's first tokens;
these figures count that as scored. docs/drafter.md quotes the output.

    python tools/anchor_coverage.py [--corpus graphs/tiny/chat.jsonl] [--seq 2048] [--block 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dflash_graph.models.nn.dflash import document_ids, slot_reach  # noqa: E402
from dflash_graph.train.data import load_data  # noqa: E402
from dflash_graph.train.metrics import coverage  # noqa: E402


def _reach_from(anchor_ok: torch.Tensor, scored: torch.Tensor, block: int) -> torch.Tensor:
    """[T, B]: t is scored at slot k when t - k passes `anchor_ok` and `scored[t - k, k]`."""
    t = anchor_ok.numel()
    out = torch.zeros(t, block, dtype=torch.bool)
    for k in range(1, min(block, t)):
        out[k:, k] = anchor_ok[:-k] & scored[:-k, k]
    return out


def _shifted(mask: torch.Tensor, block: int) -> torch.Tensor:
    """[T, B]: mask[p + k] (False past the row)."""
    t = mask.numel()
    out = torch.zeros(t, block, dtype=torch.bool)
    for k in range(block):
        out[: t - k, k] = mask[k:]
    return out


def rules(mask: torch.Tensor, pos: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    t = mask.numel()
    idx = torch.arange(t)
    doc = document_ids(pos)
    ends = torch.cumsum(torch.bincount(doc), 0)[doc]
    nxt = _shifted(mask, block)
    inside = nxt[:, 1] & (idx + 1 < ends) & (idx + block <= ends)
    return {
        "this project": slot_reach(mask, pos, block),
        "inside": _reach_from(inside, nxt, block),
        "speculators": _reach_from(mask & (idx < t - block), nxt, block),
        "specforge": _reach_from(mask & nxt[:, 1] & (idx < t - 1), nxt, block),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="tiny/chat.jsonl", help="relative to graphs/ (default: tiny/chat.jsonl)")
    ap.add_argument("--tokenizer", default="tiny/tokenizer.json")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--block", type=int, default=16)
    a = ap.parse_args(argv)
    data, _ = load_data({"corpus": a.corpus, "tokenizer": a.tokenizer}, ROOT / "graphs", a.seq, 0)
    rows = list(data.sequences())
    totals: dict[str, torch.Tensor] = {}
    n_loss = 0
    for b in rows:
        mask, pos = b["loss_mask"], b["position_ids"]
        n_loss += int(mask.sum())
        for name, reach in rules(mask, pos, a.block).items():
            r = reach & mask[:, None]
            got = torch.cat([r.sum(0), r[:, 1:].any(1).sum()[None]])      # per slot, then at any slot
            totals[name] = totals.get(name, 0) + got
    print(f"{a.corpus}: {len(rows)} rows of {a.seq} tokens, {n_loss} loss tokens, block {a.block}")
    print(f"{'rule':<14} {'never at slot 1':>16} {'never scored':>13}   share scored at slot 1 .. {a.block - 1}")
    for name, got in totals.items():
        c = coverage(got[:-1].tolist(), None, n_loss)
        never1 = 1 - c["slot_reach"][1]
        never = 1 - float(got[-1]) / n_loss
        slots = " ".join(f"{x:.3f}" for x in c["slot_reach"][1:])
        print(f"{name:<14} {never1:>16.2%} {never:>13.2%}   {slots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
