"""A stored program against torch's MemTracker over fake tensors: the check the tests and docs/memory-programs.md use.

MemTracker (torch/distributed/_tools/mem_tracker.py) is torch's own accounting of a module's memory; over
FakeTensorMode it allocates nothing, so realistic widths cost no memory. Its activation peak (ACT + TEMP) of one
causal-LM forward is compared with the program's evaluated peak for the same config and seq.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from dflash_graph.models import programs

from .archs import ArchSpec
from .record import packed_positions, packing_as_run

#: realistic widths with few layers (the public configs of the targets people train drafters for; layer counts
#: cut to a few so the MemTracker run is quick: a program's per-layer pieces repeat, so the peak is of the first
#: layers plus the logits)
REALISTIC: dict[str, dict[str, dict[str, int]]] = {
    "qwen3": {  # Qwen/Qwen3-8B config.json
        "Qwen3-8B": {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 12288,
                     "vocab": 151936}},
    "llama": {  # meta-llama/Llama-3.1-8B config.json
        "Llama-3.1-8B": {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 14336,
                         "vocab": 128256}},
    "qwen3_moe": {  # Qwen/Qwen3-30B-A3B config.json
        "Qwen3-30B-A3B": {"hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "moe_intermediate": 768,
                          "experts": 128, "top_k": 8, "vocab": 151936}},
    "qwen3_5": {  # graphs/qwen27b/target_config.json (Qwen3.5-27B)
        "Qwen3.5-27B": {"hidden": 5120, "heads": 24, "kv_heads": 4, "head_dim": 256, "intermediate": 17408,
                        "vocab": 248320, "lin_k_heads": 16, "lin_v_heads": 48, "lin_k_dim": 128, "lin_v_dim": 128}},
}


def memtracker_peak(spec: ArchSpec, point: dict[str, int], packing: str,
                    layer_types: list[str] | None = None, body: bool = False) -> int:
    """torch's MemTracker over fake tensors: the activation peak (ACT + TEMP) of one causal-LM forward, batch 1,
    bf16, torch.no_grad, use_cache=False, as the recorder runs it; `body`: of the decoder body alone (the
    embedding to the final norm, no lm_head)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = spec.config({k: v for k, v in point.items() if k != "seq"})
    if layer_types:
        cfg.num_hidden_layers = len(layer_types)
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = list(layer_types)
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
    # the inputs are the caller's, as the recorder has them (MemTracker would count an input's storage as an
    # activation from the first view an op makes of it: position_ids under packing "mask")
    mt.track_external(model, *[v for v in kw.values() if isinstance(v, torch.Tensor)])
    with packing_as_run(packing == "mask"), fake, torch.no_grad(), no_backward_hooks(), mt:
        (model.model if body else model)(**kw)
    snap = mt.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    return snap[dev][_MemRefType.ACT] + snap[dev][_MemRefType.TEMP]


@contextlib.contextmanager
def no_backward_hooks():
    """torch's module trackers (MemTracker's and FlopCounterMode's) without their backward hooks on module inputs
    and outputs, for a forward under no_grad: no backward runs, so they would never fire. transformers >= 5.25 calls
    causal_conv1d_fn as a `kernels` module with a view of the conv weight made under no_grad; the view requires
    grad but has no gradient edge, and torch's register_multi_grad_hook asserts one ("Expected gradient function
    to be set")."""
    from unittest import mock

    from torch.distributed._tools import mod_tracker
    from torch.utils import module_tracker

    class _Handle:                    # what the trackers keep and remove later
        def remove(self) -> None:
            pass

    def skip(tensors, fn, **kw):
        return _Handle()

    with mock.patch.object(mod_tracker, "register_multi_grad_hook", skip), \
            mock.patch.object(module_tracker, "register_multi_grad_hook", skip):
        yield


def default_layers(program: dict, n: int) -> list[str]:
    """n layers as the arch's config lays them out (Qwen3.5: three linear-attention layers, then one full)."""
    types = program["layer_types"]
    if len(types) == 1:
        return types * n
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def compare(spec: ArchSpec, point: dict[str, int], packing: str, layers: int = 2,
            body: bool = False) -> tuple[int, int]:
    """(the stored program's peak, MemTracker's peak) for this config, seq and number of layers; `body`: the
    decoder body's forward (upto the epilogue), else the causal LM's (lm_head and the logits included)."""
    prog = programs.load(spec.arch, packing=packing)
    types = default_layers(prog, layers)
    run = programs.evaluate(prog, {k: v for k, v in point.items() if k != "seq"}, point["seq"], types,
                            upto="epilogue" if body else "end")
    return run.peak, memtracker_peak(spec, point, packing, layer_types=types, body=body)


__all__ = ["REALISTIC", "compare", "default_layers", "memtracker_peak", "no_backward_hooks"]
