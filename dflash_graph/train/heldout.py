"""The held-out evaluation of a run under torchrun, inside the job, and what an evaluation holds on its device.

NOTE [Held-out evaluation under torchrun]: the run in one process evaluates the held-out split every
`train.eval_every` steps and at the last step (train/summary.py); under torchrun the same steps are evaluated, by
one rank, while every other rank waits:

- Who: the writer when it holds a target replica itself (a colocated layout), else the rank of replica 0's target
  (`evaluator`). That rank has the target built on its device already, so it adds only what the drafter side needs:
  the drafter (its own weights: the embedding it borrows is the target's), the target's lm_head when that replica
  dropped it (ModelStore.drop_unused_heads: no node on its device reads logits), and the forward's logits. The
  other way round, the writer would build a whole target beside the drafter and its optimizer state (50 GiB for
  qwen27b's, on the drafter's GPU).
- Memory first: that rank compares those bytes (`eval_need`, the figures `eval` checks before it loads anything)
  with what its device has free now (`free_bytes`). When they do not fit, no rank evaluates that step, and the
  writer says why (the rank, the device, both figures) and how to measure tau from the checkpoint (`eval`).
- The drafter's weights come from the writer: its module's state (a sharded drafter's all-gathered by its ranks
  first, as for a checkpoint), sent over the control group (gloo, through the host). Not over the default group:
  under NCCL the writer's receive of the evaluator's next batch is already posted on that pair's stream, and a
  send queued behind it would wait for a batch that comes only after the evaluation.
- The forward is the one-process evaluation's (train/evaluate.py) on an Interpreter that puts every logical device
  on the evaluator's torch device: the same graph, loss op, sequences and seeded anchors, so the loss and tau are
  the one-process run's (tests/test_distributed.py, tests/test_eval_bench.py).
- Waiting: the others wait for the result in a watched broadcast (Comm._watch without stall_timeout: an evaluation
  takes as long as it takes, and a lost heartbeat or a recorded cause still ends the wait); the evaluator looks for
  a stop at every node (Comm.set_where), so a rank killed, or Ctrl-C, during the evaluation stops every rank, named,
  as during training. The run's memory tracker (exec/memtrack.py) does not count what the evaluation allocates:
  memory.json compares training with check's prediction.
- Cost: `eval_batches` x R packed sequences, forward only, on one rank; in one process the same forwards run, but
  training's R target forwards per micro-batch run there one after another too, so under torchrun an evaluation
  weighs about as many training steps as in one process times the number of target ranks.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from ..analysis.launch import device_for
from ..ops import registry
from .trained import drafter_names

if TYPE_CHECKING:
    import torch


# -- memory before building ------------------------------------------------------------------------------------
def eval_need(plan, drafter: str, target: str, tokens: int) -> dict[str, int]:
    """Bytes eval holds on its device, by part, before any model is built: the target's weights (every component:
    the decoder runs its whole causal LM), the drafter's own weights (not those it shares with the target), and
    one forward's logits over the longest sequence (`tokens` positions x vocab, in the target's dtype; the
    decoders compute the logits of every position). Parameter counts are each arch's `component_params`
    (models/<arch>.py, the same counts check's memory model uses); tests/test_speculative.py compares them with
    the parameters of the modules eval builds for tiny. A lower bound: temporaries inside a forward come on top."""
    from ..models.registry import ARCHS
    from ..units import DTYPE_BYTES

    models = plan.typed.ctx.models
    t, d = models[target], models[drafter]
    tb = DTYPE_BYTES[t.spec.dtype]
    target_w = sum(ARCHS[t.spec.arch].component_params(t.dims).values()) * tb
    own = {c: n for c, n in ARCHS[d.spec.arch].component_params(d.dims).items() if c not in d.spec.shares}
    vocab = int(getattr(t.dims, "vocab_size", 0) or 0)
    return {"target weights": target_w, "drafter weights": sum(own.values()) * DTYPE_BYTES[d.spec.dtype],
            "logits": tokens * vocab * tb}


def free_bytes(device: str, fresh: bool = False) -> tuple[int | None, str]:
    """(bytes `device` has free for this process, where that figure comes from): on CUDA what the driver reports
    free plus what this process's caching allocator holds unused; on CPU the host's MemAvailable (`fresh`: read now,
    not the figure this process read first, which every figure of one check shares)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        unused = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        if not unused:
            return free, f"free on {device} (torch.cuda.mem_get_info)"
        return free + unused, (f"free on {device}: torch.cuda.mem_get_info, plus {unused:,} B the caching allocator "
                               "holds unused")
    from ..analysis.memory import host_available_bytes

    n, src = host_available_bytes.__wrapped__() if fresh else host_available_bytes()
    return n, f"this host's {src}"


# -- under torchrun --------------------------------------------------------------------------------------------
def evaluator(typed, writer: int) -> tuple[int, str] | None:
    """(rank, logical device) of the target replica beside which the held-out evaluation runs: the writer's own
    when it holds one, else replica 0's; None when no node runs a target's body."""
    spec = typed.ctx.spec
    R = max((len(typed.ctx.devices_of(n.device)) for n in typed.graph.nodes), default=1)
    bodies = [n for n in typed.graph.nodes if "body" in registry.get(n.op).module_roles()]
    found = [(spec.rank_of(device_for(typed, n.device, r)), device_for(typed, n.device, r))
             for r in range(R) for n in bodies]
    return next((f for f in found if f[0] == writer), found[0] if found else None)


@contextlib.contextmanager
def _untracked(trainer):
    """The run's memory tracker charges nothing while the evaluation runs (NOTE above)."""
    tr = trainer.interp.tracker
    if tr is None:
        yield
        return
    prev = (tr.device, tr.node)
    tr.charge(None, None)
    try:
        yield
    finally:
        tr.charge(*prev)


def _lm_head_owner(typed, drafter: str) -> str:
    return typed.ctx.models[drafter].component_owner("lm_head").split(".")[0]


def _verdict(t, step: int) -> dict[str, Any]:
    """On the evaluator: what it lacks (the lm_head of its target replica, when that was dropped) and whether the
    drafter side fits beside its target now; {"skip": why} when it does not."""
    from ..units import fmt_bytes

    typed = t.plan.typed
    drafter, target = drafter_names(t.plan)
    tdev = t.tdev[t.eval_device]
    full = t.store.full(target, tdev)
    owner = _lm_head_owner(typed, drafter)
    wants_head = owner == target and getattr(full, "lm_head", None) is None
    need = eval_need(t.plan, drafter, target, t._seq_len())
    parts = {"drafter weights": 0 if _reuses_drafter(t, tdev) else need["drafter weights"]}
    if wants_head:
        m = typed.ctx.models[target]
        from ..units import DTYPE_BYTES

        parts["lm_head"] = int(m.dims.vocab_size) * int(m.dims.hidden_size) * DTYPE_BYTES[m.spec.dtype]
    parts["logits"] = need["logits"]
    have, src = free_bytes(tdev, fresh=True)
    total = sum(parts.values())
    if have is not None and total > have:
        what = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items() if v)
        return {"wants_head": wants_head,
                "skip": f"the held-out evaluation of step {step} would need at least {fmt_bytes(total)} on rank "
                        f"{t.rank} ({t.eval_device}, {tdev}) beside its target ({what}), and it has "
                        f"{fmt_bytes(have)} ({src}); not evaluated: dflash-graph eval GRAPH --checkpoint "
                        f"{t.opts.out} measures tau from the checkpoint"}
    return {"wants_head": wants_head, "skip": None}


