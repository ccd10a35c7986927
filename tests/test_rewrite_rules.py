"""The rules on the graph that crashed (graphs/qwen27b.toml, shared/DESIGN.md "The problem, in one story"), and
on variants of it that prove each rule's legality comes from a declared trait, never from an op's name."""

from __future__ import annotations

import json
import re

import pytest

from dflash_graph.analysis.infer import build, infer
from dflash_graph.cli.main import main
from dflash_graph.ops import registry
from dflash_graph.ops.catalog import IMPL
from dflash_graph.ops.contract import IndexRemap, OpDef, Param, Port, Traits
from dflash_graph.ops import costs
from dflash_graph.rewrite.pipeline import Plan, compile_graph, compile_typed
from dflash_graph.rewrite.rules import ALL_RULES, DEFAULT_TABLES
from dflash_graph.spec.loader import parse_graph

GiB = 2**30
SEQ, VOCAB, ANCHORS, BLOCK, HIDDEN = 65536, 248320, 512, 16, 5120
DEVICES = [f"gpu{i}" for i in range(8)]


@pytest.fixture(scope="module")
def qwen_text(request) -> str:
    return (request.config.rootpath / "graphs" / "qwen27b.toml").read_text()


def plan_of(text: str, root, rewrite: bool = True) -> Plan:
    """Compile TOML text as if it were graphs/qwen27b.toml (its config path resolves from graphs/)."""
    spec = parse_graph(text, str(root / "graphs" / "variant.toml"), base_dir=root / "graphs")
    graph, ctx = build(spec)
    return compile_typed(infer(graph, ctx), rewrite)


@pytest.fixture(scope="module")
def plans(request):
    root = request.config.rootpath
    path = str(root / "graphs" / "qwen27b.toml")
    return compile_graph(path), compile_graph(path, rewrite=False)


@pytest.fixture(scope="module")
def unfused(request):
    """The 27B graph rewritten without fuse_heads_into_loss: the verifier path after the pushdown alone."""
    return compile_graph(str(request.config.rootpath / "graphs" / "qwen27b.toml"), rules_off=("fuse_heads_into_loss",))


def full_logits(plan: Plan) -> list[str]:
    return [str(r) for r, t in plan.typed.types.items() if t.sizes == (SEQ, VOCAB)]


# -- the 27B graph --------------------------------------------------------------------------------------------

def test_check_exits_0_with_rewrites_and_1_without(in_repo, capsys):
    assert main(["check", "graphs/qwen27b.toml"]) == 0
    assert "verdict: fits on every device" in capsys.readouterr().out
    assert main(["check", "graphs/qwen27b.toml", "--no-rewrite"]) == 1


def test_no_device_materialises_full_logits(plans):
    rewritten, as_written = plans
    assert sorted(full_logits(as_written)) == ["target.logits", "verifier_lm_head.logits", "verifier_roll.out"]
    assert full_logits(rewritten) == []
    for r, t in rewritten.typed.types.items():     # nor any other [seq, vocab]-sized tensor, in any layout
        assert not (SEQ in t.sizes and VOCAB in t.sizes), f"{r}: {t}"


def test_drafter_peak_falls_by_26_gib(plans):
    rewritten, as_written = plans
    before, after = as_written.memory.devices["gpu7"], rewritten.memory.devices["gpu7"]
    assert before.peak_bytes - after.peak_bytes >= 26 * GiB, (before.peak_bytes / GiB, after.peak_bytes / GiB)
    assert before.oom is not None and after.oom is None
    assert rewritten.memory_before.devices["gpu7"].peak_bytes == before.peak_bytes
    for d in DEVICES:                                  # and no device got worse
        assert rewritten.memory.devices[d].peak_bytes <= as_written.memory.devices[d].peak_bytes


def test_verifier_norm_and_lm_head_run_on_anchored_positions(plans, unfused):
    rewritten, as_written = plans
    t = unfused.typed
    for nid in ("verifier_norm", "verifier_lm_head"):
        x = t.inputs_of(nid)["x"]
        assert x.sizes == (ANCHORS, BLOCK, HIDDEN), nid
        assert x.numel // HIDDEN == 8192 == ANCHORS * BLOCK
        assert as_written.typed.inputs_of(nid)["x"].sizes == (SEQ, HIDDEN)
    assert t.outputs_of("verifier_lm_head")["logits"].sizes == (ANCHORS, BLOCK, VOCAB)
    # the loss reads the same verifier targets (type) as before
    assert t.inputs_of("loss") == as_written.typed.inputs_of("loss")
    # only the selected rows of the last hidden state cross to gpu7; the targets keep the body only
    assert t.outputs_of("last_hidden_tx")["out"].sizes == (ANCHORS, BLOCK, HIDDEN)
    assert t.graph["target"].op == "body_forward"
    # with the fusion, both heads run inside the loss node on those rows: no [anchors, block, vocab] tensor left
    f = rewritten.typed
    assert f.graph["loss"].op == "fused_head_loss" and "verifier_lm_head" not in f.graph
    assert f.inputs_of("loss")["target_x"].sizes == f.inputs_of("loss")["x"].sizes == (ANCHORS, BLOCK, HIDDEN)
    assert not any(VOCAB in ty.sizes for ty in f.types.values())
    assert f.outputs_of("loss") == as_written.typed.outputs_of("loss")


