"""The rewrite rules. Each is legal because of a declared trait of the ops involved (ops/contract.py Traits),
never because of a node's id or op name. docs/rules/ has one page per rule with the proof sketch."""

from __future__ import annotations

from collections.abc import Mapping

from ..ir.graph import Graph, Node, Ref
from ..ops import registry
from ..ops.catalog import INDEX_SHIFT, TRANSFER
from ..ops.contract import tokens
from ..analysis.infer import Typed
from .engine import Replacement, Rule


def _op(node: Node):
    return registry.get(node.op)


def deterministic(op) -> bool:
    """Same inputs and params, same outputs: a node of this op may be merged with a twin (merge_duplicates) or
    recomputed on another device (_index_on). Declared by the op: Traits.pure and Traits.deterministic
    (anchor_sample is pure, removable when unread, but draws from the run's generator: a second copy samples
    other anchors)."""
    t = op.traits
    return t.pure and t.deterministic and not t.sink


def _deterministic(node: Node) -> bool:
    return deterministic(_op(node))


def _sole_consumer(typed: Typed, ref: Ref, nid: str) -> bool:
    return [c for c, _ in typed.graph.consumers(ref)] == [nid]


# -- decompose ------------------------------------------------------------------------------------------------

def _decompose(typed: Typed, node: Node) -> Replacement | None:
    dec = _op(node).traits.decompose
    if dec is None:
        return None
    new_nodes, out_map = dec(node, typed.graph.fresh_id)
    redirect = {Ref(node.id, k): v for k, v in out_map.items()}
    return Replacement(remove=(node.id,), add=tuple(new_nodes), redirect=redirect,
                       touched=tuple(n.id for n in new_nodes), always=True)


DECOMPOSE = Rule("decompose_forward", "Traits.decompose",
                 "Replace a fused op by the equivalent subgraph it declares (causal_lm_forward = body_forward -> "
                 "norm -> lm_head), so that later rules can see and drop its parts.", _decompose)


# -- dead outputs -----------------------------------------------------------------------------------------------

def removable(op) -> bool:
    """A node of this op none of whose outputs is read may be removed (rewrite/proofs.py proves it from the same
    predicate)."""
    return op.traits.pure and not op.traits.sink


def _drop_unused(typed: Typed, node: Node) -> Replacement | None:
    op = _op(node)
    if op.traits.sink:
        return None
    read = typed.graph.read_outputs(node.id)
    if not read and removable(op):
        return Replacement(remove=(node.id,), touched=(node.id,))
    if op.traits.drop_outputs is None:
        return None
    ports = {p.name: p for p in op.output_ports(typed.params[node.id])}
    dropped = frozenset(k for k, p in ports.items() if p.optional and k not in read)
    if not dropped:
        return None
    params = op.traits.drop_outputs(node.params, dropped)
    if dict(params) == dict(node.params):
        return None
    return Replacement(remove=(node.id,), add=(node.evolve(params=params),), touched=(node.id,))


DROP_UNUSED = Rule("drop_unused", "Traits.pure / Port.optional",
                   "A pure node none of whose outputs is read is removed; an optional output no one reads is not "
                   "computed (a hook whose layer no one reads is not registered).", _drop_unused)


# -- selection through a position permutation (roll) ------------------------------------------------------------

def _selection(typed: Typed, node: Node):
    """(selection trait, the selected tensor, its producer) when `node` is a selection, else None."""
    sel = _op(node).traits.selection
    if sel is None:
        return None
    src = node.input(sel.source)
    return sel, src, typed.graph[src.node]


def remap_index(shift, n):
    """The node that maps a selection's index through a remap by `shift` along an axis of `n` positions:
    roll: out[i] = x[(i - shift) mod n]  =>  gather(roll(x), idx) = gather(x, (idx - shift) mod n).
    Exact only for 0 <= idx < n (gather clamps; rewrite/proofs.py finds the condition), so the index node checks
    that range at run time (`check_range`). Also evaluated on solver terms by rewrite/proofs.py."""
    return INDEX_SHIFT.name, {"shift": -shift % n, "modulo": n, "check_range": True}


