"""`dflash-graph trace-model CONFIG` (issue 22: "where a size cannot be fitted in the dims, a config-specific program
is derived on first use; that needs torch, and check says so").

A packaged program holds for its arch's fixed config values (Qwen3: attention_bias = false). check refuses a config
that sets another value, with the trace-model command for that config file; trace-model derives the program for
it into the user program directory (DFLASH_GRAPH_PROGRAMS here: a tmp dir); check then reads that program, and its
forward's peak is MemTracker's for that config. The lookup itself (a program chosen by its fixed values, the
packaged one for the default values) is tested without a trace on a program file written by hand.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dflash_graph.cli.main import main
from dflash_graph.models import decoder, programs
from dflash_graph.models.decoder import DecoderDims

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "graphs" / "tiny_qwen3.toml"


@pytest.fixture
def user_programs(tmp_path, monkeypatch):
    """An empty user program directory, and check's program cache emptied before and after (a program is read
    once per process, by arch, packing and fixed values)."""
    d = tmp_path / "programs"
    monkeypatch.setenv("DFLASH_GRAPH_PROGRAMS", str(d))
    decoder.program.cache_clear()
    decoder.program_body_events.cache_clear()
    yield d
    decoder.program.cache_clear()
    decoder.program_body_events.cache_clear()


def biased_config(tmp_path: Path, **changes) -> Path:
    """graphs/tiny_qwen3's config.json with attention_bias = true (q, k, v and o projections with a bias: other
    code than the packaged Qwen3 program's), in its own directory."""
    cfg = json.loads((ROOT / "graphs" / "tiny_qwen3" / "config.json").read_text())
    cfg.update({"attention_bias": True}, **changes)
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def graph_with(tmp_path: Path, config: Path) -> Path:
    """graphs/tiny_qwen3.toml with its target's config read from `config`."""
    text = TINY.read_text().replace('config = "tiny_qwen3/config.json"', f'config = "{config}"')
    assert str(config) in text
    path = tmp_path / "graph.toml"
    path.write_text(text)
    return path


def check(graph: Path, *extra: str) -> int:
    return main(["check", str(graph), "--memory-only", *extra])


def test_check_refuses_a_fixed_value_no_program_holds_for_with_the_trace_model_command(tmp_path, user_programs,
                                                                                     capsys):
    config = biased_config(tmp_path)
    graph = graph_with(tmp_path, config)
    assert check(graph) == 2
    err = capsys.readouterr().err
    assert f"{graph}:" in err and "error at models.target.config" in err
    assert "config key 'attention_bias' = true" in err and "attention_bias = false" in err
    assert f"dflash-graph trace-model {config}" in err and "Traceback" not in err
    # a value --set changed is not in the file: the command says to write the config out
    assert check(graph_with(tmp_path, ROOT / "graphs" / "tiny_qwen3" / "config.json"),
                 "--set", "models.target.config.attention_bias=true") == 2
    err = capsys.readouterr().err
    assert "dflash-graph trace-model CONFIG (CONFIG: this model's config written as a config.json)" in err


def test_load_picks_the_program_whose_fixed_values_are_the_configs(tmp_path, user_programs, capsys):
    """A user program is chosen by its recorded fixed values; the packaged one for the default values; check
    reads the chosen one for every cost (the forward's, the packing's, the parameters')."""
    packaged = programs.load("qwen3")
    assert Path(packaged["path"]).parent == Path(programs.__file__).parent
    prog = {k: v for k, v in packaged.items() if k != "path"}
    prog["fixed"] = dict(prog["fixed"], attention_bias=True)
    # a marker no packaged program has, to tell which one check read: one more parameter per norm
    prog["params"] = dict(prog["params"], norm=prog["params"]["norm"] + [[1, 1]])
    path = programs.path_of(**{"arch": "qwen3", "attn": "sdpa", "transformers_version": prog["key"]["transformers"],
                               "packing": "documents"}, fixed=prog["fixed"])
    assert path.parent == user_programs and programs.fixed_tag(prog["fixed"]) in path.name
    path.parent.mkdir()
    path.write_text(json.dumps(prog))

    assert programs.load("qwen3", fixed={"attention_bias": True})["path"] == str(path)
    assert programs.load("qwen3", fixed={"attention_bias": False})["path"] == packaged["path"]
    assert programs.load("qwen3")["path"] == packaged["path"]
    with pytest.raises(programs.ProgramError, match="trace-model"):
        programs.load("qwen3", packing="mask", fixed={"attention_bias": True})
    assert [k["user"] for k in programs.available() if k["arch"] == "qwen3"].count(True) == 1

    cfg = json.loads(biased_config(tmp_path).read_text())
    dims = DecoderDims.from_config(cfg, arch="qwen3")
    assert dict(dims.fixed)["attention_bias"] == "true" and dims.program["path"] == str(path)
    plain = DecoderDims.from_config(dict(cfg, attention_bias=False), arch="qwen3")
    assert plain.fixed == () and plain.program["path"] == packaged["path"]
    assert decoder.component_params(dims)["norm"] == decoder.component_params(plain)["norm"] + 1

    graph = graph_with(tmp_path, biased_config(tmp_path))
    assert check(graph) == 0
    assert check(graph, "--set", "models.target.packing=mask") == 2
    err = capsys.readouterr().err
    assert "error at models.target.packing" in err and "--packing mask" in err


