"""The rewrite rules proven for every size by z3 (dflash_graph/rewrite/proofs.py, docs/rules/proofs.md).

Every theorem of the registry is proven (one test each); a trait declared wrongly on a new op is refuted with a
readable counterexample; a change to a rule's own index arithmetic breaks its proof; the condition under which
gather_through_remap is exact is found, and the rule's run-time check is that condition; the torch
implementations behave as the proofs model them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("z3", reason="the proofs need z3-solver (in the test extra: pip install -e '.[test]')")

from dflash_graph.cli.main import main as cli_main  # noqa: E402
from dflash_graph.ops import registry, torch_impl  # noqa: E402
from dflash_graph.ops.contract import OpDef, Port, Traits  # noqa: E402
from dflash_graph.rewrite import proofs, rules  # noqa: E402

THEOREMS = {th.name: th for th in proofs.theorems()}
_OUTCOMES: dict[str, proofs.Outcome] = {}


def outcome(name: str) -> proofs.Outcome:
    """Each theorem of the registry is proven once per test session."""
    if name not in _OUTCOMES:
        _OUTCOMES[name] = proofs.prove(THEOREMS[name])
    return _OUTCOMES[name]


@pytest.mark.parametrize("name", list(THEOREMS))
def test_every_theorem_of_the_registry(name):
    out = outcome(name)
    assert out.ok, proofs.render([out])


def test_theorems_cover_every_declaring_op():
    """Derived from the registry: one theorem per rule and per op that declares its trait."""
    ops = registry.all_ops()
    names = set(THEOREMS)
    for op in ops.values():
        t = op.traits
        if t.positionwise:
            assert any(n.startswith(f"gather_through_positionwise[{op.name}.") for n in names), op.name
        if t.remap:
            assert any(n.startswith("gather_through_remap[") and n.endswith(f" o {op.name}]") for n in names)
        if t.movement:
            assert f"transfer_round_trip[{op.name}]" in names
        if rules.removable(op):
            assert f"drop_unused[{op.name}]" in names
        if rules.mergeable(op):
            assert f"merge_duplicates[{op.name}]" in names
    assert "chunked_row_reduction" in names


# -- a trait declared wrongly ------------------------------------------------------------------------------------

def _running_total(t, p, x):
    """cumsum along axis 0: out[i, *rest] = sum_{j <= i} x[j, *rest] (rank 0: x itself)."""
    def at(G):
        rest = t.take(G, 1, t.length(G) - 1)
        return t.where(t.length(G) == 0, x.at(G),
                       t.sum(0, t.nth(G, 0) + 1, lambda j: x.at(t.cat(t.unit(j), rest))))
    return {"out": t.tensor(("s",), at)}


def _running_total_rows(t, p, x):
    def at(i, G):
        return t.sum(0, i + 1, lambda j: x.at(j, G))
    return {"out": t.tensor(("i", "s"), at)}


# a cumulative sum along axis 0 declared position-wise over every axis: wrong
WRONG = OpDef(name="running_total", doc="cumsum along axis 0 (test only)",
              inputs=(Port("x", "*s", "like:x"),), outputs=(Port("out", "*s", "like:x"),),
              traits=Traits(positionwise="s", reference=_running_total))
# the same sum declared position-wise over the axes after the summed one: right
RIGHT = OpDef(name="running_total_rows", doc="cumsum along axis 0 (test only)",
              inputs=(Port("x", "n *rest", "like:x"),), outputs=(Port("out", "n *rest", "like:x"),),
              traits=Traits(positionwise="rest", reference=_running_total_rows))


def _field(detail: str, name: str) -> str:
    m = re.search(rf"^\s*{re.escape(name)} = (.*)$", detail, flags=re.M)
    assert m, f"{name!r} missing from the counterexample:\n{detail}"
    return m.group(1)


def _seq(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"-?\d+", text)]


def _table(detail: str, name: str) -> tuple[dict[tuple[int, ...], Fraction], Fraction]:
    """`x: [[1]] = -1/2, else 1/4` -> ({(1,): -1/2}, 1/4)."""
    line = re.search(rf"^\s*{name}: (.*)$", detail, flags=re.M).group(1)
    entries = {tuple(_seq(k)): Fraction(v) for k, v in re.findall(r"\[(\[[^\]]*\])\] = (-?[\d/]+)", line)}
    return entries, Fraction(re.search(r"else (-?[\d/]+)", line).group(1))


def test_cumsum_declared_positionwise_is_refuted_with_a_counterexample():
    with registry.registered(WRONG):
        th = next(t for n, t in ((t.name, t) for t in proofs.theorems())
                  if n == "gather_through_positionwise[running_total.out, declared axis]")
        out = proofs.prove(th)
    assert out.status == "refuted" and not out.ok
    d = out.detail
    print(proofs.render([out]))
    assert d.startswith("equality that broke: gather(running_total(...).out, idx, axis=s[k])")
    n = int(_field(d, "size of the selected axis"))
    J = _seq(_field(d, "J (index of idx)"))
    lhs, rhs = Fraction(_field(d, "lhs")), Fraction(_field(d, "rhs"))
    assert lhs != rhs and n >= 1 and len(J) == int(_field(d, "rank of idx"))
    # the counterexample is a real one: replay it with torch (x along axis 0 of size n, idx of shape J + 1)
    xs, x_else = _table(d, "x")
    ids, i_else = _table(d, "idx")
    Q = tuple(_seq(_field(d, "Q (trailing group index)")))
    x = torch.tensor([float(xs.get((i, *Q), x_else)) for i in range(n)], dtype=torch.float64)
    m = max(J[0] + 1, 1)
    idx = torch.tensor([int(ids.get((j,), i_else)) for j in range(m)])
    assert all(0 <= int(v) < n for v in idx), "the counterexample's indices are in range"
    before = torch.cumsum(x, 0)[idx][J[0]]             # gather(cumsum(x), idx)[J]
    after = torch.cumsum(x[idx], 0)[J[0]]              # cumsum(gather(x, idx))[J]
    assert float(before) == pytest.approx(float(lhs)) and float(after) == pytest.approx(float(rhs))


def test_cumsum_declared_positionwise_over_the_other_axes_is_proven():
    with registry.registered(RIGHT):
        ths = [t for t in proofs.theorems() if t.name.startswith("gather_through_positionwise[running_total_rows")]
        outs = proofs.prove_all(ths)
    assert len(outs) == 2 and all(o.status == "proved" for o in outs), proofs.render(outs)


def _flip(t, p, x):
    """out[..., i, ...] = x[..., n - 1 - i, ...] along `axis`: a permutation of positions, but not a roll."""
    a = p["axis"]

    def at(G):
        i = t.nth(G, a)
        return x.at(t.cat(t.take(G, 0, a), t.unit(x.size(a) - 1 - i), t.take(G, a + 1, t.length(G) - a - 1)))
    return {"out": t.tensor(("s",), at)}


def _ring(t, p, x):
    """torch.roll written out: out[..., i, ...] = x[..., (i - k) mod n, ...] along `dim`."""
    a, n = p["dim"], x.size(p["dim"])

    def at(G):
        i = t.nth(G, a)
        return x.at(t.cat(t.take(G, 0, a), t.unit((i - p["k"]) % n), t.take(G, a + 1, t.length(G) - a - 1)))
    return {"out": t.tensor(("s",), at)}


def _remap_op(name, shift, axis, ref):
    from dflash_graph.ops.contract import IndexRemap, Param

    return OpDef(name=name, doc="test only", inputs=(Port("x", "*x", "like:x"),), outputs=(Port("out", "*x", "like:x"),),
                 params=(Param(shift, "int", "shift", required=True), Param(axis, "int", "axis", default=0)),
                 traits=Traits(remap=IndexRemap(shift, axis), reference=ref))


def test_a_remap_under_other_param_names_is_proven():
    with registry.registered(_remap_op("ring_shift", "k", "dim", _ring)):
        th = next(t for t in proofs.theorems() if t.name == "gather_through_remap[gather o ring_shift]")
        out = proofs.prove(th)
    assert out.status == "proved", out.detail


def test_a_flip_declared_as_a_remap_is_refuted():
    with registry.registered(_remap_op("flip", "shift", "axis", _flip)):
        th = next(t for t in proofs.theorems() if t.name == "gather_through_remap[gather o flip]")
        out = proofs.prove(th)
    assert out.status == "refuted"
    assert out.detail.startswith("equality that broke: gather(flip(x, shift=k, axis=a), idx)[pre, J, post]")
    assert Fraction(_field(out.detail, "lhs")) != Fraction(_field(out.detail, "rhs"))


# -- the rules' own arithmetic is what is proven ------------------------------------------------------------------

def test_an_off_by_one_in_the_rule_breaks_its_proof(monkeypatch):
    good = rules.positionwise_axis
    monkeypatch.setattr(rules, "positionwise_axis", lambda o, a, i: good(o, a, i) + 1)
    out = proofs.prove(THEOREMS["gather_through_positionwise[norm.out, declared axis]"])
    assert out.status == "refuted"
    assert "lhs reads every input at group index" in out.detail and "rhs reads x at group index" in out.detail


def test_a_wrong_shift_sign_in_the_rule_breaks_its_proof(monkeypatch):
    good = rules.remap_index
    monkeypatch.setattr(rules, "remap_index", lambda k, n: (good(k, n)[0], {**good(k, n)[1], "shift": k % n}))
    out = proofs.prove(THEOREMS["gather_through_remap[gather o roll]"])
    assert out.status == "refuted"
    assert "shift = " in out.detail and "idx[J] = " in out.detail and "n (axis length) = " in out.detail


def test_the_condition_is_found_and_is_the_rules_check():
    out = outcome("gather_through_remap[gather o roll]: condition")
    assert out.ok, out.detail
    assert "without a condition: refuted" in out.detail
    assert "under 0 <= idx: refuted" in out.detail and "under idx < n: refuted" in out.detail
    assert "condition found: 0 <= idx and idx < n" in out.detail
    assert "rule's run-time check (index_shift check_range) == 0 <= idx and idx < n: proved" in out.detail


def test_merging_random_draws_and_dropping_effects_are_refuted():
    """What the rules' trait guards exclude is really wrong: two anchor draws differ; an impure node has effects."""
    out = outcome("merge_duplicates[anchor_sample]")
    assert out.status == "refuted" and out.ok and "value of its twin" in out.detail
    impure = proofs.prove(proofs._drop_theorem(registry.get("token_input"), expect="refuted"))
    assert impure.status == "refuted" and "state" in impure.detail


