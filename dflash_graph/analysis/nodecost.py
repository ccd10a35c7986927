"""What each node is to every analysis after inference: the cost its op declares (`node_cost`, with the layers
its hook nodes capture, `hook_refs`) and whether autograd records it (`grad_seed`, `grad_nodes`).

The memory model (memory.py), the launch's busy time (launch.py), the rewrites' certificates, `explain` and the
interpreter all read these facts here, so that none of them asks another analysis for them.
"""

from __future__ import annotations

from ..ir.graph import Node, Ref
from ..ops import registry
from ..ops.costs import CostContext, NodeCost
from ..units import DTYPE_BYTES
from .infer import Typed


def grad_nodes(typed: Typed) -> set[str]:
    """Nodes autograd records: those using a trainable model's own weights, and everything downstream of them."""
    if "_grad_nodes" not in typed.cache:
        typed.cache["_grad_nodes"] = frozenset(_grad_nodes(typed))
    return set(typed.cache["_grad_nodes"])


def _grad_nodes(typed: Typed) -> set[str]:
    out: set[str] = set()
    for n in typed.graph.nodes:
        if grad_seed(typed, n) or any(r.node in out for _, r in n.inputs):
            out.add(n.id)
    return out


def node_cost(typed: Typed, node: Node, grad: bool) -> NodeCost:
    op = registry.get(node.op)
    if op.cost is None:
        return NodeCost()
    return op.cost(cost_context(typed, node, grad, typed.inputs_of(node.id), typed.outputs_of(node.id)))


def cost_context(typed: Typed, node: Node, grad: bool, ins, outs) -> CostContext:
    """What an op's cost function reads about a node, given its input and output types (concrete, or symbolic
    for `explain`)."""
    model = typed.ctx.models.get(node.model) if node.model else None
    if model is not None:
        db = DTYPE_BYTES[model.spec.dtype]
    else:
        db = DTYPE_BYTES[next(iter(ins.values())).dtype] if ins else 4
    taps = frozenset(hook_refs(typed, node.id)) if "taps" in outs else frozenset()
    owners = {}
    if model is not None:
        for comp in registry.get(node.op).components:
            owner = typed.ctx.models.get(model.component_owner(comp).split(".")[0])
            if owner is not None:
                owners[comp] = owner.dims
    return CostContext(node, ins, outs, model.dims if model else None, db, grad, taps, owners)


def hook_refs(typed: Typed, nid: str) -> dict[int, Ref]:
    """For a forward node: each layer that hook_capture nodes ask for through its `taps`, and the output (of the
    hook node) that owns it. A layer is captured by at most one hook node (checked by infer)."""
    key = ("hooks", nid)
    if key not in typed.cache:
        out: dict[int, Ref] = {}
        for hook_id, _ in typed.graph.consumers(Ref(nid, "taps")):
            for i in registry.get(typed.graph[hook_id].op).layer_ids(typed.params[hook_id]):
                out.setdefault(int(i), Ref(hook_id, f"layer{i}"))
        typed.cache[key] = out
    return typed.cache[key]


def grad_seed(typed: Typed, node: Node) -> bool:
    """A node autograd records whatever its inputs: it uses a trainable model's own weights (grad_nodes)."""
    op = registry.get(node.op)
    if not (node.model and op.components):
        return False
    m = typed.ctx.models[node.model]
    return m.spec.trainable and any(m.component_owner(c).split(".")[0] == node.model for c in op.components)

