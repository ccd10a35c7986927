"""What `check` predicts for a target's forward, against torch's MemTracker over transformers' own module (issue 22,
point 5): for every target arch, the body forward and the causal-LM forward, packing `documents` and `mask`.

check's figure is the forward node's allocation program as the memory model replays it (ops/costs.py, from the
arch's events: a derived program, models/decoder.py), built from a graph file like a user's; MemTracker's is the
activation peak (ACT + TEMP) of the same forward over fake tensors (models/trace/memtrack.py). Both count the
embedding output, every temporary and, for the causal LM, the logits; neither counts the weights or the inputs.
Small configs run here (a few seconds); realistic widths (the public configs, a few layers) under `-m slow`.
"""

from __future__ import annotations

import json

import pytest

from dflash_graph.analysis.nodecost import node_cost
from dflash_graph.ops.costs import program_peak
from dflash_graph.rewrite.pipeline import compile_graph

torch = pytest.importorskip("torch")

from dflash_graph.models.trace.archs import ARCHS as TRACE  # noqa: E402
from dflash_graph.models.trace.memtrack import REALISTIC, default_layers, memtracker_peak  # noqa: E402
from dflash_graph.models import programs  # noqa: E402

GRAPH = """
[dims]
seq = {seq}

[devices.cpu]
torch = "cpu"
capacity = "1 TiB"

[models.target]
arch = "{arch}"
dtype = "bfloat16"
packing = "{packing}"
config = {config}

[[nodes]]
id = "tokens"
op = "token_input"
device = "cpu"
params = {{ length = "seq" }}

[[nodes]]
id = "fwd"
op = "{op}"
model = "target"
device = "cpu"
inputs = {{ input_ids = "tokens.input_ids", position_ids = "tokens.position_ids" }}

[[nodes]]
id = "out"
op = "output"
device = "cpu"
inputs = {{ x = "fwd.{port}" }}
"""


def check_peak(tmp_path, arch: str, point: dict[str, int], packing: str, layers: list[str], body: bool) -> int:
    """The forward node's peak as check models it, from a graph file with this config inline."""
    spec = TRACE[arch]
    cfg = {spec.dims[k]: v for k, v in point.items() if k != "seq"}
    cfg.update({k: v for k, v in spec.fixed.items()})
    cfg["num_hidden_layers"] = len(layers)
    if spec.layers:
        cfg["layer_types"] = layers
    (tmp_path / "config.json").write_text(json.dumps({"model_type": arch, **cfg}))
    op, port = ("body_forward", "hidden") if body else ("causal_lm_forward", "logits")
    path = tmp_path / "graph.toml"
    path.write_text(GRAPH.format(seq=point["seq"], arch=arch, packing=packing, config='"config.json"', op=op,
                                 port=port))
    plan = compile_graph(str(path), rewrite=False)
    node = next(n for n in plan.typed.graph.nodes if n.id == "fwd")
    return program_peak(node_cost(plan.typed, node, grad=False).program)


def cases(points):
    out = []
    for arch, named in points.items():
        for name, point in named.items():
            for packing in ("documents", "mask"):
                for body in (True, False):
                    out.append(pytest.param(arch, point, packing, body,
                                            id=f"{name}-{packing}-{'body' if body else 'causal_lm'}"))
    return out


SMALL = {arch: {arch: dict(spec.base)} for arch, spec in TRACE.items()}


@pytest.mark.parametrize("arch, point, packing, body", cases(SMALL))
def test_check_equals_memtracker_small(tmp_path, arch, point, packing, body):
    types = default_layers(programs.load(arch, packing=packing), 4 if arch == "qwen3_5" else 2)
    spec = TRACE[arch]
    assert check_peak(tmp_path, arch, point, packing, types, body) == \
        memtracker_peak(spec, point, packing, layer_types=types, body=body)


@pytest.mark.slow
@pytest.mark.parametrize("arch, point, packing, body",
                         cases({a: {n: dict(p, seq=4096) for n, p in named.items()} for a, named in REALISTIC.items()}))
def test_check_equals_memtracker_realistic(tmp_path, arch, point, packing, body):
    types = default_layers(programs.load(arch, packing=packing), 4 if arch == "qwen3_5" else 2)
    spec = TRACE[arch]
    assert check_peak(tmp_path, arch, point, packing, types, body) == \
        memtracker_peak(spec, point, packing, layer_types=types, body=body)