def _gather_through_remap(typed: Typed, node: Node) -> Replacement | None:
    if (found := _selection(typed, node)) is None:
        return None
    sel, src, prod = found
    remap = _op(prod).traits.remap
    if remap is None:
        return None
    p_params, g_params = typed.params[prod.id], typed.params[node.id]
    axis = g_params[sel.axis_param]
    if p_params[remap.axis_param] != axis:
        return None
    n = typed.types[src].sizes[axis]
    shift = int(p_params[remap.shift_param])
    idx_id = typed.graph.fresh_id(f"{node.id}_index")
    op, params = remap_index(shift, n)
    idx = Node(idx_id, op, (("index", node.input(sel.index)),), params,
               node.device, note=f"gather_through_remap: index of {node.id} through {prod.id}")
    (_, x_ref), = prod.inputs
    new = node.evolve(inputs=tuple((p, x_ref if p == sel.source else (Ref(idx_id, "out") if p == sel.index else r))
                                   for p, r in node.inputs), note=f"gather_through_remap: was reading {prod.id}")
    return Replacement(remove=(node.id,), add=(idx, new), touched=(node.id, prod.id))


GATHER_THROUGH_REMAP = Rule("gather_through_remap", "Traits.remap (IndexRemap)",
                            "gather(roll(x, k, axis), idx, axis) = gather(x, (idx - k) mod n, axis): a roll is a "
                            "permutation of positions, so selecting after it is selecting at permuted indices.",
                            _gather_through_remap)


# -- selection through a position-wise op ------------------------------------------------------------------------

def _group_span(spec: str, group: str, rank: int) -> tuple[int, int] | None:
    """(start, length) of the variadic `*group` in a contract matched against a tensor of `rank`."""
    toks = tokens(spec)
    if f"*{group}" not in toks:
        return None
    i = toks.index(f"*{group}")
    length = rank - (len(toks) - 1)
    return i, length


def positionwise_axis(out_start, axis, in_start):
    """The axis of an input that corresponds to `axis` of a position-wise op's output: the same place in the
    group (the group starts at `out_start` in the output, at `in_start` in the input). Also evaluated on solver
    terms by rewrite/proofs.py."""
    return in_start + (axis - out_start)


def _gather_through_positionwise(typed: Typed, node: Node) -> Replacement | None:
    if (found := _selection(typed, node)) is None:
        return None
    sel, src, prod = found
    pop = _op(prod)
    group = pop.traits.positionwise
    if group is None or not _sole_consumer(typed, src, node.id):
        return None
    axis = typed.params[node.id][sel.axis_param]
    idx_ref = node.input(sel.index)
    out_t = typed.types[src]
    # only when the selection makes the tensor smaller along the axis: otherwise it would move work up, not down
    if typed.types[idx_ref].numel > out_t.sizes[axis]:
        return None
    pparams = typed.params[prod.id]
    out_port = next(p for p in pop.output_ports(pparams) if p.name == src.output)
    span = _group_span(out_port.dims, group, len(out_t.shape))
    if span is None or not span[0] <= axis < span[0] + span[1]:
        return None
    in_ports = {p.name: p for p in pop.input_ports(pparams, len(prod.inputs))}
    add: list[Node] = []
    new_inputs = []
    for port, r in prod.inputs:
        in_t = typed.types[r]
        ispan = _group_span(in_ports[port].dims, group, len(in_t.shape))
        if ispan is None:
            new_inputs.append((port, r))
            continue
        in_device = in_t.device
        index = _index_on(typed, idx_ref, in_device, add, node)
        gid = _fresh(typed, add, f"{r.node}_rows")   # the rows of r that the selection keeps
        add.append(Node(gid, node.op, ((sel.source, r), (sel.index, index)),
                        {**node.params, sel.axis_param: positionwise_axis(span[0], axis, ispan[0])},
                        in_device, note=f"gather_through_positionwise: {node.id} moved before {prod.id}"))
        new_inputs.append((port, Ref(gid, "out")))
    moved = prod.evolve(inputs=tuple(new_inputs),
                        note=f"gather_through_positionwise: {prod.id} on the rows {node.id} selects")
    add.append(moved)
    return Replacement(remove=(node.id, prod.id), add=tuple(add), redirect={Ref(node.id, "out"): Ref(moved.id, src.output)},
                       touched=(node.id, prod.id))


def _fresh(typed: Typed, pending: list[Node], base: str) -> str:
    taken = {n.id for n in pending}
    cand = typed.graph.fresh_id(base)
    i = 2
    while cand in taken:
        cand = typed.graph.fresh_id(f"{base}_{i}")
        i += 1
    return cand


