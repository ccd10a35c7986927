"""Compare the derived Qwen3.5 program with the hand-written one (models/qwen3_5.py, ops/costs.py) and MemTracker.

Two measures, bf16, sdpa on CPU (attention "cpu_flash"), use_cache=False, packing documents and mask:
- per layer type, the body forward's workspace: the live-bytes peak above the input hidden state [seq, hidden];
- the causal LM's forward over four layers (three linear attention, one full), logits included: the hand
  program `check` uses (ops/costs.py _body_steps, its attention switched from CUDA flash to cpu_flash to match),
  the derived program and torch's MemTracker over fake tensors (the truth both are judged by).

    python tools/derived_vs_hand.py                       # the test suite's SMALL config and v_dim != k_dim
    python tools/derived_vs_hand.py --seq 4096
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflash_graph.models import programs  # noqa: E402
from dflash_graph.models import qwen3_5 as Q  # noqa: E402

DIMS = {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
        "head_dim": "head_dim", "intermediate": "intermediate_size", "vocab": "vocab_size",
        "lin_k_heads": "linear_num_key_heads", "lin_v_heads": "linear_num_value_heads",
        "lin_k_dim": "linear_key_head_dim", "lin_v_dim": "linear_value_head_dim"}
CONFIGS = {
    # tests/test_qwen3_5_cost.py SMALL
    "small": {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 32, "linear_value_head_dim": 32},
    # value head dim != key head dim (the second error class)
    "v_dim!=k_dim": {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 64},
    # a vocabulary large enough that the peak is at the logits (where the issue's [seq, seq] mask error shows)
    "vocab 32000": {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32},
}


def compare(cfg: dict, seq: int, packing: str) -> list[tuple[str, int, int]]:
    prog = programs.load("qwen3_5", packing=packing)
    dims = {k: cfg[v] for k, v in DIMS.items()}
    out = []
    for t in ("linear_attention", "full_attention"):
        derived = programs.evaluate(prog, dims, seq, [t], upto="epilogue").peak - seq * cfg["hidden_size"] * 2
        d = Q.Qwen35Dims.from_config(dict(cfg, num_hidden_layers=1, layer_types=[t]))
        hand = Q.body_forward_workspace_bytes(d, seq, 2, attention="cpu_flash", packed=packing == "mask")
        out.append((t, derived, hand))
    return out


def causal_lm(cfg: dict, seq: int, packing: str) -> tuple[int, int, int]:
    """(hand, derived, MemTracker) activation peaks of the causal LM's forward over four layers."""
    from dflash_graph.models.trace.archs import ARCHS
    from dflash_graph.models.trace.memtrack import memtracker_peak
    from dflash_graph.ops import costs

    types = ["linear_attention"] * 3 + ["full_attention"]
    d = Q.Qwen35Dims.from_config(dict(cfg, num_hidden_layers=4, layer_types=types)).with_forward(
        "sdpa", packing, "torch")
    kw = Q.forward_kwargs
    Q.forward_kwargs = lambda d: dict(kw(d), attention="cpu_flash")  # the derived programs are of CPU kernels
    try:
        costs._body_steps.cache_clear()
        steps = costs._body_steps(d, seq, 2, frozenset(), False, seq * cfg["vocab_size"] * 2, False)
    finally:
        Q.forward_kwargs = kw
        costs._body_steps.cache_clear()
    live, size, hand = 0, {}, 0
    for kind, key, n in steps:
        if kind == "alloc":
            size[key] = n
            live += n
            hand = max(hand, live)
        else:
            live -= size.pop(key)
    dims = {k: cfg[v] for k, v in DIMS.items()}
    derived = programs.evaluate(programs.load("qwen3_5", packing=packing), dims, seq, types).peak
    measured = memtracker_peak(ARCHS["qwen3_5"], dict(dims, seq=seq), packing, layer_types=types)
    return hand, derived, measured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2000)
    args = ap.parse_args(argv)
    print(f"{'config':14s} {'packing':9s} {'layer':17s} {'derived':>12s} {'hand':>12s} {'hand/derived':>12s}")
    for name, cfg in CONFIGS.items():
        for packing in ("documents", "mask"):
            for t, derived, hand in compare(cfg, args.seq, packing):
                print(f"{name:14s} {packing:9s} {t:17s} {derived:12d} {hand:12d} {hand / derived:12.4f}")
    print()
    print(f"{'config':14s} {'packing':9s} {'causal LM, 4 layers':19s} {'hand':>12s} {'derived':>12s} "
          f"{'MemTracker':>12s} {'hand/MT':>8s} {'derived/MT':>10s}")
    for name, cfg in CONFIGS.items():
        for packing in ("documents", "mask"):
            hand, derived, measured = causal_lm(cfg, args.seq, packing)
            print(f"{name:14s} {packing:9s} {'':19s} {hand:12d} {derived:12d} {measured:12d} "
                  f"{hand / measured:8.4f} {derived / measured:10.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