def _reuses_drafter(t, tdev: str) -> bool:
    """The evaluator is the writer, its drafter whole (not sharded) and on the evaluation's device: it evaluates
    with the training module itself (its own parameters, not its data-parallel wrapper)."""
    import torch

    if t.rank != t.writer or t.fsdp:
        return False
    drafter, _ = drafter_names(t.plan)
    return str(next(t.store.drafters[drafter].parameters()).device) == str(torch.device(tdev))


def _payload(t, drafter: str, target: str, wants_head: bool, whole: dict | None) -> dict[str, torch.Tensor]:
    """On the writer: the tensors the evaluator builds the drafter side from, by name."""
    state = whole if whole is not None else t.store.drafters[drafter].state_dict()
    out = {f"drafter.{k}": v.detach() for k, v in state.items()}
    if wants_head:
        dev = t.tdev[t.interp._backward_device(t.local_rs[0])]
        out["lm_head.weight"] = t.store.component(target, "lm_head", dev).weight.detach()
    return out


def _transfer(t, payload: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """The writer's `payload` on the evaluator (CPU tensors), over the control group; None on the other ranks.
    Every rank takes part in the broadcast of the names, shapes and dtypes."""
    import torch

    comm, src, dst = t.comm, t.writer, t.eval_rank
    meta = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in payload.items()] \
        if t.rank == src else None
    meta = comm.broadcast(meta, src=src, what="the names of the drafter's weights for the held-out evaluation")
    if t.rank not in (src, dst):
        return None
    if t.rank == src:
        bufs = {k: v.to("cpu").contiguous() for k, v in payload.items()}
        peer, what = dst, f"sending the drafter's weights to rank {dst} for the held-out evaluation"
    else:
        bufs = {k: torch.empty(shape, dtype=getattr(torch, dt)) for k, shape, dt in meta}
        peer, what = src, f"the drafter's weights from rank {src} for the held-out evaluation"
    comm.exchange([bufs[k] for k, *_ in meta], peer, send=t.rank == src, what=what)
    return bufs if t.rank == dst else None


