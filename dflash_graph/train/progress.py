"""Training progress: a rich progress bar on a terminal, plain lines otherwise, optional TensorBoard.

The line shows smoothed values, not one step's: an exponential moving average of the loss and of each slot's
accuracy (bias-corrected as in Adam, so the first steps are not pulled towards 0), and tau, the expected number
of tokens accepted per draft block computed from the smoothed slot accuracies: tau = 1 + sum_k prod_{j<=k} a_j
over the block's predicted slots 1..B-1 (slot 0 is the anchor itself, and the 1 is the token the verifier adds).
This is the acceptance length DFlash reports, under the usual assumption that each slot is accepted
independently given the ones before it are. The averages are the run's (train/metrics.py, RunStats), which
every checkpoint keeps: a resumed run's line goes on from where the interrupted one was.

Plain lines (every `log_every` steps and at the last) are printed when the bar is off (--no-progress), when
stdout is not a terminal, when NO_COLOR is set, or when rich is not installed.
"""

from __future__ import annotations

import os
import sys
import time

from ..units import fmt_bytes
from .metrics import RunStats


class Progress:
    def __init__(self, total: int, stats: RunStats, start: int = 0, bar: bool = True, log_every: int = 1,
                 tensorboard: str | None = None, stream=None):
        self.total, self.start, self.log_every = total, start, max(int(log_every), 1)
        self.stats = stats          # the run's smoothed values: the trainer updates them, this shows them
        self.stream = sys.stdout if stream is None else stream
        self.t0 = time.perf_counter()
        self._bar = None
        if bar and self._rich_ok():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeRemainingColumn

            from rich.console import Console

            # only on a terminal (_rich_ok): a closed pipe cannot reach this console
            self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[line]}"), TimeRemainingColumn(), transient=False,
                                     console=Console(file=self.stream))
            self._task = self._bar.add_task("train", total=total, completed=start, line="")
            self._bar.start()
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:   # tensorboard is an optional package
                from ..errors import GraphError, Location, Problem

                raise GraphError(Problem(f"logging to TensorBoard needs the tensorboard package ({e})",
                                         Location(flag=f"--tensorboard {tensorboard}"),
                                         hint="pip install tensorboard, or run without --tensorboard")) from None
            self.writer = SummaryWriter(tensorboard)

    def _rich_ok(self) -> bool:
        if os.environ.get("NO_COLOR") or not getattr(self.stream, "isatty", lambda: False)():
            return False
        try:
            import rich  # noqa: F401
        except ImportError:
            return False
        return True

    def update(self, rec: dict) -> str:
        """Show one step's metrics record (after self.stats took it); return the line."""
        if rec.get("skipped"):     # a non-finite step: the trainer says so (note); the averages leave it out
            if self._bar is not None:
                self._bar.update(self._task, completed=rec["step"])
            return f"skipped: {rec['skipped']}"
        loss = self.stats.loss.value
        tau = self.stats.tau
        tau = float("nan") if tau is None else tau
        step = rec["step"]
        done = step - self.start
        left = self.total - step
        eta = (time.perf_counter() - self.t0) / max(done, 1) * left
        mem = " ".join(f"{d} {fmt_bytes(b)}" for d, b in rec.get("memory_bytes", {}).items())
        fields = f"loss {loss:.4f} | tau {tau:.2f} | {rec.get('tokens_per_s', 0):,.0f} tok/s" + (f" | {mem}" if mem else "")
        if self._bar is not None:
            self._bar.update(self._task, completed=step, line=fields)
        elif step % self.log_every == 0 or left == 0:
            print(f"step {step}/{self.total} | {fields} | eta {eta:.0f}s", file=self.stream, flush=True)
        if self.writer is not None:
            self.writer.add_scalar("loss/raw", rec["loss"], step)
            self.writer.add_scalar("loss/smoothed", loss, step)
            self.writer.add_scalar("tau/smoothed", tau, step)
            if "acc" in rec:
                self.writer.add_scalar("acc", rec["acc"], step)
            for k in ("lr", "grad_norm", "tokens_per_s"):
                if k in rec:
                    self.writer.add_scalar(k, rec[k], step)
            for d, b in rec.get("memory_bytes", {}).items():
                self.writer.add_scalar(f"memory_gib/{d}", b / 2**30, step)
        return fields

    def note(self, line: str) -> None:
        """A line that must be seen whatever log_every says (a skipped step): above the bar, or on stderr."""
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