def _index_on(typed: Typed, ref: Ref, device: str, add: list[Node], at: Node) -> Ref:
    """The index tensor `ref` made available on `device`: as is if it is there; the sender's own copy when it
    came over a transfer; recomputed there when it is index arithmetic over such values; else sent back."""
    t = typed.types[ref]
    if t.device == device:
        return ref
    prod = typed.graph[ref.node]
    op = _op(prod)
    if op.traits.movement:
        (_, src), = prod.inputs
        if typed.types[src].device == device:
            return src
    if op.model_arch == () and _deterministic(prod) and not op.traits.movement and prod.inputs and \
            all(typed.types[r].dtype in ("int64", "int32", "bool") for _, r in prod.inputs):
        ins = [(p, _index_on(typed, r, device, add, at)) for p, r in prod.inputs]
        nid = _fresh(typed, add, f"{prod.id}_on_{device}")
        add.append(prod.evolve(id=nid, inputs=tuple(ins), device=device, spec_index=None,
                               note=f"gather_through_positionwise: {prod.id} recomputed on {device} for {at.id}"))
        return Ref(nid, ref.output)
    nid = _fresh(typed, add, f"{ref.node}_{ref.output}_to_{device}")
    add.append(Node(nid, TRANSFER.name, (("x", ref),), {}, device, note=f"gather_through_positionwise: index for {at.id}"))
    return Ref(nid, "out")


GATHER_THROUGH_POSITIONWISE = Rule(
    "gather_through_positionwise", "Traits.positionwise",
    "gather(f(x), idx, axis) = f(gather(x, idx, axis')) when f treats every position of that axis independently "
    "(norm, lm_head, elementwise, concat on another axis, transfer). Through a transfer the selected rows are "
    "sent instead of the whole tensor, the indices taken or recomputed on the sending side.",
    _gather_through_positionwise)


# -- common subexpressions --------------------------------------------------------------------------------------

def mergeable(op) -> bool:
    """Two nodes of this op with the same params, inputs and device may become one (rewrite/proofs.py proves it
    from the same predicate). Ops that use a model are left alone: two calls record two autograd graphs."""
    return deterministic(op) and not op.model_arch


def _cse(typed: Typed, node: Node) -> Replacement | None:
    if not mergeable(_op(node)):
        return None
    twins = _twins(typed.graph).get(_cse_key(node))
    first = twins[0] if twins else None
    if first is None or first == node.id:     # the first node in order with this key is kept
        return None
    return Replacement(remove=(node.id,), redirect={Ref(node.id, k): Ref(first, k) for k in typed.outputs_of(node.id)},
                       touched=(node.id, first))


def _cse_key(node: Node) -> tuple:
    return (node.op, node.inputs, tuple(sorted((k, repr(v)) for k, v in node.params.items())), node.device)


def _twins(graph: Graph) -> Mapping[tuple, tuple[str, ...]]:
    """The mergeable nodes with each (op, inputs, params, device), in order (Graph.groups: kept across rewrites,
    updated where a rewrite changed them), so that matching every node costs linear time in all, not the
    square of the node count."""
    return graph.groups("merge_duplicates", lambda n: _cse_key(n) if mergeable(_op(n)) else None)


def _changed_keys(g: Graph, ch) -> set[tuple]:
    return {_cse_key(n) for n in (*ch.gone, *ch.made, *(g[i] for i in ch.moved)) if mergeable(_op(n))}


def _cse_touches(old: Typed, new: Typed, ch) -> list[str]:
    """The nodes whose match the rewrite changed through their twins (engine NOTE [Resumed scan]): a match at a
    node reads only which node comes first among its twins, so those are the twins of a group whose first node
    the rewrite changed (a twin removed or made elsewhere in the group is in the rewrite's footprint itself)."""
    t0, t1 = _twins(old.graph), _twins(new.graph)
    out: list[str] = []
    for k in _changed_keys(new.graph, ch):
        a, b = t0.get(k, ()), t1.get(k, ())
        if a[:1] != b[:1]:
            out.extend(b)
    return out


CSE = Rule("merge_duplicates", "Traits.pure + Traits.deterministic",
           "Two pure, deterministic nodes with the same op, params, inputs and device compute the same value: "
           "keep the first.", _cse, touches=_cse_touches)


# -- transfer round trip -----------------------------------------------------------------------------------------

