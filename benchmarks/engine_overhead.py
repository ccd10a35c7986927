"""Engine overhead: the same tiny training step through the dflash_graph engine and as hand-written PyTorch.

    python benchmarks/engine_overhead.py                      # graphs/tiny.toml, 30 timed steps of each path
    python benchmarks/engine_overhead.py --steps 60 --threads 1 --json runs/engine_overhead.json
    python benchmarks/engine_overhead.py --profile 20         # + cProfile of 20 more steps of each path

Engine path: exactly what `dflash-graph run GRAPH --without-rule fuse_heads_into_loss` runs: compile_graph (load ->
infer -> rewrite -> memory) ->
Trainer(plan, RunOptions(track_memory=False, progress=False)) -> Trainer.step().

Hand path: a plain PyTorch training step doing the same math with the same modules and data: the Trainer's frozen
target (shared, read-only), a second drafter with the same initial weights and its own AdamW + LR schedule, a copy
of the Trainer's PackedData taken before any step, and its own torch.Generator seeded as the Interpreter's, so both
paths draw the same batches and the same anchors and train identically. Per replica: target body under no_grad
capturing the hooked layers, concat, anchor sampling, gather of the last hidden state at (block position - 1) mod T,
the target's final norm + lm_head on the gathered rows, the drafter, the (shared) norm + lm_head, the decayed
per-slot loss, backward; then clip, AdamW step, LR step, zero_grad.

The paths are checked to give the same loss on the first step (and every later one: both train identically), then
timed interleaved (engine, hand, engine, hand, ...) with time.perf_counter after a warmup. Peak live bytes of one
step of each path are measured afterwards in separate, untimed passes with dflash_graph.exec.memtrack.LiveTracker
(a TorchDispatchMode counting every new tensor storage until it dies, as torch's MemTracker does).

Not a timed test: tests/test_benchmark_smoke.py only checks that it runs and that the two losses agree.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GRAPH = str(ROOT / "graphs" / "tiny.toml")


# --------------------------------------------------------------------------- the engine path
def build_engine(graph: str, overrides: list[str], out: Path):
    """What `dflash-graph run GRAPH` builds (cli/run.py), minus the printing."""
    from dflash_graph.rewrite.pipeline import compile_graph
    from dflash_graph.train.trainer import RunOptions, Trainer

    # without fuse_heads_into_loss: the hand-written step below is the unfused verifier path (heads, then the
    # loss); benchmarks/verifier_path.py compares the fused node with it
    plan = compile_graph(graph, overrides, rewrite=True, rules_off=("fuse_heads_into_loss",))
    return Trainer(plan, RunOptions(out=out, track_memory=False, progress=False))


# --------------------------------------------------------------------------- the hand-written path
class HandStep:
    """A hand-written training step with the same math as the engine's plan of graphs/tiny.toml.

    Constants (sequence length, anchors, block, captured layers, loss kind and gamma, optimizer settings) are read
    from the engine's plan once, here; nothing of the engine runs in `step`."""

    def __init__(self, trainer):
        from dflash_graph.models.nn.dflash import DFlashDrafter
        from dflash_graph.models.nn.target import final_norm, lm_head
        from dflash_graph.ops.torch_impl import slot_weights
        from dflash_graph.train.trainer import _lr_lambda

        interp, store, cfg = trainer.interp, trainer.store, trainer.cfg
        typed = trainer.plan.typed
        by_op = {n.op: n for n in typed.graph.nodes}
        for op in ("token_input", "body_forward", "hook_capture", "anchor_sample", "drafter_forward", "loss"):
            if op not in by_op:
                raise SystemExit(f"engine_overhead: the plan of this graph has no '{op}' node; the hand-written step "
                                 f"mirrors graphs/tiny.toml's rewritten plan (see `dflash-graph plan`)")
        p_anchor, p_loss = interp.params[by_op["anchor_sample"].id], interp.params[by_op["loss"].id]
        self.capture = [int(i) for i in interp.params[by_op["hook_capture"].id]["layers"]]
        self.count, self.block = int(p_anchor["count"]), int(p_anchor["block"])
        self.kind, self.gamma = p_loss["kind"], float(p_loss["gamma"])
        self.seq = trainer._seq_len()
        self.replicas = interp.replicas
        self.accum = int(cfg["grad_accum"])
        devs = set(trainer.tdev.values())
        if devs != {"cpu"}:
            raise SystemExit(f"engine_overhead: the hand-written step is CPU-only, the graph uses {sorted(devs)}")

        # the same modules: the frozen target is shared; the drafter is a second one with the same weights
        self.target = store.full(by_op["body_forward"].model, "cpu")
        self.norm, self.lm_head = final_norm(self.target), lm_head(self.target)
        eng = store.drafters[by_op["drafter_forward"].model]
        self.drafter = DFlashDrafter(eng.dims, eng.embed, dtype=eng.fc.weight.dtype)
        self.drafter.load_state_dict(eng.state_dict())
        self.drafter.train()
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=float(cfg["lr"]), betas=tuple(cfg["betas"]),
                                     weight_decay=float(cfg["weight_decay"]))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr_lambda(int(cfg["warmup_steps"]), trainer.steps))
        self.grad_clip = float(cfg["grad_clip"])
        # the same data and anchors: copies of the replicas' data shards, and the generator the trainer seeds for
        # each (step, micro-batch, replica)
        self.shards = {r: copy.deepcopy(s) for r, s in trainer.shards.items()}
        self.new_generator = trainer._generator
        self.n = 0
        self.offsets = torch.arange(self.block)
        self.slot_w = slot_weights(self.block, self.gamma, "cpu")

    def forward_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        from dflash_graph.models.nn.dflash import sample_anchors, slot_valid
        from dflash_graph.models.nn.target import body_forward
        from dflash_graph.ops.torch_impl import _chunk_loss

        ids, pos, mask = batch["input_ids"], batch["position_ids"], batch["loss_mask"]
        A, B, T = self.count, self.block, self.seq
        with torch.no_grad():
            last, captured = body_forward(self.target, ids, pos, self.capture)
            features = torch.cat([captured[i] for i in self.capture], dim=-1)           # [T, n*H]
            drawn = sample_anchors(mask, pos, B, A, generator)
            anchors = torch.zeros(A, dtype=torch.int64)
            anchors[: drawn.numel()] = drawn                                             # padding: masked by valid
            valid = slot_valid(mask, anchors, drawn.numel(), B, pos)                      # [A, B]
            rows = torch.remainder((anchors[:, None] + self.offsets).clamp_max(T - 1) - 1, T)   # [A, B], in the row
            target_logits = self.lm_head(self.norm(last[rows]))                          # [A, B, V]
        hidden = self.drafter(features, ids, pos, anchors)                               # [A, B, H]
        logits = self.lm_head(self.norm(hidden))                                         # [A, B, V]
        V = logits.shape[-1]
        w = self.slot_w[None, :] * valid.float()
        per_row = _chunk_loss(self.kind, logits.reshape(A * B, V), target_logits.reshape(A * B, V)).view(A, B)
        loss = (per_row * w).sum() / w.sum().clamp_min(1e-9)
        with torch.no_grad():
            hit = (logits.argmax(-1) == target_logits.argmax(-1)).float()
            hit[:, 0] = 1.0                     # slot 0, the anchor: the verifier's own token (slot_acc[0] is 1)
            acc = (hit * valid.float()).sum(0) / valid.float().sum(0).clamp_min(1.0)
        return loss, acc

    def step(self) -> dict[str, Any]:
        R, accum = self.replicas, self.accum
        losses, accs = [], []
        for a in range(accum):
            for r in range(R):
                loss, acc = self.forward_loss(self.shards[r].next_batch(), self.new_generator(self.n, a, r))
                (loss / (R * accum)).backward()
                losses.append(float(loss.detach()))
                accs.append(acc)
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.n += 1
        acc = torch.stack(accs).mean(0)
        return {"loss": sum(losses) / len(losses), "slot_acc": [round(float(a), 4) for a in acc.tolist()],
                "grad_norm": gnorm, "lr": self.sched.get_last_lr()[0]}


