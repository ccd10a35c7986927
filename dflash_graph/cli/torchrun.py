"""`dflash-graph launch`: torchrun, in this process, starting `python -m dflash_graph run ...` (or `capture ...`)
on every rank.

Plain `torchrun ... -m dflash_graph run GRAPH` works too; what `launch` adds is how it ends. torchrun ends a launch
that failed, or that was stopped by a signal to itself (Ctrl-C at a terminal reaches torchrun and every rank),
with a Python traceback and exit 1. The ranks have already said what happened (one line, docs/distributed.md), so
`launch` adds one line and exits with the status that means it: the ranks' own status (2 for a refused graph or
flag, 4 for a lost rank, 130 for Ctrl-C), or 128 + the signal torchrun itself was stopped by.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

USAGE = "dflash-graph launch [TORCHRUN FLAGS] {run,capture} GRAPH [FLAGS]"

DESCRIPTION = """\
Run `dflash-graph run` under torchrun: one process per rank (docs/distributed.md), or `dflash-graph capture`: one
writer per target rank (docs/offline.md). The flags before `run` are
torchrun's own (`torchrun --help` lists them all); the rest is `dflash-graph run`'s. The same as
`torchrun [TORCHRUN FLAGS] -m dflash_graph run GRAPH [RUN FLAGS]`, except how it ends: Ctrl-C exits 130 and a
failed run exits with the ranks' own status, each with one line after the ranks' own, never torchrun's traceback.

exit status:
  0    every rank finished
  2    refused: a bad graph or flag, a launch of the wrong size, a predicted OOM, an existing run (the error is
       printed once, by local rank 0), or a torchrun flag or rendezvous that does not work
  4    a rank was lost (killed, crashed, frozen): the others name it and the writer saves a checkpoint
  130  Ctrl-C (SIGINT to the process group, or to one rank): the writer says what it saved
  128+N  torchrun itself was stopped by signal N (143: SIGTERM)
  other  a rank's own status (3: an internal error in dflash-graph)

torchrun's own log lines are not shown (LOGLEVEL=WARNING or INFO shows them, as under torchrun).
"""

EXAMPLES = """\
torchrun flags used most:
  --nproc-per-node N        processes on this machine (check prints the N the graph needs)
  --standalone              one machine, a rendezvous on a free local port
  --nnodes M --node-rank K --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID
                            several machines: the same command on each, K = 0..M-1

examples:
  dflash-graph launch --nproc-per-node 3 run graphs/tiny.toml --out runs/tiny-torchrun    # on a CPU: t0, t1, draft
  dflash-graph launch --nproc-per-node 8 run graphs/qwen27b.toml
  dflash-graph launch --nproc-per-node 3 run graphs/tiny.toml --resume runs/tiny-torchrun
  dflash-graph launch --nproc-per-node 3 capture graphs/tiny.toml --out /data/cache/tiny   # t0, t1 write shards
