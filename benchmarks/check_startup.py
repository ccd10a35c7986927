"""What a whole `dflash-graph check GRAPH` process costs: the real command, run as a new process N times, with the
least of the N CPU times (user + system, from resource.getrusage(RUSAGE_CHILDREN) around each run: the CPU a
process used does not grow when other programs load the machine, its wall time does) and the least wall time, and
the least time check itself prints ("checked in X s": the wall time from reading the graph to the verdict, in the
process). Reference rows: a bare `python -c pass` and `python -c "import sympy"`, the floor under any command.

    python benchmarks/check_startup.py                      # tiny, qwen27b, qwen27b --no-rewrite; 7 runs each
    python benchmarks/check_startup.py --repeat 15 graphs/qwen27b.toml
    python benchmarks/check_startup.py --importtime graphs/qwen27b.toml   # also: the 15 slowest imports (-X importtime)
    python benchmarks/check_startup.py --compare /path/to/other/checkout   # before/after: runs alternate between them
    python benchmarks/check_startup.py --repeat 9 --compare /work/main graphs/qwen27b.toml graphs/qwen3_8b.toml

Each command first runs once untimed (from each checkout), which writes its bytecode; PYTHONDONTWRITEBYTECODE is
not passed on. Each graph file named starts a command (the arguments after it, up to the next graph file, are its flags). Each run
is `python -m dflash_graph check GRAPH` in this checkout (or the --compare one: `-m` imports the package
from the working directory), with it first on PYTHONPATH and OMP_NUM_THREADS=1;
the exit code is printed too (check exits 1 on a predicted OOM, which --no-rewrite of qwen27b is). Not a timed
test: the figures are recorded in benchmarks/README.md with the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [["graphs/tiny.toml"], ["graphs/qwen27b.toml"], ["graphs/qwen27b.toml", "--no-rewrite"]]


def env(code: Path = ROOT) -> dict:
    # (bytecode is written and read as on a user's machine: under PYTHONDONTWRITEBYTECODE, which a sandbox may
    # set, every run would compile the package's sources again)
    e = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])
    return e


CHECKED = re.compile(r"^checked in ([0-9.]+) s$", re.M)


def run_once(argv: list[str], code: Path = ROOT) -> tuple[float, float, int, float | None]:
    """CPU seconds (user + system of the child) and wall seconds of one process, its exit code, and the seconds
    check printed ("checked in X s"; None for a command that prints none)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=code, env=env(code), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    m = CHECKED.search(p.stdout)
    return cpu, wall, p.returncode, float(m.group(1)) if m else None


def summary(label: str, runs: list[tuple[float, float, int, float | None]]) -> dict:
    cpus, walls = sorted(r[0] for r in runs), sorted(r[1] for r in runs)
    checked = sorted(r[3] for r in runs if r[3] is not None)
    return {"label": label, "cpu_min": cpus[0], "cpu_median": cpus[len(cpus) // 2], "wall_min": walls[0],
            "checked_min": checked[0] if checked else None, "rc": sorted({r[2] for r in runs})}


def commands(args: list[str]) -> list[list[str]]:
    """The positional arguments as commands: each graph file starts one (an argument that ends in .toml, not a
    `--set KEY=VALUE`'s value: no check flag takes a graph), the flags after it are its own."""
    out: list[list[str]] = []
    for a in args:
        if (a.endswith(".toml") and "=" not in a) or not out:
            out.append([a])
        else:
            out[-1].append(a)
    return out


def measure(label: str, argv: list[str], repeat: int, compare: Path | None = None) -> list[dict]:
    """The command's runs, after one untimed run that writes the bytecode; with `compare`, the same command from
    that checkout too, the two alternating (so that a change of load falls on both)."""
    run_once(argv)
    if compare is None:
        return [summary(label, [run_once(argv) for _ in range(repeat)])]
    run_once(argv, compare)
    mine, other = [], []
    for _ in range(repeat):
        other.append(run_once(argv, compare))
        mine.append(run_once(argv))
    return [summary(f"{label} [{compare.name}]", other), summary(f"{label} [this checkout]", mine)]


def importtime(args: list[str], top: int = 15) -> list[tuple[int, str]]:
    """The modules with the largest cumulative import time in one run (microseconds, as -X importtime reports)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "dflash_graph", "check", *args], cwd=ROOT, env=env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows = []
    for ln in p.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", ln)
        if m and len(m.group(2)) <= 3:                # top-level imports and their direct children
            rows.append((int(m.group(1)), m.group(2) + m.group(3)))
    return sorted(rows, reverse=True)[:top]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graph", nargs="*", help="graph files, each followed by its flags for check (default: tiny, "
                                             "qwen27b, qwen27b --no-rewrite)")
    ap.add_argument("--repeat", type=int, default=7, help="runs per command; the least is reported (default 7)")
    ap.add_argument("--importtime", action="store_true", help="also print the slowest imports of the first command")
    ap.add_argument("--compare", type=Path, metavar="DIR", help="another checkout of dflash-graph (e.g. before a "
                    "change): each check runs from both, alternating")
    a = ap.parse_args(argv)
    cmds = commands(a.graph) if a.graph else DEFAULT
    py = sys.executable
    rows = [*measure("python -c pass", [py, "-c", "pass"], a.repeat),
            *measure('python -c "import sympy"', [py, "-c", "import sympy"], a.repeat)]
    for args in cmds:
        rows += measure("check " + " ".join(args), [py, "-m", "dflash_graph", "check", *args], a.repeat,
                        a.compare and a.compare.resolve())
    load = os.getloadavg()
    print(f"least of {a.repeat} runs per command; {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} at the end; python {sys.version.split()[0]}")
    print(f"| {'command':<56} | CPU s, least | CPU s, median | wall s, least | checked in, least | exit |")
    print(f"|{'-' * 58}|-------------:|--------------:|--------------:|------------------:|-----:|")
    for r in rows:
        checked = "" if r["checked_min"] is None else f"{r['checked_min']:.2f}"
        print(f"| {r['label']:<56} | {r['cpu_min']:12.2f} | {r['cpu_median']:13.2f} | {r['wall_min']:13.2f} | "
              f"{checked:>17} | {','.join(map(str, r['rc'])):>4} |")
    if a.importtime:
        print(f"\nslowest imports of `check {' '.join(cmds[0])}` (cumulative, -X importtime, one run):")
        for us, name in importtime(cmds[0]):
            print(f"  {us / 1e6:6.3f} s  {name}")
    return rows


if __name__ == "__main__":
    main()
