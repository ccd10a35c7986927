"""The memory programs derived from transformers' own code (docs/memory-programs.md).

Each stored program is evaluated at sizes not used in fitting it, and its peak compared with torch's MemTracker
over fake tensors, and every allocation with the dispatch-level recorder, byte for byte. The evaluator imports
no torch. The fitter reports, never drops, an allocation whose size does not fit.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_only_tools_and_tests_import_the_tracer():
    """models/trace imports torch: nothing in the package outside it may import it (check must not)."""
    bad = []
    for path in PKG.rglob("*.py"):
        if "trace" in path.relative_to(PKG).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if "models.trace" in n]
    assert not bad, bad


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
from dflash_graph.models.trace.derive import held_out, trace_at  # noqa: E402


def _memtracker_peak(spec, point, packing, layer_types=None) -> int:
    """torch's MemTracker over fake tensors: the activation peak of one causal-LM forward."""
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from dflash_graph.models.trace.record import packed_positions, packing_as_run

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = spec.config({k: v for k, v in point.items() if k != "seq"})
    if layer_types:
        cfg.layer_types, cfg.num_hidden_layers = list(layer_types), len(layer_types)
    fake = FakeTensorMode()
    with fake:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = spec.model_class()(cfg).eval()
        finally:
            torch.set_default_dtype(prev)
        ids = torch.zeros(1, point["seq"], dtype=torch.long)
    kw = {"input_ids": ids, "use_cache": False}
    if packing == "mask":
        kw["position_ids"] = fake.from_tensor(packed_positions(point["seq"], 4))
    mt = MemTracker()
    mt.track_external(model)
    with packing_as_run(packing == "mask"), fake, torch.no_grad(), mt:
        model(**kw)
    snap = mt.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    return snap[dev][_MemRefType.ACT] + snap[dev][_MemRefType.TEMP]


@pytest.mark.parametrize("key", STORED, ids=[_id(k) for k in STORED])
def test_program_peak_equals_memtracker_at_held_out_sizes(key):
    spec = ARCHS[key["arch"]]
    prog = programs.load(key["arch"], packing=key["packing"])
    point = held_out(spec, n=1, seed=7)[0]  # not a design point, not the stored program's own held-out points
    tr = trace_at(spec, point, key["packing"])
    types = [p.name.removeprefix("layer:") for p in tr.pieces if p.name.startswith("layer:")]
    run = programs.evaluate(prog, {k: v for k, v in point.items() if k != "seq"}, point["seq"], types)
    assert [e.nbytes for e in run.events if e.kind == "alloc"] == [e.nbytes for e in tr.flat() if isinstance(e, Alloc)]
    assert run.peak == tr.peak == _memtracker_peak(spec, point, key["packing"])


@pytest.mark.skipif(not any(k["arch"] == "qwen3_5" for k in STORED), reason="no Qwen3.5 program derived yet")
def test_qwen3_5_layers_in_any_order_and_number():
    """The program composes layers it was not traced with: three layers, full attention first."""
    spec = ARCHS["qwen3_5"]
    prog = programs.load("qwen3_5")
    point = held_out(spec, n=1, seed=11)[0]
    types = ["full_attention", "linear_attention", "linear_attention"]
    run = programs.evaluate(prog, {k: v for k, v in point.items() if k != "seq"}, point["seq"], types)
    assert run.peak == _memtracker_peak(spec, point, "documents", layer_types=types)
