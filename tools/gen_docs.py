"""Regenerate docs/toml-reference.md, docs/ops.md and docs/graph.schema.json from the declarations (tests/test_docs.py checks them)."""

from pathlib import Path

from dflash_graph.cli.reference import graph_json_schema_text, ops_reference, toml_reference

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    (ROOT / "docs" / "toml-reference.md").write_text(toml_reference())
    (ROOT / "docs" / "ops.md").write_text(ops_reference())
    (ROOT / "docs" / "graph.schema.json").write_text(graph_json_schema_text())
    print("wrote docs/toml-reference.md, docs/ops.md and docs/graph.schema.json")
