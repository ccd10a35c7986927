"""What a run tells its user as it goes and at the end: the held-out evaluation every `train.eval_every` steps
(into the step's metrics.jsonl record and onto the console), and the closing summary (smoothed loss, held-out
tau, tokens/s, predicted and measured memory, where the checkpoint is; cli/run.py adds the export)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..units import fmt_bytes
from .evaluate import evaluate
from .metrics import Smoothed


class RunSummary:
    def __init__(self, trainer, eval_every: int, eval_batches: int, seed: int):
        self.t, self.eval_every, self.eval_batches, self.seed = trainer, eval_every, eval_batches, seed
        self.loss = Smoothed()
        self.tps: list[float] = []
        self.last_eval: dict[str, Any] | None = None
        self.last_tau: float | None = None
        self.skipped: list[int] = []

    def update(self, rec: dict[str, Any]) -> None:
        if rec.get("skipped"):                # NOTE [Non-finite steps]: no loss to smooth
            self.skipped.append(rec["step"])
        else:
            self.loss.add(rec["loss"])
        self.tps.append(rec["tokens_per_s"])
        self.last_tau = rec.get("tau")

    def maybe_eval(self, step: int, total: int) -> dict[str, Any] | None:
        t = self.t
        if t.held is None or not self.eval_every or not (step % self.eval_every == 0 or step == total):
            return None
        self.last_eval = {"step": step, **evaluate(t.interp, t.loss_node, t.held, self.eval_batches, self.seed)}
        return self.last_eval

    @staticmethod
    def eval_line(ev: dict[str, Any]) -> str:
        acc = " ".join(f"{a:.2f}" if a is not None else "-" for a in ev["slot_accept"])
        return (f"held-out @ step {ev['step']}: loss {ev['loss']:.4f} | tau {ev['tau']} | slot accept {acc} "
                f"({ev['anchors']} anchors, {ev['sequences']} sequences)")

    def render(self, step: int, out: Path, memory: dict[str, tuple[int, int | None]]) -> str:
        steady = self.tps[1:] or self.tps          # step 1 includes one-off warm-up
        lines = [f"done: {step} steps"]
        if self.skipped:
            few = ", ".join(map(str, self.skipped[:10])) + (", ..." if len(self.skipped) > 10 else "")
            lines.append(f"  skipped: {len(self.skipped)} step(s) with a non-finite loss or gradient norm ({few}); "
                         "see \"skipped\" in metrics.jsonl")
        if self.loss.value is not None:
            lines.append(f"  loss (smoothed): {self.loss.value:.4f}   tau (training, last step): {self.last_tau}")
        if self.last_eval is not None:
            ev = self.last_eval
            lines.append(f"  held-out tau: {ev['tau']} (step {ev['step']}, {ev['anchors']} anchors); "
                         f"held-out loss {ev['loss']:.4f}")
        else:
            lines.append("  held-out tau: not measured (set [data] holdout and [train] eval_every)")
        if steady:
            lines.append(f"  tokens/s: {sum(steady) / len(steady):,.0f} (mean over steps{' 2..' if len(self.tps) > 1 else ' '}"
                         f"{len(self.tps) if len(self.tps) > 1 else ''})")
        mem = ", ".join(f"{d} {fmt_bytes(p)} predicted" + (f" / {fmt_bytes(m)} measured" if m is not None else "")
                        for d, (p, m) in memory.items())
        lines.append(f"  memory peak: {mem}")
        lines.append(f"  metrics: {out / 'metrics.jsonl'}   memory report: {out / 'memory.json'}")
        lines.append(f"  checkpoint: {out / 'checkpoint'}")
        return "\n".join(lines)
