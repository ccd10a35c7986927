"""The training loop: data -> interpreter (forward per replica, backward) -> AdamW with warmup and clipping,
gradient accumulation, metrics, memory report, checkpoints, Ctrl-C safe."""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from ..exec.devices import torch_devices
from ..exec.interpreter import Interpreter
from ..exec.models import ModelStore
from ..ops import registry
from ..rewrite.pipeline import Plan
from ..units import fmt_bytes
from . import checkpoint
from .data import PackedData


@attrs.define
class RunOptions:
    out: Path
    steps: int | None = None
    resume: Path | None = None
    device_map: list[tuple[str, str]] = attrs.Factory(list)
    strict: bool = False
    progress: bool = True
    track_memory: bool = True


def _lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        t = (step - warmup) / max(total - warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return f


class Trainer:
    def __init__(self, plan: Plan, opts: RunOptions):
        self.plan, self.opts = plan, opts
        typed = plan.typed
        spec = typed.ctx.spec
        self.cfg = dict(spec.train)
        self.steps = opts.steps if opts.steps is not None else int(self.cfg["steps"])
        self.tdev = torch_devices(spec, opts.device_map)
        seed = int(self.cfg["seed"])
        torch.manual_seed(seed)
        self.store = ModelStore(typed, self.tdev, seed)
        self.store.preload()
        self.interp = Interpreter(typed, self.store, self.tdev, strict=opts.strict, seed=seed,
                                  track_memory=opts.track_memory and not any(t.startswith("cuda") for t in self.tdev.values()))
        self.params = self.store.trainable_parameters()
        if not self.params:
            from ..errors import GraphError, Problem
            raise GraphError(Problem("nothing to train: no node uses a trainable model", spec.loc("models"),
                                     hint="set trainable = true on the drafter model"))
        betas = tuple(self.cfg["betas"])
        # NOTE [Trainable memory] (analysis/memory.py): AdamW steps fp32 masters; a non-fp32 module gets its
        # weights copied back after each step
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=float(self.cfg["lr"]), betas=betas,
                                     weight_decay=float(self.cfg["weight_decay"]))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr_lambda(int(self.cfg["warmup_steps"]), self.steps))
        base = Path(spec.data.get("_base", "."))
        if "corpus" not in spec.data:
            from ..errors import GraphError, Problem
            raise GraphError(Problem("the graph has no [data] section", spec.loc(),
                                     hint='[data]\ncorpus = "tiny/corpus.jsonl"\ntokenizer = "tiny/tokenizer.json"'))
        seq = self._seq_len()
        self.data = PackedData(base / spec.data["corpus"], base / spec.data["tokenizer"], seq,
                               spec.data.get("text_key", "text"), seed)
        self.loss_node = next(n.id for n in typed.graph.nodes     # the loss op, or the fused op that replaced it
                              if registry.get(n.op).traits.sink and "loss" in typed.outputs_of(n.id))
        self.start_step = 0
        if opts.resume is not None:
            state, ck = checkpoint.load(opts.resume)
            checkpoint.restore(ck, self.store.drafters, self.opt, self.sched, self.interp.generator, self.masters)
            self.data.load_state(state["data"])
            self.start_step = int(state["step"])
        self.tokens_per_step = seq * self.interp.replicas * int(self.cfg["grad_accum"])

    def _seq_len(self) -> int:
        typed = self.plan.typed
        n = next(n for n in typed.graph.nodes if n.op == "token_input")
        return typed.outputs_of(n.id)["input_ids"].sizes[0]

    # -- one step ----------------------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        accum = int(self.cfg["grad_accum"])
        R = self.interp.replicas
        losses, accs = [], []
        for _ in range(accum):
            batches = [self.data.next_batch() for _ in range(R)]
            for r in range(R):
                res = self.interp.run_replica(r, lambda rr: batches[rr])
                out = res[self.loss_node]
                with self.interp.window(r, "backward"):
                    (out["loss"] / (R * accum)).backward()
                losses.append(float(out["loss"].detach()))
                accs.append(out["slot_acc"].detach().float().cpu())
                del res, out
        tr = self.interp.tracker
        if tr is not None:
            tr.charge(self.interp._backward_device(0), "optimizer")
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.masters, float(self.cfg["grad_clip"])))
        with self.interp.window(0, "optimizer"):
            self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)
                    p.grad = None
        acc = torch.stack(accs).mean(0)
        return {"loss": sum(losses) / len(losses), "slot_acc": [round(float(a), 4) for a in acc.tolist()],
                "grad_norm": gnorm, "lr": self.sched.get_last_lr()[0]}

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        out = self.opts.out
        out.mkdir(parents=True, exist_ok=True)
        metrics_path = out / "metrics.jsonl"
        mode = "a" if self.opts.resume is not None and metrics_path.exists() else "w"
        if mode == "a":   # lines past the checkpoint (a hard stop) are dropped: the resumed run writes them again
            kept = [ln for ln in metrics_path.read_text().splitlines() if ln.strip()
                    and json.loads(ln).get("step", 0) <= self.start_step]
            metrics_path.write_text("".join(ln + "\n" for ln in kept))
        tr = self.interp.tracker
        cuda = sorted({t for t in self.tdev.values() if t.startswith("cuda")})
        for d in cuda:
            torch.cuda.reset_peak_memory_stats(d)
        ck_every = int(self.cfg["checkpoint_every"])
        step = self.start_step
        t_start = time.perf_counter()
        interrupted = hard_stop = False
        # Ctrl-C asks to stop: the step in flight finishes (an optimizer step is never left half done), then a
        # checkpoint is saved. A second Ctrl-C stops at once and keeps the previous checkpoint.
        stop = {"requested": False}

        def on_sigint(signum, frame):
            if stop["requested"]:
                raise KeyboardInterrupt
            stop["requested"] = True
            print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)

        old_handler = None
        if threading.current_thread() is threading.main_thread():
            old_handler = signal.signal(signal.SIGINT, on_sigint)
        if tr is not None:
            tr.__enter__()
            self.interp.charge_weights()
        try:
            with open(metrics_path, mode) as mf:
                while step < self.steps:
                    t0 = time.perf_counter()
                    m = self.step()
                    dt = time.perf_counter() - t0
                    step += 1
                    rec = {"step": step, "loss": round(m["loss"], 6), "tokens_per_s": round(self.tokens_per_step / dt, 1),
                           "slot_acc": m["slot_acc"], "acc": round(sum(m["slot_acc"][1:]) / max(len(m["slot_acc"]) - 1, 1), 4),
                           "lr": m["lr"], "grad_norm": round(m["grad_norm"], 4), "step_seconds": round(dt, 4),
                           "memory_bytes": self._memory_now()}
                    mf.write(json.dumps(rec) + "\n")
                    mf.flush()
                    self._progress(rec, t_start)
                    if stop["requested"]:
                        interrupted = True
                        break
                    if ck_every and step % ck_every == 0 and step < self.steps:
                        self._save(step)
        except KeyboardInterrupt:
            interrupted = hard_stop = True
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            if tr is not None:
                tr.__exit__(None, None, None)
        if self.opts.progress and sys.stdout.isatty():
            print()
        if hard_stop:
            print(f"stopped during step {step + 1}: kept the last saved checkpoint in {out / 'checkpoint'} (if any); "
                  f"continue with --resume {out}", file=sys.stderr)
            return 130
        self._save(step)
        self._write_memory()
        if interrupted:
            print(f"interrupted: checkpoint of step {step} saved to {out / 'checkpoint'}; continue with --resume {out}",
                  file=sys.stderr)
            return 130
        print(f"done: {step} steps; metrics in {metrics_path}, memory report in {out / 'memory.json'}, "
              f"checkpoint in {out / 'checkpoint'}")
        return 0

    def _save(self, step: int) -> None:
        checkpoint.save(self.opts.out, step, self.store.drafters, self.opt, self.sched, self.data.state(),
                        self.interp.generator, {"graph": self.plan.typed.ctx.spec.name}, self.masters)

    def _memory_now(self) -> dict[str, int]:
        tr = self.interp.tracker
        if tr is not None:
            return {d: int(tr.peak[d]) for d in self.plan.typed.ctx.spec.devices}
        cm = self.interp.cuda_meter
        if cm is not None:
            return {d: int(cm.device_peak.get(d, (0, 0))[0]) for d, t in self.tdev.items() if t.startswith("cuda")}
        return {d: int(torch.cuda.max_memory_allocated(t)) for d, t in self.tdev.items() if t.startswith("cuda")}

    def _progress(self, rec: dict, t_start: float) -> None:
        done = rec["step"] - self.start_step
        left = self.steps - rec["step"]
        eta = (time.perf_counter() - t_start) / max(done, 1) * left
        mem = " ".join(f"{d} {fmt_bytes(b)}" for d, b in rec["memory_bytes"].items())
        width = 20
        filled = int(width * rec["step"] / max(self.steps, 1))
        bar = "#" * filled + "." * (width - filled)
        line = (f"[{bar}] step {rec['step']}/{self.steps} | loss {rec['loss']:.4f} | acc {rec['acc']:.3f} | "
                f"{rec['tokens_per_s']:,.0f} tok/s | {mem} | eta {eta:.0f}s")
        if self.opts.progress and sys.stdout.isatty():
            print("\r" + line, end="", flush=True)
        elif rec["step"] % int(self.cfg["log_every"]) == 0 or left == 0:
            print(line, flush=True)

    def _write_memory(self) -> None:
        mem = self.plan.memory
        tr = self.interp.tracker
        out: dict[str, Any] = {"graph": self.plan.typed.ctx.spec.name, "rewritten": self.plan.rewritten,
                               "measured_with": "torch.cuda.max_memory_allocated/reserved" if tr is None else
                               "live tensor storages per logical device (exec/memtrack.py, as torch's MemTracker)",
                               "devices": {}, "nodes": {}}
        for name, d in mem.devices.items():
            tdev = self.tdev[name]
            rec = {"torch": tdev, "predicted_peak_bytes": d.live_peak_bytes if tr is not None else d.peak_bytes,
                   "predicted_peak_node": d.peak_node}
            if tr is not None:
                rec["measured_peak_bytes"] = int(tr.peak[name])
            elif tdev.startswith("cuda"):
                peaks = self.interp.cuda_meter.device_peak.get(name) if self.interp.cuda_meter else None
                rec["measured_peak_bytes"] = int(peaks[0] if peaks else torch.cuda.max_memory_allocated(tdev))
                rec["predicted_reserved_bytes"] = d.reserved_peak_bytes
                rec["measured_reserved_bytes"] = int(peaks[1] if peaks else torch.cuda.max_memory_reserved(tdev))
                free, total = torch.cuda.mem_get_info(tdev)
                rec["assumed_outside_allocator_bytes"] = d.capacity_bytes - d.usable_bytes
                rec["measured_outside_allocator_bytes"] = int(total - free - torch.cuda.memory_reserved(tdev))
                if rec["predicted_reserved_bytes"]:
                    rec["reserved_ratio"] = round(rec["measured_reserved_bytes"] / rec["predicted_reserved_bytes"], 4)
            if rec.get("measured_peak_bytes"):
                rec["ratio"] = round(rec["measured_peak_bytes"] / max(rec["predicted_peak_bytes"], 1), 4)
            out["devices"][name] = rec
        if tr is not None:
            for name, d in mem.devices.items():
                for node, pred in d.node_peaks.items():
                    if node in tr.node_peak and node in self.plan.typed.graph:
                        out["nodes"].setdefault(node, {})[name] = {"predicted_peak_bytes": pred,
                                                                   "measured_peak_bytes": int(tr.node_peak[node])}
        cm = self.interp.cuda_meter
        if cm is not None:
            # per node on CUDA: the allocator's own peaks in a window around the node (see exec/memtrack.py)
            for name, d in mem.devices.items():
                for node, pred in d.node_peaks.items():
                    if node in cm.node_peak and node in self.plan.typed.graph:
                        a, r = cm.node_peak[node]
                        out["nodes"].setdefault(node, {})[name] = {"predicted_peak_bytes": pred,
                                                                   "measured_peak_bytes": int(a),
                                                                   "measured_reserved_bytes": int(r)}
        (self.opts.out / "memory.json").write_text(json.dumps(out, indent=2))
