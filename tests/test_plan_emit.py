"""`dflash-graph plan --emit`: the rewritten graph written back as TOML loads and checks to the same peaks."""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash_graph.cli.main import main
from dflash_graph.rewrite.emit import emit_toml, toml_key, toml_str, toml_value
from dflash_graph.rewrite.pipeline import compile_graph
from dflash_graph.spec.loader import load_graph


def peaks(plan) -> dict:
    return {d: (m.peak_bytes, m.reserved_peak_bytes, m.live_peak_bytes, m.weight_bytes, m.optimizer_bytes)
            for d, m in plan.memory.devices.items()}


def same_graph(a, b) -> None:
    assert [n.id for n in a.graph.nodes] == [n.id for n in b.graph.nodes]
    for n in a.graph.nodes:
        assert b.graph[n.id].same_as(n), n.id
        assert b.outputs_of(n.id) == a.outputs_of(n.id), n.id


@pytest.mark.parametrize("graph", ["graphs/qwen27b.toml", "graphs/tiny.toml"])
def test_emit_round_trip_same_peaks(graph, in_repo, tmp_path, capsys):
    out = tmp_path / "out" / "plan.toml"
    out.parent.mkdir()
    assert main(["plan", graph, "--emit", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    plan = compile_graph(graph)
    back = compile_graph(str(out), rewrite=False)
    same_graph(plan.typed, back.typed)
    assert peaks(back) == peaks(plan)
    again = compile_graph(str(out))                   # already rewritten: nothing left to apply
    assert again.applied == () and peaks(again) == peaks(plan)


def test_emit_as_written_round_trips(in_repo, tmp_path):
    plan = compile_graph("graphs/qwen27b.toml", rewrite=False)
    out = tmp_path / "as_written.toml"
    out.write_text(emit_toml(plan, out))
    back = compile_graph(str(out), rewrite=False)
    same_graph(plan.typed, back.typed)
    assert peaks(back) == peaks(plan)
    assert "# rewrite:" not in out.read_text()


def comments_above_nodes(text: str) -> dict[str, str | None]:
    """node id -> the comment line right above its [[nodes]] header (None if there is none)."""
    lines = text.splitlines()
    out = {}
    for i, line in enumerate(lines):
        if line == "[[nodes]]":
            nid = lines[i + 1].removeprefix("id = ").strip('"')
            out[nid] = lines[i - 1] if lines[i - 1].startswith("#") else None
    return out


def test_rewritten_nodes_carry_the_rule_as_a_comment(in_repo):
    fused = comments_above_nodes(emit_toml(compile_graph("graphs/qwen27b.toml"), "graphs/emitted.toml"))
    assert fused["loss"].startswith("# rewrite: fuse_heads_into_loss: drafter_lm_head and verifier_lm_head")
    plan = compile_graph("graphs/qwen27b.toml", rules_off=("fuse_heads_into_loss",))
    by_id = comments_above_nodes(emit_toml(plan, "graphs/emitted.toml"))
    assert list(by_id) == [n.id for n in plan.typed.graph.nodes]
    assert by_id["verifier_lm_head"].startswith("# rewrite: gather_through_positionwise:")
    assert by_id["verifier_norm"].startswith("# rewrite: gather_through_positionwise:")
    assert by_id["target"].startswith("# rewrite: decompose_forward:")
    assert by_id["verifier_targets_index_on_targets"].startswith("# rewrite: gather_through_positionwise:")
    assert by_id["loss"] == "# rewrite: target rewired by gather_through_positionwise: reads verifier_lm_head.logits " \
                            "(was verifier_targets.out)"
    assert by_id["tokens"] is None and by_id["drafter"] is None and by_id["features_tx"] is None
    for n in plan.typed.graph.nodes:                  # every node a rewrite made or changed, and only those
        changed = n.id not in plan.original.graph or not n.same_as(plan.original.graph[n.id])
        assert (by_id[n.id] is not None) == (changed or n.note is not None), n.id


def test_paths_are_relative_to_the_output(in_repo, tmp_path):
    plan = compile_graph("graphs/tiny.toml")
    out = tmp_path / "deep" / "er" / "tiny_plan.toml"
    out.parent.mkdir(parents=True)
    text = emit_toml(plan, out)
    doc = tomllib.loads(text)
    root = Path.cwd()
    rel = lambda p: os.path.relpath(root / p, out.parent)   # noqa: E731
    assert doc["models"]["target"]["config"] == rel("graphs/tiny/config.json")
    assert doc["models"]["target"]["weights"] == rel("graphs/tiny/model.safetensors")
    assert doc["data"] == {"corpus": rel("graphs/tiny/corpus.jsonl"), "tokenizer": rel("graphs/tiny/tokenizer.json"),
                           "holdout": 50}       # the keys the graph wrote (the defaults stay defaults)
    out.write_text(text)
    spec = load_graph(out)
    assert Path(spec.data["_base"]) / spec.data["corpus"] == out.parent / rel("graphs/tiny/corpus.jsonl")
    assert (Path(spec.data["_base"]) / spec.data["corpus"]).resolve() == (root / "graphs/tiny/corpus.jsonl").resolve()
    # next to the original, the paths read as they were written
    beside = emit_toml(plan, "graphs/tiny_plan.toml")
    assert 'config = "tiny/config.json"' in beside and 'corpus = "tiny/corpus.jsonl"' in beside
    # no out path: absolute
    assert tomllib.loads(emit_toml(plan))["models"]["target"]["config"] == str(root / "graphs/tiny/config.json")


def test_overridden_file_config_is_written_inline(in_repo, tmp_path):
    """--set on a key of a config file: the file no longer says what was checked, so the config goes inline."""
    plan = compile_graph("graphs/qwen27b.toml", ["dims.seq=4096", "models.target.config.vocab_size=1000"])
    out = tmp_path / "small.toml"
    out.write_text(emit_toml(plan, out))
    doc = tomllib.loads(out.read_text())
    assert doc["dims"]["seq"] == 4096
    assert doc["models"]["target"]["config"]["vocab_size"] == 1000
    back = compile_graph(str(out), rewrite=False)
    same_graph(plan.typed, back.typed)
    assert peaks(back) == peaks(plan)


def test_graph_strings_with_quotes_and_newlines(in_repo, tmp_path):
    src = Path("tests/graphs/minimal.toml").read_text()
    odd = 'a "quoted" \\ back\\slash\nnew line\ttab \x01 ✓'
    text = f"[graph]\nname = {toml_str('odd name')}\ndescription = {toml_str(odd)}\n\n" + src
    path = tmp_path / "odd.toml"
    path.write_text(text)
    plan = compile_graph(str(path))
    out = tmp_path / "odd_plan.toml"
    out.write_text(emit_toml(plan, out))
    spec = load_graph(out)
    assert spec.description == odd and spec.name == "odd name"
    assert "_base" not in tomllib.loads(out.read_text()).get("data", {})


# -- TOML values ---------------------------------------------------------------------------------------------

@given(st.text())
def test_toml_str_round_trips(s):
    assert tomllib.loads(f"k = {toml_str(s)}\n")["k"] == s


@given(st.text(min_size=1))
def test_toml_key_round_trips(k):
    assert list(tomllib.loads(f"{toml_key(k)} = 1\n")) == [k]


scalars = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False), st.text())
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(), inner, max_size=4)), max_leaves=12)


