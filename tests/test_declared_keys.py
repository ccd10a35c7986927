"""Every key a graph may write is acted on or refused, never ignored; the files a graph names are verified by
check (issue 21, points 5 and 7)."""

from __future__ import annotations

import json

import pytest

from dflash_graph.cli.main import main
from dflash_graph.models.registry import ARCHS
from dflash_graph.spec import schema

MISSING = "tests/graphs/bad/missing_data_paths.toml"


def test_missing_files_are_errors_with_their_line(in_repo, capsys):
    assert main(["check", MISSING]) == 2
    err = capsys.readouterr().err
    lines = in_repo.joinpath(MISSING).read_text().splitlines()
    for key, toml in (("data.corpus", "corpus = "), ("data.tokenizer", "tokenizer = ")):
        line = next(i + 1 for i, text in enumerate(lines) if text.startswith(toml))
        assert f"{MISSING}:{line}: error at {key}: " in err
    assert "check --memory-only" in err


def test_memory_only_makes_them_warnings_and_says_which(in_repo, capsys):
    assert main(["check", MISSING, "--memory-only"]) == 0
    out = capsys.readouterr().out
    assert "warning at data.corpus" in out and "warning at data.tokenizer" in out
    assert "verdict: fits on every device; `run` needs the 2 missing file(s) above" in out
    assert main(["check", MISSING, "--memory-only", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(m["key"], m["needed_by"]) for m in doc["missing_paths"]] == [("data.corpus", "run"),
                                                                           ("data.tokenizer", "run")]
    assert all(m["file"] == MISSING and isinstance(m["line"], int) for m in doc["missing_paths"])


def test_json_lists_no_missing_path_for_a_complete_graph(in_repo, capsys):
    assert main(["check", "graphs/tiny.toml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_paths"] == []


def _path_keys():
    """Every key declared as a path, with a --set that reaches it on graphs/tiny.toml."""
    out = []
    for sec in schema.SECTIONS:
        for k in sec.keys:
            if k.path:
                prefix = {"models.<name>": "models.target", "data": "data"}[sec.name]
                out.append(f"{prefix}.{k.name}")
    return out


@pytest.mark.parametrize("key", _path_keys())
def test_every_declared_path_is_verified(key, in_repo, capsys):
    assert main(["check", "graphs/tiny.toml", "--set", f"{key}=no/such/file"]) == 2
    err = capsys.readouterr().err
    assert f"error at {key}: " in err and "no such file or directory" in err


def test_run_refuses_a_missing_corpus_naming_the_graph_line(in_repo, tmp_path, capsys):
    assert main(["run", MISSING, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{MISSING}:" in err and "error at data.corpus" in err
    assert "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_drafter_weights_missing_is_refused(in_repo, capsys):
    """`weights` on a dflash drafter that names no file: refused, naming the flag (run would otherwise train from
    scratch)."""
    code = main(["check", "graphs/tiny.toml", "--set", "models.drafter.weights=/nonexistent/x.safetensors"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--set models.drafter.weights=/nonexistent/x.safetensors: error at models.drafter.weights" in err
    assert "no such file or directory" in err


def test_arch_declarations_match_what_run_does():
    """The arch registry's declarations are what the run-time store does: every target loads weights (ModelStore
    .full builds it through transformers' own class) and so does the drafter (ModelStore.drafter, from a DFlash
    draft checkpoint), only dflash trains (ModelStore.trainable_parameters holds the drafters)."""
    assert {a for a, x in ARCHS.items() if x.loads_weights} == {a for a, x in ARCHS.items() if x.target} | {"dflash"}
    assert all(x.hf_causal_lm for x in ARCHS.values() if x.target)
    assert {a for a, x in ARCHS.items() if x.trains} == {"dflash"}


# -- target_layer_ids against the hooked layers (issue 21, point 6) ------------------------------------------------

def _tiny_text(in_repo) -> str:
    return (in_repo / "tests/graphs/bad/target_layer_ids_not_hooked.toml").read_text().replace(
        "target_layer_ids = [1, 2]", "target_layer_ids = [1, 3]")


def test_hooked_layers_in_declared_order_pass(in_repo):
    from dflash_graph.analysis.infer import build, infer
    from dflash_graph.spec.loader import parse_graph

    base = in_repo / "tests/graphs/bad"
    infer(*build(parse_graph(_tiny_text(in_repo), "t.toml", base)))


def test_concatenated_in_another_order_is_refused(in_repo):
    """Layers 1 and 3 hooked, but concatenated as [3, 1]: the drafter's fc reads them in that order."""
    from dflash_graph.analysis.infer import build, infer
    from dflash_graph.errors import GraphError
    from dflash_graph.spec.loader import parse_graph

    text = _tiny_text(in_repo).replace('inputs = ["hooks.layer1", "hooks.layer3"]', 'inputs = ["hooks.layer3", "hooks.layer1"]')
    with pytest.raises(GraphError) as e:
        infer(*build(parse_graph(text, "t.toml", in_repo / "tests/graphs/bad")))
    msg = str(e.value)
    assert "error at models.drafter.config.target_layer_ids (node 'drafter')" in msg
    assert "expected: target_layer_ids = [3, 1]" in msg and "actual:   target_layer_ids = [1, 3]" in msg


@pytest.mark.parametrize("graph", ["graphs/tiny.toml", "graphs/qwen27b.toml", "graphs/gpu_check.toml"])
def test_export_names_the_layers_the_drafter_reads(graph, in_repo):
    """What the export tells serving stacks (dflash_config.target_layer_ids) is what the graph hooks and feeds the
    drafter, as written and after the rewrites."""
    from dflash_graph.analysis.infer import layer_sources
    from dflash_graph.ops import registry
    from dflash_graph.rewrite.pipeline import compile_graph
    from dflash_graph.train.export import config

    plan = compile_graph(graph)
    for typed in (plan.original, plan.typed):
        readers = [n for n in typed.graph.nodes if registry.get(n.op).traits.reads_layers is not None]
        assert readers
        src = layer_sources(typed)
        for n in readers:
            dims = typed.ctx.models[n.model].dims
            hooked = [layer for _, layer in src[dict(n.inputs)["context"]]]
            assert config(dims, 64, "bfloat16", 4096)["dflash_config"]["target_layer_ids"] == hooked


# -- check --json carries the model assumptions the report prints (issue 21, point 11) ----------------------------

@pytest.mark.parametrize("graph,sets", [("graphs/tiny.toml", []),
                                        ("graphs/qwen27b.toml", []),
                                        ("graphs/tiny.toml", ["models.target.attn_implementation=eager",
                                                              "models.target.packing=mask"])])
def test_json_has_the_assumptions_the_report_prints(graph, sets, in_repo, capsys):
    args = ["check", graph, *[x for s in sets for x in ("--set", s)]]
    main(args)
    text = capsys.readouterr().out
    main([*args, "--json"])
    doc = json.loads(capsys.readouterr().out)
    target = doc["models"]["target"]
    a = target["assumptions"]
    assert target["arch"] == "qwen3_5"
    line = next(x for x in text.splitlines() if x.startswith("model target: "))
    for key in ("attn_implementation", "packing", "linear_kernels"):
        assert f"{a[key]['means']} ({a[key]['source']})" in line     # the words printed, and their source
    declared = dict(s.split("=") for s in sets)
    for key, value in declared.items():
        name = key.rsplit(".", 1)[1]
        assert a[name] == {**a[name], "value": value, "source": "declared"}
    assert doc["models"]["drafter"]["assumptions"] == {}


@pytest.mark.parametrize("fmt,key", [("tokens", "text_key"), ("chat", "text_key"), ("tokens", "messages_key"),
                                     ("text", "messages_key")])
def test_a_data_key_the_format_never_reads_is_refused(fmt, key, in_repo, capsys):
    assert main(["check", "graphs/tiny.toml", "--set", f"data.format={fmt}", "--set", f"data.{key}=body"]) == 2
    err = capsys.readouterr().err
    assert f"--set data.{key}=body: error at data.{key}: [data] format = '{fmt}' never reads {key}" in err


def test_a_data_key_the_format_reads_is_accepted(in_repo, capsys):
    assert main(["check", "graphs/tiny.toml", "--set", "data.format=chat", "--set", "data.messages_key=m"]) == 0
