"""`dflash-graph eval GRAPH --checkpoint DIR`: real speculative decoding with the target and the trained drafter
on held-out prompts or on benchmark files (`--bench`, train/bench.py), against target-only decoding
(train/speculative.py), one table row per benchmark beside the held-out tau training measured. Before anything
is loaded it compares the graph with the run's run.json and eval's memory with the device's. `dflash-graph export
DIR --out HF_DIR`: the drafter in the DFlash draft format (train/export.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..errors import GraphError, Location, Problem
from ..rewrite.pipeline import compile_graph
from ..train.heldout import eval_need, free_bytes


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


def _plan(graph: str | None, overrides: list[str], ckpt: Path, rewrite: bool = True):
    rec = run_record(ckpt)
    graph = graph or rec.get("graph")
    if graph is None:
        raise GraphError(Problem(f"{ckpt} has no run.json that names the graph it trained (a run of an older "
                                 "version)", Location(str(ckpt)),
                                 hint="pass --graph GRAPH (and the --set overrides the run used)"))
    same = rec.get("graph") and Path(rec["graph"]).resolve() == Path(graph).resolve()
    return compile_graph(graph, [*(rec.get("overrides", []) if same else []), *overrides], rewrite=rewrite)


# -- the graph against the run ---------------------------------------------------------------------------------
# What the drafter's weights and its decoding depend on: a difference in any of these evaluates another drafter
# than the one trained (a block-4 drafter decoded at block 8 drafts 7 tokens it never learned to draft).
DRAFTER_KEYS = ("block_size", "target_layer_ids", "mask_token_id", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
TARGET_KEYS = ("num_hidden_layers", "hidden_size", "vocab_size")


def _resolve(flat: dict[str, Any], v: Any, depth: int = 0) -> Any:
    """A resolved config value as a number where the graph wrote a dim's name (`block`), another model's key
    (`target.hidden_size`) or integer arithmetic of them (`vocab - 1`): both graphs are compared by what their keys
    evaluate to, not by how they are written. A value that does not reduce to a number is compared as written."""
    if not isinstance(v, str) or depth > 4:
        return v
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}

    def name(text: str) -> Any:
        if f"dims.{text}" in flat:
            return _resolve(flat, flat[f"dims.{text}"], depth + 1)
        model, _, key = text.partition(".")
        if key and f"models.{model}.config.{key}" in flat:
            return _resolve(flat, flat[f"models.{model}.config.{key}"], depth + 1)
        raise ValueError(text)

    def ev(node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            out = name(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            out = name(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        else:
            raise ValueError(ast.dump(node))
        if not isinstance(out, int):
            raise ValueError(str(out))
        return out

    try:
        return ev(ast.parse(v.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return v


def graph_differences(rec: dict, spec, drafter: str, target: str, ckpt: Path) -> list[Problem]:
    """Each key the drafter's weights or decoding depend on whose value in this graph differs from the run's
    (run.json's resolved graph of its latest invocation), as a located Problem; [] without a run.json."""
    from ..train.rundir import _jsonable, flatten

    try:
        old = (rec.get("resumes") or [rec])[-1]["resolved"]
    except (KeyError, TypeError, IndexError, AttributeError):
        return []
    a, b = flatten(old), flatten(_jsonable(spec.resolved))
    same = rec.get("graph") and spec.file and Path(rec["graph"]).resolve() == Path(spec.file).resolve()
    hint = ("evaluate with the --set flags the run used (eval adds run.json's overrides when GRAPH is the run's "
            "graph): drop the --set flags that change this key" if same else
            f"the run trained {rec.get('graph')}" + (f" with --set {' --set '.join(rec['overrides'])}"
                                                     if rec.get("overrides") else "") +
            ": evaluate with that graph (or omit GRAPH's changes to this key)")
    keys = [("models", drafter, "config", k) for k in DRAFTER_KEYS] + \
           [("models", target, "config", k) for k in TARGET_KEYS] + [("models", target, "weights")]
    out = []
    for path in keys:
        k = ".".join(path)
        was, now = _resolve(a, a.get(k, "<absent>")), _resolve(b, b.get(k, "<absent>"))
        if was == now:
            continue
        wrote = f" (written {b[k]!r})" if isinstance(b.get(k), str) and b[k] != now else ""
        out.append(Problem(f"{k} is {now}{wrote} in this graph, {was} in the run that trained {ckpt}",
                           spec.loc(*path), expected=f"{was} (the run's)", actual=str(now), hint=hint))
    return out


# -- memory before loading (eval_need and free_bytes live in train/heldout.py) ----------------------------------
def _available(device: str, host_memory: str | None) -> tuple[int | None, str]:
    """(bytes the eval device has free, where that figure comes from): --host-memory for a CPU device when given."""
    import torch

    if torch.device(device).type != "cuda" and host_memory is not None:
        from ..units import parse_bytes

        try:
            return parse_bytes(host_memory), "--host-memory"
        except ValueError as e:
            raise GraphError(Problem(f"--host-memory {e}", Location(flag=f"--host-memory {host_memory}"),
                                     hint="e.g. --host-memory 64GiB")) from None
    return free_bytes(device)


def memory_problem(plan, drafter: str, target: str, device: str, tokens: int,
                   host_memory: str | None) -> Problem | None:
    """The refusal, with the figures, when eval's weights and logits (eval_need) exceed what `device` has."""
    from ..units import fmt_bytes

    need = eval_need(plan, drafter, target, tokens)
    have, src = _available(device, host_memory)
    total = sum(need.values())
    if have is None or total <= have:
        return None
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in need.items())
    return Problem(f"eval would need at least {fmt_bytes(total)} on {device} ({parts}), and {device} has "
                   f"{fmt_bytes(have)} ({src}); nothing was loaded", Location(flag=f"--device {device}"),
                   expected=f"at most {fmt_bytes(have)}", actual=fmt_bytes(total),
                   hint="evaluate on a device that holds the target (--device cuda:N), or a smaller target; "
                        "--host-memory SIZE if this host's figure is wrong")


