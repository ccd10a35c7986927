"""The JSON Schema for editors: generated from spec/schema.py (and the op/arch registries), current in docs/,
every shipped graph valid against it, and the bad fixtures that are format errors invalid."""

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from dflash_graph.cli.reference import graph_json_schema, graph_json_schema_text

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "docs" / "graph.schema.json"
# fixtures whose error is one of format: a key, a type, a value out of a declared set (the rest are errors of
# meaning that only inference finds: cycles, shapes, dtypes, references between nodes)
FORMAT_ERRORS = {"bad_size", "empty", "missing_section", "unknown_arch", "unknown_config_key", "unknown_key",
                 "unknown_op", "unknown_param", "zero_dim", "long_inline_value", "arch_coming", "foreign_config_key",
                 "arch_omitted_unknown_model_type", "arch_omitted_no_model_type"}
# not loadable by Python's tomllib at all (check reports them itself): junk, syntax, 500-deep nesting, an integer
# over Python's 4,300-digit limit
NOT_TOML = {"binary_junk", "syntax_error", "deep_nesting", "huge_integer"}


def validator():
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def load(path):
    with open(path, "rb") as f:
        return tomllib.load(f)


def test_schema_is_current():
    assert SCHEMA.read_text() == graph_json_schema_text(), "run: python tools/gen_docs.py"


@pytest.mark.parametrize("path", sorted([*ROOT.glob("graphs/*.toml"), *ROOT.glob("tests/graphs/*.toml")]),
                         ids=lambda p: p.name)
def test_shipped_graphs_validate(path):
    errors = list(validator().iter_errors(load(path)))
    assert not errors, [e.message for e in errors]


@pytest.mark.parametrize("path", sorted(ROOT.glob("tests/graphs/bad/*.toml")), ids=lambda p: p.stem)
def test_bad_fixtures(path):
    if path.stem in NOT_TOML:
        with pytest.raises(Exception):
            load(path)
        return
    errors = list(validator().iter_errors(load(path)))
    if path.stem in FORMAT_ERRORS:
        assert errors, f"{path.name} is a format error the schema should catch"
    else:
        assert not errors, f"{path.name} is an error of meaning; the schema must not reject it: {errors[0].message}"


def test_every_op_and_arch_is_in_the_schema():
    from dflash_graph.models.registry import ARCHS
    from dflash_graph.ops import registry

    js = graph_json_schema()
    node = js["properties"]["nodes"]["items"]
    assert node["properties"]["op"]["enum"] == sorted(registry.all_ops())
    assert {r["if"]["properties"]["op"]["const"] for r in node["allOf"]} == set(registry.all_ops())
    assert js["properties"]["models"]["additionalProperties"]["properties"]["arch"]["enum"] == list(ARCHS)


@pytest.mark.skipif(shutil.which("taplo") is None, reason="taplo not installed (pip install taplo)")
def test_taplo_uses_the_schema():
    ok = subprocess.run(["taplo", "check", "graphs/qwen27b.toml", "graphs/tiny.toml"], cwd=ROOT,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(["taplo", "check", "tests/graphs/bad/unknown_param.toml"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "'eps' was unexpected" in bad.stderr + bad.stdout
