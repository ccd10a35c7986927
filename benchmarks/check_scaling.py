"""How `check` time grows with the number of nodes and of layers: graphs/tiny.toml widened with N extra verifier
chains on the drafter device (transfer, norm, lm_head, roll, gather, output: 6 nodes each, each one rewritten by
push_selections and merge rules), and tests/graphs/minimal.toml with L target layers. Prints seconds per graph and
the ratio to the smallest, measured side by side in one process (not a timed assert).

    python benchmarks/check_scaling.py                      # rewritten: 25..100 nodes; as written: 100..4000
    python benchmarks/check_scaling.py --nodes 50 100 --written --layers 2 64

Rewriting is bounded at 100 nodes (rewrite/engine.py, NOTE [Rewrite bound]); larger graphs are timed as written
(`--no-rewrite`).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_graph.rewrite.pipeline import compile_graph  # noqa: E402

CHAIN = '''
[[nodes]]
id = "h{i}"
op = "transfer"
device = "draft"
inputs = {{ x = "target.hidden" }}

[[nodes]]
id = "n{i}"
op = "norm"
model = "target"
device = "draft"
inputs = {{ x = "h{i}.out" }}

[[nodes]]
id = "l{i}"
op = "lm_head"
model = "target"
device = "draft"
inputs = {{ x = "n{i}.out" }}

[[nodes]]
id = "r{i}"
op = "roll"
device = "draft"
inputs = {{ x = "l{i}.logits" }}
params = {{ shift = 1, axis = 0 }}

[[nodes]]
id = "g{i}"
op = "gather"
device = "draft"
inputs = {{ x = "r{i}.out", index = "block_index.index" }}
params = {{ axis = 0 }}

[[nodes]]
id = "o{i}"
op = "output"
device = "draft"
inputs = {{ x = "g{i}.out" }}
'''


def wide_graph(dirpath: Path, n_nodes: int) -> Path:
    base = (ROOT / "graphs/tiny.toml").read_text()
    head, sep, data = base.partition("\n[data]")
    base_nodes = len(re.findall(r"^\[\[nodes\]\]", head, flags=re.M))
    chains = max(0, (n_nodes - base_nodes) // 6)
    text = head + "".join(CHAIN.format(i=i) for i in range(chains)) + sep + data
    p = dirpath / f"wide_{n_nodes}.toml"
    p.write_text(text)
    (dirpath / "tiny").exists() or (dirpath / "tiny").symlink_to(ROOT / "graphs/tiny")
    return p


def timed(path: Path, overrides=(), rewrite: bool = True) -> tuple[float, int, int]:
    t = time.process_time()     # CPU seconds: steadier than wall time on a shared machine
    plan = compile_graph(str(path), list(overrides), rewrite=rewrite)
    return time.process_time() - t, len(plan.original.graph), len(plan.applied)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="*", default=[25, 50, 100])
    ap.add_argument("--written", type=int, nargs="*", default=[100, 1000, 4000])
    ap.add_argument("--layers", type=int, nargs="*", default=[2, 64, 256, 512])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        print("rewritten\nnodes  rewrites  cpu s  ratio")
        first = None
        for n in args.nodes:
            s, nodes, applied = timed(wide_graph(d, n))
            first = first or (s, nodes)
            print(f"{nodes:5d}  {applied:8d}  {s:7.2f}  {s / first[0]:5.1f}x time for {nodes / first[1]:.1f}x nodes")
        print("\nas written (--no-rewrite)\nnodes  seconds  ratio")
        first = None
        for n in args.written:
            s, nodes, _ = timed(wide_graph(d, n), rewrite=False)
            first = first or (s, nodes)
            print(f"{nodes:5d}  {s:7.2f}  {s / first[0]:5.1f}x time for {nodes / first[1]:.1f}x nodes")
        print("\nlayers  seconds  ratio")
        first = None
        for n in args.layers:
            s, _, _ = timed(ROOT / "tests/graphs/minimal.toml", [f"models.target.config.num_hidden_layers={n}"])
            first = first or (s, n)
            print(f"{n:6d}  {s:7.2f}  {s / first[0]:5.1f}x time for {n / first[1]:.0f}x layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