def test_chunking_with_a_wrong_chunk_end_is_refuted():
    import z3

    over = proofs.prove(proofs.chunked_sum_theorem(lambda start, size, rows: start + size))   # reads past R
    assert over.status == "refuted" and "L2 chunks, step m -> m+1: refuted" in over.detail
    short = proofs.prove(proofs.chunked_sum_theorem(
        lambda start, size, rows: z3.If(start + size - 1 < rows, start + size - 1, rows)))     # drops a row per chunk
    assert short.status == "refuted"
    for d in (over.detail, short.detail):
        assert "rows R = " in d and "chunk size C = " in d and "T(m+1) (the chunks' sum) = " in d


# -- the torch implementations are what the proofs model -----------------------------------------------------------

def _ctx(**params):
    return SimpleNamespace(params=params)


def test_gather_clamps_as_its_selection_declares():
    assert registry.get("gather").traits.selection.out_of_range == "clamp"
    x = torch.arange(4.0)
    out = torch_impl.gather(_ctx(axis=0), x, torch.tensor([-1, 0, 3, 4, 9]))["out"]
    assert out.tolist() == [0.0, 0.0, 3.0, 3.0, 3.0]


def test_index_shift_checks_its_range_when_asked():
    idx = torch.tensor([[0, 3], [1, 2]])
    assert torch_impl.index_shift(_ctx(shift=3, modulo=4, check_range=True), idx)["out"].tolist() == [[3, 2], [0, 1]]
    with pytest.raises(ValueError, match=r"outside \[0, 4\).*index 4 at \[1, 0\]"):
        torch_impl.index_shift(_ctx(shift=3, modulo=4, check_range=True), torch.tensor([[0, 3], [4, 2]]))
    assert torch_impl.index_shift(_ctx(shift=3, modulo=4), torch.tensor([4, -1]))["out"].tolist() == [3, 2]


