"""`dflash-graph` command line: check, plan, run. Bad input exits 2 with a message, never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import GraphError

EXAMPLES = """examples:
  dflash-graph check graphs/qwen27b.toml                 # will the 27B run fit? (rewrites applied)
  dflash-graph check graphs/qwen27b.toml --no-rewrite    # the graph exactly as written
  dflash-graph check graphs/tiny.toml --json --set dims.seq=512
  dflash-graph run graphs/tiny.toml                      # train the embedded tiny default on CPU
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
                                   "GPUs. Exit 0: fits on every device; 1: predicted OOM; 2: invalid graph or usage.")
    _common(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.add_argument("--no-rewrite", action="store_true", help="check the graph exactly as written")
    c.add_argument("--expandable-segments", choices=("on", "off"), default=None,
                   help="override memory.expandable_segments for this check")
    c.add_argument("--verify", action="store_true", help="re-check every contract before and after each rewrite pass")
    pl = sub.add_parser("plan", help="print or write the rewritten graph",
                        description="Rewrite the graph and print it, or write it as TOML with --emit.")
    _common(pl)
    pl.add_argument("--emit", metavar="OUT.toml", help="write the rewritten graph as TOML")
    r = sub.add_parser("run", help="check, rewrite and execute the graph: train the drafter",
                       description="Run `check` first (refusing a graph predicted to OOM unless --force), then "
                                   "execute the rewritten graph on its devices and train.")
    _common(r)
    r.add_argument("--steps", type=int, help="optimizer steps (default: train.steps)")
    r.add_argument("--out", default=None, help="output directory for metrics, memory report and checkpoints "
                                                 "(default: runs/<graph name>)")
    r.add_argument("--resume", metavar="DIR", help="continue from the last checkpoint in DIR")
    r.add_argument("--device-map", action="append", default=[], metavar="FROM=TO",
                   help="remap torch devices, e.g. 'cuda:*=cpu' (repeatable)")
    r.add_argument("--strict", action="store_true", help="check every node's tensors against its contract at run time")
    r.add_argument("--force", action="store_true", help="run even if check predicts an OOM")
    r.add_argument("--no-rewrite", action="store_true", help="run the graph exactly as written")
    r.add_argument("--no-progress", action="store_true", help="print plain log lines instead of a progress bar")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.cmd is None:
        ap.print_help()
        return 2
    try:
        if args.cmd == "check":
            from .check import cmd_check
            return cmd_check(args)
        if args.cmd == "plan":
            from .check import cmd_plan
            return cmd_plan(args)
        if args.cmd == "run":
            from .run import cmd_run
            return cmd_run(args)
    except GraphError as e:
        print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:   # the environment, not the graph: a path that cannot be read or written
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        print(f"error:{where}: {e.strerror or e}", file=sys.stderr)
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
