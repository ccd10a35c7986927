"""The held-out evaluation of a run trained under torchrun, after its ranks have exited.

Under torchrun each rank holds only its part of the graph, and the held-out forward would need every rank in
step, so training evaluates in one process only (train/summary.py). `dflash-graph launch` then evaluates here, in
its own process, once training has finished on one machine: the graph as the run recorded it (run.json: graph,
--set overrides, rewrite and device-map flags), every model built on the devices that machine's ranks used (now
free), the drafter from the newest checkpoint, and the same forward and loss op as the evaluation during training
(train/evaluate.py), so the held-out tau means the same. The result joins the last step's record of metrics.jsonl as
`heldout`, as it would have in one process, and is printed as the `held-out @ step N` line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def evaluate_run(out: Path) -> dict[str, Any] | None:
    """{"step", loss, tau, ...} for the run in `out`, recorded in its metrics.jsonl; None when the graph has no
    held-out split or no eval_every (nothing to evaluate, as in one process)."""
    import torch

    from ..exec.devices import parse_device_map, torch_devices
    from ..exec.interpreter import Interpreter
    from ..exec.models import ModelStore
    from ..ops import registry
    from ..rewrite.pipeline import compile_graph
    from .checkpoint import read_weights
    from .data import load_data
    from .evaluate import evaluate
    from .trained import checkpoint_file, drafter_names
    from .trainer import _data_sources as data_sources

    rec = json.loads((out / "run.json").read_text())
    last = (rec.get("resumes") or [rec])[-1]
    flags = last.get("run_with") or {}
    plan = compile_graph(last["graph"], list(last.get("overrides", [])), rewrite=flags.get("rewrite", True),
                         rules_off=list(flags.get("without_rule", [])))
    typed, spec = plan.typed, plan.typed.ctx.spec
    train = spec.train
    if not int(spec.data.get("holdout") or 0) or not int(train.get("eval_every") or 0):
        return None
    seed = int(train["seed"])
    tdev = torch_devices(spec, parse_device_map(flags.get("device_map", [])))
    vocab = next((int(m.dims.vocab_size) for m in typed.ctx.models.values() if m.spec.arch == "dflash"), None)
    seq = int(typed.outputs_of(data_sources(typed)[0].id)["input_ids"].sizes[0])    # as Trainer._seq_len
    _, held = load_data(spec.data, Path(spec.data.get("_base", ".")), seq, seed, vocab, spec.loc)
    drafter, _ = drafter_names(plan)
    weights = read_weights(checkpoint_file(out, drafter, "--out"))
    torch.manual_seed(seed)
    store = ModelStore(typed, tdev, seed)
    store.preload()
    store.drafters[drafter].load_state_dict({k: v.to(next(store.drafters[drafter].parameters()).device)
                                             for k, v in weights.items()})
    store.drafters[drafter].eval()
    interp = Interpreter(typed, store, tdev, seed=seed, track_memory=False)
    loss_node = next(n.id for n in typed.graph.nodes
                     if registry.get(n.op).traits.sink and "loss" in typed.outputs_of(n.id))
    res = evaluate(interp, loss_node, held, int(train["eval_batches"]), seed)
    step = _record(out / "metrics.jsonl", res)
    return {"step": step, **res}


def _record(path: Path, res: dict[str, Any]) -> int:
    """Add `heldout` to the last step's record of metrics.jsonl (rewritten whole, then renamed over it)."""
    lines = path.read_text().splitlines()
    i = max(k for k, line in enumerate(lines) if line.strip() and "step" in json.loads(line))
    rec = json.loads(lines[i])
    rec["heldout"] = {**res, "after_launch": True}
    lines[i] = json.dumps(rec)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return int(rec["step"])
