"""What a step's (or an evaluation's) loss outputs mean to a user: the greedy acceptance length tau and the
per-slot conditional acceptance rate, from the loss op's `accepted` counts (ops/torch_impl.acceptance_counts),
summed over micro-batches and replicas before dividing, so every anchor weighs the same."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence


def acceptance(counts: Sequence[float]) -> dict[str, object]:
    """counts[k]: anchors whose slots 1..k were all accepted (counts[0]: anchors). tau = 1 + sum(counts[1:]) /
    counts[0] (tokens per block: the anchor's bonus token plus the accepted drafts); slot_accept[k-1] =
    counts[k] / counts[k-1], the rate at which slot k is accepted given slots 1..k-1 were."""
    n = [float(c) for c in counts]
    if not n or n[0] <= 0:
        return {"tau": None, "slot_accept": [None] * max(len(n) - 1, 0), "anchors": 0}
    cond = [round(n[k] / n[k - 1], 4) if n[k - 1] > 0 else None for k in range(1, len(n))]
    return {"tau": round(1.0 + sum(n[1:]) / n[0], 4), "slot_accept": cond, "anchors": int(n[0])}


class Smoothed:
    """Exponential moving average with bias correction (what a loss curve's 'smoothed' value usually means)."""

    def __init__(self, beta: float = 0.9):
        self.beta, self.avg, self.n = beta, 0.0, 0

    def add(self, x: float) -> float:
        self.n += 1
        self.avg = self.beta * self.avg + (1 - self.beta) * x
        return self.value

    @property
    def value(self) -> float | None:
        return None if self.n == 0 else self.avg / (1 - self.beta ** self.n)


def finite_or_none(obj):
    """obj with every NaN or infinite float replaced by None (nested dicts and lists)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def json_line(rec: dict) -> str:
    """One metrics.jsonl record: strict JSON (a non-finite number is written as null, never as the NaN or Infinity
    tokens that json.dumps writes by default and strict parsers reject)."""
    return json.dumps(finite_or_none(rec), allow_nan=False) + "\n"
