"""What `check` predicts for a target's forward, against torch's MemTracker over transformers' own module (issue 22,
point 5): for every target arch, the body forward and the causal-LM forward, packing `documents` and `mask`.

check's figure is the forward node's allocation program as the memory model replays it (ops/costs.py, from the
arch's events: a derived program, models/decoder.py), built from a graph file like a user's
(tools/derived_vs_memtracker.py `check_peak`, which prints the same comparison as a table); MemTracker's is the
activation peak (ACT + TEMP) of the same forward over fake tensors (models/trace/memtrack.py). Both count the
embedding output, every temporary and, for the causal LM, the logits; neither counts the weights or the inputs.
Small configs run here (a few seconds); realistic widths (the public configs, a few layers) under `-m slow`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

from dflash_graph.models import programs  # noqa: E402
from dflash_graph.models.trace.archs import ARCHS as TRACE  # noqa: E402
from dflash_graph.models.trace.memtrack import REALISTIC, default_layers, memtracker_peak  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "derived_vs_memtracker", Path(__file__).resolve().parent.parent / "tools" / "derived_vs_memtracker.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def cases(points):
    out = []
    for arch, named in points.items():
        for name, point in named.items():
            for packing in ("documents", "mask"):
                for body in (True, False):
                    # the causal LM's forward holds the body's: the body alone under -m slow
                    out.append(pytest.param(arch, point, packing, body,
                                            id=f"{name}-{packing}-{'body' if body else 'causal_lm'}",
                                            marks=(pytest.mark.slow,) if body else ()))
    return out


def layers_of(arch: str, packing: str) -> list[str]:
    """Two layers; Qwen3.5 four (three linear-attention layers, then a full one)."""
    return default_layers(programs.load(arch, packing=packing), 4 if TRACE[arch].layers else 2)


SMALL = {arch: {arch: dict(spec.base)} for arch, spec in TRACE.items()}


@pytest.mark.parametrize("arch, point, packing, body", cases(SMALL))
def test_check_equals_memtracker_small(arch, point, packing, body):
    types = layers_of(arch, packing)
    assert tool.check_peak(arch, point, packing, types, body) == \
        memtracker_peak(TRACE[arch], point, packing, layer_types=types, body=body)


@pytest.mark.parametrize("arch", sorted(TRACE))
def test_check_equals_memtracker_at_one_chunk(arch):
    """seq 30: Qwen3.5's delta rule runs one chunk (its scan never loops); the others' forwards at a short seq."""
    point = dict(TRACE[arch].base, seq=30)
    types = layers_of(arch, "documents")
    assert tool.check_peak(arch, point, "documents", types, False) == \
        memtracker_peak(TRACE[arch], point, "documents", layer_types=types, body=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch, point, packing, body",
                         cases({a: {n: dict(p, seq=4096) for n, p in named.items()} for a, named in REALISTIC.items()}))
def test_check_equals_memtracker_realistic(arch, point, packing, body):
    types = layers_of(arch, packing)
    assert tool.check_peak(arch, point, packing, types, body) == \
        memtracker_peak(TRACE[arch], point, packing, layer_types=types, body=body)
