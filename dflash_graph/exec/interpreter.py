"""Execute a checked (and rewritten) graph: each node's torch implementation on its node's device, replicas of
group nodes one after another, every value freed after its last use, memory measured as it goes.

One step runs the graph once per replica index r (a node on a group runs on the group's r-th device, a node on
one device runs there for every r: the drafter device trains on each target's batch in turn). Nodes that feed a
trainable model's loss run with autograd; everything else under no_grad.

Under torchrun a process owns only some devices (`local`): it runs the nodes placed on them, and a transfer whose
two ends are on different ranks is a send on one side (`Comm.send`) and, on the other, a tensor that has already
arrived in this rank's receive queue (`inbox`). In one process every device is local and a transfer is `.to()`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import attrs
import torch

from ..analysis.infer import Typed
from ..analysis.nodecost import grad_nodes, hook_refs
from ..ir.graph import Node, Ref
from ..ops import registry
from .contracts import check_node
from .memtrack import CudaMeter, LiveTracker
from .models import ModelStore


@attrs.define
class ExecContext:
    node: Node
    params: Mapping[str, Any]
    device: torch.device
    logical_device: str
    replica: int
    wanted: frozenset[str]
    generator: torch.Generator
    store: ModelStore
    batch_fn: Callable[[int], Mapping[str, torch.Tensor]]

    def module(self, role: str):
        return self.store.module(self.node, role, str(self.device))

    def batch(self) -> Mapping[str, torch.Tensor]:
        return self.batch_fn(self.replica)

    def send(self, x: torch.Tensor) -> torch.Tensor:
        # a transfer makes a new buffer on the receiving device, also between logical devices of one torch device
        y = x.to(self.device, non_blocking=False)
        return y.clone() if y is x or y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else y


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def _impl(op_name: str):
    mod, _, fn = registry.get(op_name).impl.partition(":")
    return getattr(importlib.import_module(mod), fn)


class Interpreter:
    def __init__(self, typed: Typed, store: ModelStore, torch_device: Mapping[str, str], strict: bool = False,
                 seed: int = 0, track_memory: bool = True, local: frozenset[str] | None = None, comm=None):
        self.typed, self.store, self.torch_device, self.strict = typed, store, dict(torch_device), strict
        self.local = frozenset(typed.ctx.spec.devices) if local is None else frozenset(local)
        self.comm = comm
        self.on_node: Callable[[str, int], None] | None = None
        g = typed.graph
        self.order = list(g.nodes)
        self.grads = grad_nodes(typed)
        self.replicas = max((len(typed.ctx.devices_of(n.device)) for n in self.order), default=1)
        self.impls = {n.id: _impl(n.op) for n in self.order}
        self.last_use: dict[Ref, str] = {}
        for n in self.order:
            for _, r in n.inputs:
                self.last_use[r] = n.id
        self.sinks = [n.id for n in self.order if registry.get(n.op).traits.sink]
        self.generator = torch.Generator().manual_seed(seed)
        self.tracker = LiveTracker() if track_memory else None
        cuda = any(str(self.torch_device[d]).startswith("cuda") for d in self.local)
        self.cuda_meter = CudaMeter() if cuda and track_memory else None
        self._sched: list[tuple] | None = None
        self.params = {n.id: {k: (v[1] if isinstance(v, tuple) and k in typed.params[n.id].get("_dim_params", ()) else v)
                              for k, v in typed.params[n.id].items()} for n in self.order}

    def device_of(self, node: Node, r: int) -> str:
        devs = self.typed.ctx.devices_of(node.device)
        return devs[r % len(devs)]

    def role(self, node: Node, r: int) -> str:
        """What this process does with a node for replica r: run it, only send (its input is here, its device is
        another rank's), take its output from the receive queue ('recv'), or nothing ('skip')."""
        here = self.device_of(node, r) in self.local
        if registry.get(node.op).traits.movement:
            (_, src), = node.inputs
            there = self.device_of(self.typed.graph[src.node], r) in self.local
            if here and there:
                return "run"
            return "send" if there else ("recv" if here else "skip")
        return "run" if here else "skip"

    def runs_replica(self, r: int) -> bool:
        return any(self.role(n, r) != "skip" for n in self.order)

    def charge_weights(self) -> None:
        """Charge resident weights to each logical device that uses them (as the prediction does)."""
        if self.tracker is None:
            return
        seen: set[tuple[str, int]] = set()
        for n in self.order:
            if not n.model:
                continue
            for dev in self.typed.ctx.devices_of(n.device):
                if dev not in self.local:
                    continue
                tdev = self.torch_device[dev]
                for role in registry.get(n.op).module_roles():     # declared by the op (Traits.modules)
                    for p in self.store.resident(n, role, tdev):
                        key = (dev, p.untyped_storage().data_ptr())
                        self.tracker.adopt(p, dev, charge=key not in seen)
                        seen.add(key)

    def _schedule(self) -> list[tuple]:
        """Per node, everything run_replica needs, computed once: the engine's per-node cost stays small."""
        sched = []
        for n in self.order:
            op = registry.get(n.op)
            wanted = frozenset(k for k in self.typed.outputs_of(n.id)
                               if self.typed.graph.consumers(Ref(n.id, k)) or op.traits.sink)
            frees = tuple(ref for _, ref in n.inputs if self.last_use.get(ref) == n.id)
            devices = [self.device_of(n, r) for r in range(self.replicas)]
            tdevs = [torch.device(self.torch_device[d]) for d in devices]
            params = self.params[n.id]
            if "taps" in self.typed.outputs_of(n.id):
                params = {**params, "_taps": sorted(hook_refs(self.typed, n.id))}
            roles = [self.role(n, r) for r in range(self.replicas)]
            sched.append((n, self.impls[n.id], params, wanted, frees, devices, tdevs,
                          n.id in self.grads, n.id in self.sinks, op, roles))
        return sched

    def run_replica(self, r: int, batch_fn, keep: frozenset[Ref] = frozenset(), generator: torch.Generator | None = None,
                    inbox: MutableMapping[str, torch.Tensor] | None = None,
                    sends: Mapping[str, Any] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """Forward of the graph's local nodes for replica index r; returns the sink nodes' outputs (and, under
        their node ids, any outputs named in `keep`, which are then not freed after their last use). `generator`
        drives the random nodes of this replica's micro-batch (anchor sampling); `inbox` holds the transfers that
        arrived from other ranks; `sends` maps a transfer node to its cross-rank route (exec/distributed.py)."""
        env: dict[Ref, torch.Tensor] = {}
        results: dict[str, dict[str, torch.Tensor]] = {}
        tr = self.tracker
        gen = self.generator if generator is None else generator
        if self._sched is None:
            self._sched = self._schedule()
        for n, impl, params, wanted, frees, devices, tdevs, grad, sink, op, roles in self._sched:
            role = roles[r]
            if role == "skip":
                continue
            dev, tdev = devices[r], tdevs[r]
            if self.on_node is not None:
                self.on_node(n.id, r)
            if role == "send":
                (_, src), = n.inputs
                self.comm.send(env[src], sends[n.id])
                if self.last_use.get(src) == n.id:
                    env.pop(src, None)
                continue
            if role == "recv":
                # taken out of the inbox: the buffer then lives only as long as its readers need it (freed after
                # its last use like any value, as analysis/memory.py counts it), not to the end of the replica
                outs = {"out": inbox.pop(n.id)}
                if tr is not None:
                    tr.charge(dev, n.id)
                    tr.receive(outs["out"], dev)   # it is this device's now, whoever made it (memtrack.receive)
            else:
                ctx = ExecContext(n, params, tdev, dev, r, wanted, gen, self.store, batch_fn)
                inputs = {p: env[ref] for p, ref in n.inputs}
                if tr is not None:
                    tr.charge(dev, n.id)
                meter = self.cuda_meter.window(dev, tdev, n.id) if self.cuda_meter and tdev.type == "cuda" else _NULL
                with torch.set_grad_enabled(grad), meter:
                    outs = impl(ctx, **inputs)
            if self.strict and role == "run":
                check_node(op, n.id, self.typed.params[n.id], {**inputs, **outs},
                           {**self.typed.inputs_of(n.id), **self.typed.outputs_of(n.id)}, str(tdev), len(n.inputs))
            for k, v in outs.items():
                if k in wanted:
                    env[Ref(n.id, k)] = v
            if sink:
                results[n.id] = outs
            if keep:
                for k, v in outs.items():
                    if Ref(n.id, k) in keep:
                        results.setdefault(n.id, {})[k] = v
            del outs
            inputs = None
            for ref in frees:
                env.pop(ref, None)
        if tr is not None:
            tr.charge(self._backward_device(r), "backward")
        return results

    def window(self, r: int, name: str):
        """A measuring window on the trainable device (backward, optimizer step) when it is a CUDA device."""
        dev = self._backward_device(r)
        if self.cuda_meter is None or dev is None or not self.torch_device[dev].startswith("cuda"):
            return _NULL
        return self.cuda_meter.window(dev, torch.device(self.torch_device[dev]), name)

    def _backward_device(self, r: int) -> str | None:
        for n in reversed(self.order):
            if n.id in self.grads and self.device_of(n, r) in self.local:
                return self.device_of(n, r)
        return None
