"""The training loop: data -> interpreter (forward per replica, backward) -> AdamW with warmup and clipping,
gradient accumulation, metrics, memory report, checkpoints, Ctrl-C safe.

The same loop runs in one process (every device local) and under torchrun (each rank runs the nodes of its own
devices, exec/distributed.py). Per micro-batch the replicas are visited in a fixed order r = 0..R-1; a target
rank produces replica r's batch from its own data shard and sends it, the rank that owns the trainable model
(the writer: optimizer, metrics, checkpoints) consumes them in that order. Replica r of micro-batch m draws its
random anchors from a generator seeded by (seed, m, r), so both modes draw the same anchors and resume needs no
generator state.

NOTE [Non-finite steps]: a step whose loss or global gradient norm is NaN or infinite is skipped: the optimizer
does not step (weights, fp32 masters and AdamW state stay those of the step before), the gradients are dropped,
and the learning-rate schedule still advances, so the lr at step s is always the schedule's value at s and a
resume needs nothing more than the scheduler's state. The step still consumed its data (the data position is
the step). metrics.jsonl records it with "skipped" and null for the non-finite values. `train.max_nonfinite_steps`
such steps in a row stop the run (exit 2), naming the steps and the last checkpoint, which a skip never makes
non-finite (checkpoint.save also refuses non-finite tensors). Only the writer rank holds the loss and the
optimizer, so the decision is the writer's alone and cannot differ between ranks; when it stops the run, it
records the cause in the rendezvous store (Comm.fail) before it exits, and every other rank stops at its next
wait with that cause (exit 4) instead of waiting on a peer that is gone.

NOTE [Write failures]: an OSError while writing metrics.jsonl, a checkpoint or memory.json (a full disk, a
directory made unwritable) stops the run with exit 2 and a message that names the path, the error, the newest
complete checkpoint on disk, the steps metrics.jsonl holds, and a fix; a failed checkpoint leaves the previous
ones intact (checkpoint.save), a failed metrics line is cut off again so the file stays one record per line. A failed export at the end of
a finished run (cli/run.py, export_problem) is exit 2 too, with the command that writes it again from the checkpoint."""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import attrs
import torch

from ..analysis.launch import analyze_launch, device_for
from ..analysis.nodecost import grad_nodes
from ..errors import GraphError, Location, Problem
from ..exec.devices import torch_devices
from ..exec.interpreter import Interpreter
from ..exec.models import ModelStore
from ..ops import registry
from ..rewrite.pipeline import Plan
from . import checkpoint
from ..spec.paths import require_paths
from .data import PackedData, load_data
from .metrics import RunStats, acceptance, coverage, json_line
from .rundir import resumed_steps, write_json


# the host memory a run from the hidden-state cache reads into, as the live tracker names it (not a graph device)
SOURCE_HOST = "(host: hidden-state source)"


@attrs.define
class RunOptions:
    out: Path
    steps: int | None = None
    resume: Path | None = None
    device_map: list[tuple[str, str]] = attrs.Factory(list)
    strict: bool = False
    progress: bool = True
    track_memory: bool = True
    distributed: bool = False      # under torchrun: this process is one rank
    # where the drafter side's inputs come from: None, the target side's nodes run here (online); a source with
    # `drafter_devices` and `next_inbox()` (train/hidden_cache.CacheSource): only the drafter side's nodes run, and
    # its transfers receive the source's tensors (run --hidden-states)
    source: Any = None
    # the launch this run is: None, the graph's (analysis/launch.analyze_launch); a run from the cache under
    # torchrun: the drafter side's ranks alone (analysis/from_disk.drafter_launch, NOTE [From disk under torchrun])
    launch: Any = None


