"""Dims without sympy (ir/dims.py, NOTE [Dims without sympy]): what `check` computes on IntPolys is exactly what
sympy computes, printed the same, and `check` of the shipped graphs does not import sympy at all."""

import ast
import random
import subprocess
import sys
from pathlib import Path

import pytest
import sympy

from dflash_graph.ir.dims import DimEnv, IntPoly, as_sympy, evaluate, parse_expr, symbol
from dflash_graph.ops.contract import _evaluate

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["seq", "anchors", "block", "Vocab", "d0", "d_1"]


def random_expr(rng: random.Random, depth: int = 0) -> str:
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(NAMES + ["1", "2", "3", "16"])
    op = rng.choice(["+", "-", "*", "*", "+", "**", "//", "%", "min", "max", "-u"])
    a, b = random_expr(rng, depth + 1), random_expr(rng, depth + 1)
    if op == "**":
        return f"({a}) ** {rng.choice([0, 1, 2, 3])}"
    if op in ("min", "max"):
        return f"{op}({a}, {b})"
    if op == "-u":
        return f"-({a})"
    return f"({a}) {op} ({b})"


def sympy_evaluate(text: str, values: dict[str, int]):
    """The same expression computed by sympy alone, as ir/dims.py did before IntPoly."""
    def go(node):
        if isinstance(node, ast.Constant):
            return sympy.Integer(node.value)
        if isinstance(node, ast.Name):
            return symbol(node.id)
        if isinstance(node, ast.UnaryOp):
            return -go(node.operand)
        if isinstance(node, ast.Call):
            return (sympy.Min if node.func.id == "min" else sympy.Max)(*map(go, node.args))
        a, b = go(node.left), go(node.right)
        return {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b, ast.Pow: lambda: a ** b,
                ast.FloorDiv: lambda: sympy.floor(a / b), ast.Mod: lambda: sympy.Mod(a, b)}[type(node.op)]()
    return go(parse_expr(text))


def test_intpoly_prints_as_sympy_and_computes_the_same_on_random_expressions():
    rng = random.Random(21)
    values = {n: rng.randint(2, 50) for n in NAMES}
    fast = 0
    for _ in range(300):        # 300 random expressions (600 took a tenth of the suite's slowest tests)
        text = random_expr(rng)
        if "-(" in text:
            continue           # unary minus is not dim syntax (evaluate refuses it); kept out of the comparison
        try:
            expr, val = evaluate(parse_expr(text), lambda n: (IntPoly.of(n), values[n]))
        except Exception as e:   # division by zero, over the bound: the sympy path is not asked
            assert type(e).__name__ == "DimError", (text, e)
            continue
        want = sympy_evaluate(text, values)
        fast += isinstance(expr, IntPoly)
        assert str(expr) == str(want), text
        assert as_sympy(expr) == want, text
        assert int(want.subs({symbol(n): v for n, v in values.items()})) == val, text
    assert fast > 75       # the comparison is not all fallbacks (a quarter of the draws at least)


@pytest.mark.parametrize("text", ["seq*anchors - seq", "seq*block + anchors*block", "2*seq + 4", "5*seq*seq",
                                  "seq - 1 + Vocab", "d0 + d0 + d0", "anchors*block - anchors*block + 7",
                                  "seq**2 - 2*seq*d0 + d0**2", "min(seq, 16) + seq"])
def test_contract_expressions_are_simplified_as_sympy_simplifies(text):
    """ops/contract.py skips sympy.simplify for monomials and linear sums (NOTE [Simplified without sympy]): its
    result equals simplify's on those, and sympy is still asked for the rest (`seq*(anchors - 1)`)."""
    env = {"seq": ("seq", 100), "anchors": ("anchors", 8), "block": ("block", 16), "Vocab": ("Vocab", 3),
           "d0": ("d0", 5)}
    names = sorted(set(__import__("re").findall(r"[A-Za-z_]\w*", text)) - {"min"})
    got = _evaluate.__wrapped__(text, tuple((n, *env[n]) for n in names))
    loc = {n: sympy.Symbol(n) for n in names}
    want = sympy.simplify(sympy.sympify(text.replace("min(", "Min("), locals={**loc, "Min": sympy.Min}))
    assert got.sym == str(want).replace(" ", "")


def test_dim_env_symbols_are_intpolys_for_sums_and_products():
    env = DimEnv({"seq": 1024, "anchors": 4, "tokens": "anchors * block", "block": 16, "last": "vocab - 1",
                  "vocab": "target.vocab_size"}, {"target": {"vocab_size": 300}})
    assert str(env.eval_text("tokens")[0]) == "tokens" and env.value("tokens") == 64
    assert str(env.eval_text("anchors * block")[0]) == "anchors*block"
    assert str(env.eval_text("2 * (seq + block)")[0]) == "2*block + 2*seq"
    assert env.eval_text("last") == (IntPoly.of("last"), 299)


def test_check_does_not_import_sympy():
    """sympy is imported by --max, explain and the proofs, not by a check: ~0.5 s of CPU on every check."""
    code = ("import sys; from dflash_graph.cli.main import main\n"
            "for args in (['graphs/tiny.toml'], ['graphs/qwen27b.toml'], ['graphs/qwen27b.toml', '--no-rewrite']):\n"
            "    try: main(['check', *args, '--json'])\n"
            "    except SystemExit: pass\n"
            "print('SYMPY', 'sympy' in sys.modules, file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "SYMPY False" in p.stderr, p.stderr[-2000:]
