"""How `check` time grows with the number of nodes and of layers: graphs/tiny.toml widened with N extra verifier
chains on the drafter device (transfer, norm, lm_head, roll, gather, output: 6 nodes each, each one rewritten by
push_selections and merge rules), and tests/graphs/minimal.toml with L target layers. Prints CPU seconds per graph
(time.process_time: steadier than wall time on a shared machine), the ratio to the smallest, and the growth
exponent log(time ratio) / log(size ratio) (1: linear, 2: square, 3: cube), measured side by side in one process
(not a timed assert).

    python benchmarks/check_scaling.py              # rewritten: 25..300 nodes (400: refused); as written: 100..5000; layers 2..10,000 (20,000: refused)
    python benchmarks/check_scaling.py --nodes 50 100 --written 1000 --layers 2 64 --graph graphs/qwen27b.toml
    python benchmarks/check_scaling.py --nodes 200 400 800 1000 --lift-rewrite-bound   # past the rewrite bound
    python benchmarks/check_scaling.py --repeat 3 ...   # the least of 3 runs per size (a shared machine's times spread)

A size over a bound is reported as refused, with the bound: rewriting at 300 nodes (rewrite/engine.py, NOTE
[Rewrite bound]; larger graphs check as written, --no-rewrite), 5,000 nodes (MAX_NODES) and 10,000 layers
(analysis/infer.py, NOTE [Layer bound]; identical layers are folded, NOTE [Layer folding]).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_graph.errors import GraphError  # noqa: E402
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


REPEAT = 1


def timed(path: Path, overrides=(), rewrite: bool = True) -> tuple[float, int, int]:
    """The least CPU seconds (steadier than wall time on a shared machine) of REPEAT runs, nodes and rewrites."""
    best = math.inf
    for _ in range(REPEAT):
        t = time.process_time()
        plan = compile_graph(str(path), list(overrides), rewrite=rewrite)
        best = min(best, time.process_time() - t)
    return best, len(plan.original.graph), len(plan.applied)


def _row(size: int, extra: str, s: float, first: tuple[float, int] | None) -> str:
    if first is None or size == first[1]:
        return f"{size:6d}  {extra}{s:7.2f}  {1.0:6.1f}x  {1.0:6.1f}x     -"
    grow = math.log(s / first[0]) / math.log(size / first[1]) if s > 0 and first[0] > 0 else float("nan")
    return f"{size:6d}  {extra}{s:7.2f}  {s / first[0]:6.1f}x  {size / first[1]:6.1f}x  {grow:5.2f}"


def _refused(size: int, e: GraphError) -> str:
    return f"{size:6d}  refused: {str(e).splitlines()[0].split(': error', 1)[-1].split(': ', 1)[-1][:100]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="*", default=[25, 50, 100, 200, 300, 400])
    ap.add_argument("--written", type=int, nargs="*", default=[100, 1000, 2000, 5000])
    ap.add_argument("--layers", type=int, nargs="*", default=[2, 64, 512, 2000, 10000, 20000])
    ap.add_argument("--graph", default="tests/graphs/minimal.toml", help="the graph whose target's layers vary")
    ap.add_argument("--lift-rewrite-bound", action="store_true",
                    help="rewrite graphs over the rewrite bound and the replay budget too (to measure how the time "
                         "grows past them)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run each size N times and print the least CPU time (times on a shared machine spread)")
    args = ap.parse_args(argv)
    global REPEAT
    REPEAT = max(1, args.repeat)
    if args.lift_rewrite_bound:     # (and the replay budget, which large widened graphs also pass)
        from dflash_graph.rewrite import engine
        engine.MAX_REWRITE_NODES = 10**6
        engine.REPLAY_BUDGET = 10**12
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        timed(wide_graph(d, 25))        # untimed warm-up: imports and the cost model's caches
        print("rewritten\n nodes  rewrites  cpu s   time  nodes  exponent")
        first = None
        for n in args.nodes:
            try:
                s, nodes, applied = timed(wide_graph(d, n))
            except GraphError as e:
                print(_refused(n, e))
                continue
            print(_row(nodes, f"{applied:8d}  ", s, first))
            first = first or (s, nodes)
        print("\nas written (--no-rewrite)\n nodes  cpu s   time  nodes  exponent")
        first = None
        for n in args.written:
            try:
                s, nodes, _ = timed(wide_graph(d, n), rewrite=False)
            except GraphError as e:
                print(_refused(n, e))
                continue
            print(_row(nodes, "", s, first))
            first = first or (s, nodes)
        print(f"\nlayers ({args.graph})\nlayers  cpu s   time  layers exponent")
        first = None
        for n in args.layers:
            try:
                s, _, _ = timed(ROOT / args.graph, [f"models.target.config.num_hidden_layers={n}"])
            except GraphError as e:
                print(_refused(n, e))
                continue
            print(_row(n, "", s, first))
            first = first or (s, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
