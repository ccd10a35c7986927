"""The architecture holds: each layer of dflash_graph imports only from the layers before it."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "dflash_graph"
ORDER = ["errors", "units", "spec", "ir", "ops", "models", "analysis", "rewrite", "exec", "train", "cli"]
# ops and models are one layer: an op's cost reads its architecture's formulas, and models/nn is only imported
# by the torch implementations
RANK = {name: i for i, name in enumerate(ORDER)}
RANK["models"] = RANK["ops"]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "dflash_graph" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in RANK else None


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    mod = "dflash_graph." + ".".join(path.relative_to(PKG).with_suffix("").parts)
    pkg = mod.rsplit(".", 1)[0] if path.name != "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                out.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_imports_point_one_way():
    bad = []
    for path in PKG.rglob("*.py"):
        here = layer_of("dflash_graph." + ".".join(path.relative_to(PKG).with_suffix("").parts))
        if here is None:
            continue
        for imp in imports(path):
            there = layer_of(imp)
            if there is not None and RANK[there] > RANK[here]:
                bad.append(f"{path.relative_to(PKG.parent)} ({here}) imports {imp} ({there})")
    assert not bad, "\n".join(bad)
