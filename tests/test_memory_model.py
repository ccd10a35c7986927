"""Invariants of the allocation sequences the memory analysis builds: nothing leaks (each step ends where it
began: weights and training state only), shared components count once, and the verdict reads the allocator."""

import pytest

from dflash_graph.analysis.memory import device_events
from dflash_graph.rewrite.pipeline import compile_graph


@pytest.mark.parametrize("graph,rewrite", [("graphs/tiny.toml", True), ("graphs/tiny.toml", False),
                                           ("graphs/qwen27b.toml", True), ("graphs/qwen27b.toml", False),
                                           ("graphs/gpu_check.toml", True), ("graphs/gpu_check.toml", False)])
def test_no_leaks_between_steps(in_repo, graph, rewrite):
    plan = compile_graph(graph, rewrite=rewrite)
    for dev in plan.typed.ctx.spec.devices:
        events, resident = device_events(plan.typed, dev, steps=3)
        live, ids = 0, {}
        ends = []
        for ev in events:
            if ev.op == "alloc":
                assert ev.tensor not in ids
                ids[ev.tensor] = ev.size
                live += ev.size
            else:
                live -= ids.pop(ev.tensor)
            if ev.label == "zero_grad(set_to_none=True)" or ev.label.startswith("optimizer/step"):
                ends.append(live)
        loaded = sum(ev.size for ev in events if ev.op == "alloc" and ev.label.startswith("load/"))
        assert live == loaded, f"{dev}: {live - loaded} bytes still live after 3 steps"


def test_shared_components_count_once(in_repo):
    plan = compile_graph("graphs/qwen27b.toml")
    gpu7 = plan.memory.devices["gpu7"]
    # target embed + lm_head (bf16, 248,320 x 5,120 each) + final norm + the drafter's own bf16 weights
    embed = 248320 * 5120 * 2
    assert 2 * embed < gpu7.weight_bytes < 2 * embed + 4 * 2**30


def test_expandable_segments_changes_only_reserved(in_repo):
    a = compile_graph("graphs/qwen27b.toml", rewrite=False, expandable_segments=False).memory
    b = compile_graph("graphs/qwen27b.toml", rewrite=False, expandable_segments=True).memory
    for dev in a.devices:
        assert abs(a.devices[dev].live_peak_bytes - b.devices[dev].live_peak_bytes) == 0
    assert a.allocator.expandable_segments is False and b.allocator.expandable_segments is True