def test_trace_model_refuses_what_it_cannot_derive(tmp_path, user_programs, capsys):
    def run(cfg) -> tuple[int, str]:
        path = tmp_path / "c" / "config.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
        rc = main(["trace-model", str(path), "--packing", "documents"])
        return rc, capsys.readouterr().err

    qwen3 = json.loads(biased_config(tmp_path).read_text())
    for cfg, words in [
        ({k: v for k, v in qwen3.items() if k != "model_type"}, "expected the model_type of a target, found none"),
        (dict(qwen3, model_type="bert"), "'bert' is not a target"),
        (dict(qwen3, model_type="qwen3_5"), "its packaged programs only"),
        (dict(qwen3, attention_bias="yes"), "error at attention_bias: expected a bool"),
        (dict(qwen3, hidden_act=3), "Qwen3Config refuses this config"),
        ("{not json", "not valid JSON"),
        ([1, 2], "found a JSON list"),
    ]:
        rc, err = run(cfg)
        assert rc == 2 and words in err and "hint:" in err and "Traceback" not in err, (cfg, err)
    assert main(["trace-model", str(tmp_path / "nowhere")]) == 2
    assert "no such file" in capsys.readouterr().err
    # the packaged programs hold: nothing derived, nothing written
    rc, err = run(dict(qwen3, attention_bias=False, tie_word_embeddings=True))
    assert rc == 0 and "nothing to derive" in err and not user_programs.exists()


def _tool():
    spec = importlib.util.spec_from_file_location("derived_vs_memtracker", ROOT / "tools" / "derived_vs_memtracker.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_trace_model_derives_a_program_check_reads_and_memtracker_measures(tmp_path, user_programs, capsys):
    """trace-model on a Qwen3 config with attention_bias = true writes a program (one packing: 36 traces and 3
    held-out checks); check then accepts the graph, and its forward's peak, body and causal LM, is MemTracker's
    at a config outside the program's design."""
    import attrs

    from dflash_graph.models.trace.archs import ARCHS as TRACE
    from dflash_graph.models.trace.memtrack import default_layers, memtracker_peak

    config = biased_config(tmp_path)
    graph = graph_with(tmp_path, config)
    assert check(graph) == 2
    capsys.readouterr()
    assert main(["trace-model", str(config.parent), "--packing", "documents"]) == 0
    out, err = capsys.readouterr()
    (written,) = out.split()
    fixed = dict(TRACE["qwen3"].fixed, attention_bias=True)
    assert Path(written).parent == user_programs and programs.fixed_tag(fixed) in written
    assert "tracing design size 1/" in err and "exact at 3 held-out points" in err
    prog = json.loads(Path(written).read_text())
    assert prog["fixed"] == fixed and prog["key"]["packing"] == "documents"
    assert check(graph) == 0

    spec = attrs.evolve(TRACE["qwen3"], fixed=fixed)
    point = {"hidden": 56, "heads": 6, "kv_heads": 3, "head_dim": 40, "intermediate": 104, "vocab": 350, "seq": 77}
    types = default_layers(prog, 2)
    tool = _tool()
    for body in (True, False):
        assert tool.check_peak("qwen3", point, "documents", types, body, fixed=fixed) == \
            memtracker_peak(spec, point, "documents", layer_types=types, body=body)
