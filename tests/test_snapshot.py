"""`check --memory-snapshot`: the predicted run in the pickle format of torch.cuda.memory._snapshot(), read by
PyTorch's own reader (torch.cuda._memory_viz) and by a port of its web viewer's replay (MemoryViz.js)."""

import contextlib
import io
import pickle
import subprocess
import sys

import pytest

from dflash_graph.analysis.snapshot import cuda_index, snapshot
from dflash_graph.cli.main import main
from dflash_graph.rewrite.pipeline import compile_graph

G = "graphs/qwen27b.toml"


@pytest.fixture(scope="module", params=[True, False], ids=["rewritten", "as-written"])
def plan_and_snap(request):
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    old = os.getcwd()
    os.chdir(root)
    try:
        plan = compile_graph(G, rewrite=request.param)
    finally:
        os.chdir(old)
    return plan, snapshot(plan.typed, plan.memory.allocator)


def replay_backward(snap, device):
    """MemoryViz.js `simulate_memory`, ported: start from the snapshot's segments and active blocks, undo the
    trace from its last event to its first. The viewer draws every intermediate state and dereferences each
    block's segment, so each block must lie in a segment, and undoing everything must leave nothing. Returns
    the largest reserved and allocated bytes seen on the way."""
    segs, mapped = {}, 0            # cudaMalloc'd segments by address; bytes mapped in expandable segments
    blocks = {}
    for s in snap["segments"]:
        if s["device"] != device:
            continue
        if s["is_expandable"]:
            mapped += s["total_size"]
        else:
            segs[s["address"]] = s["total_size"]
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[addr] = b["requested_size"]
            addr += b["size"]
    res_peak, alloc_peak = sum(segs.values()) + mapped, sum(blocks.values())
    for e in reversed(snap["device_traces"][device]):
        a = e["action"]
        if a == "free_completed":
            assert e["addr"] not in blocks
            blocks[e["addr"]] = e["size"]
            if not mapped:
                assert any(s <= e["addr"] < s + z for s, z in segs.items()), "a block outside every segment"
        elif a == "alloc":
            assert blocks.pop(e["addr"]) == e["size"]
        elif a == "segment_free":
            assert e["addr"] not in segs
            segs[e["addr"]] = e["size"]
        elif a == "segment_alloc":
            assert segs.pop(e["addr"]) == e["size"]
        elif a == "segment_map":
            mapped -= e["size"]
        elif a == "segment_unmap":
            mapped += e["size"]
        else:
            assert a in ("free_requested", "oom"), a
        res_peak = max(res_peak, sum(segs.values()) + mapped)
        alloc_peak = max(alloc_peak, sum(blocks.values()))
    assert not blocks and not segs and mapped == 0, "memory left before the first event"
    return res_peak, alloc_peak


def test_pytorch_reader_accepts_it(plan_and_snap, tmp_path):
    import torch.cuda._memory_viz as mv

    plan, snap = plan_and_snap
    text = mv.segsum(snap)                       # checks every segment's blocks add up
    assert "total_reserved" in text
    assert "entries" in mv.trace(snap)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # pairs every alloc with its free_requested/completed (and replaces the traces: give it a copy)
        html = mv.trace_plot({**snap, "device_traces": list(snap["device_traces"])}, filter_freed=True)
    assert "without free_requested" not in out.getvalue()
    assert "MemoryViz.js" in html and "Active Memory Timeline" in html
    assert mv.segments(snap, format_flamegraph=lambda s: s).count("\n") >= len(snap["segments"])
    mv.memory(snap, format_flamegraph=lambda s: s)
    if not plan.memory.fits:
        oom = [e for t in snap["device_traces"] for e in t if e["action"] == "oom"]
        assert oom and oom[0]["size"] == plan.memory.ooms[0].requested_bytes


def test_the_viewer_replays_it_to_the_predicted_peaks(plan_and_snap):
    plan, snap = plan_and_snap
    for name, d in plan.memory.devices.items():
        idx = cuda_index(d.torch)
        res, alloc = replay_backward(snap, idx)
        if d.oom is None:
            assert res == d.reserved_peak_bytes, name
            assert alloc == d.live_peak_bytes, name
        else:   # the trace stops at the OOM: the peak reached before it, within what the device could give
            assert res <= d.usable_bytes


def test_memory_snapshot_flag_and_pytorch_command_line(in_repo, tmp_path, capsys):
    f = tmp_path / "pred.pickle"
    assert main(["check", G, "--no-rewrite", "--memory-snapshot", str(f)]) == 1
    out = capsys.readouterr().out
    assert f"wrote {f}" in out and "8 CUDA devices" in out
    html = tmp_path / "out.html"
    p = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(f), "-o", str(html)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert html.stat().st_size > 1000
    p = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(f)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0 and "total_reserved" in p.stdout, p.stderr
    with open(f, "rb") as fh:
        assert pickle.load(fh)["dflash_graph"]["predicted"] is True


def test_cpu_graph_has_no_cuda_trace(in_repo, tmp_path, capsys):
    f = tmp_path / "tiny.pickle"
    assert main(["check", "graphs/tiny.toml", "--memory-snapshot", str(f)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
