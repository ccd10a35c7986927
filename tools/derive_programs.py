"""Derive the memory programs of transformers' causal LMs and store them under dflash_graph/models/programs/.

Each arch's forward is traced under FakeTensorMode at a few small sizes (no weights, no GPU), each allocation's
shape fitted in the config's dims and seq, and the program checked byte for byte at held-out sizes before it is
written (docs/memory-programs.md).

    python tools/derive_programs.py                     # every arch, packing documents and mask
    python tools/derive_programs.py --arch qwen3 --packing documents
    python tools/derive_programs.py --arch qwen3_5 --cache /tmp/traces   # reuse traces when refitting
    python tools/derive_programs.py --params-only       # only the stored programs' parameter counts (seconds)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflash_graph.models.trace.archs import ARCHS  # noqa: E402
from dflash_graph.models.trace.derive import derive, with_params, write  # noqa: E402
from dflash_graph.models.trace.fit import FitError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", choices=sorted(ARCHS), help="repeatable; default: all")
    ap.add_argument("--packing", action="append", choices=("documents", "mask"), help="repeatable; default: both")
    ap.add_argument("--cache", type=Path, help="keep each trace here and reuse it (a refit costs no new trace)")
    ap.add_argument("--params-only", action="store_true",
                    help="rederive only the stored programs' \"params\" (the meta-device model, no trace)")
    args = ap.parse_args(argv)
    failed = 0
    for arch in args.arch or sorted(ARCHS):
        for packing in args.packing or ("documents", "mask"):
            try:
                path = write(with_params(arch, packing) if args.params_only else derive(arch, packing, cache=args.cache))
            except FitError as e:
                print(f"{arch}/{packing}: not derived: {e}", file=sys.stderr)
                failed += 1
                continue
            print(f"  wrote {os.path.relpath(path)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