def _numbered(step_fn):
    """The trainer's step takes its index (it seeds each replica's anchor generator from it): count them."""
    n = [0]

    def f():
        m = step_fn(n[0])
        n[0] += 1
        return m
    return f


# --------------------------------------------------------------------------- measuring
def timed(fn) -> tuple[dict, float, float]:
    """fn()'s result, wall seconds (time.perf_counter) and CPU seconds of this process (time.process_time: all its
    threads; less disturbed than wall time by other processes on a shared machine)."""
    c0, t0 = time.process_time(), time.perf_counter()
    m = fn()
    t1, c1 = time.perf_counter(), time.process_time()
    return m, t1 - t0, c1 - c0


def peak_live_bytes(fn) -> tuple[int, dict]:
    """Peak bytes of tensor storages created during fn() and alive at once (weights, optimizer state and anything
    else that existed before are not counted: the same for both paths)."""
    from dflash_graph.exec.memtrack import LiveTracker

    tr = LiveTracker()
    tr.charge("step")
    with tr:
        m = fn()
    return int(tr.peak["step"]), m


def resident_bytes(params: list[torch.Tensor], modules: list[torch.nn.Module], opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    tensors = [*params, *(t for m in modules for t in (*m.parameters(), *m.buffers())),
               *(v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))]
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def summary(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "mean_s": statistics.fmean(xs), "min_s": min(xs),
            "stdev_s": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def bootstrap(e: list[float], h: list[float], n: int = 2000, seed: int = 0) -> dict[str, list[float]]:
    """95% intervals, resampling the interleaved (engine, hand) pairs together (paired bootstrap), of
    median(engine)/median(hand) and of the median of the per-pair ratios engine_i/hand_i (the pair ratio cancels
    load that changes slowly, so it is the steadier of the two on a shared machine)."""
    rng = random.Random(seed)
    k = len(e)
    meds, pairs = [], []
    for _ in range(n):
        idx = [rng.randrange(k) for _ in range(k)]
        meds.append(statistics.median([e[i] for i in idx]) / statistics.median([h[i] for i in idx]))
        pairs.append(statistics.median([e[i] / h[i] for i in idx]))
    lo, hi = int(0.025 * n), min(n - 1, int(0.975 * n))
    meds.sort()
    pairs.sort()
    return {"ratio_of_medians": [meds[lo], meds[hi]], "median_pair_ratio": [pairs[lo], pairs[hi]]}


def profile_steps(fn, n: int, top: int = 25) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --------------------------------------------------------------------------- main
def run(args) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trainer = build_engine(args.graph, args.set, Path(tmp) / "run")
        hand = HandStep(trainer)
        setup_s = time.perf_counter() - t0
        engine_step = _numbered(trainer.step)

        # 1. the same loss on the same step, from the same state
        me, he = engine_step(), hand.step()
        first = {"engine_loss": me["loss"], "hand_loss": he["loss"], "abs_diff": abs(me["loss"] - he["loss"]),
                 "engine_grad_norm": me["grad_norm"], "hand_grad_norm": he["grad_norm"],
                 "engine_slot_acc": me["slot_acc"], "hand_slot_acc": he["slot_acc"]}
        loss_diffs = [first["abs_diff"]]

        # 2. warmup, then interleaved timing: engine, hand, engine, hand, ...
        for _ in range(args.warmup):
            me, he = engine_step(), hand.step()
            loss_diffs.append(abs(me["loss"] - he["loss"]))
        te, th, ce, ch = [], [], [], []
        for _ in range(args.steps):
            me, dt, dc = timed(engine_step)
            te.append(dt)
            ce.append(dc)
            he, dt, dc = timed(hand.step)
            th.append(dt)
            ch.append(dc)
            loss_diffs.append(abs(me["loss"] - he["loss"]))

        # 3. peak live bytes of one step of each, untimed, from the same state
        peak_e, me = peak_live_bytes(engine_step)
        peak_h, he = peak_live_bytes(hand.step)
        loss_diffs.append(abs(me["loss"] - he["loss"]))
        res_e = resident_bytes(trainer.params, list(trainer.store._full.values()), trainer.opt)
        res_h = resident_bytes(hand.params, [hand.target], hand.opt)

        prof = None
        if args.profile:
            prof = {"engine": profile_steps(engine_step, args.profile), "hand": profile_steps(hand.step, args.profile)}

    se, sh = summary(te), summary(th)
    ci = bootstrap(te, th)
    pair = sorted(a / b for a, b in zip(te, th, strict=True))
    result = {
        "graph": args.graph, "overrides": args.set, "steps": args.steps, "warmup": args.warmup,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_average_before": load_before,
        "load_average_after": load_average(), "setup_s": round(setup_s, 3),
        "replicas": hand.replicas, "tokens_per_step": trainer.tokens_per_step,
        "loss_check": {**first, "max_abs_diff_all_steps": max(loss_diffs), "steps_compared": len(loss_diffs)},
        "time": {
            "engine": se, "hand": sh,
            "ratio_of_medians": se["median_s"] / sh["median_s"],
            "ratio_of_medians_95ci": ci["ratio_of_medians"],
            "ratio_of_means": se["mean_s"] / sh["mean_s"],
            "ratio_of_mins": se["min_s"] / sh["min_s"],
            "median_pair_ratio": statistics.median(pair),
            "median_pair_ratio_95ci": ci["median_pair_ratio"],
            "engine_steps_s": te, "hand_steps_s": th,
        },
        "cpu_time": {
            "engine": summary(ce), "hand": summary(ch),
            "ratio_of_medians": statistics.median(ce) / statistics.median(ch),
            "median_pair_ratio": statistics.median([a / b for a, b in zip(ce, ch, strict=True)]),
            "engine_steps_s": ce, "hand_steps_s": ch,
        },
        "memory": {
            "engine_step_peak_bytes": peak_e, "hand_step_peak_bytes": peak_h,
            "step_peak_ratio": peak_e / max(peak_h, 1),
            "engine_resident_bytes": res_e, "hand_resident_bytes": res_h,
            "total_peak_ratio": (peak_e + res_e) / max(peak_h + res_h, 1),
            "measured_with": "dflash_graph.exec.memtrack.LiveTracker (live tensor storages created during one step)",
        },
    }
    if prof is not None:
        result["profile"] = prof
    return result


def render(r: dict[str, Any]) -> str:
    t, m, lc = r["time"], r["memory"], r["loss_check"]
    ms = lambda s: f"{s * 1e3:9.2f} ms"  # noqa: E731
    kib = lambda b: f"{b / 1024:10.1f} KiB"  # noqa: E731
    lines = [
        f"engine overhead: {r['graph']}  ({r['replicas']} replicas, {r['tokens_per_step']} tokens/step, "
        f"torch {r['torch']}, {r['threads']} thread(s), load avg {r['load_average_before']})",
        f"loss check (step 1): engine {lc['engine_loss']:.8f}  hand {lc['hand_loss']:.8f}  |diff| {lc['abs_diff']:.3g}"
        f"  (max over {lc['steps_compared']} steps {lc['max_abs_diff_all_steps']:.3g})",
        "",
        f"{'wall per step (' + str(r['steps']) + ' interleaved)':<28}{'engine':>13}{'hand':>13}{'ratio':>9}",
    ]
    for k in ("median_s", "mean_s", "min_s"):
        lines.append(f"{k[:-2]:<28}{ms(t['engine'][k])}{ms(t['hand'][k])}{t['engine'][k] / t['hand'][k]:9.3f}")
    lines.append(f"{'stdev':<28}{ms(t['engine']['stdev_s'])}{ms(t['hand']['stdev_s'])}")
    c = r["cpu_time"]
    lines.append(f"{'process CPU, median':<28}{ms(c['engine']['median_s'])}{ms(c['hand']['median_s'])}"
                 f"{c['ratio_of_medians']:9.3f}   (median pair ratio {c['median_pair_ratio']:.3f})")
    lo, hi = t["ratio_of_medians_95ci"]
    plo, phi = t["median_pair_ratio_95ci"]
    lines += [
        f"time ratio engine/hand (goal <= 1.05): median of pair ratios {t['median_pair_ratio']:.3f} "
        f"(95% bootstrap {plo:.3f}..{phi:.3f}); ratio of medians {t['ratio_of_medians']:.3f} ({lo:.3f}..{hi:.3f})",
        "",
        f"{'peak live bytes, one step':<28}{'engine':>14}{'hand':>14}{'ratio':>9}",
        f"{'created during the step':<28}{kib(m['engine_step_peak_bytes'])}{kib(m['hand_step_peak_bytes'])}"
        f"{m['step_peak_ratio']:9.3f}",
        f"{'+ weights and optimizer':<28}{kib(m['engine_step_peak_bytes'] + m['engine_resident_bytes'])}"
        f"{kib(m['hand_step_peak_bytes'] + m['hand_resident_bytes'])}{m['total_peak_ratio']:9.3f}",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--graph", default=DEFAULT_GRAPH, help="graph file (default graphs/tiny.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="graph override, as `run --set`")
    ap.add_argument("--steps", type=int, default=30, help="timed steps of each path (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each path first (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1; 0 = torch's default)")
    ap.add_argument("--json", metavar="PATH", help="write the result as JSON here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also cProfile N more steps of each path and print the top functions by own time")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    r = run(args)
    print(render(r))
    if "profile" in r:
        for k in ("engine", "hand"):
            print(f"\n---- cProfile, {args.profile} steps, {k} path ----")
            print(r["profile"][k])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=2))
        print(f"\nwrote {args.json}")
    return r


if __name__ == "__main__":
    main()
    sys.exit(0)
