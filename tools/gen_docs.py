"""Regenerate docs/toml-reference.md and docs/ops.md from the declarations (tests/test_docs.py checks them)."""

from pathlib import Path

from dflash_graph.cli.reference import ops_reference, toml_reference

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    (ROOT / "docs" / "toml-reference.md").write_text(toml_reference())
    (ROOT / "docs" / "ops.md").write_text(ops_reference())
    print("wrote docs/toml-reference.md and docs/ops.md")