def _transfer_round_trip(typed: Typed, node: Node) -> Replacement | None:
    if not _op(node).traits.movement:
        return None
    (_, src), = node.inputs
    prod = typed.graph[src.node]
    if not _op(prod).traits.movement:
        return None
    (_, orig), = prod.inputs
    if typed.types[orig].device != node.device:
        return None
    return Replacement(remove=(node.id,), redirect={Ref(node.id, "out"): orig}, touched=(node.id, prod.id))


TRANSFER_ROUND_TRIP = Rule("transfer_round_trip", "Traits.movement",
                           "transfer(transfer(x, A->B), B->A) = x: a movement copies its input unchanged.",
                           _transfer_round_trip)


# -- linear heads into the loss that reads them ------------------------------------------------------------------

def _fuse_heads(typed: Typed, node: Node) -> Replacement | None:
    fuse = _op(node).traits.fuses_heads
    if fuse is None:
        return None
    heads = []
    given = dict(node.inputs)
    for port in (fuse.student, fuse.target):
        if port not in given:       # no verifier rows (labels from the data): the student's head alone is fused
            continue
        ref = node.input(port)
        head = typed.graph[ref.node]
        lin = _op(head).traits.linear_head
        # the logits must be read by this node only: another reader would still need them made
        if lin is None or ref.output != lin.output or head.model is None or not _sole_consumer(typed, ref, node.id):
            return None
        heads.append((head, lin))
    (sh, sl), (th, tl) = heads if len(heads) == 2 else (heads[0], heads[0])
    models = typed.ctx.models
    # one weight: both heads project with the same component of the same model (the drafter shares the target's
    # lm_head), so one W serves the teacher and the student inside one chunk loop
    if models[sh.model].component_owner(sl.component) != models[th.model].component_owner(tl.component):
        return None
    x, tx = sh.input(sl.input), th.input(tl.input)
    xt, txt = typed.types[x], typed.types[tx]
    if not (sh.device == th.device == node.device) or xt.dtype != txt.dtype or xt.sizes != txt.sizes:
        return None
    into = registry.get(fuse.into)
    hidden, vocab = xt.sizes[-1], typed.types[node.input(fuse.student)].sizes[-1]
    rows = xt.numel // hidden
    params = dict(fuse.params(node.params, rows, hidden, vocab)) if fuse.params else {}
    passed = {p: r for p, r in node.inputs if p not in (fuse.student, fuse.target)}
    inputs = {**passed, fuse.student_input: x, **({fuse.target_input: tx} if th is not sh else {})}
    order = [p.name for p in into.input_ports(params, len(inputs))]
    fused = Node(node.id, into.name, tuple((p, inputs[p]) for p in order), params, node.device, sh.model,
                 spec_index=node.spec_index,
                 note=f"fuse_heads_into_loss: {sh.id} and {th.id} (one {sl.component} weight) computed inside {node.id}"
                 if th is not sh else f"fuse_heads_into_loss: {sh.id} computed inside {node.id}")
    return Replacement(remove=tuple(dict.fromkeys((sh.id, th.id, node.id))), add=(fused,),
                       touched=tuple(dict.fromkeys((node.id, sh.id, th.id))))


FUSE_HEADS = Rule("fuse_heads_into_loss", "Traits.fuses_heads + Traits.linear_head",
                  "loss(x @ W.T, t @ W.T) = fused(x, t; W), computed chunk by chunk, when a loss that reads two logits "
                  "row by row (target without gradient) is the only reader of two linear heads with one weight: "
                  "neither [rows, vocab] logits tensor is made.", _fuse_heads)


DEFAULT_TABLES: list[tuple[str, list[Rule]]] = [
    ("canonicalize", [DECOMPOSE]),
    ("drop_dead", [DROP_UNUSED]),
    ("push_selections", [GATHER_THROUGH_REMAP, GATHER_THROUGH_POSITIONWISE, DROP_UNUSED]),
    ("fuse", [FUSE_HEADS]),
    ("cleanup", [TRANSFER_ROUND_TRIP, CSE, DROP_UNUSED]),
]

ALL_RULES: dict[str, Rule] = {r.name: r for _, rules in DEFAULT_TABLES for r in rules}
ALL_RULES = dict(sorted(ALL_RULES.items()))


def table(*names: str) -> list[Rule]:
    return [ALL_RULES[n] for n in names]