def test_json_rewrites_carry_rule_nodes_and_savings(in_repo, capsys, plans):
    assert main(["check", "graphs/qwen27b.toml", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    rw = js["rewrites"]
    assert [r["rule"] for r in rw] == [
        "decompose_forward", "drop_unused", "drop_unused", "gather_through_remap", "drop_unused",
        "gather_through_positionwise", "gather_through_positionwise", "gather_through_positionwise",
        "drop_unused", "drop_unused", "fuse_heads_into_loss"]
    for r in rw:
        assert r["rule"] in ALL_RULES and r["trait"] == ALL_RULES[r["rule"]].trait
        assert r["nodes"] and all(isinstance(n, str) for n in r["nodes"])
        assert sorted(r["saved_bytes"]) == sorted(DEVICES)
        assert all(isinstance(v, int) and v >= 0 for v in r["saved_bytes"].values()), r   # decompose is `always`
    assert rw[0]["nodes"] == ["target", "target_norm", "target_lm_head"]
    drop_head = rw[1]
    # the logits (30.31 GiB) against the body's own peak, which carries the 4 GiB packed mask (packing = "mask")
    assert drop_head["nodes"] == ["target_lm_head"] and all(drop_head["saved_bytes"][f"gpu{i}"] > 9 * GiB for i in range(7))
    assert rw[4]["nodes"] == ["verifier_roll"] and rw[4]["saved_bytes"]["gpu7"] > 26 * GiB
    # the savings add up: each is the driver's cost function (live_peaks) before minus after that rewrite
    from dflash_graph.analysis.memory import live_peaks

    before, after = live_peaks(plans[0].original)[0], live_peaks(plans[0].typed)[0]
    for d in DEVICES:
        assert sum(r["saved_bytes"][d] for r in rw) == before[d] - after[d]


# -- legality from traits ---------------------------------------------------------------------------------------

RING_SHIFT = OpDef(
    name="ring_shift", doc="torch.roll under another name and other param names.",
    inputs=(Port("x", "*x", "like:x"),), outputs=(Port("out", "*x", "like:x"),),
    params=(Param("k", "int", "Shift.", required=True), Param("dim", "int", "Axis.", default=0)),
    traits=Traits(remap=IndexRemap("k", "dim")), cost=costs.no_workspace, impl=f"{IMPL}:roll")

def _variant(text: str, node: str, **changes: str) -> str:
    """Change `key = value` lines inside the [[nodes]] table whose id is `node`."""
    start = text.index(f'id = "{node}"')
    end = text.find("[[nodes]]", start)
    end = len(text) if end < 0 else end
    block = text[start:end]
    for key, value in changes.items():
        if re.search(rf"^{key} = .*$", block, flags=re.M):
            block = re.sub(rf"^{key} = .*$", f"{key} = {value}", block, count=1, flags=re.M)
        else:
            block = block.rstrip("\n") + f"\n{key} = {value}\n\n"
    return text[:start] + block + text[end:]


def test_remap_legality_from_traits(qwen_text, plans, request):
    """A roll registered under another name, with other param names, is moved through the same way."""
    text = _variant(qwen_text, "verifier_roll", op='"ring_shift"', params="{ k = 1, dim = 0 }")
    with registry.registered(RING_SHIFT):
        plan = plan_of(text, request.config.rootpath)
    stock, _ = plans
    assert [(a.rule, a.nodes) for a in plan.applied] == [(a.rule, a.nodes) for a in stock.applied]
    assert full_logits(plan) == []
    assert {d: m.peak_bytes for d, m in plan.memory.devices.items()} == \
           {d: m.peak_bytes for d, m in stock.memory.devices.items()}
    shift = plan.typed.graph["verifier_targets_index_on_targets"]
    assert shift.op == "index_shift" and dict(shift.params) == {"shift": SEQ - 1, "modulo": SEQ, "check_range": True}


def test_remap_param_values_are_read_through_the_trait(qwen_text, request):
    """Shift 3 along axis 0: the index is shifted by -3 mod seq. Along another axis than the gather's: no rewrite."""
    text = _variant(qwen_text, "verifier_roll", op='"ring_shift"', params="{ k = 3, dim = 0 }")
    with registry.registered(RING_SHIFT):
        plan = plan_of(text, request.config.rootpath)
        assert dict(plan.typed.graph["verifier_targets_index_on_targets"].params) == {"shift": SEQ - 3, "modulo": SEQ,
                                                                                     "check_range": True}
        other = plan_of(_variant(qwen_text, "verifier_roll", op='"ring_shift"', params="{ k = 3, dim = 1 }"),
                        request.config.rootpath)
    assert "gather_through_remap" not in {a.rule for a in other.applied}
    assert other.typed.graph["verifier_roll"].op == "ring_shift"


def test_positionwise_legality_from_traits(qwen_text, request):
    """The verifier norm as an op with the norm's contract but no position-wise trait: the gather moves through
    the roll and the lm_head, and stops there: the norm still runs on all 65,536 positions."""
    import attrs

    opaque = attrs.evolve(registry.get("norm"), name="opaque_norm", traits=Traits())
    text = _variant(qwen_text, "verifier_norm", op='"opaque_norm"')
    with registry.registered(opaque):
        plan = plan_of(text, request.config.rootpath)
    assert full_logits(plan) == []
    t = plan.typed
    assert t.inputs_of("verifier_norm")["x"].sizes == (SEQ, HIDDEN)
    assert t.inputs_of("loss")["target_x"].sizes == (ANCHORS, BLOCK, HIDDEN)   # the verifier head, fused
    assert t.outputs_of("last_hidden_tx")["out"].sizes == (SEQ, HIDDEN)
    assert not any(a.rule == "gather_through_positionwise" and "verifier_norm" in a.nodes for a in plan.applied)


def test_movement_legality_from_traits(qwen_text, plans, request):
    """A transfer under another name (same declaration) is crossed the same way."""
    import attrs

    send = attrs.evolve(registry.get("transfer"), name="p2p_send")
    text = _variant(qwen_text, "last_hidden_tx", op='"p2p_send"')
    with registry.registered(send):
        plan = plan_of(text, request.config.rootpath)
    stock, _ = plans
    assert plan.typed.graph["last_hidden_tx"].op == "p2p_send"
    assert plan.typed.outputs_of("last_hidden_tx")["out"].sizes == (ANCHORS, BLOCK, HIDDEN)
    assert {d: m.peak_bytes for d, m in plan.memory.devices.items()} == \
           {d: m.peak_bytes for d, m in stock.memory.devices.items()}


def test_decompose_legality_from_traits(qwen_text, plans, request):
    """A fused forward under another name that declares the same decomposition is split and its lm_head dropped;
    without the trait, the [seq, vocab] logits stay on the targets."""
    import attrs

    fused = attrs.evolve(registry.get("causal_lm_forward"), name="hf_forward")
    plain = attrs.evolve(fused, name="hf_forward_plain", traits=Traits())
    with registry.registered(fused), registry.registered(plain):
        plan = plan_of(_variant(qwen_text, "target", op='"hf_forward"'), request.config.rootpath)
        kept = plan_of(_variant(qwen_text, "target", op='"hf_forward_plain"'), request.config.rootpath)
    assert plan.typed.graph["target"].op == "body_forward" and full_logits(plan) == []
    assert full_logits(kept) == ["target.logits"]
    assert kept.memory.devices["gpu0"].peak_bytes > plan.memory.devices["gpu0"].peak_bytes


# -- the cleanup rules on variants of the 27B graph --------------------------------------------------------------

ROUND_TRIP = '''
[[nodes]]
id = "valid_back"
op = "transfer"
device = "targets"
inputs = { x = "valid_tx.out" }

[[nodes]]
id = "valid_log"
op = "output"
device = "targets"
inputs = { x = "valid_back.out" }
'''


def with_nodes(text: str, extra: str) -> str:
    i = text.index("[train]")
    return text[:i] + extra.lstrip("\n") + "\n" + text[i:]


def test_transfer_round_trip_on_qwen27b_variant(qwen_text, request):
    """valid sent to gpu7 and back to the targets for logging: the way back is removed."""
    plan = plan_of(with_nodes(qwen_text, ROUND_TRIP), request.config.rootpath)
    rt = [a for a in plan.applied if a.rule == "transfer_round_trip"]
    assert [a.nodes for a in rt] == [("valid_back", "valid_tx")]
    assert "valid_back" not in plan.typed.graph
    assert str(plan.typed.graph["valid_log"].input("x")) == "anchors.valid"


DUPLICATE = '''
[[nodes]]
id = "pos_tx2"
op = "transfer"
device = "gpu7"
inputs = { x = "tokens.position_ids" }
params = { queue = 7 }

[[nodes]]
id = "pos_log"
op = "output"
device = "gpu7"
inputs = { x = "pos_tx2.out" }
'''


def test_merge_duplicates_on_qwen27b_variant(qwen_text, request):
    """position_ids sent to gpu7 a second time (for logging): the second transfer and its queue go."""
    plan = plan_of(with_nodes(qwen_text, DUPLICATE), request.config.rootpath)
    merged = [a for a in plan.applied if a.rule == "merge_duplicates"]
    assert [a.nodes for a in merged] == [("pos_tx2", "pos_tx")]
    assert merged[0].saved_bytes["gpu7"] > 0
    assert "pos_tx2" not in plan.typed.graph
    assert str(plan.typed.graph["pos_log"].input("x")) == "pos_tx.out"


# -- regressions found by the property tests ---------------------------------------------------------------------

ANCHOR_GRAPH = '''
[dims]
seq = 64
anchors = 4
block = 4
hidden = "target.hidden_size"

[devices.a]
torch = "cpu"
capacity = "1 GiB"

[devices.b]
torch = "cpu"
capacity = "1 GiB"

[models.target]
arch = "qwen3_5"
dtype = "float32"
config = { vocab_size = 128, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 16, linear_num_key_heads = 1, linear_num_value_heads = 2, linear_key_head_dim = 16, linear_value_head_dim = 16, full_attention_interval = 2 }

[[nodes]]
id = "tokens"
op = "token_input"
device = "a"

[[nodes]]
id = "body"
op = "body_forward"
model = "target"
device = "a"
inputs = { input_ids = "tokens.input_ids", position_ids = "tokens.position_ids" }

[[nodes]]
id = "hidden_tx"
op = "transfer"
device = "b"
inputs = { x = "body.hidden" }

[[nodes]]
id = "mask_tx"
op = "transfer"
device = "b"
inputs = { x = "tokens.loss_mask" }

[[nodes]]
id = "pos_tx"
op = "transfer"
device = "b"
inputs = { x = "tokens.position_ids" }

[[nodes]]
id = "anchors"
op = "anchor_sample"
device = "b"
inputs = { loss_mask = "mask_tx.out", position_ids = "pos_tx.out" }

[[nodes]]
id = "block_index"
op = "block_positions"
device = "b"
inputs = { anchors = "anchors.anchors" }

[[nodes]]
id = "norm"
op = "norm"
model = "target"
device = "b"
inputs = { x = "hidden_tx.out" }

[[nodes]]
id = "picked"
op = "gather"
device = "b"
inputs = { x = "norm.out", index = "block_index.index" }

[[nodes]]
id = "result"
op = "output"
device = "b"
inputs = { x = "picked.out" }

[[nodes]]
id = "anchors_out"
op = "output"
device = "b"
inputs = { x = "anchors.anchors" }
'''


def test_random_anchors_are_sent_not_resampled():
    """Anchors sampled on the receiving side: when the gather moves across the transfer, the block positions may
    be recomputed on the sender, but the anchors themselves must be sent, not sampled a second time (a second
    anchor_sample draws other anchors: the verifier rows would not be the drafter's)."""
    graph, ctx = build(parse_graph(ANCHOR_GRAPH, "anchors.toml"))
    plan = compile_typed(infer(graph, ctx))
    g = plan.typed.graph
    assert [n.id for n in g.nodes if n.op == "anchor_sample"] == ["anchors"]
    gather = next(n for n in g.nodes if n.op == "gather")
    assert gather.device == "a"                                        # the gather did move
    index = g[gather.input("index").node]
    assert index.op == "block_positions"
    sent = g[index.input("anchors").node]
    assert sent.op == "transfer" and str(sent.input("x")) == "anchors.anchors"


def test_rewrite_keeps_the_replica_count():
    """d0 -> group -> d0 round trip: the way back is removed, but not the (now unread) transfer to the group: that
    would leave no node on the group, and every node on d0 would run once per step instead of once per replica
    (found by test_a_same_outputs)."""
    text = '''
[dims]
n = 4
[devices.d0]
torch = "cpu"
capacity = "1 GiB"
[devices.d1]
torch = "cpu"
capacity = "1 GiB"
[groups]
g = ["d0", "d1"]
[[nodes]]
id = "tokens"
op = "token_input"
device = "d0"
params = { length = "n" }
[[nodes]]
id = "there"
op = "transfer"
device = "g"
inputs = { x = "tokens.input_ids" }
[[nodes]]
id = "back"
op = "transfer"
device = "d0"
inputs = { x = "there.out" }
[[nodes]]
id = "o"
op = "output"
device = "d0"
inputs = { x = "back.out" }
'''
    graph, ctx = build(parse_graph(text, "replicas.toml"))
    plan = compile_typed(infer(graph, ctx))
    assert [a.rule for a in plan.applied] == ["transfer_round_trip"]         # the way back goes ...
    assert "there" in plan.typed.graph                                       # ... the node on the group stays
    assert str(plan.typed.graph["o"].input("x")) == "tokens.input_ids"


def test_passes_run_to_a_joint_fixpoint():
    """merge_duplicates (cleanup) can leave a position-wise node with one reader, which push_selections then moves a
    gather through: the driver runs the passes again until none applies (found by test_d_idempotent)."""
    from strategies import RAND_INPUT

    text = '''
[dims]
n0 = 1
hidden = "target.hidden_size"
[devices.d0]
torch = "cpu"
capacity = "1 GiB"
[models.target]
arch = "qwen3_5"
dtype = "float64"
config = { vocab_size = 3, hidden_size = 8, intermediate_size = 8, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 4, linear_num_key_heads = 1, linear_num_value_heads = 1, linear_key_head_dim = 4, linear_value_head_dim = 4, full_attention_interval = 1 }
[[nodes]]
id = "src0"
op = "rand_input"
device = "d0"
params = { rank = 2, d0 = "hidden", d1 = "hidden" }
[[nodes]]
id = "head1"
op = "lm_head"
device = "d0"
model = "target"
inputs = { x = "src0.out" }
[[nodes]]
id = "idx2"
op = "rand_input"
device = "d0"
params = { rank = 1, d0 = "hidden", dtype = "int64", values = [0, 0, 0, 0, 0, 0, 0, 0] }
[[nodes]]
id = "gather4"
op = "gather"
device = "d0"
inputs = { x = "head1.logits", index = "idx2.out" }
[[nodes]]
id = "cat5"
op = "concat"
device = "d0"
inputs = ["gather4.out", "src0.out"]
[[nodes]]
id = "cat6"
op = "concat"
device = "d0"
inputs = ["cat5.out", "gather4.out"]
[[nodes]]
id = "idx7"
op = "rand_input"
device = "d0"
params = { rank = 1, d0 = 1, dtype = "int64", values = [0] }
[[nodes]]
id = "gather8"
op = "gather"
device = "d0"
inputs = { x = "cat6.out", index = "idx7.out" }
[[nodes]]
id = "out9"
op = "output"
device = "d0"
inputs = { x = "gather8.out" }
'''
    with registry.registered(RAND_INPUT):
        graph, ctx = build(parse_graph(text, "fixpoint.toml"))
        plan = compile_typed(infer(graph, ctx))
        rules = [a.rule for a in plan.applied]
        assert "merge_duplicates" in rules
        assert rules.index("merge_duplicates") < len(rules) - 1 and rules[-1] == "gather_through_positionwise"
        again = compile_typed(plan.typed)
        assert again.applied == ()


def test_every_rule_has_a_doc_page(request):
    docs = request.config.rootpath / "docs" / "rules"
    index = (docs / "README.md").read_text()
    for name, rule in ALL_RULES.items():
        page = docs / f"{name}.md"
        assert page.exists(), f"docs/rules/{name}.md is missing"
        body = page.read_text()
        assert rule.trait in body, f"docs/rules/{name}.md does not name the trait {rule.trait}"
        assert f"({name}.md)" in index, f"docs/rules/README.md does not link {name}.md"
    for pass_name, _ in DEFAULT_TABLES:
        assert f"`{pass_name}`" in index


def _check_scaling():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("check_scaling", root / "benchmarks" / "check_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rewrite_bound_refuses_with_hint_and_checks_as_written(tmp_path):
    """NOTE [Rewrite bound]: a graph over MAX_REWRITE_NODES is refused for rewriting with the bound named and
    --no-rewrite as the hint; as written it checks. Graphs at the bound are rewritten (the widened graphs of
    benchmarks/check_scaling.py, whose rewrites the incremental engine applies as the full one does:
    tests/test_rewrite_properties.py, property g)."""
    from dflash_graph.errors import GraphError
    from dflash_graph.rewrite.engine import MAX_REWRITE_NODES

    cs = _check_scaling()
    over = cs.wide_graph(tmp_path, MAX_REWRITE_NODES + 10)
    with pytest.raises(GraphError) as e:
        compile_graph(str(over))
    msg = str(e.value)
    assert f"over the bound of {MAX_REWRITE_NODES} for rewriting" in msg and "--no-rewrite" in msg
    assert not compile_graph(str(over), rewrite=False).rewritten
    plan = compile_graph(str(cs.wide_graph(tmp_path, 50)))
    assert len(plan.applied) > 40 and plan.memory.fits


def test_rewrite_work_grows_linearly(tmp_path, monkeypatch):
    """NOTE [Resumed scan], NOTE [Certificate index]: the work of rewriting a widened graph of
    benchmarks/check_scaling.py, counted (not timed) at a quarter of the rewrite bound and at the bound, grows with
    the graph, not faster: the nodes examined, the certificates tested after an accepted rewrite, and the node
    groups built from scratch (Graph.groups keeps them across rewrites). Before the index and merge_duplicates' narrower footprint, examinations per node grew
    1.6x from 250 to 1,000 nodes, and every accepted rewrite tested every certificate."""
    from dflash_graph.ir.graph import Graph
    from dflash_graph.rewrite import engine
    from dflash_graph.rewrite.engine import MAX_REWRITE_NODES

    counts: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(engine._Driver, "examine", counted("examine", engine._Driver.examine))
    monkeypatch.setattr(engine, "_valid", counted("valid", engine._valid))
    monkeypatch.setattr(engine._Certs, "add", counted("certificates", engine._Certs.add))
    real_derived = Graph.derived

    def derived(self, name, build, update):
        return real_derived(self, name, counted("built", build), update)

    monkeypatch.setattr(Graph, "derived", derived)
    cs = _check_scaling()
    per_node = {}
    sizes = (MAX_REWRITE_NODES // 4, MAX_REWRITE_NODES)
    for n in sizes:
        counts.clear()
        plan = compile_graph(str(cs.wide_graph(tmp_path, n)))
        per_node[n] = {k: v / len(plan.original.graph) for k, v in counts.items()}
        assert len(plan.applied) > n
    small, large = per_node[sizes[0]], per_node[sizes[1]]
    assert large["examine"] <= 1.1 * small["examine"], per_node
    assert large["certificates"] >= small["certificates"] > 0.1, per_node     # (the index has work to do)
    assert large.get("valid", 0) <= 1.1 * max(small.get("valid", 0), 1), per_node
    assert large["built"] * sizes[1] <= small["built"] * sizes[0] + 10, per_node   # built a fixed number of times


def test_check_scaling_benchmark_smoke(capsys):
    """benchmarks/check_scaling.py runs at small sizes and reports a size over a bound as refused (it asserts
    nothing about time)."""
    cs = _check_scaling()
    assert cs.main(["--nodes", "25", "--written", "100", "--layers", "2", "600", "20000"]) == 0
    out = capsys.readouterr().out
    assert "exponent" in out and "20000  refused: model 'target' has 20,000 layers, over the bound of 10,000" in out
    assert "   600  " in out and "600  refused" not in out


@pytest.mark.parametrize("n_nodes", [60, 120, 240])
def test_rejection_certificates_change_no_verdict(tmp_path, n_nodes):
    """NOTE [Rejection certificates], NOTE [Resumed scan]: on the widened graphs of benchmarks/check_scaling.py
    (where hundreds of rejected candidates are re-rejected by certificate), the rewrites applied are those of a
    driver that scans from the first node after every rewrite and prices every candidate every time, and
    verify=True (which prices every certified candidate and raises if pricing
    would accept it) passes."""
    from dflash_graph.analysis.memory import live_peaks
    from dflash_graph.rewrite import engine
    from dflash_graph.spec.loader import load_graph

    path = _check_scaling().wide_graph(tmp_path, n_nodes)
    typed = infer(*build(load_graph(str(path))))
    new, applied = engine.rewrite(typed, DEFAULT_TABLES, live_peaks)
    slow_new, slow_applied = engine.rewrite(typed, DEFAULT_TABLES, live_peaks, certificates=False)
    assert applied == slow_applied and new.graph.same_as(slow_new.graph)
    assert [n.id for n in new.graph.nodes] == [n.id for n in slow_new.graph.nodes]
    if n_nodes <= 60:
        _, checked = engine.rewrite(typed, DEFAULT_TABLES, live_peaks, verify=True)
        assert checked == applied


@pytest.mark.parametrize("n_nodes", [60, 150])
def test_live_curves_change_no_verdict(tmp_path, n_nodes):
    """NOTE [Live curve]: on the widened graphs of benchmarks/check_scaling.py, pricing candidates from the live
    curves applies the rewrites (the same log, FLOPs in the same order) of pricing each by a full replay, and
    verify=True (which checks every price read off the curves against a full replay) passes."""
    from dflash_graph.analysis.memory import live_peaks
    from dflash_graph.rewrite import engine
    from dflash_graph.spec.loader import load_graph

    path = _check_scaling().wide_graph(tmp_path, n_nodes)
    typed = infer(*build(load_graph(str(path))))
    new, applied = engine.rewrite(typed, DEFAULT_TABLES, live_peaks)
    slow_new, slow_applied = engine.rewrite(typed, DEFAULT_TABLES, live_peaks, curves=False)
    assert applied == slow_applied and new.graph.same_as(slow_new.graph)
    assert [list(a.saved_flops.items()) for a in applied] == [list(a.saved_flops.items()) for a in slow_applied]
    assert [n.id for n in new.graph.nodes] == [n.id for n in slow_new.graph.nodes]
    if n_nodes <= 60:
        _, checked = engine.rewrite(typed, DEFAULT_TABLES, live_peaks, verify=True)
        assert checked == applied


def _varied_chain(i: int, rnd) -> str:
    """A verifier chain with random parts left out, shifts, sources and result devices."""
    src = rnd.choice(["target.hidden", "target.hidden", f"h{max(i - 1, 0)}.out"]) if i else "target.hidden"
    s = f'\n[[nodes]]\nid = "h{i}"\nop = "transfer"\ndevice = "draft"\ninputs = {{ x = "{src}" }}\n'
    x = f"h{i}.out"
    if rnd.random() < 0.7:
        s += f'\n[[nodes]]\nid = "n{i}"\nop = "norm"\nmodel = "target"\ndevice = "draft"\ninputs = {{ x = "{x}" }}\n'
        x = f"n{i}.out"
    s += f'\n[[nodes]]\nid = "l{i}"\nop = "lm_head"\nmodel = "target"\ndevice = "draft"\ninputs = {{ x = "{x}" }}\n'
    x = f"l{i}.logits"
    if rnd.random() < 0.7:
        s += (f'\n[[nodes]]\nid = "r{i}"\nop = "roll"\ndevice = "draft"\ninputs = {{ x = "{x}" }}\n'
              f'params = {{ shift = {rnd.choice([1, 2, -1])}, axis = 0 }}\n')
        x = f"r{i}.out"
    if rnd.random() < 0.8:
        s += (f'\n[[nodes]]\nid = "g{i}"\nop = "gather"\ndevice = "draft"\n'
              f'inputs = {{ x = "{x}", index = "block_index.index" }}\nparams = {{ axis = 0 }}\n')
        x = f"g{i}.out"
    if rnd.random() < 0.2:
        s += f'\n[[nodes]]\nid = "t{i}"\nop = "transfer"\ndevice = "t0"\ninputs = {{ x = "{x}" }}\n'
        x = f"t{i}.out"
    return s + f'\n[[nodes]]\nid = "o{i}"\nop = "output"\ndevice = "{"t0" if x.startswith("t") else "draft"}"\ninputs = {{ x = "{x}" }}\n'


@pytest.mark.parametrize("seed", range(6))
def test_rejection_certificates_on_varied_chains(tmp_path, request, seed):
    """Graphs/tiny.toml with random verifier chains (parts left out, chained sources, results on another device):
    with rejection certificates and live curves, the rewrites applied are those of pricing every candidate every
    time by a full replay, and verify=True (pricing every certified candidate, and checking every price read off
    the curves against a full replay) passes. (A fuzz of 40 seeds found no difference.)"""
    import random

    from dflash_graph.analysis.memory import live_peaks
    from dflash_graph.rewrite import engine
    from dflash_graph.spec.loader import load_graph

    root = request.config.rootpath
    rnd = random.Random(seed)
    head, sep, data = (root / "graphs" / "tiny.toml").read_text().partition("\n[data]")
    (tmp_path / "tiny").symlink_to(root / "graphs" / "tiny")
    path = tmp_path / "varied.toml"
    path.write_text(head + "".join(_varied_chain(i, rnd) for i in range(rnd.randint(6, 12))) + sep + data)
    typed = infer(*build(load_graph(str(path))))
    new, applied = engine.rewrite(typed, DEFAULT_TABLES, live_peaks, verify=True)
    slow_new, slow_applied = engine.rewrite(typed, DEFAULT_TABLES, live_peaks, certificates=False, curves=False)
    assert applied == slow_applied
    assert [n.id for n in new.graph.nodes] == [n.id for n in slow_new.graph.nodes] and new.graph.same_as(slow_new.graph)


def test_queued_transfers_are_priced_from_the_curve(tmp_path, request):
    """NOTE [Live curve]: a rewrite that removes, makes or re-infers a transfer with a queue moves the device's
    load by its queue buffers, read off the curve instead of a full replay (a fuzzed graph of 400 unread queued
    transfers took 12.8 CPU s with a replay per candidate). With verify=True every price is checked against a
    full replay: the same rewrites, the same figures."""
    root = request.config.rootpath
    text = (root / "graphs/qwen27b.toml").read_text()
    extra = "".join(f'\n[[nodes]]\nid = "anchors_tx_{i}"\nop = "transfer"\ndevice = "gpu7"\n'
                    f'inputs = {{ x = "anchors.anchors" }}\nparams = {{ queue = {2 + i % 6} }}\n' for i in range(30))
    path = tmp_path / "qwen27b.toml"
    path.write_text(text + extra)
    (tmp_path / "qwen27b").symlink_to(root / "graphs/qwen27b")
    plan = compile_graph(str(path), verify=True)
    assert sum(1 for a in plan.applied if "anchors_tx_" in " ".join(a.nodes)) >= 30
    shipped = compile_graph(str(root / "graphs/qwen27b.toml")).memory.devices["gpu7"]
    assert plan.memory.devices["gpu7"].peak_bytes == shipped.peak_bytes


def test_unread_forwards_are_priced_from_the_curve(tmp_path, request):
    """NOTE [Live curve]: a forward whose taps no hook node reads makes no hooked layer, so removing it (unread) is
    priced off the curve (a fuzzed graph of 400 unread forwards took 14.6 CPU s with a replay per candidate);
    verify=True checks every price against a full replay."""
    root = request.config.rootpath
    text = (root / "tests/graphs/minimal.toml").read_text()
    extra = "".join(f'\n[[nodes]]\nid = "body_{i}"\nop = "body_forward"\nmodel = "target"\ndevice = "a"\n'
                    'inputs = { input_ids = "tokens.input_ids", position_ids = "tokens.position_ids" }\n'
                    for i in range(30))
    path = tmp_path / "minimal.toml"
    path.write_text(text + extra)
    plan = compile_graph(str(path), verify=True)
    assert not any(n.id.startswith("body_") for n in plan.typed.graph.nodes)
    assert plan.memory.devices == compile_graph(str(root / "tests/graphs/minimal.toml")).memory.devices


@pytest.mark.parametrize("enabled", [True, False])
def test_rewrite_restores_the_cycle_collector(tmp_path, monkeypatch, enabled):
    """NOTE [No cycle collection while rewriting]: the collector is paused while the driver runs and left as
    the caller had it afterwards, also when the driver raises."""
    import gc

    from dflash_graph.rewrite import engine

    seen = []
    real_run = engine._run

    def run(*a, **k):
        seen.append(gc.isenabled())
        return real_run(*a, **k)

    monkeypatch.setattr(engine, "_run", run)
    path = str(_check_scaling().wide_graph(tmp_path, 40))
    (gc.enable if enabled else gc.disable)()
    try:
        compile_graph(path)
        assert seen == [False] and gc.isenabled() is enabled

        def boom(*a, **k):
            raise RuntimeError("boom")

        monkeypatch.setattr(engine, "_run", boom)
        with pytest.raises(RuntimeError):
            compile_graph(path)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_replay_budget_refuses(tmp_path):
    """NOTE [Replay budget]: dropping an unread drafter norm changes autograd's path, so each such rewrite is
    priced by a full replay: a graph over SMALL_REWRITE_NODES made of them is refused once its replays pass
    REPLAY_BUDGET (both bounds named, --no-rewrite as the hint; the count is of the graph as written, so dropping
    nodes below the bound does not lift it), and checks as written; one at the bound is rewritten."""
    from pathlib import Path

    from dflash_graph.errors import GraphError
    from dflash_graph.rewrite.engine import REPLAY_BUDGET, SMALL_REWRITE_NODES

    root = Path(__file__).resolve().parent.parent
    head, sep, data = (root / "graphs/tiny.toml").read_text().partition("\n[data]")
    written = len(re.findall(r"^\[\[nodes\]\]", head, flags=re.M))
    (tmp_path / "tiny").symlink_to(root / "graphs/tiny")

    def norms(total: int) -> str:
        p = tmp_path / f"norms_{total}.toml"
        p.write_text(head + "".join(f'\n[[nodes]]\nid = "unread_norm_{i}"\nop = "norm"\nmodel = "drafter"\n'
                                    f'device = "draft"\ninputs = {{ x = "drafter.hidden" }}\n'
                                    for i in range(total - written)) + sep + data)
        return str(p)

    over = norms(SMALL_REWRITE_NODES + 10)
    with pytest.raises(GraphError) as e:
        compile_graph(over)
    msg = str(e.value)
    assert f"the graph has {SMALL_REWRITE_NODES + 10} nodes" in msg and f"{REPLAY_BUDGET:,} node replays" in msg
    assert f"a graph over {SMALL_REWRITE_NODES} nodes" in msg and "--no-rewrite" in msg
    assert not compile_graph(over, rewrite=False).rewritten
    plan = compile_graph(norms(SMALL_REWRITE_NODES))
    assert sum(a.rule == "drop_unused" for a in plan.applied) >= SMALL_REWRITE_NODES - written
