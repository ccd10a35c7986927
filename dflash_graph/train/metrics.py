"""What a step's (or an evaluation's) loss outputs mean to a user: the greedy acceptance length tau and the
per-slot conditional acceptance rate, from the loss op's `accepted` counts (ops/torch_impl.acceptance_counts),
summed over micro-batches and replicas before dividing, so every anchor weighs the same; and what a run carries
from step to step for its user (RunStats: the smoothed loss and tau, the skipped steps, the last evaluation), which
each checkpoint keeps; and the anchors' coverage of the loss tokens, per block slot."""

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


def shares(counts: Sequence[float], total: float) -> list[float | None]:
    """counts[k] / total, rounded to 4 places (None for every entry when total is 0)."""
    return [round(float(c) / total, 4) if total > 0 else None for c in counts]


def coverage(reach: Sequence[float], scored: Sequence[float] | None, loss_tokens: float) -> dict[str, object]:
    """The anchors' coverage of a step's loss tokens, per block slot k (slot 0, the anchor, is never scored):

    * slot_reach[k]: the share of the loss tokens that some eligible anchor scores at slot k
      (models/nn/dflash.slot_reach). 1 - slot_reach[1] is the share never drafted at slot 1, whatever the
      draw: the tokens the drafter never learns to draft first (docs/drafter.md, "Coverage").
    * slot_scored[k]: the share of the loss tokens this step's anchors scored at slot k (`valid` [A, B]
      summed over anchors; the draw and the anchor budget decide it).

    reach, scored: per-slot counts summed over the step's sequences; loss_tokens: their loss tokens."""
    out: dict[str, object] = {"slot_reach": shares(reach, loss_tokens)}
    if scored is not None:
        out["slot_scored"] = shares(scored, loss_tokens)
    return out


SMOOTHING = 0.1     # weight of the newest step in the moving averages (about the last 10 steps)


class Smoothed:
    """Exponential moving average with bias correction as in Adam (what a loss curve's 'smoothed' value usually
    means; the first steps are not pulled towards 0)."""

    def __init__(self, beta: float = 1 - SMOOTHING):
        self.beta, self.avg, self.n = beta, 0.0, 0

    def add(self, x: float) -> float:
        self.n += 1
        self.avg = self.beta * self.avg + (1 - self.beta) * float(x)
        return self.value

    @property
    def value(self) -> float | None:
        return None if self.n == 0 else self.avg / (1 - self.beta ** self.n)


def acceptance_length(slot_acc: Sequence[float]) -> float:
    """tau from per-slot accuracies (slot 0 is the anchor and is skipped): 1 + sum_k prod_{j<=k} a_j."""
    tau, run = 1.0, 1.0
    for a in slot_acc[1:]:
        run *= max(0.0, min(1.0, float(a)))
        tau += run
    return tau


def _num(x: float) -> float | str:
    """A float for state.json: a number (JSON keeps it exactly), or "nan", "inf", "-inf" (strict JSON has no such
    numbers); float() reads both back."""
    x = float(x)
    return x if math.isfinite(x) else repr(x)


class RunStats:
    """What a run carries from step to step besides the model and the optimizer: the smoothed loss and per-slot
    accuracies (the progress line and the closing summary), the steps skipped, the streak of non-finite steps in
    a row that train.max_nonfinite_steps bounds, the last held-out evaluation and the last step's tau. Each
    checkpoint holds it (state.json, "stats"), so a resumed run shows and decides exactly what the uninterrupted
    run would (JSON keeps a float exactly)."""

    def __init__(self):
        self.loss = Smoothed()
        self.slots: list[Smoothed] = []
        self.skipped: list[int] = []
        self.streak: list[tuple[int, str, float, float]] = []   # (step, why, loss, gradient norm) of the skips in a row
        self.last_eval: dict | None = None
        self.last_tau: float | None = None

    def update(self, rec: dict) -> None:
        """Take one step's metrics record (with its "heldout" evaluation, if any)."""
        if rec.get("skipped"):              # NOTE [Non-finite steps]: no loss to smooth
            self.skipped.append(rec["step"])
        else:
            self.loss.add(rec["loss"])
            acc = rec.get("slot_acc") or []
            while len(self.slots) < len(acc):
                self.slots.append(Smoothed(self.loss.beta))
            for s, a in zip(self.slots, acc):
                s.add(a)
        self.last_tau = rec.get("tau")
        if rec.get("heldout"):
            self.last_eval = {"step": rec["step"], **rec["heldout"]}

    @property
    def tau(self) -> float | None:
        """tau from the smoothed slot accuracies."""
        return acceptance_length([s.value for s in self.slots]) if self.slots and self.slots[0].n else None

    def state_dict(self) -> dict:
        return {"beta": _num(self.loss.beta), "loss": [_num(self.loss.avg), self.loss.n],
                "slots": [[_num(s.avg), s.n] for s in self.slots], "skipped": list(self.skipped),
                "streak": [[s, why, _num(lo), _num(g)] for s, why, lo, g in self.streak],
                "last_eval": self.last_eval, "last_tau": self.last_tau}

    def load_state_dict(self, d: dict) -> None:
        beta = float(d["beta"])

        def sm(pair) -> Smoothed:
            s = Smoothed(beta)
            s.avg, s.n = float(pair[0]), int(pair[1])
            return s

        self.loss = sm(d["loss"])
        self.slots = [sm(p) for p in d["slots"]]
        self.skipped = [int(s) for s in d["skipped"]]
        self.streak = [(int(s), str(why), float(lo), float(g)) for s, why, lo, g in d["streak"]]
        self.last_eval, self.last_tau = d.get("last_eval"), d.get("last_tau")


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