"""

COMMANDS = ("run", "capture")   # what launch starts on every rank; the others run in one process


class LaunchUsage(Exception):
    """A launch command line that cannot be started; `str()` is the message (exit 2)."""


def help_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-graph launch", usage=USAGE, description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    p.add_argument("-h", "--help", action="help", help="show this help and exit")
    return p


def split(argv: Sequence[str], commands=()):
    """torchrun's flags, parsed by torchrun's own parser, and the dflash-graph command after them.

    torchrun's parser knows which of its flags take a value, so `--rdzv-id run` stays torchrun's; its first
    positional (the script it would start) is the dflash-graph command (`commands`: every dflash-graph command,
    to say why another one is refused). Returns (torchrun's args set up to start
    `python -m dflash_graph COMMAND ...`, [COMMAND, *its args])."""
    from torch.distributed.run import get_args_parser

    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        help_parser().print_help()
        raise SystemExit(0 if argv else 2)
    tp = get_args_parser()
    tp.prog, tp.usage = "dflash-graph launch", USAGE
    tp.epilog = "see: dflash-graph launch --help"
    args = tp.parse_args(argv)   # a bad torchrun flag: argparse prints it with the usage and exits 2
    if args.module or args.no_python:
        flag = "-m" if args.module else "--no-python"
        raise LaunchUsage(f"dflash-graph launch: error: {flag} is not a flag of launch: it starts "
                          f"`python -m dflash_graph COMMAND` itself\n"
                          f"  hint: drop {flag}, e.g. dflash-graph launch --nproc-per-node 3 run graphs/tiny.toml")
    command = [args.training_script, *args.training_script_args]
    if args.training_script not in COMMANDS:
        known = args.training_script in commands
        why = (f"`{args.training_script}` runs in one process: dflash-graph {args.training_script} ..."
               if known else f"`{args.training_script}` is not a dflash-graph command")
        raise LaunchUsage(f"dflash-graph launch: error: launch starts `dflash-graph run` or `capture` on every rank, not "
                          f"`{args.training_script}` ({why})\n"
                          f"  hint: dflash-graph launch [TORCHRUN FLAGS] run GRAPH [RUN FLAGS], e.g. "
                          f"dflash-graph launch --nproc-per-node 3 run graphs/tiny.toml")
    args.module, args.training_script, args.training_script_args = True, "dflash_graph", command
    return args, command


def _signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def failure_status(failures) -> tuple[int, str]:
    """The exit status of a launch whose ranks failed, and one line on the rank that caused it.

    `failures`: torchrun's {rank: ProcessFailure} (exitcode < 0: killed by that signal). torchrun's own root
    cause is the failure with the earliest whole-second timestamp, which ties when ranks stop together, so the
    cause is chosen here: a rank that stopped on its own (2: refused, 130: interrupted, 3: a bug), before a rank
    that stopped because another one was lost (EXIT_LOST) or was killed; the earliest first, then the lowest
    rank. A run that lost a rank exits EXIT_LOST, as its surviving ranks do."""
    from ..exec.distributed import EXIT_LOST

    def order(rank):
        return failures[rank].timestamp, rank

    own = sorted((r for r, f in failures.items() if f.exitcode > 0 and f.exitcode != EXIT_LOST), key=order)
    killed = sorted((r for r, f in failures.items() if f.exitcode < 0), key=order)
    if own:
        rank = own[0]
        f = failures[rank]
        return f.exitcode, (f"dflash-graph launch: rank {rank} (pid {f.pid}) exited {f.exitcode} (its reason is "
                            f"above); torchrun stopped the other ranks")
    if killed:
        rank = killed[0]
        f = failures[rank]
        return EXIT_LOST, (f"dflash-graph launch: lost rank {rank} (pid {f.pid}): killed by "
                           f"{_signal_name(-f.exitcode)}; every other rank has stopped")
    rank = min(failures, key=order)
    return EXIT_LOST, (f"dflash-graph launch: rank {rank} (pid {failures[rank].pid}) stopped because another rank "
                       f"was lost (its reason is above); every rank has stopped")


def launch(args) -> int:
    """Run torchrun with `args` (from `split`) and return the launch's exit status (module docstring)."""
    import logging
    import os

    import torch.distributed.run as torchrun
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    if "LOGLEVEL" not in os.environ:   # torchrun's log lines (a rank's exit, its SIGTERM to the others) restate
        logging.disable(logging.ERROR)   # what the ranks and the line below say; LOGLEVEL=INFO shows them
    try:
        torchrun.run(args)
    except SignalException as e:   # torchrun was stopped: it has passed the signal on to every rank and waited
        code = 128 + int(e.sigval)
        print(f"dflash-graph launch: stopped by {_signal_name(int(e.sigval))}; every rank has exited (exit {code})",
              file=sys.stderr)
        return code
    except ChildFailedError as e:
        code, line = failure_status(e.failures)
        print(line, file=sys.stderr)
        return code
    except (RendezvousError, DistError) as e:
        print(f"dflash-graph launch: error: torchrun could not start the ranks: {type(e).__name__}: {e}\n"
              "  hint: check --rdzv-endpoint (reachable from every machine, the port free) and --nnodes; on one "
              "machine, --standalone picks a free port", file=sys.stderr)
        return 2
    return 0
