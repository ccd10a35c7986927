"""`dflash-graph` command line: check, plan, run. Bad input exits 2 with a message, never a traceback."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence

from ..errors import GraphError

EXAMPLES = """examples:
  dflash-graph check graphs/qwen27b.toml                 # will the 27B run fit? (rewrites applied)
  dflash-graph check graphs/qwen27b.toml --no-rewrite    # the graph exactly as written
  dflash-graph check graphs/tiny.toml --json --set dims.seq=512
  dflash-graph run graphs/tiny.toml                      # train the embedded tiny default on CPU
  dflash-graph capture graphs/tiny.toml --out cache/tiny # the target side once, to disk (docs/offline.md)
  dflash-graph run graphs/tiny.toml --hidden-states cache/tiny   # the drafter alone, from the cache
  dflash-graph launch --nproc-per-node 3 run graphs/tiny.toml --out runs/tiny-torchrun   # one process per rank
  dflash-graph eval graphs/tiny.toml --checkpoint runs/tiny   # speculative decoding: measured acceptance length
  dflash-graph export runs/tiny --out runs/tiny/hf       # the drafter in the DFlash format SGLang loads
  dflash-graph prove                                     # prove every rewrite rule for all sizes (z3)
  dflash-graph trace-model graphs/qwen3_8b/config.json   # a memory program for a config check refuses (torch)
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("graph", help="graph file (TOML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scalar by its dotted path, e.g. dims.seq=4096 or models.target.config.hidden_size=64 "
                        "(repeatable)")
    p.add_argument("--without-rule", dest="rules_off", action="append", default=[], metavar="RULE",
                   help="rewrite without this rule, e.g. fuse_heads_into_loss (repeatable; see docs/rules/)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflash-graph", formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Check, rewrite and run DFlash drafter training graphs.", epilog=EXAMPLES)
    from .. import __version__

    ap.add_argument("--version", action="version", version=f"dflash-graph {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    c = sub.add_parser("check", help="infer shapes and per-device memory; report OOMs before they happen",
                       description="Infer every shape and every device's memory over the schedule, without weights or "
                                   "GPUs, and that every file the graph names exists. Exit 0: fits on every device; 1: predicted "
                                   "OOM; 2: invalid graph or usage, or a missing file (a warning under --memory-only).")
    _common(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.add_argument("--no-rewrite", action="store_true", help="check the graph exactly as written")
    c.add_argument("--expandable-segments", choices=("on", "off"), default=None,
                   help="override memory.expandable_segments for this check")
    c.add_argument("--verify", action="store_true", help="re-check every contract before and after each rewrite pass")
    c.add_argument("--device-map", action="append", default=[], metavar="FROM=TO",
                   help="predict for remapped torch devices, as run would use them, e.g. 'cuda:*=cpu' (repeatable)")
    c.add_argument("--host-memory", metavar="SIZE", help="the memory of the host the CPU devices share, e.g. 512GiB "
                                                         "(default: [memory] host_memory, else MemAvailable here)")
    c.add_argument("--memory-only", action="store_true",
                   help="predict memory only: a file the graph names that does not exist (weights, corpus, "
                        "tokenizer, chat template: what run reads) is a warning, not an error")
    c.add_argument("--max", metavar="DIM", help="the largest value of a dim for which every device fits, e.g. "
                                                "--max dims.seq (the live bytes solved, the allocator replayed)")
    c.add_argument("--memory-snapshot", metavar="FILE.pickle",
                   help="write the predicted allocation trace and segments of every CUDA device in the format of "
                        "torch.cuda.memory._snapshot(), for https://pytorch.org/memory_viz")
    c.add_argument("--layouts", action="store_true",
                   help="predict every layout of the graph's devices (colocated, each N:M split, N:1), each checked "
                        "as a graph variant: fits or OOM, peak, bottleneck rank, samples/s (docs/distributed.md)")
    c.add_argument("--capture", nargs="?", const="", default=None, metavar="DIR",
                   help="the hidden-state cache's storage bill: bytes per sample and per corpus for each storage "
                        "choice, the read rate the drafter needs, and whether it fits on [capture] disk or, given "
                        "DIR, the free space of DIR's filesystem (docs/offline.md)")
    c.add_argument("--plot", metavar="FILE.png|svg", help="draw each device's memory over the schedule, by category, "
                                                          "as written and rewritten (needs matplotlib)")
    e = sub.add_parser("explain", help="one node: its contract, shapes, memory and FLOP formulas, and its rewrites",
                       description="Explain one node of a graph: its contract (ops/catalog.py), its inferred shapes "
                                   "symbolic and concrete, its memory and FLOP formulas with the dims substituted "
                                   "and where each comes from, and which rewrites touched it and why they were legal.")
    _common(e)
    e.add_argument("node", help="node id (of the graph as written or as rewritten)")
    e.add_argument("--no-rewrite", action="store_true", help="explain the node in the graph exactly as written")
    d = sub.add_parser("draw", help="draw the graph as written and rewritten (Graphviz)",
                       description="Draw the graph as written and as rewritten: nodes, devices as clusters, shapes on "
                                   "the edges, rewritten nodes marked. SVG and PNG need Graphviz's `dot`; .dot needs "
                                   "nothing.")
    _common(d)
    d.add_argument("-o", "--output", required=True, metavar="FILE.svg|png|dot", help="where to write the drawing")
    d.add_argument("--no-rewrite", action="store_true", help="draw only the graph exactly as written")
    pl = sub.add_parser("plan", help="print or write the rewritten graph",
                        description="Rewrite the graph and print it, or write it as TOML with --emit.")
    _common(pl)
    pl.add_argument("--emit", metavar="OUT.toml", help="write the rewritten graph as TOML")
    pl.add_argument("--layout", metavar="NAME", help="the graph in one of the layouts `check --layouts` lists "
                                                      "(e.g. colocated-fsdp, 4:4-ddp, 7:1)")
    r = sub.add_parser("run", help="check, rewrite and execute the graph: train the drafter",
                       description="Run `check` first (refusing a graph predicted to OOM unless --force), then "
                                   "execute the rewritten graph on its devices and train.")
    _common(r)
    r.add_argument("--steps", type=int, help="optimizer steps (default: train.steps)")
    r.add_argument("--out", default=None, help="output directory for metrics, memory report and checkpoints "
                                                 "(default: runs/<graph name>)")
    r.add_argument("--resume", metavar="DIR", help="continue from the newest good checkpoint in DIR (and write into "
                                                   "DIR unless --out says otherwise); refused if the graph differs")
    r.add_argument("--overwrite", action="store_true", help="replace a run already in --out (default: refuse)")
    r.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                   help="on --resume, accept a changed train.lr, train.warmup_steps, train.weight_decay or "
                        "train.grad_clip (repeatable)")
    r.add_argument("--device-map", action="append", default=[], metavar="FROM=TO",
                   help="remap torch devices, e.g. 'cuda:*=cpu' (repeatable)")
    r.add_argument("--host-memory", metavar="SIZE", help="the memory of the host the CPU devices share, e.g. 512GiB "
                                                         "(default: [memory] host_memory, else MemAvailable here)")
    r.add_argument("--strict", action="store_true", help="check every node's tensors against its contract at run time")
    r.add_argument("--force", action="store_true", help="run even if check predicts an OOM")
    r.add_argument("--no-rewrite", action="store_true", help="run the graph exactly as written")
    r.add_argument("--no-progress", action="store_true", help="no progress bar: a plain line every train.log_every "
                                                               "steps (also when stdout is not a terminal or NO_COLOR "
                                                               "is set)")
    r.add_argument("--tensorboard", metavar="DIR", help="also log loss, tau, accuracy, lr and memory to TensorBoard "
                                                        "(torch.utils.tensorboard.SummaryWriter; needs tensorboard)")
    r.add_argument("--hidden-states", metavar="DIR", help="train the drafter side alone from the hidden-state cache "
                                                          "`dflash-graph capture` wrote in DIR: the target side does "
                                                          "not run (docs/offline.md)")
    r.add_argument("--hybrid", action="store_true",
                   help="with --hidden-states: the first pass over the cache's samples runs the target and writes "
                        "the cache while it trains (epoch 0 is the online run); later passes read it")
    r.add_argument("--on-bad-shard", choices=("stop", "skip"), default="stop",
                   help="with --hidden-states: a shard that is missing or differs from the manifest stops the run "
                        "(exit 2, naming it; default), or is skipped and counted")
    r.add_argument("--loader-workers", type=int, default=1, metavar="N",
                   help="with --hidden-states: DataLoader worker processes that read and verify shards (default 1; "
                        "0: read in the training process)")
    cp = sub.add_parser("capture", help="run the graph's target side over the corpus and write what crosses its "
                                        "transfers to a hidden-state cache",
                        description="Write the hidden-state cache that `run --hidden-states DIR` trains from: "
                                    "safetensors shards and a manifest with the graph's signature and each shard's "
                                    "sha256 (docs/offline.md). Resumes: shards already complete and verified are "
                                    "kept. Refused before any work when the cache would not fit on the disk.")
    _common(cp)
    cp.add_argument("--out", required=True, metavar="DIR", help="directory of the cache")
    cp.add_argument("--samples", type=int, default=None, metavar="N",
                    help="packed sequences to capture (default: [capture] samples, else what `run` trains on: "
                         "train.steps x grad_accum x replicas)")
    cp.add_argument("--overwrite", action="store_true", help="replace what DIR holds (default: resume a cache of "
                                                             "this graph, refuse anything else)")
    cp.add_argument("--device-map", action="append", default=[], metavar="FROM=TO",
                    help="remap torch devices, e.g. 'cuda:*=cpu' (repeatable)")
    cp.add_argument("--no-rewrite", action="store_true", help="capture what the graph as written transfers")
    cp.add_argument("--no-progress", action="store_true", help="no progress lines")
    sub.add_parser("launch", add_help=False,
                   help="run under torchrun, one process per rank: Ctrl-C exits 130, a failed rank its own status",
                   usage="dflash-graph launch [TORCHRUN FLAGS] {run,capture} GRAPH [FLAGS]  (see: dflash-graph launch --help)")
    from ..train.bench import BY_NAME as BENCH_FORMATS   # the formats' one declaration (no torch)

    ev = sub.add_parser("eval", help="speculative decoding with the trained drafter: acceptance length, speed, lossless",
                       description="Decode held-out prompts, or the prompts of --bench files, with the target and "
                                   "the trained drafter (the graph's block size; greedy, or sampled with "
                                   "--temperature) and with the target alone, both with the target's KV cache; report "
                                   "per benchmark the measured acceptance length, the accept rate per slot, tokens per "
                                   "target forward, decode tokens/s and the speed-up, beside the held-out tau training "
                                   "measured. Memory and the graph against the run's are checked before anything is "
                                   "loaded. Greedy: exit 0 when every output equals target-only greedy decoding.")
    _common(ev)
    ev.add_argument("--checkpoint", required=True, metavar="DIR", help="the --out directory of a run")
    ev.add_argument("--prompts", type=int, default=16, help="prompts to decode: held-out ones, or the first N of each "
                                                            "--bench file (default 16)")
    ev.add_argument("--prompt-tokens", type=int, default=24, help="tokens of each held-out document used as prompt")
    ev.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per prompt (default 48)")
    ev.add_argument("--device", default="cpu", help="torch device for the target and the drafter (default cpu)")
    ev.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ev.add_argument("--bench", action="append", default=[], metavar="FILE",
                    help="a local JSONL benchmark file (MT-Bench, every turn; GSM8K, HumanEval, MBPP, MATH500, "
                         "{\"messages\"} or {\"prompt\"} records; repeatable: one row each); its first --prompts "
                         "records go through the target's chat template (default: held-out prompts of the corpus)")
    ev.add_argument("--bench-format", default=None,
                    choices=tuple(BENCH_FORMATS),
                    help="the --bench files' record format (default: detected from each file's keys)")
    ev.add_argument("--chat-template-kwarg", action="append", default=[], metavar="KEY=VALUE",
                    help="a variable for the target's chat template when it renders --bench prompts (VALUE as JSON "
                         "when it is: false, 3, \"x\"; repeatable), e.g. enable_thinking=false; refused when the "
                         "template does not read KEY")
    ev.add_argument("--no-thinking", action="store_true",
                    help="--chat-template-kwarg enable_thinking=false: Qwen3's chat-template switch that asks for an "
                         "answer without a thinking block")
    ev.add_argument("--host-memory", metavar="SIZE", help="the memory eval may use on a CPU device, e.g. 64GiB "
                                                          "(default: MemAvailable here)")
    ev.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default): greedy, outputs identical to target-only greedy decoding; above 0: sampling, "
                         "verified by the lossless speculative-sampling rule (docs/drafter.md, \"eval\")")
    ev.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling cut, in (0, 1] (default 1: none); "
                                                              "used only with --temperature above 0")
    ev.add_argument("--seed", type=int, default=0, help="sampling seed: prompt i is decoded with seed + i (default 0)")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    x = sub.add_parser("export", help="write the drafter as a Hugging Face DFlash draft directory",
                       description="Write DIR's drafter as config.json + model.safetensors in the DFlash draft "
                                   "format that z-lab's dflash code and SGLang (--speculative-algorithm DFLASH) load.")
    x.add_argument("dir", metavar="DIR", help="the --out directory of a run (or its checkpoint/)")
    x.add_argument("--out", required=True, metavar="HF_DIR", help="directory to write")
    x.add_argument("--graph", default=None, help="the graph the run trained (default: from DIR/run.json)")
    x.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="overrides, as given to run (added to those in DIR/run.json)")
    x.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="weight dtype (default bfloat16, as published DFlash drafters)")
    x.add_argument("--overwrite", action="store_true", help="replace the files of an existing, non-empty HF_DIR")
    x.add_argument("--modeling-file", metavar="PATH",
                   help="a local copy of z-lab's dflash.py (MIT), copied into HF_DIR for the auto_map of z-lab's "
                        "Transformers loader (AutoModel.from_pretrained(..., trust_remote_code=True))")
    pv = sub.add_parser("prove", help="prove every rewrite rule for all sizes with an SMT solver (z3)",
                        description="Prove each rewrite rule's theorem, built from the ops' declared traits, for every "
                                    "size, offset, index and rank (docs/rules/). Exit 0: every theorem as required; "
                                    "1: a theorem failed (its counterexample is printed).")
    pv.add_argument("-v", "--verbose", action="store_true", help="print each theorem's statement and axioms")
    pv.add_argument("-k", dest="only", default=None, help="only theorems whose name contains this")
    tm = sub.add_parser(
        "trace-model", help="derive the memory program of one target config (needs torch; tens of seconds)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill("Derive the memory program of a target whose config sets a value no stored program holds for "
                    "(check refuses it and names this command), e.g. attention_bias = true on Qwen3 or Llama, "
                    "mlp_bias = true on Llama, norm_topk_prob = false on Qwen3-MoE. transformers' own causal LM "
                    "(the arch from the config's model_type) is traced under fake tensors at a few small sizes with "
                    "the config's values of those keys, each allocation fitted in the dims, and the fit checked byte "
                    "for byte at held-out sizes; the program is written where check reads it, its file name ending "
                    "in a hash of those values. Exit 0: the program(s) written (their paths on stdout; progress on "
                    "stderr); 1: transformers' code for these values could not be fitted; 2: not a config of a "
                    "supported target, or one transformers refuses.", 100),
        epilog=textwrap.fill("where programs go: $DFLASH_GRAPH_PROGRAMS, else $XDG_CACHE_HOME/dflash-graph/programs, "
                             "else ~/.cache/dflash-graph/programs (check looks there besides the packaged programs)",
                             100) + "\n\n"
               "examples:\n"
               "  dflash-graph trace-model graphs/my_qwen3/config.json                 # both packings\n"
               "  dflash-graph trace-model ~/models/Llama-3.1-8B-bias --packing mask     # a checkpoint directory\n"
               "  DFLASH_GRAPH_PROGRAMS=progs dflash-graph trace-model config.json     # a project's own directory")
    tm.add_argument("config", metavar="CONFIG", help="a target's config.json, or a directory that holds one")
    tm.add_argument("--packing", action="append", choices=("documents", "mask"), default=None,
                    help="the packing to derive for, as the graph's models.<name>.packing (repeatable; default both)")
    tm.add_argument("--out", metavar="DIR", default=None,
                    help="write into DIR instead of the user program directory (check reads DIR only when "
                         "DFLASH_GRAPH_PROGRAMS=DIR)")
    ap.subcommands = {"trace-model": tm, "check": c, "explain": e, "draw": d, "plan": pl, "run": r, "capture": cp, "eval": ev, "export": x,
                      "prove": pv}
    return ap