def _lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        t = (step - warmup) / max(total - warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return f


def _set_threads(threads: int, tdev: dict[str, str]) -> None:
    """torch's default (one thread per core) is right for one process alone on the machine; the tiny default
    ran 12-16x slower with it on a loaded 2-core machine than with one thread. A run whose devices are all CPU
    takes, unless `train.threads` says otherwise, half the cores (at least one): the other half is left to the
    machine. A GPU run keeps torch's default. (Under torchrun, OMP_NUM_THREADS=1 per rank unless set.)"""
    if threads <= 0:
        if any(not t.startswith("cpu") for t in tdev.values()):
            return
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // 2)
    torch.set_num_threads(threads)


def micro_generator(seed: int, accum: int, step: int, micro: int, r: int) -> torch.Generator:
    """Replica r of micro-batch `micro` of `step` draws its random nodes (anchors) from this generator, in every
    mode: one process, torchrun, capture (train/hidden_cache.py)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step * accum + micro) * 4096 + r)


def _data_sources(typed) -> list:
    """The nodes that read the data loader: sources (no inputs) that are not pure (token_input), by trait."""
    return [n for n in typed.graph.nodes if not n.inputs and registry.get(n.op).traits.pure is False]


def _metrics_through(path: Path, step: int, dst: Path | None = None) -> None:
    """On resume from the checkpoint of `step`, keep metrics.jsonl's records of steps 1..step: the records past it
    (steps a killed run computed after its last checkpoint) are computed again, and a line a kill cut short is not
    JSON. Rewritten to a temporary and renamed over, so a kill here leaves the old file or the new one. `dst`: the
    metrics.jsonl of another --out the run continues in (the resumed directory's file is left as it is)."""
    dst = path if dst is None else dst
    for stale in dst.parent.glob(f".{dst.name}.tmp*"):   # what a kill during an earlier rewrite left
        stale.unlink(missing_ok=True)
    kept, torn = [], 0
    for ln in path.read_text().splitlines():
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
        except ValueError:
            torn += 1
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= step:
            kept.append(ln)
    if torn:
        print(f"note: {path}: dropped {torn} line(s) that are not complete JSON (a run killed while writing them)",
              file=sys.stderr)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write("".join(ln + "\n" for ln in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dst)


class RunFailed(Exception):
    """The run cannot go on (non-finite steps in a row, a write that failed): `problem` says why and what is kept."""

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem


class WriteFailed(Exception):
    """An OSError while writing one of the run's files: what was being written, where, and at which step."""

    def __init__(self, what: str, path: Path, err: OSError, step: int):
        super().__init__(f"{what}: {err}")
        self.what, self.path, self.err, self.step = what, path, err, step


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


def _append(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _steps(a: int, b: int) -> str:
    return f"step {a}" if a == b else f"steps {a}-{b}"


def _metrics_on_disk(path: Path) -> str:
    """Which steps metrics.jsonl holds, as read back (what a failed write left)."""
    steps = []
    try:
        for ln in path.read_text().splitlines():
            try:
                steps.append(int(json.loads(ln)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    except FileNotFoundError:
        return "metrics.jsonl holds no step"
    except OSError as e:
        return f"metrics.jsonl cannot be read back ({e.strerror})"
    return f"metrics.jsonl holds {_steps(min(steps), max(steps))}" if steps else "metrics.jsonl holds no step"


def _location(path: Path) -> Location:
    return Location(str(path))


def _why(err: OSError) -> str:
    code = errno.errorcode.get(err.errno or 0)
    return f"{err.strerror or err}" + (f" ({code})" if code else "")


def _complete(saved: tuple[int, Path] | None) -> str:
    return f"the checkpoint of step {saved[0]} is complete on disk ({saved[1]})" if saved else \
        "no checkpoint is complete on disk"


def _kept(out: Path, resume: Path | None) -> str:
    """What a stop without a final save keeps (a second Ctrl-C): the newest complete checkpoint on disk, read
    back, and how to continue; or that there is none."""
    saved = checkpoint.newest_complete(out)
    if saved is not None:
        return f"kept the checkpoint of step {saved[0]} ({saved[1]}); continue with --resume {out}"
    if resume is not None and (saved := checkpoint.newest_complete(resume)) is not None:
        return (f"no checkpoint was saved in {out} yet; the one resumed from is kept (step {saved[0]}, {saved[1]}): "
                f"continue with --resume {resume} --out {out}")
    return f"no checkpoint was saved yet, so there is nothing to resume; start again with --out {out} --overwrite"


def _last_good(saved: tuple[int, Path] | None, none: str) -> str:
    return f"the last good checkpoint is intact: {saved[1]} (step {saved[0]})" if saved else none


def _fix(err: OSError, where: Path, writable: Path, again: str, full: str) -> str:
    """The fix to try for a failed write: room on a full disk, rights on a refused path, else a look at it."""
    if err.errno in _FULL:
        return f"{full}, {again}"
    if err.errno in _DENIED:
        return f"make {writable} writable by this user (or move {where} to a writable place), {again}"
    return f"check the filesystem of {where}, {again}"


def _what_nonfinite(reason: str, loss: float, gnorm: float, short: bool = False) -> str:
    if short:
        return f"loss {loss:g}" if "loss" in reason else f"gradient norm {gnorm:g}"
    return f"{reason} (loss {loss:g}, gradient norm {gnorm:g})"


class Trainer:
    def __init__(self, plan: Plan, opts: RunOptions):
        self.plan, self.opts = plan, opts
        typed = plan.typed
        spec = typed.ctx.spec
        require_paths(spec, "run")      # every file the graph names, each with its line, before any work
        self.cfg = dict(spec.train)
        # NOTE [What a resume continues]: a fresh run trains --steps (else train.steps) steps on a schedule over
        # as many; a resume takes both from its checkpoint (below)
        self.steps = self.schedule_steps = opts.steps if opts.steps is not None else int(self.cfg["steps"])
        self.accum = int(self.cfg["grad_accum"])
        self.launch = opts.launch if opts.launch is not None else analyze_launch(typed)
        grads = grad_nodes(typed)
        if not grads:
            raise GraphError(Problem("nothing to train: no node uses a trainable model", spec.loc("models"),
                                     hint="set trainable = true on the drafter model"))
        R = self.launch.replicas
        writer_ranks = {self.launch.devices[device_for(typed, typed.graph[n].device, r)].rank
                        for n in grads for r in range(R)}
        self.comm = None
        self.rank = 0
        local = None
        if opts.distributed:
            from ..exec.distributed import Comm

            by_rank = {k: self.launch.rank_devices(k) for k in range(self.launch.world_size)}
            self.tdev = torch_devices(spec, opts.device_map, only=by_rank[int(os.environ["RANK"])])
            self.comm = Comm(self.launch, by_rank, spec.launch.stall_timeout, lambda d: self.tdev[d])
            self.rank = self.comm.rank
            local = frozenset(by_rank[self.rank])
        else:
            self.tdev = torch_devices(spec, opts.device_map)
            if opts.source is not None:     # the drafter side alone: its inputs come from the source
                local = frozenset(opts.source.drafter_devices)
        if self.comm is None or int(self.cfg.get("threads", 0)) > 0:
            _set_threads(int(self.cfg.get("threads", 0)), self.tdev)
        self.writer = min(writer_ranks) if self.comm is not None else 0
        self.is_writer = self.rank == self.writer
        # NOTE [Data-parallel drafter]: a trainable model with `parallel` whose nodes sit on several ranks has a
        # replica on each (the drafter ranks); the writer is the first of them. Each replica trains on the batches
        # of its own replica indices, its forward goes through DistributedDataParallel, whose all-reduce averages
        # the gradients over the drafter ranks at the last backward of the step (no_sync before it), so every
        # replica steps its optimizer on the same gradients: one optimizer step per global batch. Each local loss
        # is scaled by M / (R * grad_accum) (M drafter ranks, R replicas) so that DDP's mean is the single
        # process's sum over replicas / (R * grad_accum). The step's losses, accuracies and busy times are gathered
        # from every drafter rank and folded in the single process's order (micro-batch, then replica).
        self.dp_ranks = sorted(writer_ranks) if self.comm is not None else [0]
        self.is_drafter = self.rank in self.dp_ranks
        self.dp_group = None
        self.fsdp = False        # parallel = "fsdp": the drafter sharded with FSDP2 (NOTE [Sharded drafter])
        self.whole_weights: dict[str, dict[str, torch.Tensor]] = {}
        if self.comm is not None and len(self.dp_ranks) > 1:
            from ..exec.distributed import parallel_model, replica_group

            self.dp_group = replica_group(self.comm, self.dp_ranks)
            self.fsdp = parallel_model(typed)[1] == "fsdp"
        self.seed = int(self.cfg["seed"])
        # under torchrun one rank, beside a target replica, runs the held-out evaluation (NOTE [Held-out
        # evaluation under torchrun], train/heldout.py)
        self.eval_rank, self.eval_device = None, None
        if self.comm is not None and opts.source is None and int(spec.data.get("holdout") or 0) and \
                int(self.cfg.get("eval_every") or 0):
            from .heldout import evaluator

            self.eval_rank, self.eval_device = evaluator(typed, self.writer) or (None, None)
        # data first, so a bad record is reported before any model is built: one shard per replica whose
        # token_input runs in this process; the held-out split where the held-out evaluation runs (the one
        # process, or the evaluator's rank)
        base = Path(spec.data.get("_base", "."))
        token_nodes = _data_sources(typed)
        self.shards: dict[int, PackedData] = {}
        self.held = None
        here = set(local) if local is not None else set(spec.devices)
        mine = [r for r in range(R) if any(device_for(typed, n.device, r) in here for n in token_nodes)]
        if mine or self.rank == self.eval_rank:
            if "corpus" not in spec.data:
                raise GraphError(Problem("the graph has no [data] section", spec.loc(),
                                         hint='[data]\ncorpus = "tiny/corpus.jsonl"\ntokenizer = "tiny/tokenizer.json"'))
            vocab = next((int(m.dims.vocab_size) for m in typed.ctx.models.values() if m.spec.arch == "dflash"), None)
            train, held = load_data(spec.data, base, self._seq_len(), self.seed, vocab, spec.loc)
            self.shards = {r: train.shard(r, R) for r in mine}
            self.held = held if self.comm is None or self.rank == self.eval_rank else None
        torch.manual_seed(self.seed)
        self.store = ModelStore(typed, self.tdev, self.seed)
        self.store.heads_only = opts.source is not None    # no target body runs here (NOTE [Heads only])
        self.store.preload(local)
        local_cuda = any(self.tdev[d].startswith("cuda") for d in (local or self.tdev))
        self.interp = Interpreter(typed, self.store, self.tdev, strict=opts.strict, seed=self.seed,
                                  track_memory=opts.track_memory and not local_cuda, local=local, comm=self.comm)
        if self.comm is not None:
            self.interp.on_node = self._on_node
        if self.fsdp and self.is_drafter:
            self._shard_fsdp()
        self.params = self.store.trainable_parameters() if self.is_drafter else []
        self.local_rs = [r for r in range(R) if self.interp._backward_device(r) is not None]
        self.loss_node = next(n.id for n in typed.graph.nodes     # the loss op, or the fused op that replaced it
                              if registry.get(n.op).traits.sink and "loss" in typed.outputs_of(n.id))
        # the anchors' coverage per slot (train/metrics.coverage): the loss node's `valid` [A, B] is kept for it
        loss_in = dict(next(n for n in typed.graph.nodes if n.id == self.loss_node).inputs)
        self.valid_ref = loss_in.get("valid")
        self.block = typed.types[self.valid_ref].sizes[-1] if self.valid_ref is not None else 0
        self.start_step = 0
        self.stats = RunStats()
        self.masters, self.opt, self.sched = [], None, None
        try:
            ck = None
            if opts.resume is not None and self.is_drafter:
                state, ck = checkpoint.load(opts.resume)
                if "batches" not in state.get("data", {}):
                    raise GraphError(Problem(f"{ck} was written by an older dflash-graph (data position as epoch and "
                                             "cursor, before per-replica shards)", None,
                                             hint="start a new run in another --out directory"))
                self.start_step = int(state["step"])
                if int(state.get("replicas", R)) != R:     # a layout may change on resume, the data split may not
                    raise GraphError(Problem(
                        f"--resume {opts.resume}: the run trained {state['replicas']} replicas per micro-batch (each "
                        f"on its own data shard), this graph's groups make {R}", spec.loc("groups"),
                        expected=f"{state['replicas']} replicas", actual=f"{R} replicas",
                        hint="resume with groups of the run's size (the drafter's group may differ: "
                             "docs/distributed.md, \"Data-parallel drafters\"), or start a new run"))
                self.steps, self.schedule_steps, note = resumed_steps(opts.resume, state, opts.steps,
                                                                      int(self.cfg["steps"]))
                if note and self.is_writer:
                    print(f"note: {note}", file=sys.stderr, flush=True)
                if state.get("stats"):
                    self.stats.load_state_dict(state["stats"])
            if self.is_drafter:
                self._make_optimizer()
                if ck is not None:
                    checkpoint.restore(ck, self.store.drafters, self.opt, self.sched, self.interp.generator,
                                       self.masters, group=self.dp_group)
                    self._take_allowed_changes()
                if self.dp_group is not None and not self.fsdp:
                    self._wrap_ddp()
        except GraphError as e:   # under torchrun the other ranks wait for the step: tell them why there is none
            if self.comm is None:
                raise
            self.fail(e.problems[0], "cannot resume")
        if self.comm is not None:
            self.start_step, self.steps = self.comm.broadcast((self.start_step, self.steps), src=self.writer,
                                                              what="the step to resume from")
            self.comm.plan_slots(self.start_step, self.steps, self.accum, R)
        self.finished = self.start_step >= self.steps    # a resume of a finished run: run() changes nothing
        for shard in self.shards.values():
            shard.skip(self.start_step * self.accum)
        if opts.source is not None:
            opts.source.skip(self.start_step * self.accum * R)
        self.tokens_per_step = self._seq_len() * R * self.accum
        self.routes = [{t.node: t for t in self.launch.transfers if t.replica == r and t.src_rank == self.rank}
                       for r in range(R)]
        self.receives = [any(t.replica == r and t.dst_rank == self.rank for t in self.launch.transfers)
                         for r in range(R)]
        self._step_now = self.start_step
        self.max_nonfinite = int(self.cfg.get("max_nonfinite_steps") or 3)
        from .summary import RunSummary

        self.summary = RunSummary(self, self.stats, int(self.cfg["eval_every"]), int(self.cfg["eval_batches"]),
                                  self.seed)

    def _make_optimizer(self) -> None:
        """AdamW over fp32 masters (NOTE [Trainable memory], analysis/memory.py: a non-fp32 module gets its weights
        copied back after each step), and the learning-rate schedule over the run's schedule_steps."""
        cfg = self.cfg
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True)
                        for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=float(cfg["lr"]), betas=tuple(cfg["betas"]),
                                     weight_decay=float(cfg["weight_decay"]))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr_lambda(int(cfg["warmup_steps"]),
                                                                            self.schedule_steps))

    def _wrap_ddp(self) -> None:
        """The drafter's forward through DistributedDataParallel over the drafter ranks (NOTE [Data-parallel
        drafter]). Built after a resume's restore: its construction broadcasts the first drafter rank's weights,
        which every replica then already holds."""
        from torch.nn.parallel import DistributedDataParallel

        for name, m in self.store.drafters.items():
            dev = next(m.parameters()).device
            # no buffer sync at each forward: the drafter's buffers (rotary tables) are equal on every replica
            sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(
                DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False}
            self.store.wrapped[name] = DistributedDataParallel(
                m, process_group=self.dp_group, device_ids=[dev] if dev.type == "cuda" else None, **sync)

    def _shard_fsdp(self) -> None:
        """NOTE [Sharded drafter]: parallel = "fsdp" shards the drafter with FSDP2's fully_shard over the drafter
        ranks' group: each DFlash layer a unit, the drafter's own final norm (which the graph's norm node calls
        directly, outside the drafter's forward) a unit of its own so that calling it gathers its weight, then the
        root (fc, hidden_norm). The embedding it borrows is not registered (DFlashDrafter._embed_ref) and stays
        whole. Each rank then holds 1/M of every parameter as a DTensor shard, and so 1/M of the gradients, the
        fp32 masters and the AdamW state; the forward all-gathers a unit's weights, the backward reduce-scatters
        its gradients (averaged over the M ranks, as DDP's all-reduce). Done before the optimizer is made (it steps
        the shards) and before a resume's restore (which loads into the shards: train/checkpoint.py)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        # FSDP2 warns that the drafter's forward returns a view (its [A, B, H] hidden states): an in-place op on it
        # would skip the backward's all-gather; the graph's nodes read it out of place (the norm node)
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        for m in self.store.drafters.values():
            mesh = DeviceMesh.from_group(self.dp_group, next(m.parameters()).device.type)
            for layer in getattr(m, "layers", ()):
                fully_shard(layer, mesh=mesh)
            if getattr(m, "norm", None) is not None:
                fully_shard(m.norm, mesh=mesh)
            fully_shard(m, mesh=mesh)

    def _gather_whole(self) -> None:
        """Every drafter rank of a sharded drafter: the drafter's whole weights, all-gathered (collective), for the
        writer's safetensors and export."""
        self.whole_weights = {name: self._whole_state(m) for name, m in self.store.drafters.items()}

    def _whole_state(self, m=None) -> dict[str, torch.Tensor]:
        """A sharded drafter's (the only one by default) whole state dict, all-gathered: every drafter rank calls it."""
        from torch.distributed.tensor import DTensor

        m = next(iter(self.store.drafters.values())) if m is None else m
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in m.state_dict().items()}

    def _take_allowed_changes(self) -> None:
        """After a checkpoint is restored: the graph's train.lr and train.weight_decay, which the optimizer's and
        scheduler's saved state would otherwise bring back (rundir.check_resume refuses a change of them unless
        --allow-change names it), and the lr of the step resumed from under the graph's schedule. Unchanged
        settings give back exactly the saved values."""
        lr, wd = float(self.cfg["lr"]), float(self.cfg["weight_decay"])
        for g in self.opt.param_groups:
            g["initial_lr"], g["weight_decay"] = lr, wd
        self.sched.base_lrs = [lr] * len(self.opt.param_groups)
        lrs = [base * f(self.sched.last_epoch) for base, f in zip(self.sched.base_lrs, self.sched.lr_lambdas)]
        for g, v in zip(self.opt.param_groups, lrs):
            g["lr"] = v

    def _seq_len(self) -> int:
        typed = self.plan.typed
        n = _data_sources(typed)[0]
        return typed.outputs_of(n.id)["input_ids"].sizes[0]

    def _on_node(self, node: str, r: int) -> None:
        self.comm.set_where(self._step_now + 1, node, r)   # raises at Ctrl-C (Interrupted) or a lost rank

    def _generator(self, step: int, micro: int, r: int) -> torch.Generator:
        return micro_generator(self.seed, self.accum, step, micro, r)

    def _alloc(self, t) -> torch.Tensor:
        """A receive buffer for a cross-rank transfer, shaped and typed from the checked graph, charged to the
        receiving device (it is the transfer's output once it arrives)."""
        from ..exec.models import DTYPES

        from ..ir.graph import Ref

        ty = self.plan.typed.types[Ref(t.node, "out")]
        tr = self.interp.tracker
        if tr is not None:
            prev = (tr.device, tr.node)
            tr.charge(t.dst_device, None)
        dtype = DTYPES.get(ty.dtype) or getattr(torch, ty.dtype)
        buf = torch.empty(tuple(ty.sizes), dtype=dtype, device=self.tdev[t.dst_device])
        if tr is not None:
            tr.charge(*prev)
        return buf

    def _from_source(self) -> dict[str, torch.Tensor]:
        """The next sample's transfers from the source (run --hidden-states). What the source holds on the host
        while it reads (the loader's shards, a hybrid run's target side) is charged to SOURCE_HOST, not to the
        device whose node ran last; each tensor becomes the drafter device's at its transfer's receive
        (Interpreter.run_replica, memtrack.receive), where check counts it (NOTE [From-disk memory],
        analysis/from_disk.py)."""
        tr = self.interp.tracker
        if tr is None:
            return self.opts.source.next_inbox()
        prev = (tr.device, tr.node)
        tr.charge(SOURCE_HOST, "hidden-state source")
        try:
            return self.opts.source.next_inbox()
        finally:
            tr.charge(*prev)

    # -- one step ----------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, Any]:
        accum = self.accum
        R = self.interp.replicas
        comm = self.comm
        records = []      # per (micro-batch, replica) that this process trained: loss, slot_acc, accepted, scored
        cover = {"reach": 0, "loss_tokens": 0}
        ddp = next(iter(self.store.wrapped.values()), None)
        last = (accum - 1, self.local_rs[-1]) if self.local_rs else None
        scale = len(self.dp_ranks) if self.dp_group is not None else 1

        def batch(rr: int) -> dict[str, torch.Tensor]:
            b = self.shards[rr].next_batch()
            if self.block:
                from ..models.nn.dflash import slot_reach

                # the run's own statistics, host tensors on any device: not the graph's memory that memory.json
                # compares with check (charged to the token node's device, they were 12,800 B at that node and
                # 32 B at the target's peak on tiny.toml's CPU devices)
                tr = self.interp.tracker
                untracked = tr.paused() if tr is not None else contextlib.nullcontext()
                mask = b["loss_mask"]
                with untracked:
                    cover["reach"] = cover["reach"] + (slot_reach(mask, b["position_ids"], self.block)
                                                       & mask[:, None]).sum(0)
                    cover["loss_tokens"] += int(mask.sum())
            return b
        ranks: dict[int, list[float]] = {}
        t_step = time.perf_counter()
        wait0 = comm.wait_seconds if comm else 0.0
        for a in range(accum):
            for r in range(R):
                if not self.interp.runs_replica(r):
                    continue
                t0 = time.perf_counter()
                w0 = comm.wait_seconds if comm else 0.0
                inbox = self._from_source() if self.opts.source is not None else None
                if comm is not None and self.receives[r]:
                    comm.set_where(step + 1, "(waiting for its batch)", r)
                    inbox, headers = comm.receive(step, a, r, self._alloc)
                    for src, (b, w) in headers.items():
                        acc_ = ranks.setdefault(src, [0.0, 0.0])
                        acc_[0] += b
                        acc_[1] += w
                keep = frozenset([self.valid_ref]) if self.valid_ref is not None else frozenset()
                # a data-parallel drafter averages its gradients at the last backward of the step only
                if self.fsdp:
                    for m in self.store.drafters.values():
                        m.set_requires_gradient_sync((a, r) == last)
                with ddp.no_sync() if ddp is not None and (a, r) != last else contextlib.nullcontext():
                    res = self.interp.run_replica(r, batch, keep=keep, generator=self._generator(step, a, r),
                                                  inbox=inbox, sends=self.routes[r])
                    inbox = None
                    out = res.get(self.loss_node)
                    if out is not None:
                        loss = out["loss"] if scale == 1 else out["loss"] * scale
                        with self.interp.window(r, "backward"):
                            (loss / (R * accum)).backward()
                        valid = res.get(self.valid_ref.node, {}).get(self.valid_ref.output) if self.valid_ref else None
                        records.append((a, r, float(out["loss"].detach()), out["slot_acc"].detach().float().cpu(),
                                        out["accepted"].detach().double().cpu(),
                                        None if valid is None else valid.detach().to(torch.int64).sum(0).cpu()))
                    del res, out
                if comm is not None:
                    if self.receives[r]:
                        comm.release(self._alloc)
                    if self.routes[r]:
                        w = comm.wait_seconds - w0
                        comm.send_header(step, a, r, time.perf_counter() - t0 - w, w)
        m: dict[str, Any] = {}
        if self.dp_group is not None and self.is_drafter:
            # every drafter rank's records and busy times, on every drafter rank, folded in the single process's
            # order (NOTE [Data-parallel drafter]); this rank's busy time ends here (the optimizer step is not in it)
            from ..exec.distributed import gather_among

            wait = comm.wait_seconds - wait0
            ranks[self.rank] = [time.perf_counter() - t_step - wait, wait]
            pieces = gather_among(comm, (records, ranks), self.dp_group, self.dp_ranks,
                                  "the step's losses of the drafter ranks")
            records = sorted((x for rec, _ in pieces for x in rec), key=lambda x: (x[0], x[1]))
            ranks = {k: v for _, rk in pieces for k, v in rk.items()}   # each its own, and its senders' headers
        if self.is_drafter:
            losses = [x[2] for x in records]
            loss = sum(losses) / len(losses)
            m = self._optimizer_step(None if math.isfinite(loss) else "non-finite loss")
            acc = torch.stack([x[3] for x in records]).mean(0)
            counts, scored = 0, 0
            for x in records:
                counts = counts + x[4]
                if x[5] is not None:
                    scored = scored + x[5]
            m.update({"loss": loss, "slot_acc": [round(float(a), 4) for a in acc.tolist()],
                      **acceptance(counts.tolist())})
            if cover["loss_tokens"]:      # where this process packs the batches (not on a torchrun drafter rank)
                cov = coverage(cover["reach"].tolist(), None if isinstance(scored, int) else scored.tolist(),
                               cover["loss_tokens"])
                m.update({k: [None, *v[1:]] for k, v in cov.items()})     # slot 0, the anchor, is never scored
        if self.dp_group is None or not self.is_drafter:
            wait = (comm.wait_seconds - wait0) if comm else 0.0
            ranks[self.rank] = [time.perf_counter() - t_step - wait, wait]
        m["ranks"] = {str(k): {"busy_s": round(v[0], 4), "wait_s": round(v[1], 4)} for k, v in sorted(ranks.items())}
        return m

    def _optimizer_step(self, skip: str | None = None) -> dict[str, Any]:
        """Clip and step; `skip` (or a non-finite gradient norm) skips the optimizer step, NOTE [Non-finite steps]."""
        tr = self.interp.tracker
        if tr is not None:
            tr.charge(self.interp._backward_device(self.local_rs[0]), "optimizer")
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        gnorm = torch.nn.utils.clip_grad_norm_(self.masters, float(self.cfg["grad_clip"]))
        # over a sharded drafter's DTensor gradients the norm is a DTensor: the whole norm, on every drafter rank
        gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
        if skip is None and not math.isfinite(gnorm):
            skip = "non-finite gradient norm"
        if skip is None:
            with self.interp.window(self.local_rs[0], "optimizer"):
                self.opt.step()
        with warnings.catch_warnings():   # a skipped first step: torch warns that the scheduler stepped first
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    if skip is None:
                        p.copy_(m)
                    p.grad = None
        return {"grad_norm": gnorm, "lr": self.sched.get_last_lr()[0], "skipped": skip}

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        out = self.opts.out
        if self.finished:
            return 0
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.fail(self.write_problem(WriteFailed("the run directory", out, e, self.start_step)))
        if self.comm is not None:
            self._write_rank_file()
        metrics_path = out / "metrics.jsonl"
        # a resume keeps the records of the steps it continues from, also into another --out
        resumed = self.opts.resume / "metrics.jsonl" if self.opts.resume is not None else None
        mode = "a" if resumed is not None and resumed.exists() else "w"
        if self.is_writer and mode == "a":
            try:
                _metrics_through(resumed, self.start_step, metrics_path)
            except OSError as e:
                self.fail(self.write_problem(WriteFailed("metrics.jsonl", metrics_path, e, self.start_step)))
        tr = self.interp.tracker
        cuda = sorted({self.tdev[d] for d in self.interp.local if self.tdev[d].startswith("cuda")})
        for d in cuda:
            torch.cuda.reset_peak_memory_stats(d)
        ck_every = int(self.cfg["checkpoint_every"])
        step = self.start_step
        t_start = time.perf_counter()
        interrupted = hard_stop = False
        # Ctrl-C asks to stop. In one process the step in flight finishes (an optimizer step is never left half
        # done), then a checkpoint is saved; a second Ctrl-C stops at once and keeps the previous checkpoint.
        # Under torchrun Comm handles SIGINT: every rank stops at its next node or wait and the writer saves the
        # last completed step (NOTE [Ctrl-C under torchrun]).
        stop = {"requested": False}

        def on_sigint(signum, frame):
            if stop["requested"]:
                raise KeyboardInterrupt
            stop["requested"] = True
            print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)

        old_handler = None
        if self.comm is None and threading.current_thread() is threading.main_thread():
            old_handler = signal.signal(signal.SIGINT, on_sigint)
        if tr is not None:
            tr.__enter__()
            self.interp.charge_weights()
        lost = failure = None
        fd = None
        try:
            if self.is_writer:
                try:
                    fd = os.open(metrics_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if mode == "w" else 0),
                                 0o644)
                except OSError as e:
                    raise WriteFailed("metrics.jsonl", metrics_path, e, step) from None
            while step < self.steps:
                self._step_now = step
                t0 = time.perf_counter()
                m = self.step(step)
                dt = time.perf_counter() - t0
                step += 1
                rec = self._record(step, m, dt) if self.is_writer else None
                try:
                    ev = self.summary.maybe_eval(step, self.steps)     # under torchrun every rank takes part
                except Exception:
                    if self.is_writer:      # stopped during the evaluation: the step trained and is checkpointed
                        self.stats.update(rec)
                        with contextlib.suppress(WriteFailed):
                            self._write_metrics(fd, rec, metrics_path)
                    raise
                if self.is_writer:
                    self.summary.update(rec)
                    if ev is not None and "skipped" in ev:
                        self._note(f"note: {ev['skipped']}")
                        ev = None
                    if ev is not None:
                        rec["heldout"] = {k: v for k, v in ev.items() if k != "step"}
                    self.stats.update(rec)
                    self._write_metrics(fd, rec, metrics_path)
                    self._progress(rec, t_start)
                    if ev is not None:
                        self._eval_line(ev)
                    self._count_nonfinite(step, m)
                if stop["requested"]:
                    interrupted = True
                    break
                if self.is_drafter and ck_every and step % ck_every == 0 and step < self.steps:
                    self._save(step)
        except KeyboardInterrupt:
            interrupted = hard_stop = True
        except WriteFailed as e:
            failure = self.write_problem(e)
        except RunFailed as e:
            failure = e.problem
        except Exception as e:
            from ..exec.distributed import Interrupted, RankLost, _short

            if self.comm is not None and isinstance(e, RuntimeError) and any(
                    w in str(e) for w in ("Connection", "gloo", "NCCL", "closed by peer")):
                e = self.comm._lost(None, f"a collective failed ({_short(e)})")   # a peer went away mid-op
            if isinstance(e, Interrupted):
                interrupted, lost = True, e
            elif isinstance(e, RankLost):
                lost = e
            else:
                raise
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            if tr is not None:
                tr.__exit__(None, None, None)
            if fd is not None:
                os.close(fd)
        if getattr(self, "progress", None) is not None:
            self.progress.close()
        if failure is not None:
            self.fail(failure)
        if self.comm is not None and (lost is not None or interrupted):
            return self._stop_distributed(step, lost)
        if hard_stop:
            print(f"stopped during step {step + 1}: {_kept(out, self.opts.resume)}", file=sys.stderr)
            return 130
        try:
            if self.is_drafter:
                self._save(step)
            devices = self._write_memory(step)
        except WriteFailed as e:
            self.fail(self.write_problem(e))
        except RunFailed as e:
            self.fail(e.problem)
        if self.comm is not None:
            self.comm.close()
        if interrupted:
            print(f"interrupted: checkpoint of step {step} saved to {out / 'checkpoint'}; continue with --resume {out}",
                  file=sys.stderr)
            return 130
        if self.is_writer:
            print(self.summary.render(step, out, {d: (r["predicted_peak_bytes"], r.get("measured_peak_bytes"))
                                                  for d, r in devices.items()}))
        return 0

    # -- one step's record, non-finite steps, failed writes (NOTE [Non-finite steps], NOTE [Write failures]) --------
    def _record(self, step: int, m: dict[str, Any], dt: float) -> dict[str, Any]:
        loss, gnorm = m["loss"], m["grad_norm"]
        rec = {"step": step, "loss": round(loss, 6) if math.isfinite(loss) else None,
               "tokens_per_s": round(self.tokens_per_step / dt, 1), "slot_acc": m["slot_acc"],
               "acc": round(sum(m["slot_acc"][1:]) / max(len(m["slot_acc"]) - 1, 1), 4),
               "tau": m["tau"], "slot_accept": m["slot_accept"],
               "lr": m["lr"], "grad_norm": round(gnorm, 4) if math.isfinite(gnorm) else None,
               "step_seconds": round(dt, 4), "ranks": m["ranks"], "memory_bytes": self._memory_now()}
        rec.update({k: m[k] for k in ("slot_reach", "slot_scored") if k in m})
        if m.get("skipped"):
            rec["skipped"] = m["skipped"]
        return rec

    def _write_metrics(self, fd: int, rec: dict[str, Any], path: Path) -> None:
        """Append one strict-JSON line; a write that fails part-way is cut off again (the file stays whole lines)."""
        data = json_line(rec).encode()
        pos = None
        try:
            pos = os.fstat(fd).st_size
            _append(fd, data)
        except OSError as e:
            if pos is not None:
                try:
                    os.ftruncate(fd, pos)
                except OSError:
                    pass
            raise WriteFailed(f"the metrics of step {rec['step']}", path, e, rec["step"]) from None

    def _count_nonfinite(self, step: int, m: dict[str, Any]) -> None:
        if not m.get("skipped"):
            self.stats.streak.clear()
            return
        self.stats.streak.append((step, m["skipped"], m["loss"], m["grad_norm"]))
        n, limit = len(self.stats.streak), self.max_nonfinite
        good = step - n
        before = f"those of step {good}" if good > 0 else "the initial ones"
        self._note(f"step {step}: skipped, {_what_nonfinite(m['skipped'], m['loss'], m['grad_norm'])}: weights and "
                   f"optimizer state stay {before} ({n} such step{'s' if n > 1 else ''} in a row; "
                   f"train.max_nonfinite_steps = {limit} stops the run)")
        if n < limit:
            return
        out = self.opts.out
        steps = [s for s, *_ in self.stats.streak]
        what = ", ".join(f"step {s}: {_what_nonfinite(r, lo, g, short=True)}" for s, r, lo, g in self.stats.streak[-3:])
        saved = checkpoint.newest_complete(out)
        kept = _last_good(saved, f"no checkpoint was saved before (train.checkpoint_every = "
                                 f"{int(self.cfg['checkpoint_every'])})")
        then = f"then continue with --resume {out} --allow-change train.lr" if saved else "then run again"
        raise RunFailed(Problem(
            f"{_steps(steps[0], steps[-1])}: the loss or gradient norm was not finite in {n} steps in a row "
            f"(train.max_nonfinite_steps = {limit}; {what}); their optimizer steps were skipped, so the weights are "
            f"{before}; {kept}", _location(out / "metrics.jsonl"),
            hint=f"lower train.lr (now {float(self.cfg['lr']):g}) or train.grad_clip (now "
                 f"{float(self.cfg['grad_clip']):g}), check the loss node's params (gamma) and the data; {then}"))

    def _note(self, line: str) -> None:
        progress = getattr(self, "progress", None)
        if progress is not None:
            progress.note(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def write_problem(self, e: WriteFailed) -> Problem:
        """What a failed write means to the user: where, why, what is on disk, what is lost, what to do."""
        out, err = self.opts.out, e.err
        # the file the OS refused (inside a checkpoint's temporary), else the file being written
        path = Path(err.filename) if e.path.is_dir() and getattr(err, "filename", None) else e.path
        saved = checkpoint.newest_complete(out) if out.is_dir() else None
        last = saved[0] if saved else 0
        lost = (f"{_steps(last + 1, e.step)} trained but in no checkpoint" if e.step > last else
                "nothing (every trained step is in the checkpoint)" if saved else "nothing (no step was trained)")
        again = f"then continue with --resume {out}" if saved else "then run again"
        fix = _fix(err, out, e.path if e.path.is_dir() else e.path.parent, again,
                   full=f"free space on the filesystem of {out} (df -h {out}) or lower train.keep_checkpoints")
        return Problem(f"cannot write {e.what}: {_why(err)}", _location(path),
                       context=f"saved: {_complete(saved)}; {_metrics_on_disk(out / 'metrics.jsonl')}\n  lost: {lost}",
                       hint=fix)

    def export_problem(self, err: OSError, export_dir: Path) -> Problem:
        """The export at the end of a finished run failed: training is complete and in the checkpoint; only the
        export is missing, and `dflash-graph export` writes it again from the checkpoint."""
        out = self.opts.out
        saved = checkpoint.newest_complete(out) if out.is_dir() else None
        again = f"then write the export from the checkpoint: dflash-graph export {out} --out {export_dir} --overwrite"
        fix = _fix(err, export_dir, export_dir, again, full=f"free space on the filesystem of {export_dir} (df -h {out})")
        path = Path(err.filename) if getattr(err, "filename", None) else export_dir
        return Problem(f"cannot write the drafter's export: {_why(err)}", _location(path),
                       context=f"saved: training is complete, {_complete(saved)}; "
                               f"{_metrics_on_disk(out / 'metrics.jsonl')}\n  lost: only the export in {export_dir}",
                       hint=fix)

    def fail(self, problem: Problem, how: str = "stopped the run"):
        """Stop the run with exit 2 and `problem`. Under torchrun the cause goes to the rendezvous store first, so
        every other rank stops at its next wait naming it (NOTE [Non-finite steps]), and this process exits at
        once (pending receives would keep it alive)."""
        if self.comm is None:
            raise GraphError(problem)
        devs = ", ".join(sorted(self.interp.local))
        where = f"{problem.loc.render()}: " if problem.loc.file else ""
        self.comm.fail(f"rank {self.rank} ({devs}) {how}: {where}{problem.message}")
        print(f"dflash-graph: rank {self.rank} ({devs}): {GraphError(problem)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)

    def _eval_line(self, ev: dict) -> None:
        if self.opts.progress and sys.stdout.isatty():
            print()
        print(self.summary.eval_line(ev), flush=True)

    def _stop_distributed(self, step: int, lost) -> int:
        """A rank was lost or Ctrl-C was pressed under torchrun: say why, keep what is consistent, exit at once.
        The writer's weights and optimizer are those of the last completed step (a stop is only taken between
        nodes, never inside an optimizer step), so that step is checkpointed. A lost rank: every rank says why it
        stops (exit 4). Ctrl-C: only the writer speaks, one line (exit 130 everywhere). os._exit: pending receives
        from a dead peer would otherwise keep the process alive."""
        from ..exec.distributed import EXIT_INTERRUPTED, EXIT_LOST, Interrupted

        interrupt = lost is None or isinstance(lost, Interrupted)
        kept = ""
        if self.is_writer and step > self.start_step and self.fsdp:
            # a sharded drafter's weights and optimizer are spread over its ranks: the writer alone holds 1/M
            saved = checkpoint.newest_complete(self.opts.out)
            kept = (f"the sharded drafter (fsdp) cannot be saved without every drafter rank: "
                    f"{_last_good(saved, 'no checkpoint was saved before')}")
            if saved:
                kept += f"; continue with --resume {self.opts.out}"
        elif self.is_writer and step > self.start_step:
            try:
                self._save(step, collective=False)     # the writer alone: its peers may be gone
                kept = f"checkpoint of step {step} saved to {self.opts.out / 'checkpoint'}; continue with " \
                       f"--resume {self.opts.out}"
            except Exception as e:   # the disk, not the run: say so, keep the exit status
                kept = f"saving the checkpoint of step {step} failed: {e}"
        elif self.is_writer:
            saved = checkpoint.newest_complete(self.opts.out)
            kept = ("no step completed since the checkpoint of step "
                    f"{saved[0]} in {self.opts.out / 'checkpoint'}; continue with --resume {self.opts.out}" if saved
                    else "no step completed, nothing saved")
        if interrupt:
            if self.is_writer:
                why = f"{lost} " if lost is not None and str(lost) else ""
                print(f"interrupted: {why}during step {step + 1}; {kept}", file=sys.stderr, flush=True)
        else:
            print(f"dflash-graph: {lost}{'; ' + kept if kept else ''}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED if interrupt else EXIT_LOST)

    def _write_rank_file(self) -> None:
        d = self.opts.out / "ranks"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{self.rank}.json").write_text(json.dumps({
            "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
            "devices": sorted(self.interp.local), "writer": self.is_writer,
            "torch": {k: self.tdev[k] for k in sorted(self.interp.local)}}, indent=2))

    def _save(self, step: int, collective: bool = True) -> None:
        """The checkpoint of `step`: by the writer, and with a data-parallel drafter by every drafter rank
        together (NOTE [Sharded checkpoints], train/checkpoint.py); `collective=False`: the writer alone, whole (a
        stop after a lost rank, when no collective can run)."""
        out = self.opts.out
        try:
            sharded = None
            if self.dp_group is not None and collective:
                from ..exec.distributed import gather_among

                if self.is_writer:     # what a killed save of this step left
                    shutil.rmtree(out / "checkpoints" / f".dcp-step-{step:08d}", ignore_errors=True)
                gather_among(self.comm, step, self.dp_group, self.dp_ranks, "the start of a checkpoint")
                sharded = checkpoint.save_sharded(out, step, self.store.drafters, self.opt, self.masters,
                                                  self.dp_group)
                if self.fsdp:
                    self._gather_whole()
            if not self.is_writer:
                return
            checkpoint.save(out, step, self.store.drafters, self.opt, self.sched,
                            {"batches": step * self.accum}, self.interp.generator,
                            {"graph": self.plan.typed.ctx.spec.name, "steps": self.steps,
                             "schedule_steps": self.schedule_steps, "stats": self.stats.state_dict(),
                             "replicas": self.launch.replicas}, self.masters,
                            keep=int(self.cfg.get("keep_checkpoints") or 3), sharded=sharded,
                            weights=self.whole_weights or None)
        except checkpoint.NonFiniteWeights as e:
            saved = checkpoint.newest_complete(out)
            kept = _last_good(saved, "no checkpoint was saved before")
            raise RunFailed(Problem(f"{e}; {kept}", _location(out / "checkpoints"),
                                    hint=f"lower train.lr (now {float(self.cfg['lr']):g}), check the loss node's params "
                                         "(gamma) and the data")) from None
        except OSError as e:
            raise WriteFailed(f"the checkpoint of step {step}", out / "checkpoints", e, step) from None

    def _memory_now(self) -> dict[str, int]:
        tr = self.interp.tracker
        if tr is not None:
            return {d: int(tr.peak[d]) for d in self.plan.typed.ctx.spec.devices if d in self.interp.local}
        cm = self.interp.cuda_meter
        local = [d for d in self.interp.local if self.tdev[d].startswith("cuda")]
        if cm is not None:
            return {d: int(cm.device_peak.get(d, (0, 0))[0]) for d in local}
        return {d: int(torch.cuda.max_memory_allocated(self.tdev[d])) for d in local}

    def _progress(self, rec: dict, t_start: float) -> None:
        # all rendering lives in train/progress.py (rich bar or plain lines, smoothed loss and tau, TensorBoard);
        # the command line may have set self.progress already (run --tensorboard)
        if getattr(self, "progress", None) is None:
            from .progress import Progress

            self.progress = Progress(self.steps, self.stats, self.start_step, bar=self.opts.progress,
                                     log_every=int(self.cfg["log_every"]))
        self.progress.update(rec)

    def _local_memory(self) -> tuple[dict, dict]:
        """This process's measured peaks, per local device and per node, next to the prediction."""
        mem = self.plan.memory
        tr = self.interp.tracker
        devices: dict[str, Any] = {}
        nodes: dict[str, Any] = {}
        for name, d in mem.devices.items():
            if name not in self.interp.local:
                continue
            tdev = self.tdev[name]
            rec = {"torch": tdev, "rank": self.rank,
                   "predicted_peak_bytes": d.live_peak_bytes if tr is not None else d.peak_bytes,
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
            devices[name] = rec
            if tr is not None:
                for node, pred in d.node_peaks.items():
                    if node in tr.node_peak and node in self.plan.typed.graph:
                        nodes.setdefault(node, {})[name] = {"predicted_peak_bytes": pred,
                                                            "measured_peak_bytes": int(tr.node_peak[node])}
            cm = self.interp.cuda_meter
            if cm is not None:
                # per node on CUDA: the allocator's own peaks in a window around the node (see exec/memtrack.py)
                for node, pred in d.node_peaks.items():
                    if node in cm.node_peak and node in self.plan.typed.graph:
                        a, r = cm.node_peak[node]
                        nodes.setdefault(node, {})[name] = {"predicted_peak_bytes": pred,
                                                            "measured_peak_bytes": int(a),
                                                            "measured_reserved_bytes": int(r)}
        return devices, nodes

    def _write_memory(self, step: int) -> dict[str, Any]:
        """memory.json: this invocation's measurement (of steps start_step+1..step) next to the prediction. A
        resume keeps the earlier invocations' measurements in it ("earlier", newest first), and an invocation
        that ran no step writes nothing: a measurement is never replaced by a lesser one."""
        devices, nodes = self._local_memory()
        if self.comm is not None:
            gathered = self.comm.gather((devices, nodes), dst=self.writer)
            if not self.is_writer:
                return {}
            devices, nodes = {}, {}
            for devs, nds in gathered:
                devices.update(devs)
                for k, v in nds.items():
                    nodes.setdefault(k, {}).update(v)
        tr = self.interp.tracker
        out: dict[str, Any] = {"graph": self.plan.typed.ctx.spec.name, "rewritten": self.plan.rewritten,
                               "processes": 1 if self.comm is None else self.comm.world,
                               "measured_with": "torch.cuda.max_memory_allocated/reserved" if tr is None else
                               "live tensor storages per logical device (exec/memtrack.py, as torch's MemTracker)",
                               "measured_steps": [self.start_step + 1, step],
                               "devices": {d: devices[d] for d in self.plan.memory.devices if d in devices},
                               "nodes": nodes}
        loader = getattr(self.opts.source, "loader_memory", None)
        if loader is not None and tr is not None:   # run --hidden-states: the loader's host memory (NOTE [From-disk memory])
            lm = loader()
            out["host_source"] = {"predicted_peak_bytes": lm.bytes, "predicted": lm.text(),
                                  "measured_in_process_peak_bytes": int(tr.peak[SOURCE_HOST]),
                                  "measured": "what the training process held for the source (the shard being "
                                              "consumed); the workers' prefetched shards are other processes'"}
        if step <= self.start_step:
            return out["devices"]
        path = self.opts.out / "memory.json"
        if self.opts.resume is not None:
            try:
                before = json.loads((self.opts.resume / "memory.json").read_text())
            except (OSError, ValueError):
                before = None
            if isinstance(before, dict):
                out["earlier"] = [{k: v for k, v in before.items() if k != "earlier"}, *before.get("earlier", [])]
        try:
            write_json(path, out)
        except OSError as e:
            raise WriteFailed("memory.json", path, e, self._step_now + 1) from None
        return out["devices"]
