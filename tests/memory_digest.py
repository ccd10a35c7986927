"""Digests of every predicted memory figure (allocated/reserved peaks, peak nodes, OOMs, node peaks, the
timelines and labels behind --plot/--max/snapshot, each device's allocation events) for a set of graphs: the
golden file tests/memory_digests.json was written by the replay before it was made faster, and
tests/test_memory_digest.py checks that the current replay gives byte-identical figures.

    python tests/memory_digest.py            # print the digests
    python tests/memory_digest.py --update   # rewrite tests/memory_digests.json (only when a figure is meant to change)
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_graph.analysis.memory import device_events  # noqa: E402
from dflash_graph.errors import GraphError  # noqa: E402
from dflash_graph.rewrite.pipeline import compile_graph  # noqa: E402

L = "models.target.config.num_hidden_layers="
CUDA_A = ["devices.a.torch=cuda:0", "devices.a.capacity=64 MiB"]
TINY_CUDA = ["devices.t0.torch=cuda:0", "devices.t1.torch=cuda:1", "devices.draft.torch=cuda:2"]
# (name, graph, overrides, rewrite, expandable segments[, text edits of the graph file: (old, new) pairs])
CASES = [
    ("tiny", "graphs/tiny.toml", [], True, None),
    ("tiny-written", "graphs/tiny.toml", [], False, None),
    ("tiny-cuda", "graphs/tiny.toml", ["devices.t0.torch=cuda:0", "devices.t1.torch=cuda:1",
                                       "devices.draft.torch=cuda:2"], True, None),
    ("tiny-cuda-expandable", "graphs/tiny.toml", ["devices.t0.torch=cuda:0", "devices.t1.torch=cuda:1",
                                                  "devices.draft.torch=cuda:2"], True, True),
    ("tiny-cuda-hook-last", "graphs/tiny.toml", TINY_CUDA, True, None,
     [("layers = [1, 3]", "layers = [2, 5]"), ("target_layer_ids = [1, 3]", "target_layer_ids = [2, 5]"),
      ('"hooks.layer1", "hooks.layer3"', '"hooks.layer2", "hooks.layer5"')]),
    *[(f"minimal-{n}", "tests/graphs/minimal.toml", [f"{L}{n}"], True, None) for n in (64, 100, 128, 500)],
    *[(f"minimal-cuda-{n}", "tests/graphs/minimal.toml", [f"{L}{n}", *CUDA_A], True, None) for n in (64, 100, 500)],
    ("minimal-cuda-100-expandable", "tests/graphs/minimal.toml", [f"{L}100", *CUDA_A], True, True),
    ("minimal-cuda-100-bf16", "tests/graphs/minimal.toml", [f"{L}100", "models.target.dtype=bfloat16", *CUDA_A],
     True, None),
    ("minimal-cuda-500-small", "tests/graphs/minimal.toml", [f"{L}500", "devices.a.torch=cuda:0",
                                                             "devices.a.capacity=8 MiB"], True, None),
    ("qwen27b", "graphs/qwen27b.toml", [], True, None),
    ("qwen27b-written", "graphs/qwen27b.toml", [], False, None),
    ("qwen27b-expandable", "graphs/qwen27b.toml", [], True, True),
    ("qwen27b-fp32", "graphs/qwen27b.toml", [], True, None, [('dtype = "bfloat16"', 'dtype = "float32"')]),
    ("qwen27b-100-hook-last", "graphs/qwen27b.toml", [f"{L}100"], True, None,
     [("[1, 16, 31, 46, 61]", "[1, 30, 50, 70, 99]"), ("layer16", "layer30"), ("layer31", "layer50"),
      ("layer46", "layer70"), ("layer61", "layer99")]),
    ("qwen27b-160-oom", "graphs/qwen27b.toml", [f"{L}160"], True, None),
]


def _mem(report):
    """A report without what the host reads at run time (its available memory)."""
    if report is None:
        return None
    host = report.host and (report.host.devices, report.host.need_bytes)
    return report.devices, report.allocator, host


def _h(obj) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:24]


def digest(graph: str, overrides, rewrite: bool, expandable, edits=()) -> dict:
    path = ROOT / graph
    with tempfile.TemporaryDirectory() as tmp:
        if edits:   # the edited graph next to links to the original's folder's files (configs it names)
            for f in path.parent.iterdir():
                (Path(tmp) / f.name).symlink_to(f)
            text = path.read_text()
            for old, new in edits:
                assert old in text, old
                text = text.replace(old, new)
            path = Path(tmp) / ("edited_" + path.name)
            path.write_text(text)
        try:
            plan = compile_graph(str(path), list(overrides), rewrite=rewrite, expandable_segments=expandable)
        except GraphError as e:
            return {"error": _h(str(e).replace(str(path), graph))}
    out = {"memory": _h(_mem(plan.memory)), "before": _h(_mem(plan.memory_before)), "applied": _h(plan.applied)}
    for typed, tag in ((plan.original, "orig"), (plan.typed, "new")):
        for d in typed.ctx.spec.devices:
            out[f"events/{tag}/{d}"] = _h(device_events(typed, d))
    return out


def all_digests(names=None) -> dict:
    return {c[0]: digest(*c[1:]) for c in CASES if names is None or c[0] in names}


if __name__ == "__main__":
    got = all_digests()
    text = json.dumps(got, indent=1, sort_keys=True) + "\n"
    if "--update" in sys.argv:
        (ROOT / "tests/memory_digests.json").write_text(text)
    print(text)
