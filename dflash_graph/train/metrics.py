"""What a step's (or an evaluation's) loss outputs mean to a user: the greedy acceptance length tau and the
per-slot conditional acceptance rate, from the loss op's `accepted` counts (ops/torch_impl.acceptance_counts),
summed over micro-batches and replicas before dividing, so every anchor weighs the same."""

from __future__ import annotations

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