def test_index_shift_reference_matches_torch():
    import z3

    ref = registry.get("index_shift").traits.reference
    values = torch.tensor([-9, -1, 0, 3, 7, 12])
    for shift, modulo in ((3, 4), (-5, 7), (65535, 65536)):
        t = proofs.Algebra()
        index = proofs.Tensor(("i",), lambda i: z3.IntVal(int(values[int(str(i))])))
        out = ref(t, {"shift": shift, "modulo": modulo}, index)["out"]
        got = [z3.simplify(out.at(z3.IntVal(i))).as_long() for i in range(len(values))]
        assert got == torch_impl.index_shift(_ctx(shift=shift, modulo=modulo), values)["out"].tolist()


def test_the_rule_inserts_the_check():
    op, params = rules.remap_index(1, 65536)
    assert op == "index_shift" and params == {"shift": 65535, "modulo": 65536, "check_range": True}


_ROLL_GATHER = """
[dims]
n = 8

[devices.d0]
torch = "cpu"
capacity = "1 GiB"

[[nodes]]
id = "x"
op = "rand_input"
device = "d0"
params = { rank = 2, d0 = 8, d1 = 4 }

[[nodes]]
id = "idx"
op = "rand_input"
device = "d0"
params = { rank = 1, d0 = 2, dtype = "int64", values = [1, LAST] }

[[nodes]]
id = "rolled"
op = "roll"
device = "d0"
inputs = { x = "x.out" }
params = { shift = 1 }

[[nodes]]
id = "rows"
op = "gather"
device = "d0"
inputs = { x = "rolled.out", index = "idx.out" }

[[nodes]]
id = "result"
op = "output"
device = "d0"
inputs = { x = "rows.out" }
"""