def _unknown_flags(ap: argparse.ArgumentParser, argv: Sequence[str] | None, unknown: list[str]) -> int:
    """An unrecognized argument: name it, suggest the closest flag of that command, show the command's usage."""
    import difflib

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = next((a for a in argv if a in ap.subcommands), None)
    sub = ap.subcommands.get(cmd, ap)
    flags = [o for a in sub._actions for o in a.option_strings]
    lines = []
    for u in unknown:
        flag = u.split("=")[0]
        close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6) if flag.startswith("-") else []
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{sub.prog}: error: unrecognized argument {u}{hint}")
    print(sub.format_usage().rstrip(), file=sys.stderr)
    print("\n".join(lines), file=sys.stderr)
    print(f"see: {sub.prog} --help", file=sys.stderr)
    return 2


# The exit status of a command whose reader went away (`dflash-graph check G | head -1`): what a shell reports for
# a program ended by SIGPIPE, 128 + 13. Not 1, which `check` uses for a predicted OOM.
EXIT_CLOSED_PIPE = 141


def _closed_pipe() -> int:
    """The reader of stdout closed the pipe: end quietly, as a program killed by SIGPIPE would. stdout is pointed
    at /dev/null so that the interpreter's last flush at exit does not fail again and print "Exception ignored"
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):   # stdout is not a file descriptor (captured, replaced)
        pass
    return EXIT_CLOSED_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point: every command's output ends quietly when its reader closes the pipe."""
    try:
        try:
            return _main(argv)
        finally:   # what is still buffered goes out now, where a closed pipe can be caught (not at exit)
            sys.stdout.flush()
    except BrokenPipeError:
        return _closed_pipe()


