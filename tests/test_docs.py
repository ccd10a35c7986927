"""docs/ stays true: the generated reference pages match the declarations, and every graph shipped checks."""

from pathlib import Path

from dflash_graph.cli.reference import ops_reference, toml_reference

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_toml_reference_is_current():
    assert (DOCS / "toml-reference.md").read_text() == toml_reference(), "run: python tools/gen_docs.py"


def test_ops_reference_is_current():
    assert (DOCS / "ops.md").read_text() == ops_reference(), "run: python tools/gen_docs.py"


def test_every_schema_key_is_documented():
    from dflash_graph.spec import schema

    text = (DOCS / "toml-reference.md").read_text()
    for sec in schema.SECTIONS:
        for k in sec.keys:
            assert f"`{k.name}`" in text
