"""What each predicted allocation is, for pictures and tables: weights, training state, activations, workspace,
receive buffers. Read from the event labels analysis/memory.py writes ("node/what"), and the node's op traits."""

from __future__ import annotations

from ..ops import registry
from .infer import Typed

CATEGORIES = ("weights", "training state", "receive buffers", "activations", "workspace")


def category(typed: Typed, label: str) -> str:
    node, _, what = label.partition("/")
    if node == "load":
        if what.startswith("weights"):
            return "weights"
        if "queue buffer" in what:
            return "receive buffers"
        return "training state"        # fp32 master weights, AdamW moments
    if node == "optimizer" or "weight grad" in what:
        return "training state"        # gradients of the weights, fp32 copies, the foreach temporaries
    if node in typed.graph and registry.get(typed.graph[node].op).traits.movement and " [" in what:
        return "receive buffers"       # what a transfer lands on this device
    if " [" in what or "saved for backward" in what or "grad of" in what:
        return "activations"           # node outputs, hooked layers, autograd's saved tensors, their gradients
    return "workspace"                 # a node's temporaries while it runs