def test_the_rewritten_graph_stops_where_it_would_differ():
    """gather(roll(x, 1), idx) on 8 rows: with idx = [1, 7] the rewritten graph computes the same rows; with
    idx = [1, 8] the graph as written clamps 8 to 7, and the rewritten one stops at the inserted check."""
    from dflash_graph.analysis.infer import build, infer
    from dflash_graph.analysis.memory import live_peaks
    from dflash_graph.exec.interpreter import Interpreter
    from dflash_graph.exec.models import ModelStore
    from dflash_graph.rewrite.engine import rewrite
    from dflash_graph.spec.loader import parse_graph
    from strategies import RAND_INPUT

    def run(typed):
        interp = Interpreter(typed, ModelStore(typed, {"d0": "cpu"}), {"d0": "cpu"}, strict=True, track_memory=False)
        ref = typed.graph["result"].input("x")
        return interp.run_replica(0, lambda _r: {}, keep=frozenset([ref]))[ref.node][ref.output]

    with registry.registered(RAND_INPUT):
        for last in (7, 8):
            typed = infer(*build(parse_graph(_ROLL_GATHER.replace("LAST", str(last)), "roll_gather.toml")))
            new, applied = rewrite(typed, rules.DEFAULT_TABLES, live_peaks)
            assert [a.rule for a in applied] == ["gather_through_remap", "drop_unused"]
            as_written = run(typed)
            if last == 7:
                assert torch.equal(run(new), as_written)
            else:
                with pytest.raises(ValueError, match=r"outside \[0, 8\).*--no-rewrite \(index 8 at \[1\]\)"):
                    run(new)


# -- running them ------------------------------------------------------------------------------------------------

def test_cli_prove_prints_each_theorem_and_its_time(capsys):
    assert cli_main(["prove", "-k", "round_trip"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^transfer_round_trip\[transfer\]\s+proved\s+\d+\.\d\d s$", out, flags=re.M), out
    assert cli_main(["prove", "-k", "no such theorem"]) == 2


def test_importing_the_proofs_does_not_import_z3():
    code = ("import sys, dflash_graph.rewrite.proofs, dflash_graph.cli.main; "
            "assert 'z3' not in sys.modules, 'z3 imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
