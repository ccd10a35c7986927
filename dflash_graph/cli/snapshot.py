"""`check --memory-snapshot FILE.pickle`: write the predicted snapshot (analysis/snapshot.py) and say so."""

from __future__ import annotations

import pickle

from ..analysis.memory import drawable
from ..analysis.snapshot import snapshot
from ..rewrite.pipeline import Plan


def write_snapshot(plan: Plan, path: str) -> tuple[dict, str]:
    drawable(plan.typed, "--memory-snapshot")
    snap = snapshot(plan.typed, plan.memory.allocator)
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=pickle.HIGHEST_PROTOCOL)
    devices = snap["dflash_graph"]["devices"]
    events = sum(len(t) for t in snap["device_traces"])
    info = {"file": path, "devices": devices, "events": events, "segments": len(snap["segments"])}
    if not devices:
        return info, (f"wrote {path}: no CUDA device in this graph (CPU tensors have no caching allocator), so the "
                      "snapshot is empty")
    which = "as written" if not plan.rewritten else "rewritten"
    return info, (f"wrote {path}: predicted memory snapshot of {len(devices)} CUDA devices ({which}), {events:,} "
                  f"trace events, {len(snap['segments'])} segments at the end of the trace\n"
                  f"  open it at https://pytorch.org/memory_viz, or: python -m torch.cuda._memory_viz trace_plot "
                  f"{path} -o memory.html")
