"""The per-arch table of issue 22: what `check` predicts for a target's forward against torch's MemTracker.

For every stored program (arch, packing), at a small held-out config (sizes not used in fitting) and, with
--wide, at the public config's widths (few layers): the body's forward and the causal LM's. `check` is the
forward node's peak as check models it, from a graph file like a user's with the config inline (the node's
allocation program, ops/costs.py, built from the arch's events); `program` is the stored program evaluated
alone; MemTracker's is measured over fake tensors (bf16, batch 1, no_grad, no cache, sdpa on CPU). Markdown on
stdout (docs/memory-programs.md holds its output). tests/test_target_memory.py asserts the same equality.

    python tools/derived_vs_memtracker.py                  # small held-out configs (about a minute)
    python tools/derived_vs_memtracker.py --wide --seq 4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflash_graph.models import programs  # noqa: E402
from dflash_graph.models.trace.archs import ARCHS  # noqa: E402
from dflash_graph.models.trace.derive import held_out  # noqa: E402
from dflash_graph.models.trace.memtrack import REALISTIC, compare, default_layers  # noqa: E402

GRAPH = """
[dims]
seq = {seq}

[devices.cpu]
torch = "cpu"
capacity = "1 TiB"

[models.target]
arch = "{arch}"
dtype = "bfloat16"
packing = "{packing}"
config = "config.json"

[[nodes]]
id = "tokens"
op = "token_input"
device = "cpu"
params = {{ length = "seq" }}

[[nodes]]
id = "fwd"
op = "{op}"
model = "target"
device = "cpu"
inputs = {{ input_ids = "tokens.input_ids", position_ids = "tokens.position_ids" }}

[[nodes]]
id = "out"
op = "output"
device = "cpu"
inputs = {{ x = "fwd.{port}" }}
"""


def check_peak(arch: str, point: dict[str, int], packing: str, layers: list[str], body: bool,
               fixed: dict | None = None) -> int:
    """The forward node's peak as `check` models it, from a graph file with this config (a config.json beside it,
    as a user's target would have), without rewrites: the node's allocation program replayed (program_peak), for
    the one output transformers' forward returns (the logits; the body's hidden state). A causal-LM node that
    also hands on its `hidden` keeps the last layer's output alive past the body, as run's hook does. `fixed`:
    the config's values of the keys a program holds for (default the arch entry's: the packaged program's); other
    values make check read a program `dflash-graph trace-model` derived for them."""
    from dflash_graph.analysis.nodecost import cost_context
    from dflash_graph.ops import registry
    from dflash_graph.ops.costs import program_peak
    from dflash_graph.rewrite.pipeline import compile_graph

    spec = ARCHS[arch]
    cfg = {spec.dims[k]: v for k, v in point.items() if k != "seq"}
    cfg.update(spec.fixed if fixed is None else fixed)
    cfg["num_hidden_layers"] = len(layers)
    if spec.layers:
        cfg["layer_types"] = list(layers)
    op, port = ("body_forward", "hidden") if body else ("causal_lm_forward", "logits")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({"model_type": arch, **cfg}))
        path = Path(tmp) / "graph.toml"
        path.write_text(GRAPH.format(seq=point["seq"], arch=arch, packing=packing, op=op, port=port))
        plan = compile_graph(str(path), rewrite=False)
    typed = plan.typed
    node = next(n for n in typed.graph.nodes if n.id == "fwd")
    outs = {k: v for k, v in typed.outputs_of(node.id).items() if k == port}
    cost = registry.get(node.op).cost(cost_context(typed, node, False, typed.inputs_of(node.id), outs))
    return program_peak(cost.program)


def rows(wide: bool, seq: int, layers: int):
    for key in programs.available():
        spec = ARCHS[key["arch"]]
        n = max(layers, 4) if spec.layers else layers
        cases = [("held-out " + ",".join(f"{k}={v}" for k, v in p.items() if k != "seq"), p, 2 if not spec.layers
                  else 4) for p in held_out(spec, key["packing"], n=1, seed=3)]
        if wide:
            cases += [(name, dict(dims, seq=seq), n) for name, dims in REALISTIC.get(key["arch"], {}).items()]
        for name, point, nl in cases:
            types = default_layers(programs.load(key["arch"], packing=key["packing"]), nl)
            for body in (True, False):
                predicted, measured = compare(spec, point, key["packing"], layers=nl, body=body)
                checked = check_peak(key["arch"], point, key["packing"], types, body)
                yield (key["arch"], key["packing"], name, point["seq"], nl, "body" if body else "causal LM",
                       checked, predicted, measured)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wide", action="store_true", help="also the public configs' widths (REALISTIC)")
    ap.add_argument("--seq", type=int, default=4096, help="seq of the wide configs")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen3.5: at least 4, one full attention)")
    args = ap.parse_args(argv)
    print("| arch | packing | config | seq | layers | forward | check (B) | program (B) | MemTracker (B) | "
          "check / MemTracker |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arch, packing, name, seq, nl, fwd, chk, pred, meas in rows(args.wide, args.seq, args.layers):
        print(f"| {arch} | {packing} | {name} | {seq} | {nl} | {fwd} | {chk:,} | {pred:,} | {meas:,} | "
              f"{chk / meas:.6f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
