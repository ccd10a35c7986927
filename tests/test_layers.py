"""The architecture holds: each layer of dflash_graph imports only from the layers before it, no module is part of
an import circle (inside a layer either), and no code outside ops/ asks for an op by its name.

An import inside a function counts like one at the top of the module: it delays the import, it does not change
which module depends on which (docs/architecture.md)."""

import ast
import textwrap
from pathlib import Path

import networkx as nx

from dflash_graph.ops import registry

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


def module_of(path: Path, root: Path = PKG) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = PKG) -> list[tuple[str, int]]:
    """(module or module.name, line) for every import in the file, at the top or inside a function."""
    tree = ast.parse(path.read_text())
    mod = module_of(path, root)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]   # `from pkg import module`
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
    return out


def import_graph(root: Path = PKG) -> nx.DiGraph:
    """Modules of the package, an edge a -> b where a imports b (labelled with the file and line)."""
    paths = {module_of(p, root): p for p in root.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(paths)
    for mod, path in paths.items():
        for target, line in imports(path, root):
            if target in paths and target != mod and not mod.startswith(target + "."):
                g.add_edge(mod, target, at=f"{path.relative_to(root.parent)}:{line}")
    return g


def circles(root: Path = PKG) -> list[str]:
    g = import_graph(root)
    return [" -> ".join(f"{a} ({g.edges[a, b]['at']})" for a, b in zip(c, c[1:] + c[:1]))
            for c in nx.simple_cycles(g)]


def test_imports_point_one_way():
    bad = []
    for path in PKG.rglob("*.py"):
        here = layer_of(module_of(path))
        if here is None:
            continue
        for imp, line in imports(path):
            there = layer_of(imp)
            if there is not None and RANK[there] > RANK[here]:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} ({here}) imports {imp} ({there})")
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    found = circles()
    assert not found, "import circles (give the shared part its own module):\n" + "\n".join(found)


def test_circles_are_found_inside_a_layer_and_behind_a_function_level_import(tmp_path):
    pkg = tmp_path / "dflash_graph"
    (pkg / "analysis").mkdir(parents=True)
    for f in ("__init__.py", "analysis/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "analysis" / "launch.py").write_text("def f():\n    from .memory import g\n")
    (pkg / "analysis" / "memory.py").write_text("from . import launch\n")
    (pkg / "analysis" / "infer.py").write_text("from .memory import g\n")
    found = circles(pkg)
    assert len(found) == 1
    assert "dflash_graph.analysis.launch (dflash_graph/analysis/launch.py:2)" in found[0]
    assert "dflash_graph.analysis.memory (dflash_graph/analysis/memory.py:1)" in found[0]


# -- op names ---------------------------------------------------------------------------------------------------

# an expression that stands for an op's identity: node.op, op.name, op_name, ...
_OP_ATTRS = {"op"}
_OP_NAMES = {"op", "op_name", "name"}


def _is_op_identity(e: ast.expr) -> bool:
    if isinstance(e, ast.Attribute):
        return e.attr in _OP_ATTRS or (e.attr == "name" and isinstance(e.value, ast.Name) and "op" in e.value.id)
    return isinstance(e, ast.Name) and e.id in _OP_NAMES


def _literals(e: ast.expr, names: set[str]) -> list[ast.Constant]:
    """The op-name string constants of an expression or of a tuple, list, set or dict display it is."""
    if isinstance(e, ast.Constant) and e.value in names:
        return [e]
    if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
        return [x for x in e.elts if isinstance(x, ast.Constant) and x.value in names]
    if isinstance(e, ast.Dict):
        return [k for k in e.keys if isinstance(k, ast.Constant) and k.value in names]
    return []


def op_name_uses(source: str, names: set[str]) -> list[tuple[int, str, str]]:
    """(line, op name, how) where code asks for an op by its name: compares an op's identity with it (`n.op ==
    'lm_head'`, `n.op in (...)`), looks it up (`registry.get('loss')`, `OPS['loss']`), makes a node of it (`Node(id,
    'transfer', ...)`, `.evolve(op='norm')`), dispatches on it (`{'norm': f}[n.op]`), or keeps a table of op names
    (`FORWARDS = ('body_forward', 'causal_lm_forward')`). A component, port or metric that shares an op's name
    (`op.components`, `outputs['loss']`) is not an op."""
    out = []
    for node in ast.walk(ast.parse(source)):
        hits: list[tuple[ast.Constant, str]] = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_op_identity(s) for s in sides):
                hits += [(c, "compared with an op") for s in sides for c in _literals(s, names)]
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if fname == "get" and owner in ("registry", "OPS") and node.args:
                hits += [(c, "looked up by name") for c in _literals(node.args[0], names)]
            if fname == "Node" and len(node.args) > 1:
                hits += [(c, "a node made by op name") for c in _literals(node.args[1], names)]
            if fname == "get" and isinstance(f, ast.Attribute) and node.args and _is_op_identity(node.args[0]):
                hits += [(c, "dispatched on the op") for c in _literals(f.value, names)]
            hits += [(c, "a node made by op name") for k in node.keywords if k.arg == "op"
                     for c in _literals(k.value, names)]
        elif isinstance(node, ast.Subscript):
            if isinstance(node.value, ast.Name) and node.value.id == "OPS":
                hits += [(c, "looked up by name") for c in _literals(node.slice, names)]
            if _is_op_identity(node.slice):
                hits += [(c, "dispatched on the op") for c in _literals(node.value, names)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
            v = node.value
            elts = v.keys if isinstance(v, ast.Dict) else v.elts if isinstance(v, (ast.Tuple, ast.List, ast.Set)) \
                else None
            if elts and all(isinstance(x, ast.Constant) and x.value in names for x in elts):
                hits += [(c, "a table of op names") for c in _literals(v, names)]
        out += [(c.lineno, c.value, how) for c, how in hits]
    return out


def test_no_op_name_outside_ops():
    names = set(registry.all_ops())
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path.relative_to(PKG).parts[0] == "ops":
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{line}: op '{name}' {how}"
                for line, name, how in op_name_uses(path.read_text(), names)]
    assert not bad, ("code outside ops/ asks for ops by name (declare what it needs as a trait of the op, "
                     "ops/contract.py):\n" + "\n".join(bad))


