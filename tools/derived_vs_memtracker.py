"""The per-arch table of issue 22: each stored memory program's predicted peak against torch's MemTracker.

For every stored program (arch, packing), at a small held-out config (sizes not used in fitting) and, with
--wide, at the public config's widths (few layers): the body's forward and the causal LM's, the program's
predicted activation peak, MemTracker's measured one over fake tensors (bf16, batch 1, no_grad, no cache, sdpa
on CPU), and their ratio. Markdown on stdout (docs/memory-programs.md holds its output).

    python tools/derived_vs_memtracker.py                  # small held-out configs (about a minute)
    python tools/derived_vs_memtracker.py --wide --seq 4096
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflash_graph.models import programs  # noqa: E402
from dflash_graph.models.trace.archs import ARCHS  # noqa: E402
from dflash_graph.models.trace.derive import held_out  # noqa: E402
from dflash_graph.models.trace.memtrack import REALISTIC, compare  # noqa: E402


def rows(wide: bool, seq: int, layers: int):
    for key in programs.available():
        spec = ARCHS[key["arch"]]
        n = max(layers, 4) if spec.layers else layers
        cases = [("held-out " + ",".join(f"{k}={v}" for k, v in p.items() if k != "seq"), p, 2 if not spec.layers
                  else 4) for p in held_out(spec, key["packing"], n=1, seed=3)]
        if wide:
            cases += [(name, dict(dims, seq=seq), n) for name, dims in REALISTIC.get(key["arch"], {}).items()]
        for name, point, nl in cases:
            for body in (True, False):
                predicted, measured = compare(spec, point, key["packing"], layers=nl, body=body)
                yield (key["arch"], key["packing"], name, point["seq"], nl, "body" if body else "causal LM",
                       predicted, measured)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wide", action="store_true", help="also the public configs' widths (REALISTIC)")
    ap.add_argument("--seq", type=int, default=4096, help="seq of the wide configs")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen3.5: at least 4, one full attention)")
    args = ap.parse_args(argv)
    print("| arch | packing | config | seq | layers | forward | predicted peak (B) | MemTracker peak (B) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch, packing, name, seq, nl, fwd, pred, meas in rows(args.wide, args.seq, args.layers):
        print(f"| {arch} | {packing} | {name} | {seq} | {nl} | {fwd} | {pred:,} | {meas:,} | {pred / meas:.6f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
