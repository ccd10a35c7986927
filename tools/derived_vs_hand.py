"""Compare the derived Qwen3.5 program with the hand-written one (models/qwen3_5.py) at one layer of each type.

Both are the body forward's workspace: the live-bytes peak above the input hidden state [seq, hidden]
(bf16, sdpa on CPU = attention "cpu_flash", use_cache=False), for packing documents and mask.

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2000)
    args = ap.parse_args(argv)
    print(f"{'config':14s} {'packing':9s} {'layer':17s} {'derived':>12s} {'hand':>12s} {'hand/derived':>12s}")
    for name, cfg in CONFIGS.items():
        for packing in ("documents", "mask"):
            for t, derived, hand in compare(cfg, args.seq, packing):
                print(f"{name:14s} {packing:9s} {t:17s} {derived:12d} {hand:12d} {hand / derived:12.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