# -- eval ------------------------------------------------------------------------------------------------------
def _flags(args) -> None:
    from ..exec.devices import device_problem
    from ..train.speculative import check_sampling

    why = device_problem(args.device)
    if why is not None:
        raise GraphError(Problem(why, Location(flag=f"--device {args.device}"),
                                 hint="--device cpu (the default), or cuda:N for a GPU this machine has"))
    for flag, n in (("--prompts", args.prompts), ("--prompt-tokens", args.prompt_tokens),
                    ("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):
        if n < 1:
            raise GraphError(Problem(f"must be at least 1, got {n}", Location(flag=f"{flag} {n}"),
                                     hint=f"e.g. {flag} 16"))
    for f in getattr(args, "bench", None) or []:
        if not Path(f).is_file():
            raise GraphError(Problem("no such file" if not Path(f).exists() else "not a file",
                                     Location(flag=f"--bench {f}"),
                                     hint="--bench takes a local JSONL file of a benchmark's records (nothing is "
                                          "downloaded); graphs/tiny/bench/ has one per format"))
    if getattr(args, "bench_format", None) and not getattr(args, "bench", None):
        raise GraphError(Problem("--bench-format applies to --bench files, and none was given",
                                 Location(flag=f"--bench-format {args.bench_format}"),
                                 hint="add --bench FILE, or drop --bench-format"))
    check_sampling(args.temperature, args.top_p, args.seed)
    template_kwargs(args)


def template_kwargs(args) -> tuple[dict[str, Any], dict[str, str]]:
    """The --chat-template-kwarg KEY=VALUE values (VALUE read as JSON when it is JSON: `false`, `3`, `"x"`;
    otherwise as the text written) and --no-thinking (enable_thinking=false), with each key's flag as written;
    a located error (exit 2) for a malformed one, a key given twice, or one given without --bench."""
    out: dict[str, Any] = {}
    flags: dict[str, str] = {}
    given = [(f"--chat-template-kwarg {kv}", kv) for kv in getattr(args, "chat_template_kwarg", None) or []]
    if getattr(args, "no_thinking", False):
        given.append(("--no-thinking", "enable_thinking=false"))
    for flag, kv in given:
        key, eq, raw = kv.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise GraphError(Problem("not KEY=VALUE with KEY a template variable's name", Location(flag=flag),
                                     expected="KEY=VALUE", actual=kv, hint="e.g. --chat-template-kwarg "
                                                                            "enable_thinking=false"))
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        if key in out and out[key] != value:
            raise GraphError(Problem(f"{key} is given twice, with different values", Location(flag=flag),
                                     expected=f"{key}={json.dumps(out[key])} (from {flags[key]})",
                                     actual=f"{key}={json.dumps(value)}", hint="give each template variable once"))
        out[key], flags[key] = value, flag
    if out and not getattr(args, "bench", None):
        raise GraphError(Problem("chat template values apply to --bench prompts, which go through the chat "
                                 "template; held-out prompts are token ids of the corpus", Location(flag=given[0][0]),
                                 hint="add --bench FILE, or drop the flag"))
    return out, flags


def _bench_prompts(args, spec) -> tuple[list[tuple[str, str, str, list]], int | None]:
    """(name, file, format, dialogues to ask through the chat template) per --bench file, with the tokenizer the
    graph's [data] uses and the --chat-template-kwarg values (each refused when the template does not read it);
    and that tokenizer's eos id."""
    from ..train.bench import bench_name, chats, read_bench, template_kwargs_problems
    from ..train.corpus import load_tokenizer

    base = Path(spec.data.get("_base", "."))
    if not spec.data.get("tokenizer"):
        raise GraphError(Problem("--bench prompts are text, and the graph's [data] names no tokenizer to turn them "
                                 "into the target's tokens", spec.loc("data"),
                                 hint='[data] tokenizer = the target\'s tokenizer.json (or its directory)'))
    ct = spec.data.get("chat_template")
    tok = load_tokenizer(base / spec.data["tokenizer"], base / ct if ct else None)
    kwargs, flags = template_kwargs(args)
    written = Path(spec.data["tokenizer"])
    if ct:
        source = f"[data] chat_template = {ct}"
    elif not (base / written).is_dir() and (base / written).with_name("chat_template.jinja").is_file():
        source = f"{written.with_name('chat_template.jinja')}, beside [data] tokenizer"      # load_tokenizer's pick
    else:
        source = f"the chat template of [data] tokenizer = {written}"
    problems = template_kwargs_problems(tok, kwargs, flags, source)
    if problems:
        raise GraphError(problems)
    taken: set[str] = set()
    out = []
    for f in args.bench:
        fmt, dialogues = read_bench(Path(f), args.prompts, args.bench_format)
        out.append((bench_name(Path(f), taken), f, fmt, chats(tok, dialogues, f, kwargs)))
    return out, tok.eos_token_id


def _row(name: str, fmt: str, file: str | None, res: dict[str, Any]) -> dict[str, Any]:
    lossless = res.get("lossless")     # measure's: True/False greedy, None sampled (lossless in distribution)
    return {"name": name, "format": fmt, "file": file, **res, "tau": res["tau"], "speedup": res["speedup"],
            "accept_per_slot": res["slot_accept"], "lossless": lossless}


def render_table(rows: list[dict[str, Any]], predicted: dict[str, Any] | None) -> str:
    """One line per benchmark: tau, the accept rate of each slot, tokens per target forward, speed-up, lossless."""
    head = ["benchmark", "prompts", "turns", "tau", "accept per slot", "tok/fwd", "decode tok/s (spec/target)",
            "speed-up", "lossless"]
    body = [[r["name"], str(r["prompts"]), str(r.get("turns", r["prompts"])),
             "-" if r["tau"] is None else f"{r['tau']:.2f}",
             " ".join("-" if a is None else f"{a:.2f}" for a in r["accept_per_slot"]),
             f"{r['tokens_per_target_forward']:.2f}",
             f"{r.get('speculative_decode_tokens_per_s', '-')}/{r.get('greedy_decode_tokens_per_s', '-')}",
             "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
             f"{r['identical_to_greedy']}/{r.get('turns', r['prompts'])}" if r.get("identical_to_greedy") is not None
             else ("in distribution" if r["lossless"] is None else str(r["lossless"]))]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("accept per slot: how often slot k is accepted when slots 1..k-1 were; speed-up: target-only "
                 "decoding's time over speculative decoding's, both with the target's KV cache")
    if any(r.get("turns", r["prompts"]) != r["prompts"] for r in rows):
        lines.append("turns: the decodes of a row; a multi-turn prompt asks each turn after the answer decoded for the "
                     "one before, and every figure counts every turn")
    for r in rows:
        for d in r.get("divergences") or ():
            lines.append(f"{r['name']}: prompt {d['prompt']} (from 0) turn {d['turn']}: greedy speculative decoding "
                         "differed from target-only decoding; its later turns were asked after each side's own "
                         "answer and are not counted identical")
    if any(r["speedup"] is not None and r["speedup"] < 1 for r in rows):
        lines.append("a speed-up below 1x: a round (the drafter's forward and a verify forward of the block) costs "
                     "more here than the tokens per target forward it yields (docs/drafter.md, \"Acceptance length\")")
    if predicted is not None:
        lines.append(f"training predicted tau {predicted['tau']} (held-out, step {predicted['step']}; "
                     "metrics.jsonl)")
    else:
        lines.append("training predicted no tau: the run's metrics.jsonl has no held-out evaluation")
    return "\n".join(lines)


def cmd_eval(args) -> int:
    import torch

    from ..train.bench import heldout_tau
    from ..train.data import load_data
    from ..train.speculative import Decoder, held_out_prompts, measure
    from ..train.trained import Trained, drafter_names

    _flags(args)
    torch.set_num_threads(args.threads)
    from ..train.checkpoint import run_directory

    ckpt = run_directory(args.checkpoint, "--checkpoint")
    plan = _plan(args.graph, args.overrides, ckpt, rewrite=False)   # eval runs the decoders, not the graph's nodes
    spec = plan.typed.ctx.spec
    drafter, target = drafter_names(plan)
    block = int(plan.typed.ctx.models[drafter].dims.block_size)
    host_memory = getattr(args, "host_memory", None)
    # before anything is read or built: the graph against the run's, and eval's memory against the device's
    problems = graph_differences(run_record(ckpt), spec, drafter, target, ckpt)
    mem = memory_problem(plan, drafter, target, args.device, args.prompt_tokens + args.max_new_tokens + block,
                         host_memory)
    if problems or mem:
        raise GraphError([*problems, *([mem] if mem else [])])
    from ..spec.paths import require_paths

    require_paths(spec, "run")          # eval reads what run reads: the target's weights, corpus, tokenizer
    benches, eos = _bench_prompts(args, spec) if args.bench else ([], None)
    # a benchmark's longest prompt (a later turn's estimated: earlier answers at --max-new-tokens each)
    longest = max((c.longest(args.max_new_tokens) for *_, cs in benches for c in cs), default=0)
    if longest > args.prompt_tokens:    # longer than the first check assumed
        mem = memory_problem(plan, drafter, target, args.device, longest + args.max_new_tokens + block, host_memory)
        if mem:
            raise GraphError(mem)
    from ..models.registry import kernel_notes

    for note in kernel_notes(plan.typed.ctx.models):
        print(note, file=sys.stderr)
    tr = Trained(plan, ckpt, args.device)
    if not benches:
        seq = int(tr.target.config.max_position_embeddings or 1 << 20)    # prompts come from whole documents
        _, held = load_data(spec.data, Path(spec.data.get("_base", ".")), seq, int(spec.train["seed"]),
                            int(tr.dims.vocab_size), spec.loc)
        if held is None:
            raise GraphError(Problem("eval decodes prompts from the held-out split, and the graph has none",
                                     spec.loc("data"), hint="[data] holdout = 50, or --bench FILE"))
        eos = held.eos
        benches = [("held-out", None, "held-out", held_out_prompts(held, args.prompts, args.prompt_tokens))]
    dec = Decoder(tr.target, tr.drafter, tr.dims.target_layer_ids, int(tr.dims.block_size), eos)
    rows = [_row(name, fmt, f, measure(dec, prompts, args.max_new_tokens, args.temperature, args.top_p, args.seed))
            for name, f, fmt, prompts in benches]
    predicted = heldout_tau(ckpt)
    res: dict[str, Any] = {"graph": spec.name, "checkpoint": str(ckpt), "max_new_tokens": args.max_new_tokens,
                           "block": block, "predicted_tau": predicted, "benchmarks": rows}
    if args.bench:
        res["chat_template_kwargs"] = template_kwargs(args)[0]
    else:                   # the held-out row's figures at the top level too, as before --bench
        res.update({k: v for k, v in rows[0].items() if k not in ("name", "format", "file")})
    if args.json:
        print(json.dumps(res))
    else:
        what = (f"{rows[0]['prompts']} held-out prompts" if not args.bench
                else f"{len(rows)} benchmark file(s), up to {args.prompts} prompts each")
        kw = res.get("chat_template_kwargs")
        if kw:
            what += " (chat template with " + ", ".join(f"{k}={json.dumps(v)}" for k, v in kw.items()) + ")"
        temp = rows[0].get("temperature")           # measure's, when it samples
        verify = "greedy verification" if not temp else f"sampled verification at temperature {temp}" + (
            f", top-p {rows[0]['top_p']}" if rows[0].get("top_p") not in (None, 1, 1.0) else "")
        print(f"{spec.name}: speculative decoding of {what}, up to "
              f"{args.max_new_tokens} new tokens, block {block}, {verify}, against target-only decoding")
        print(render_table(rows, predicted))
    return 0 if all(r["lossless"] is not False for r in rows) else 1


def cmd_export(args) -> int:
    from ..train.checkpoint import run_directory
    from ..train.export import export, mask_token_string, refuse_existing, tokenizer_path
    from ..train.trained import Trained

    ckpt = run_directory(args.dir, "export DIR")
    out = Path(args.out)
    if not args.overwrite:            # refused before anything is built
        refuse_existing(out)
    modeling = Path(args.modeling_file) if args.modeling_file else None
    if modeling is not None and not modeling.is_file():
        raise GraphError(Problem("no such file", Location(flag=f"--modeling-file {modeling}"),
                                 hint="a local copy of z-lab's dflash.py (the modeling file of their published "
                                      "drafters, e.g. z-lab/Qwen3-8B-DFlash-b16)"))
    plan = _plan(args.graph, args.overrides, ckpt, rewrite=False)
    spec = plan.typed.ctx.spec
    tr = Trained(plan, ckpt, "cpu", flag="export DIR")
    mask = mask_token_string(tokenizer_path(spec), tr.dims.mask_token_id)
    out = export(tr.drafter, tr.dims, tr.norm_weight, tr.target.config, out, args.dtype, tr.drafter_name,
                 spec.loc("models", tr.drafter_name, "config"), norm_plus_one=tr.norm_plus_one, overwrite=True,
                 mask_token=mask, modeling_file=modeling)
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'} ({args.dtype}): the DFlash draft format "
          f"(SGLang --speculative-algorithm DFLASH --speculative-draft-model-path {out}; vLLM --speculative-config "
          f"'{{\"method\": \"dflash\", \"model\": \"{out}\"}}'; docs/drafter.md)")
    if mask is None:
        print(f"note: the graph's [data] names no tokenizer, so dflash_config.mask_token is not written: SGLang then "
              f"assumes \"<|MASK|>\" and refuses the draft if the target's tokenizer maps it to another id than "
              f"{tr.dims.mask_token_id}", file=sys.stderr)
    if modeling is None:
        print(f"note: z-lab's Transformers loader (AutoModel.from_pretrained(..., trust_remote_code=True)) also "
              f"needs their dflash.py in {out} (auto_map names it; MIT licence): --modeling-file PATH copies it in",
              file=sys.stderr)
    return 0
