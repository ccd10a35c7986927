"""Measure the Qwen3.5-27B body forward with MemTracker over fake tensors; compare with
the static formula in dflash_graph.models.qwen3_5.

No weights and no GPU: the model is built inside torch's FakeTensorMode (CPU device, so
sdpa reaches aten._scaled_dot_product_flash_attention_for_cpu, i.e. attention="cpu_flash"),
with the 27B dims from docs/memory-qwen3_5.md but only N layers (the peak is per layer).

    python tools/memtrack_qwen27b.py                 # seq 65536, 4 layers, bf16, 3 variants
    python tools/memtrack_qwen27b.py --seq 8192 --layers 8 --variants plain

Variants (each one of the forwards a graph can declare; see docs/memory-qwen3_5.md):
  plain   sdpa, use_cache=False, no mask: what a real unpacked run (packing = "documents") does.
          Fake tensors would otherwise make transformers build a dense mask (is_tracing() is true
          for FakeTensor, so find_packed_sequence_indices never returns None), so the mask mapping
          is passed in precomputed as {"full_attention": None, ...}, which is exactly what
          create_causal_mask returns for real tensors without padding or packing.
  packed  sdpa, use_cache=False, position_ids restarting at each of --docs packed documents
          (packing = "mask"): transformers' own mask creation, the dense [seq, seq] mask.
  eager   attn_implementation="eager", packed as above: eager_mask's additive [seq, seq] mask in
          the model dtype and eager_attention_forward's [heads, seq, seq] scores.
  cache   sdpa, use_cache=True (transformers' default when the caller does not pass it).

Prints, per variant, MemTracker's activation peak (the input hidden state passed as
inputs_embeds is not counted, as in the formula), the formula's workspace, their ratio,
and the same per module kind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflash_graph.models.qwen3_5 import (  # noqa: E402
    Qwen35Dims,
    body_forward_workspace_breakdown,
    body_forward_workspace_bytes,
)

# the 27B dims, from the graph that describes the crashed run (one source for the graph, tests and tools)
QWEN35_27B = {k: v for k, v in json.loads(
    (pathlib.Path(__file__).resolve().parent.parent / "graphs" / "qwen27b" / "target_config.json").read_text()
).items() if k not in ("model_type", "rms_norm_eps", "tie_word_embeddings")}   # tie: the default (untied)

GIB = 2**30
DTYPES = {"bf16": (torch.bfloat16, 2), "fp16": (torch.float16, 2), "fp32": (torch.float32, 4)}


#: variant -> (attn_implementation, packed position_ids, use_cache)
VARIANTS = {"plain": ("sdpa", False, False), "packed": ("sdpa", True, False), "eager": ("eager", True, False),
            "cache": ("sdpa", False, True)}


def packed_positions(seq: int, docs: int) -> torch.Tensor:
    """position_ids [1, seq] of `docs` equal documents (the last takes the remainder), restarting at 0."""
    n = seq // docs
    return torch.cat([torch.arange(n)] * (docs - 1) + [torch.arange(seq - n * (docs - 1))])[None]


def measure(cfg: dict, seq: int, dtype: torch.dtype, variant: str, docs: int = 8) -> dict[str, int]:
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    impl, packed, use_cache = VARIANTS[variant]
    config = Qwen3_5TextConfig(**cfg, attn_implementation=impl)
    fake = FakeTensorMode()
    with fake:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = Qwen3_5TextModel(config).eval()
        finally:
            torch.set_default_dtype(prev)
        x = torch.empty(1, seq, config.hidden_size, dtype=dtype)
    kwargs: dict = {"inputs_embeds": x, "use_cache": use_cache}
    if packed:
        kwargs["position_ids"] = fake.from_tensor(packed_positions(seq, docs))
    elif variant == "plain":
        kwargs["attention_mask"] = {"full_attention": None, "linear_attention": None}
    mt = MemTracker()
    mt.track_external(model)
    from dflash_graph.models.trace.memtrack import no_backward_hooks

    with fake, torch.no_grad(), no_backward_hooks(), mt:
        model(**kwargs)
    snap = mt.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    out = {"total": snap[dev][_MemRefType.ACT] + snap[dev][_MemRefType.TEMP]}

    def module_peak(mod: torch.nn.Module) -> int:
        return max(s[dev][_MemRefType.ACT] for s in mt.memory_tracking[mod].snapshots[_ModState.PEAK_FW])

    for i, layer in enumerate(model.layers):
        mixer = layer.linear_attn if config.layer_types[i] == "linear_attention" else layer.self_attn
        for kind, mod in (
            ("input_layernorm", layer.input_layernorm),
            (config.layer_types[i], mixer),
            ("post_attention_layernorm", layer.post_attention_layernorm),
            ("mlp", layer.mlp),
        ):
            out[kind] = max(out.get(kind, 0), module_peak(mod))
    out["final_norm"] = module_peak(model.norm)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers to build (4 = 3 linear + 1 full)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--variants", default="plain,packed,cache", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--docs", type=int, default=8, help="packed documents per sequence (packed, eager)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(min(2, torch.get_num_threads()))

    cfg = dict(QWEN35_27B, num_hidden_layers=args.layers)
    dims = Qwen35Dims.from_config(cfg)
    dtype, nbytes = DTYPES[args.dtype]
    print(f"Qwen3.5-27B dims, {args.layers} layers {list(dims.layer_types)}, seq {args.seq}, {args.dtype}")
    print(f"live input hidden state (not in either figure): {args.seq * dims.hidden_size * nbytes / GIB:.3f} GiB")
    results = []
    for variant in [v for v in args.variants.split(",") if v]:
        impl, packed, use_cache = VARIANTS[variant]
        flags = {"attention": "cpu_flash", "use_cache": use_cache, "packed": packed, "attn_implementation": impl}
        t0 = time.time()
        meas = measure(cfg, args.seq, dtype, variant, args.docs)
        wall = time.time() - t0
        pred = body_forward_workspace_breakdown(dims, args.seq, nbytes, **flags)
        pred["total"] = body_forward_workspace_bytes(dims, args.seq, nbytes, **flags)
        cuda = body_forward_workspace_bytes(dims, args.seq, nbytes, **dict(flags, attention="flash"))
        print(f"\n[{variant}] formula flags {flags}  ({wall:.0f} s under MemTracker)")
        print(f"  {'':26s} {'measured GiB':>14s} {'formula GiB':>12s} {'ratio':>7s}")
        for key in ["total"] + [k for k in meas if k != "total"]:
            m, p = meas[key], pred.get(key, 0)
            print(f"  {key:26s} {m / GIB:14.4f} {p / GIB:12.4f} {p / m if m else float('nan'):7.4f}")
        print(f"  formula with attention='flash' (CUDA): {cuda / GIB:.4f} GiB")
        live_in = args.seq * dims.hidden_size * nbytes
        print(f"  activation peak (live input + workspace): measured {(meas['total'] + live_in) / GIB:.4f} GiB, "
              f"formula {(pred['total'] + live_in) / GIB:.4f} GiB, difference {meas['total'] - pred['total']} bytes")
        results.append({"variant": variant, "flags": flags, "measured": meas, "predicted": pred,
                        "predicted_flash": cuda, "seconds": wall})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq": args.seq, "layers": args.layers, "dtype": args.dtype, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