def test_op_name_uses_finds_each_way_of_asking_and_nothing_else():
    names = set(registry.all_ops())
    asks = textwrap.dedent("""
        roles = ["body"] if n.op in ("body_forward", "causal_lm_forward") else []
        if n.op == "drafter_forward": pass
        if "lm_head" != node.op: pass
        if name == "hook_capture": pass
        if op.name == "loss": pass
        op = registry.get("transfer")
        fused = OPS["fused_head_loss"]
        x = Node(nid, "index_shift", (), {}, device)
        y = node.evolve(op="norm")
        f = {"norm": a, "gather": b}[n.op]
        g = {"roll": a}.get(n.op)
        FORWARDS = ("body_forward", "causal_lm_forward")
    """)
    found = [(line, name) for line, name, _ in op_name_uses(asks, names)]
    assert {name for _, name in found} == {"body_forward", "causal_lm_forward", "drafter_forward", "lm_head",
                                           "hook_capture", "loss", "transfer", "fused_head_loss", "index_shift",
                                           "norm", "gather", "roll"}
    assert {line for line, _ in found} == set(range(2, 14))
    others = textwrap.dedent("""
        if "lm_head" in op.components: pass
        loss = out["loss"]
        mod = store.component(name, "norm", tdev)
        pick = {"embed": e, "norm": f, "lm_head": g}[comp]
        __all__ = ["body_forward", "lm_head"]
        __slots__ = ("ids", "loss")
        if "loss" in typed.outputs_of(n.id): pass
        if op.device_rule == "any_input": pass
    """)
    assert op_name_uses(others, names) == []


def test_every_op_with_a_model_declares_modules_the_store_builds():
    # exec/models.py ModelStore.module: "body", "trainable", or a component of the node's model
    for name, op in registry.all_ops().items():
        roles = op.module_roles()
        if op.model_arch and op.components:
            assert roles, name
        assert all(r in ("body", "trainable") or r in op.components for r in roles), (name, roles)
