"""The memory programs derived from transformers' own code (docs/memory-programs.md).

Each stored program is evaluated at sizes not used in fitting it, and its peak compared with torch's MemTracker
over fake tensors, and every allocation with the dispatch-level recorder, byte for byte. The evaluator imports
no torch. The fitter reports, never drops, an allocation whose size does not fit.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflash_graph.models import programs

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dflash_graph"
STORED = programs.available()


def _id(k):
    return f"{k['arch']}-{k['packing']}"


# --------------------------------------------------------------------------------------------------------------
# the evaluator without torch, and the tracer off check's path


def test_programs_evaluate_without_torch():
    code = (
        "import sys\n"
        "from dflash_graph.models import programs\n"
        "for k in programs.available():\n"
        "    p = programs.load(k['arch'], packing=k['packing'])\n"
        "    dims = p['held_out'][0]['point']\n"
        "    programs.evaluate(p, dims, dims['seq'], p['layer_types'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(len(programs.available()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(STORED) > 0


#: the one command that derives a program, for one config (`dflash-graph trace-model`): it needs torch by design
TRACER_COMMAND = PKG / "cli" / "trace_model.py"


def test_only_tools_and_tests_import_the_tracer():
    """models/trace imports torch: nothing in the package outside it may import it (check must not), but the
    trace-model command."""
    bad = []
    for path in PKG.rglob("*.py"):
        if "trace" in path.relative_to(PKG).parts or path == TRACER_COMMAND:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if "models.trace" in n]
    assert not bad, bad


@functools.lru_cache(maxsize=None)
def _stored(arch: str, packing: str) -> dict:
    return programs.load(arch, packing=packing)


@st.composite
def _admissible(draw, arch: str, packing: str):
    """Dims, seq, layers and upto a program holds for: each dim drawn small, a quotient dim ("div") made whole,
    head_dim a multiple of 8 (as the design's) and a dim a condition wants a multiple of n one, then the
    program's conditions assumed; seqs up to several
    delta-rule chunks."""
    prog = _stored(arch, packing)
    # a dim a condition wants a multiple of n ("hidden % 8 == 0") is drawn as one
    step = {w[0]: int(w[2]) for w in (c.split() for c in prog.get("holds_when", ())) if len(w) == 5 and w[4] == "0"}
    values = {d: step.get(d, 1) * draw(st.integers(1, 48 // step.get(d, 1)), label=d)
              for d in prog["dims"] if d != "seq"}
    values["head_dim"] = 8 * draw(st.integers(1, 6), label="head_dim / 8")  # rotary: Qwen3.5's dim is head_dim/4, halved
    for name, (op, a, b) in prog.get("derived", {}).items():
        if op == "div":
            values[a] = values[b] * draw(st.integers(1, 4), label=name)
    values["seq"] = draw(st.integers(2, 700), label="seq")
    values.update(programs.derived_values(prog.get("derived", {}), values))
    assume(all(programs.holds(c, values) for c in prog.get("holds_when", ())))
    layers = draw(st.lists(st.sampled_from(prog["layer_types"]), min_size=1, max_size=6), label="layers")
    upto = draw(st.sampled_from(["end", "epilogue"]), label="upto")
    return {d: values[d] for d in prog["dims"] if d != "seq"}, values["seq"], layers, upto


@pytest.mark.parametrize("key", STORED, ids=[_id(k) for k in STORED])
@given(data=st.data())
@settings(max_examples=max(1, settings.default.max_examples // 3))  # 8 programs: a few seconds in all
def test_the_fast_walk_equals_the_full_expansion(key, data):
    """evaluate's peaks, computed piece by piece with a loop's iterations extrapolated, are those of the replay of
    every event (expand=True), at random admissible dims, seqs, layers and stopping points; the events it expands
    on demand are the replay's."""
    prog = _stored(key["arch"], key["packing"])
    dims, seq, layers, upto = data.draw(_admissible(key["arch"], key["packing"]))
    fast = programs.evaluate(prog, dims, seq, layers, upto=upto)
    full = programs.evaluate(prog, dims, seq, layers, upto=upto, expand=True)
    assert (fast.peak, fast.piece_peak, fast.peak_event) == (full.peak, full.piece_peak, full.peak_event)
    live: dict[str, int] = {}
    for e in fast.events[: fast.peak_event + 1]:  # the live bytes right after the peak's allocation are the peak
        if e.kind == "alloc":
            live[e.id] = e.nbytes
        else:
            del live[e.id]
    assert fast.events[fast.peak_event].kind == "alloc" and sum(live.values()) == fast.peak
    assert fast.events == full.events


def _alloc(ident: str, n: int) -> dict:
    return {"alloc": ident, "dtype": "uint8", "itemsize": 1, "shape": [[[n, 1]]], "shape_text": f"[{n}]",
            "storage": "shape", "op": "aten.empty.memory_format", "module": "m"}


def test_the_fast_walk_extrapolates_a_loop_that_grows():
    """A loop whose iterations keep something (net +5 bytes each) peaks in its last iteration, one whose free
    reaches two iterations back repeats only after a warm-up: the fast walk equals the replay at every count."""
    loop = {"count": [[1, 1, "c"]], "count_text": "c",
            "body": [_alloc("b0", 5), _alloc("b1", 7), _alloc("b2", 2), _alloc("b3", 4), {"f": "b1", "iter": 0},
                     {"f": "b2", "iter": -2}, {"f": "b3", "iter": -1, "init": "h1"}]}
    prog = {"key": {"arch": "toy", "packing": "documents"}, "dims": {"c": "c", "seq": "seq"}, "derived": {},
            "pieces": {"embed": {"head": [_alloc("h0", 8)], "tail": [],
                                 "exports": [{"id": "h0", "dies": {"piece": "end", "at": 0}}]},
                       "layer:x": {"head": [_alloc("h0", 3), _alloc("h1", 11)], "loop": loop, "tail": [{"f": "h0"}],
                                   "exports": []},
                       "between": {"head": [], "tail": [], "exports": []}, "end": {"head": [], "tail": [], "exports": []}}}
    peaks = []
    for c in range(7):
        fast = programs.evaluate(prog, {"c": c}, 1, ["x", "x"])
        full = programs.evaluate(prog, {"c": c}, 1, ["x", "x"], expand=True)
        assert (fast.peak, fast.piece_peak, fast.peak_event) == (full.peak, full.piece_peak, full.peak_event), c
        peaks.append(fast.peak)
    assert peaks[-1] - peaks[-2] == 2 * 5  # the second layer's last iteration, over both layers' kept bytes


# --------------------------------------------------------------------------------------------------------------
# the fitter on synthetic traces (no torch run)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dflash_graph.models.trace import fit  # noqa: E402
from dflash_graph.models.trace.record import Alloc, Free, Piece, Trace  # noqa: E402


def test_fit_poly_recovers_products_and_fractions():
    pts = [{"a": a, "b": b} for a in (3, 5, 8) for b in (2, 7, 9)]
    ys = [a * b + a // 1 * 2 + 3 for a, b in ((p["a"], p["b"]) for p in pts)]
    poly = fit.fit_poly(pts, ys, ["a", "b"])
    assert fit.poly_text(poly) == "3 + 2*a + a*b"
    quarter = fit.fit_poly([{"a": a} for a in (8, 16, 24, 40)], [a // 4 for a in (8, 16, 24, 40)], ["a"])
    assert fit.poly_text(quarter) == "a/4"


def _trace(sizes: list[int], loop: int = 0) -> Trace:
    """embed, one layer allocating `sizes` (and, `loop` times, a carried state) and freeing them, norm."""
    ev, i = [], 0
    for n in sizes:
        ev += [Alloc(i, n, (n,), "uint8", 1, "aten.empty.memory_format", "mlp"), Free(i)]
        i += 1
    state = None
    for _ in range(loop):
        ev.append(Alloc(i, 4, (4,), "uint8", 1, "aten.add.Tensor", "scan"))
        if state is not None:
            ev.append(Free(state))
        state, i = i, i + 1
    if state is not None:
        ev.append(Free(state))
    pieces = (Piece("embed", (Alloc(100, 8, (8,), "uint8", 1, "aten.embedding.default", ""),)),
              Piece("layer:decoder", tuple(ev)), Piece("between", ()), Piece("epilogue", (Free(100),)))
    return Trace(pieces, 0, {})


def test_an_allocation_that_does_not_fit_is_reported():
    pts = [{"x": x} for x in (2, 3, 4, 5, 6)]
    good = fit.fit_program("toy", [(p, _trace([7 * p["x"]])) for p in pts], ["x"])
    ev = good["pieces"]["layer:decoder"]["head"][0]
    assert ev["shape_text"] == "[7*x]" and ev["op"] == "aten.empty.memory_format"
    with pytest.raises(fit.FitError, match=r"layer:decoder.head event 0 \(aten.empty.memory_format in mlp\).*x"):
        fit.fit_program("toy", [(p, _trace([2 ** p["x"]])) for p in pts], ["x"])


def test_a_loop_over_chunks_is_found_and_its_count_fitted():
    pts = [{"c": c} for c in (2, 3, 4, 6)]
    prog = fit.fit_program("toy", [(p, _trace([5], loop=p["c"])) for p in pts], ["c"])
    loop = prog["pieces"]["layer:decoder"]["loop"]
    run = programs.evaluate(dict(prog, dims={"c": "c"}), {"c": 9}, 1, ["decoder"])
    assert loop["count_text"] in ("c", "-1 + c")
    assert sum(e.kind == "alloc" for e in run.events) == 1 + 1 + 9
    assert run.peak == 8 + 2 * 4  # the embedding, the old and the new state


def test_structures_that_differ_are_reported():
    pts = [{"x": 2}, {"x": 3}]
    a = _trace([1])
    b = Trace(a.pieces[:1] + (Piece("layer:decoder", (
        Alloc(0, 1, (1,), "uint8", 1, "aten.mm.default", "mlp"), Free(0))),) + a.pieces[2:], 0, {})
    with pytest.raises(fit.FitError, match="layer:decoder: traces run different ops at event 0"):
        fit.fit_program("toy", [(pts[0], a), (pts[1], b)], ["x"])


# --------------------------------------------------------------------------------------------------------------
# every stored program against MemTracker and the recorder, at sizes not used in fitting

from dflash_graph.models.trace.archs import ARCHS  # noqa: E402
from dflash_graph.models.trace.derive import disagreement, held_out, trace_at  # noqa: E402
from dflash_graph.models.trace.memtrack import REALISTIC, compare, memtracker_peak  # noqa: E402


def test_a_quotient_of_dims_is_fitted_in_a_derived_dim():
    """repeat_kv's [1, kv_heads, groups, seq, head_dim]: groups = heads / kv_heads is no polynomial in heads and
    kv_heads (a degree-2 fit through the design was wrong at held-out sizes); with the derived dim the simplest
    fit is the dim itself, though the design has fewer points than monomials."""
    from dflash_graph.models.trace.derive import design, program_dims

    spec = ARCHS["qwen3"]
    pts = [program_dims(spec, p) for p in design(spec, "mask")]
    assert len(pts) < len(fit.monomials(spec.names()))
    poly = fit.fit_poly(pts, [p["heads"] // p["kv_heads"] for p in pts], spec.names())
    assert fit.poly_text(poly) == "groups"
    far = spec.with_derived({"heads": 40, "kv_heads": 5})
    assert fit.poly_value(poly, far) == far["heads"] // far["kv_heads"]
    with pytest.raises(programs.ProgramError, match="groups = heads / kv_heads must be a whole number"):
        programs.derived_values({"groups": ["div", "heads", "kv_heads"]}, {"heads": 12, "kv_heads": 5})


@pytest.mark.parametrize("key", STORED, ids=[_id(k) for k in STORED])
def test_program_peak_equals_memtracker_at_held_out_sizes(key):
    """Every stored program, at a point outside its design and its own held-out points: each allocation's size
    equals the recorder's, and the peak equals MemTracker's, byte for byte."""
    spec = ARCHS[key["arch"]]
    prog = programs.load(key["arch"], packing=key["packing"])
    point = held_out(spec, key["packing"], n=4, seed=7)[-1]
    assert point not in [h["point"] for h in prog["held_out"]]
    tr = trace_at(spec, point, key["packing"])
    types = [p.name.removeprefix("layer:") for p in tr.pieces if p.name.startswith("layer:")]
    run = programs.evaluate(prog, {k: v for k, v in point.items() if k != "seq"}, point["seq"], types)
    assert disagreement(run, tr) is None, disagreement(run, tr)
    assert run.peak == memtracker_peak(spec, point, key["packing"], layer_types=types)


@pytest.mark.skipif(not any(k["arch"] == "qwen3_5" for k in STORED), reason="no Qwen3.5 program derived yet")
def test_qwen3_5_layers_in_any_order_and_number():
    """The program composes layers it was not traced with: three layers, full attention first."""
    spec = ARCHS["qwen3_5"]
    prog = programs.load("qwen3_5")
    point = held_out(spec, "documents", n=1, seed=11)[0]
    types = ["full_attention", "linear_attention", "linear_attention"]
    run = programs.evaluate(prog, {k: v for k, v in point.items() if k != "seq"}, point["seq"], types)
    assert run.peak == memtracker_peak(spec, point, "documents", layer_types=types)


@pytest.mark.parametrize("key", STORED, ids=[_id(k) for k in STORED])
def test_parameter_counts_equal_transformers_numel_at_held_out_points(key):
    """Each component's stored parameter count, at the program's held-out points and layers, is the numel of
    transformers' own model built there on the meta device (embedding, the layers summed, norm, lm_head)."""
    from dflash_graph.models.trace.params import build_meta

    spec = ARCHS[key["arch"]]
    prog = programs.load(key["arch"], packing=key["packing"])
    for h in prog["held_out"]:
        model, _ = build_meta(spec, h["point"], h["layers"])
        want = {"embed": model.model.embed_tokens, "layers": model.model.layers, "norm": model.model.norm,
                "lm_head": model.lm_head}
        got = programs.params(prog, {k: v for k, v in h["point"].items() if k != "seq"}, h["layers"])
        assert got == {c: sum(p.numel() for p in m.parameters()) for c, m in want.items()}, h["point"]
        assert sum(got.values()) == sum(p.numel() for p in model.parameters())
    with pytest.raises(programs.ProgramError, match="layer type 'mamba' has no derived parameter count"):
        programs.params(prog, h["point"], ["mamba"])


REALISTIC_CASES = [(k, name) for k in STORED for name in REALISTIC.get(k["arch"], {})]


@pytest.mark.slow
@pytest.mark.parametrize("key,name", REALISTIC_CASES, ids=[f"{_id(k)}-{n}" for k, n in REALISTIC_CASES])
def test_program_peak_equals_memtracker_at_realistic_width(key, name):
    """The public configs' widths (few layers, seq 2048): the program's peak is MemTracker's, byte for byte."""
    spec = ARCHS[key["arch"]]
    point = dict(REALISTIC[key["arch"]][name], seq=2048)
    predicted, measured = compare(spec, point, key["packing"], layers=4 if spec.layers else 2)
    assert predicted == measured


# --------------------------------------------------------------------------------------------------------------
# where a program holds: a config transformers refuses, and the code paths sdpa takes


def test_a_config_transformers_refuses_is_a_fit_error():
    """LlamaConfig refuses hidden not a multiple of heads: the tracer names the point and the fix, no traceback."""
    spec = ARCHS["llama"]
    with pytest.raises(fit.FitError, match=r"LlamaConfig refuses the point .*'hidden': 50.*not a multiple.*`valid`"):
        trace_at(spec, dict(spec.base, hidden=50), "documents")
    assert not spec.admits(dict(spec.base, hidden=50), "documents")


def test_a_forward_that_fails_at_a_point_is_a_fit_error():
    """torch._grouped_mm wants rows of 16 bytes: Qwen3-MoE at hidden 49 (bf16) fails inside the forward; the
    tracer names the point and where the condition goes, and the arch entry keeps such points out."""
    spec = ARCHS["qwen3_moe"]
    bad = dict(spec.base, hidden=49, seq=16)
    with pytest.raises(fit.FitError, match=r"Qwen3MoeForCausalLM fails at the point .*'hidden': 49.*16 bytes.*"
                                           r"`holds_when`"):
        trace_at(spec, bad, "documents")
    assert not spec.admits(bad, "documents") and spec.admits(dict(bad, hidden=56), "documents")


def test_conditions_of_a_program():
    values = {"heads": 8, "kv_heads": 1, "head_dim": 512, "seq": 100}
    assert programs.holds("heads != kv_heads", values) and not programs.holds("kv_heads != 1", values)
    assert not programs.holds("head_dim <= 256", values) and programs.holds("seq > 1", values)
    with pytest.raises(programs.ProgramError, match="'experts', not a dim"):
        programs.holds("experts > 1", values)


def _layer_ops(spec, point, packing):
    tr = trace_at(spec, point, packing)
    return fit._tokens(next(s for s in fit._split(tr) if s["name"].startswith("layer:"))["own"])


def test_sdpa_conditions_are_where_the_layer_runs_other_code():
    """With a mask, sdpa repeats kv heads by a copy, except with one kv head (a view) or no repeat: each
    excluded point runs other ops than an admitted one, and the design admits only points that run the same."""
    spec = ARCHS["qwen3"]
    base = dict(spec.base, seq=24)
    ops = _layer_ops(spec, base, "mask")
    assert _layer_ops(spec, dict(base, heads=8, kv_heads=4), "mask") == ops
    for excluded in (dict(base, kv_heads=1), dict(base, heads=4, kv_heads=4)):
        assert not spec.admits(excluded, "mask") and spec.admits(excluded, "documents")
        assert _layer_ops(spec, excluded, "mask") != ops
    # head_dim > 256 without a mask: sdpa cannot take the grouped heads, repeat_kv copies them
    wide = dict(base, head_dim=264)
    assert not spec.admits(wide, "documents") and spec.admits(wide, "mask")
    assert _layer_ops(spec, wide, "documents") != _layer_ops(spec, base, "documents")


@pytest.mark.parametrize("key", STORED, ids=[_id(k) for k in STORED])
def test_the_evaluator_refuses_a_config_the_program_does_not_hold_for(key):
    prog = programs.load(key["arch"], packing=key["packing"])
    point = dict(prog["held_out"][0]["point"])
    seq = point.pop("seq")
    bad = dict(point, head_dim=512) if key["packing"] == "documents" else dict(point, kv_heads=point["heads"])
    with pytest.raises(programs.ProgramError, match="holds when .* transformers runs other code"):
        programs.evaluate(prog, bad, seq, prog["layer_types"])