@given(values)
def test_toml_value_round_trips(v):
    got = tomllib.loads(f"k = {toml_value(v)}\n")["k"]
    assert got == v or (isinstance(v, float) and math.copysign(1, v) == math.copysign(1, got) and got == v)


def test_toml_value_nan_and_unsupported():
    assert math.isnan(tomllib.loads(f"k = {toml_value(float('nan'))}")["k"])
    with pytest.raises(TypeError, match="cannot write"):
        toml_value(object())


# -- every key survives: emit then load gives the same document and the same check (issue 21, point 8) ----------

ROOT = Path(__file__).resolve().parent.parent
GRAPHS = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("graphs/*.toml"), *ROOT.glob("tests/graphs/*.toml")])


def declared_values(spec) -> dict:
    """Every declared key the document sets, by TOML path, nodes aside (a rewrite changes them); a path as the
    file it names; a model config as the keys it holds (a file or inline)."""
    from dflash_graph.spec import schema

    out = {}
    for sec, where, table in schema.declared_tables(dict(spec.resolved)):
        if where[:1] == ("nodes",) or sec is schema.TOP:
            continue
        for k in sec.keys:
            if k.name not in table:
                continue
            v = table[k.name]
            if k.path:
                v = str((spec.base_dir / v).resolve())
            out[(*where, k.name)] = v
    out[("graph", "name")] = spec.name     # written even where the file has none (then named after its file)
    out["dims"] = dict(spec.resolved.get("dims", {}))
    out["groups"] = dict(spec.resolved.get("groups", {}))
    return out


def check_result(plan) -> dict:
    from dflash_graph.cli.check import plan_json

    doc = plan_json(plan)
    for k in ("file", "rewritten", "rewrites", "before"):
        doc.pop(k, None)
    for n in doc["nodes"]:
        n.pop("note")          # a rewrite's note is written as a comment above the node
    return doc


def test_every_declared_key_is_in_the_every_key_graph(in_repo):
    """tests/graphs/every_key.toml writes every key the schema declares, so the round trip below covers them all:
    a key added to the schema must be added there (and then `plan --emit` is tested to keep it)."""
    from dflash_graph.spec import schema

    spec = load_graph("tests/graphs/every_key.toml")
    written = {(sec.name, k) for sec, _, table in schema.declared_tables(dict(spec.resolved)) for k in table}
    declared = {(sec.name, k.name) for sec in schema.SECTIONS if not sec.open for k in sec.keys}
    assert declared - written == set()


@pytest.mark.parametrize("rewrite", [True, False], ids=["rewritten", "as-written"])
@pytest.mark.parametrize("graph", GRAPHS)
def test_emit_keeps_every_key_and_the_check(graph, rewrite, in_repo, tmp_path):
    plan = compile_graph(graph, rewrite=rewrite)
    out = tmp_path / "elsewhere" / "emitted.toml"
    out.parent.mkdir()
    out.write_text(emit_toml(plan, out))
    back = compile_graph(str(out), rewrite=False)
    assert declared_values(back.typed.ctx.spec) == declared_values(plan.typed.ctx.spec)
    same_graph(plan.typed, back.typed)
    assert check_result(back) == check_result(plan)      # busy time, host, forward assumptions, every peak
