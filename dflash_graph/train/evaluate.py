"""Held-out evaluation during training: the graph's forward (no gradients) on the held-out split, with the same
loss op, so the held-out tau is computed exactly as the training tau. Anchors come from a generator seeded for
evaluation; the training generator's state is put back afterwards, so evaluating never changes training (or a
resumed run)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .data import PackedData
from .metrics import acceptance


def evaluate(interp, loss_node: str, held: PackedData, batches: int, seed: int = 0) -> dict[str, Any]:
    R = interp.replicas
    saved = interp.generator.get_state()
    interp.generator.manual_seed(seed + 7919)
    losses, accs, counts = [], [], None
    seqs = list(held.sequences(batches * R))
    # the run's memory figures are the training steps': memory.json compares them with check's prediction of a
    # step (NOTE [Held-out evaluation under torchrun] says the same of the evaluation inside a torchrun job)
    untracked = interp.tracker.paused() if interp.tracker is not None else contextlib.nullcontext()
    meter, interp.cuda_meter = interp.cuda_meter, None
    try:
        with torch.no_grad(), untracked:
            for i in range(0, len(seqs), R):
                group = seqs[i:i + R]
                while len(group) < R:          # the last group: repeat its first sequence, counted once
                    group.append(None)
                for r in range(R):
                    if group[r] is None:
                        continue
                    res = interp.run_replica(r, lambda rr: group[rr] if group[rr] is not None else group[0])
                    out = res[loss_node]
                    losses.append(float(out["loss"]))
                    accs.append(out["slot_acc"].float().cpu())
                    c = out["accepted"].double().cpu()
                    counts = c if counts is None else counts + c
                    del res, out
    finally:
        interp.generator.set_state(saved)
        interp.cuda_meter = meter
    acc = torch.stack(accs).mean(0)
    return {"loss": round(sum(losses) / len(losses), 6), "slot_acc": [round(float(a), 4) for a in acc.tolist()],
            "sequences": len(seqs), **acceptance(counts.tolist())}
