"""What a run tells its user as it goes and at the end: the held-out evaluation every `train.eval_every` steps
(into the step's metrics.jsonl record and onto the console; under torchrun run by one rank, train/heldout.py),
and the closing summary (smoothed loss, held-out tau, tokens/s, predicted and measured memory, where the
checkpoint is; cli/run.py adds the export).

The smoothed loss, the skipped steps and the last evaluation are the run's (train/metrics.py, RunStats, kept in
each checkpoint), so the summary of a resumed run says what the uninterrupted run's would; tokens/s is this
invocation's, and says which steps it averages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..units import fmt_bytes
from .evaluate import evaluate
from .metrics import RunStats


class RunSummary:
    def __init__(self, trainer, stats: RunStats, eval_every: int, eval_batches: int, seed: int):
        self.t, self.stats, self.eval_every, self.eval_batches, self.seed = trainer, stats, eval_every, eval_batches, seed
        self.tps: list[tuple[int, float]] = []       # (step, tokens/s) of the steps this invocation ran
        self.skipped: str | None = None              # why the last evaluation under torchrun did not run

    def update(self, rec: dict[str, Any]) -> None:
        self.tps.append((rec["step"], rec["tokens_per_s"]))

    def maybe_eval(self, step: int, total: int) -> dict[str, Any] | None:
        """The held-out evaluation of `step` when it is due: {"step", loss, tau, ...}, or {"step", "skipped": why}
        when it did not fit beside the target under torchrun. Under torchrun every rank calls this, and one of
        them evaluates (train/heldout.py)."""
        t = self.t
        if not self.eval_every or not (step % self.eval_every == 0 or step == total):
            return None
        if t.comm is not None:
            if t.eval_rank is None:
                return None
            from .heldout import evaluate_under_torchrun

            ev = evaluate_under_torchrun(t, step)
            self.skipped = ev.get("skipped")
            return ev
        if t.held is None:
            return None
        return {"step": step, **evaluate(t.interp, t.loss_node, t.held, self.eval_batches, self.seed)}

    @staticmethod
    def eval_line(ev: dict[str, Any]) -> str:
        acc = " ".join(f"{a:.2f}" if a is not None else "-" for a in ev["slot_accept"])
        return (f"held-out @ step {ev['step']}: loss {ev['loss']:.4f} | tau {ev['tau']} | slot accept {acc} "
                f"({ev['anchors']} anchors, {ev['sequences']} sequences)")

    def _no_eval(self) -> str:
        """Why there is no held-out tau, from what the graph and this run actually have."""
        t = self.t
        holdout = int(t.plan.typed.ctx.spec.data.get("holdout") or 0)
        if t.opts.source is not None:
            return ("a run from the hidden-state cache does not run the target, which held-out evaluation needs; "
                    f"dflash-graph eval GRAPH --checkpoint {t.opts.out} measures tau from the checkpoint")
        if not holdout and not self.eval_every:
            return "set [data] holdout and [train] eval_every"
        if not holdout:
            return "set [data] holdout: the held-out split is empty"
        if not self.eval_every:
            return "set [train] eval_every"
        if self.skipped:
            return self.skipped
        return "no evaluation ran"

    def render(self, step: int, out: Path, memory: dict[str, tuple[int, int | None]]) -> str:
        st = self.stats
        lines = [f"done: {step} steps"]
        if st.skipped:
            few = ", ".join(map(str, st.skipped[:10])) + (", ..." if len(st.skipped) > 10 else "")
            lines.append(f"  skipped: {len(st.skipped)} step(s) with a non-finite loss or gradient norm ({few}); "
                         "see \"skipped\" in metrics.jsonl")
        if st.loss.value is not None:
            lines.append(f"  loss (smoothed): {st.loss.value:.4f}   tau (training, last step): {st.last_tau}")
        if st.last_eval is not None:
            ev = st.last_eval
            lines.append(f"  held-out tau: {ev['tau']} (step {ev['step']}, {ev['anchors']} anchors); "
                         f"held-out loss {ev['loss']:.4f}")
        else:
            lines.append(f"  held-out tau: not measured ({self._no_eval()})")
        if self.tps:
            steady = self.tps[1:] or self.tps          # the first step of an invocation includes one-off warm-up
            a, b = steady[0][0], steady[-1][0]
            since = f", since the resume at step {self.tps[0][0] - 1}" if self.t.start_step else ""
            lines.append(f"  tokens/s: {sum(v for _, v in steady) / len(steady):,.0f} (mean over "
                         f"{f'steps {a}..{b}' if a != b else f'step {a}'}{since})")
        mem = ", ".join(f"{d} {fmt_bytes(p)} predicted" + (f" / {fmt_bytes(m)} measured" if m is not None else "")
                        for d, (p, m) in memory.items())
        lines.append(f"  memory peak: {mem}")
        lines.append(f"  metrics: {out / 'metrics.jsonl'}   memory report: {out / 'memory.json'}")
        lines.append(f"  checkpoint: {out / 'checkpoint'}")
        return "\n".join(lines)
