"""A trainable model declared `parallel = "ddp" | "fsdp"`: which devices hold its replicas, and what check refuses
about that placement. No torch here.

NOTE [Data-parallel placement]: the trainable model's nodes (every node autograd records: `grad_nodes`) sit on
one placement, a device or a group of M devices. Replica r of the graph (r < R, the widest group) runs a node
placed on a group of size G on the group's device r mod G (`launch.device_for`), so a transfer from a group of N
target devices into the model's group of M sends replica r's batch to the model's replica r mod M: that is the
routing, the same rule for every placement, with the bounded queues of any transfer. Colocated is the case where
the target's nodes and the model's share the group (no transfer crosses a rank). Each of the M replicas trains
on R / M batches per micro-batch, and DDP and FSDP reduce gradients once per optimizer step on every rank, so R
must be a multiple of M. Without `parallel` the model trains on one device, as it always has.
"""

from __future__ import annotations

import attrs

from ..errors import Problem
from .infer import Typed


@attrs.frozen
class DataParallel:
    model: str                  # the trainable model's name
    engine: str                 # "ddp" | "fsdp"
    placement: str              # the device or group its nodes are placed on
    devices: tuple[str, ...]    # its replicas' devices, replica j on devices[j]


def fsdp_shard(params: int, m: int) -> int:
    """Elements of one FSDP2 shard of a parameter block: dim 0 chunked into m, padded to m equal chunks
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, padded_sharded_param_size); counted on the block."""
    return -(-params // m)


def trainable_placements(typed: Typed) -> dict[str, list[str]]:
    """Placement -> the nodes autograd records that are placed there, in graph order."""
    from .nodecost import grad_nodes

    grads = grad_nodes(typed)
    out: dict[str, list[str]] = {}
    for n in typed.graph.nodes:
        if n.id in grads:
            out.setdefault(n.device, []).append(n.id)
    return out


def trained_model(typed: Typed) -> str | None:
    """The trainable model the graph trains (the first declared that a node uses)."""
    used = {n.model for n in typed.graph.nodes}
    return next((m for m, info in typed.ctx.models.items() if info.spec.trainable and m in used), None)


def data_parallel(typed: Typed) -> DataParallel | None:
    """The data-parallel model of a checked graph, or None when the trainable model is on one device."""
    name = trained_model(typed)
    if name is None or typed.ctx.models[name].spec.parallel is None:
        return None
    places = trainable_placements(typed)
    if not places:
        return None
    place = next(iter(places))
    return DataParallel(name, typed.ctx.models[name].spec.parallel, place, typed.ctx.devices_of(place))


def placement_problems(typed: Typed) -> list[Problem]:
    """What check refuses about where a trainable model's nodes sit (NOTE [Data-parallel placement])."""
    spec, ctx = typed.ctx.spec, typed.ctx
    name = trained_model(typed)
    if name is None:
        return []
    engine = ctx.models[name].spec.parallel
    places = trainable_placements(typed)
    nodes = {n.id: n for n in typed.graph.nodes}
    problems = []
    if engine is None:
        for place, ids in places.items():
            devs = ctx.devices_of(place)
            if len(devs) > 1:
                n = nodes[ids[0]]
                problems.append(Problem(
                    f"node '{n.id}' trains model '{name}' and is placed on group '{place}' ({len(devs)} devices: "
                    f"{', '.join(devs)}), but model '{name}' declares no `parallel`: a trainable model without it "
                    "trains on one device", ctx.loc(n, "device"), node=n.id,
                    expected="one device, or [models.%s] parallel = \"ddp\" | \"fsdp\"" % name,
                    actual=f"device = '{place}' ({len(devs)} devices)",
                    hint=f"declare parallel = \"ddp\" or \"fsdp\" in [models.{name}] (one replica per device of "
                         f"'{place}': docs/distributed.md, \"Layouts\"), or place the node on one device"))
                break
        return problems
    where = spec.loc("models", name, "parallel")
    if len(places) > 1:
        (p0, ids0), (p1, ids1) = list(places.items())[:2]
        n = nodes[ids1[0]]
        problems.append(Problem(
            f"model '{name}' is data-parallel (parallel = {engine!r}), so every node it trains through must sit on "
            f"its replicas' one placement: node '{ids0[0]}' is on '{p0}', node '{n.id}' on '{p1}'",
            ctx.loc(n, "device"), node=n.id, expected=f"device = '{p0}'", actual=f"device = '{p1}'",
            hint=f"place '{n.id}' on '{p0}' (each replica computes its own loss; gradients are reduced across them)"))
        return problems
    if not places:
        return []
    place, ids = next(iter(places.items()))
    devs = ctx.devices_of(place)
    R = max(len(ctx.devices_of(n.device)) for n in typed.graph.nodes)   # the graph's replicas (launch.replicas)
    if R % len(devs):
        problems.append(Problem(
            f"model '{name}' has {len(devs)} data-parallel replicas ({', '.join(devs)}) and the graph {R} replicas: "
            f"replica r feeds the model's replica r mod {len(devs)}, so some replicas would train on more batches "
            f"than others, and {engine.upper()} reduces gradients once per step on every rank", where,
            expected=f"a replica count that divides {R}", actual=f"{len(devs)} devices in '{place}'",
            hint=f"give '{place}' a number of devices that divides {R} (or the target group a multiple of "
                 f"{len(devs)})"))
    ranks = [spec.rank_of(d) for d in devs]
    if len(set(ranks)) < len(ranks):
        problems.append(Problem(
            f"model '{name}' is data-parallel over '{place}', but its devices share ranks "
            f"({', '.join(f'{d}={k}' for d, k in zip(devs, ranks))}): {engine.upper()} runs one replica per process",
            spec.loc("devices", next(d for i, d in enumerate(devs) if ranks[i] in ranks[:i]), "rank"),
            hint=f"give each device of '{place}' its own rank"))
    return problems