def _main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["launch"]:   # torchrun's flags, then a command: split by torchrun's own parser (cli/torchrun.py)
        args, unknown = argparse.Namespace(cmd="launch", launch=given[1:]), []
    else:
        args, unknown = ap.parse_known_args(argv)
    if unknown:
        return _unknown_flags(ap, argv, unknown)
    if args.cmd is None:
        ap.print_help()
        return 2
    try:
        if args.cmd == "check":
            from .check import cmd_check
            return cmd_check(args)
        if args.cmd == "explain":
            from .explain import cmd_explain
            return cmd_explain(args)
        if args.cmd == "draw":
            from .draw import cmd_draw
            return cmd_draw(args)
        if args.cmd == "plan":
            from .check import cmd_plan
            return cmd_plan(args)
        if args.cmd == "run":
            from .run import cmd_run
            return cmd_run(args)
        if args.cmd == "capture":
            from .capture import cmd_capture
            return cmd_capture(args)
        if args.cmd == "launch":
            from . import torchrun
            try:
                targs, command = torchrun.split(args.launch, ap.subcommands)
            except torchrun.LaunchUsage as e:
                print(e, file=sys.stderr)
                return 2
            _, unknown = ap.parse_known_args(command)   # a bad `run` flag: refused once here, not once per rank
            if unknown:
                return _unknown_flags(ap, command, unknown)
            return torchrun.launch(targs)
        if args.cmd in ("eval", "export"):
            from . import evaluate
            return evaluate.cmd_eval(args) if args.cmd == "eval" else evaluate.cmd_export(args)
        if args.cmd == "trace-model":
            from .trace_model import cmd_trace_model
            return cmd_trace_model(args)
        if args.cmd == "prove":
            from ..rewrite.proofs import run_cli
            return run_cli(verbose=args.verbose, only=args.only)
    except GraphError as e:   # a problem about the graph's keys, raised where its file was not known, gets it here
        print(str(e.in_file(getattr(args, "graph", None))), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # the reader of the output went away: main ends quietly
        raise
    except OSError as e:   # the environment, not the graph: a path that cannot be read or written
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"{where}error: {e.strerror or e}\n  hint: check that the path exists, is of the right kind (file or "
              "directory) and that you may read or write it", file=sys.stderr)
        return 2
    except Exception as e:  # a bug in dflash-graph, not in the graph: say so, and keep the traceback reachable
        import os
        import traceback

        if os.environ.get("DFLASH_GRAPH_DEBUG"):
            raise
        print(f"internal error in dflash-graph: {type(e).__name__}: {e}\n"
              f"  at {traceback.extract_tb(e.__traceback__)[-1].filename}:{traceback.extract_tb(e.__traceback__)[-1].lineno}\n"
              "  this is a bug; rerun with DFLASH_GRAPH_DEBUG=1 for the full traceback and report it", file=sys.stderr)
        return 3
    return 2