def _evaluate_here(t, step: int, state: dict[str, torch.Tensor] | None, head: torch.Tensor | None) -> dict[str, Any]:
    """On the evaluator: the whole graph beside its target replica, the drafter's weights `state` (None: the
    training module itself), `head` the target's lm_head weight where its replica dropped it, and the one-process
    evaluation's forward."""
    import torch

    from ..exec.interpreter import Interpreter
    from .evaluate import evaluate

    typed = t.plan.typed
    drafter, target = drafter_names(t.plan)
    tdev = t.tdev[t.eval_device]
    store = t.store.on_one_device(tdev)
    full = store.full(target, tdev)
    try:
        if head is not None:
            lm = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, device=tdev, dtype=head.dtype)
            with torch.no_grad():
                lm.weight.copy_(head)
            full.lm_head = lm.requires_grad_(False)
        if state is None:
            store.drafters[drafter] = t.store.drafters[drafter]
        else:
            cuda = [torch.device(tdev)] if torch.device(tdev).type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):       # building draws an initialisation: not from the run's
                module = store.drafter(drafter, tdev, published=False)
            own = module.state_dict()
            module.load_state_dict({k: v.to(own[k].device, own[k].dtype) for k, v in state.items()})
        interp = Interpreter(typed, store, {d: tdev for d in typed.ctx.spec.devices}, strict=t.opts.strict,
                             seed=t.seed, track_memory=False)
        interp.on_node = lambda node, r: t.comm.set_where(step, f"held-out evaluation: {node}", r)
        res = evaluate(interp, t.loss_node, t.held, t.summary.eval_batches, t.seed)
    finally:
        if head is not None:
            full.lm_head = None          # as training holds it: dropped
    return {"step": step, **res}


def evaluate_under_torchrun(t, step: int) -> dict[str, Any]:
    """Every rank of the run calls this at an evaluation step (NOTE above): the evaluator's result on every rank,
    {"step", loss, tau, ...}, or {"step", "skipped": why}."""
    comm = t.comm
    drafter, target = drafter_names(t.plan)
    comm.set_where(step, f"(waiting for the held-out evaluation on rank {t.eval_rank})" if t.rank != t.eval_rank
                   else "(the held-out evaluation)", None)
    with _untracked(t):
        verdict = _verdict(t, step) if t.rank == t.eval_rank else None
        verdict = comm.broadcast(verdict, src=t.eval_rank, what=f"the held-out evaluation on rank {t.eval_rank}")
        if verdict["skip"]:
            return {"step": step, "skipped": verdict["skip"]}
        whole = t._whole_state() if t.fsdp and t.is_drafter else None     # collective over the drafter ranks
        state = head = None
        if t.eval_rank != t.writer:
            got = _transfer(t, _payload(t, drafter, target, verdict["wants_head"], whole) if t.is_writer else None)
            if got is not None:
                head = got.pop("lm_head.weight", None)
                state = {k.removeprefix("drafter."): v for k, v in got.items()}
        elif t.is_writer:
            payload = _payload(t, drafter, target, verdict["wants_head"], whole)
            head = payload.pop("lm_head.weight", None)
            if not _reuses_drafter(t, t.tdev[t.eval_device]):
                state = {k.removeprefix("drafter."): v for k, v in payload.items()}
            del payload
        del whole
        res = _evaluate_here(t, step, state, head) if t.rank == t.eval_rank else None
        del state, head
        return comm.broadcast(res, src=t.eval_rank, what=f"the held-out evaluation on rank {t.eval_rank}")
