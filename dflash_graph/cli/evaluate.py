"""`dflash-graph eval GRAPH --checkpoint DIR`: real speculative decoding with the target and the trained drafter
on held-out prompts (train/speculative.py), against target-only greedy decoding; `dflash-graph export DIR --out
HF_DIR`: the drafter in the DFlash draft format (train/export.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import GraphError, Location, Problem
from ..rewrite.pipeline import compile_graph


def run_record(d: Path) -> dict:
    """What `run` wrote about itself into its --out directory (graph file and --set overrides); {} when there is
    no run.json (a run of an older version) or it cannot be read (then --graph says which graph)."""
    for f in (d / "run.json", d.parent / "run.json", d.parent.parent / "run.json"):
        if f.is_file():
            try:
                rec = json.loads(f.read_text())
            except (ValueError, OSError) as e:
                print(f"warning: {f} cannot be read ({type(e).__name__}): the graph and --set flags of the run are "
                      "not known from it", file=sys.stderr)
                return {}
            return rec if isinstance(rec, dict) else {}
    return {}


def _plan(graph: str | None, overrides: list[str], ckpt: Path):
    rec = run_record(ckpt)
    graph = graph or rec.get("graph")
    if graph is None:
        raise GraphError(Problem(f"{ckpt} has no run.json that names the graph it trained (a run of an older "
                                 "version)", Location(str(ckpt)),
                                 hint="pass --graph GRAPH (and the --set overrides the run used)"))
    same = rec.get("graph") and Path(rec["graph"]).resolve() == Path(graph).resolve()
    return compile_graph(graph, [*(rec.get("overrides", []) if same else []), *overrides])


def cmd_eval(args) -> int:
    import torch

    from ..exec.devices import device_problem
    from ..train.data import load_data
    from ..train.speculative import Decoder, check_sampling, held_out_prompts, measure
    from ..train.trained import Trained

    why = device_problem(args.device)
    if why is not None:
        raise GraphError(Problem(why, Location(flag=f"--device {args.device}"),
                                 hint="--device cpu (the default), or cuda:N for a GPU this machine has"))
    for flag, n in (("--prompts", args.prompts), ("--prompt-tokens", args.prompt_tokens),
                    ("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):
        if n < 1:
            raise GraphError(Problem(f"must be at least 1, got {n}", Location(flag=f"{flag} {n}"),
                                     hint=f"e.g. {flag} 16"))
    check_sampling(args.temperature, args.top_p, args.seed)
    torch.set_num_threads(args.threads)
    from ..train.checkpoint import run_directory

    ckpt = run_directory(args.checkpoint, "--checkpoint")
    plan = _plan(args.graph, args.overrides, ckpt)
    spec = plan.typed.ctx.spec
    from ..spec.paths import require_paths

    require_paths(spec, "run")          # eval reads what run reads: the target's weights, corpus, tokenizer
    from ..models.registry import kernel_notes

    for note in kernel_notes(plan.typed.ctx.models):
        print(note, file=sys.stderr)
    tr = Trained(plan, ckpt, args.device)
    seq = int(tr.target.config.max_position_embeddings or 1 << 20)    # prompts come from whole documents
    _, held = load_data(spec.data, Path(spec.data.get("_base", ".")), seq, int(spec.train["seed"]),
                        int(tr.dims.vocab_size), spec.loc)
    if held is None:
        raise GraphError(Problem("eval decodes prompts from the held-out split, and the graph has none",
                                 spec.loc("data"), hint="[data] holdout = 50"))
    prompts = held_out_prompts(held, args.prompts, args.prompt_tokens)
    eos = held.eos
    dec = Decoder(tr.target, tr.drafter, tr.dims.target_layer_ids, int(tr.dims.block_size), eos)
    res = {"graph": spec.name, "checkpoint": str(ckpt), "max_new_tokens": args.max_new_tokens,
           **measure(dec, prompts, args.max_new_tokens, args.temperature, args.top_p, args.seed)}
    if args.json:
        print(json.dumps(res))
    else:
        acc = " ".join(f"{a:.2f}" if a is not None else "-" for a in res["slot_accept"])
        print(f"{spec.name}: speculative decoding of {res['prompts']} held-out prompts, up to {args.max_new_tokens} "
              f"new tokens each, block {res['block']}, "
              + ("greedy verification" if args.temperature == 0 else "speculative-sampling verification"))
        print(f"  acceptance length tau: {res['tau']} tokens per block ({res['rounds']} blocks); slot accept {acc}")
        print(f"  tokens per target forward: {res['tokens_per_target_forward']} (target-only: "
              f"{res['greedy_tokens_per_target_forward']})")
        print(f"  wall time: {res['speculative_seconds']:.2f} s speculative, {res['greedy_seconds']:.2f} s target-only "
              f"({res['speedup']}x; both with the target's KV cache); decode {res['speculative_decode_tokens_per_s']} "
              f"against {res['greedy_decode_tokens_per_s']} tokens/s ({res['decode_speedup']}x)")
        print(f"  lossless: {res['identical_to_greedy']} of {res['prompts']} outputs identical to target-only greedy"
              if res["lossless"] is not None else f"  sampling at temperature {args.temperature}, top-p {args.top_p}, "
              f"seed {args.seed}: lossless in distribution (the speculative-sampling rule; not comparable per prompt)")
    return 0 if res["lossless"] is not False else 1


def cmd_export(args) -> int:
    from ..train.export import export
    from ..train.trained import Trained

    from ..train.checkpoint import run_directory

    ckpt = run_directory(args.dir, "export DIR")
    plan = _plan(args.graph, args.overrides, ckpt)
    tr = Trained(plan, ckpt, "cpu", flag="export DIR")
    out = export(tr.drafter, tr.dims, tr.norm_weight, tr.target.config, Path(args.out), args.dtype, tr.drafter_name,
                 plan.typed.ctx.spec.loc("models", tr.drafter_name, "config"), norm_plus_one=tr.norm_plus_one)
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'} ({args.dtype}): the DFlash draft format "
          f"(z-lab dflash DFlashDraftModel; SGLang --speculative-algorithm DFLASH --speculative-draft-model-path {out})",
          file=sys.stdout)
    return 0
