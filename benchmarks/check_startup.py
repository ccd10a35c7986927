"""What a whole `dflash-graph check GRAPH` process costs: the real command, run as a new process N times, with the
least of the N CPU times (user + system, from resource.getrusage(RUSAGE_CHILDREN) around each run: the CPU a
process used does not grow when other programs load the machine, its wall time does) and the least wall time.
Reference rows: a bare `python -c pass` and `python -c "import sympy"`, the floor under any command.

    python benchmarks/check_startup.py                      # tiny, qwen27b, qwen27b --no-rewrite; 7 runs each
    python benchmarks/check_startup.py --repeat 15 graphs/qwen27b.toml
    python benchmarks/check_startup.py --importtime graphs/qwen27b.toml   # also: the 15 slowest imports (-X importtime)
    python benchmarks/check_startup.py --compare /path/to/other/checkout   # before/after: runs alternate between them

Each run is `python -m dflash_graph check GRAPH` in this checkout (or the --compare one: `-m` imports the package
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
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])
    return e


def run_once(argv: list[str], code: Path = ROOT) -> tuple[float, float, int]:
    """CPU seconds (user + system of the child) and wall seconds of one process, and its exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    rc = subprocess.run(argv, cwd=code, env=env(code), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, rc


def summary(label: str, runs: list[tuple[float, float, int]]) -> dict:
    cpus, walls = sorted(r[0] for r in runs), sorted(r[1] for r in runs)
    return {"label": label, "cpu_min": cpus[0], "cpu_median": cpus[len(cpus) // 2], "wall_min": walls[0],
            "rc": sorted({r[2] for r in runs})}


def measure(label: str, argv: list[str], repeat: int, compare: Path | None = None) -> list[dict]:
    """The command's runs; with `compare`, the same command from that checkout too, the two alternating (so
    that a change of load falls on both)."""
    if compare is None:
        return [summary(label, [run_once(argv) for _ in range(repeat)])]
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
    ap.add_argument("graph", nargs="*", help="graph file, then check's flags (default: tiny, qwen27b, qwen27b "
                                             "--no-rewrite)")
    ap.add_argument("--repeat", type=int, default=7, help="runs per command; the least is reported (default 7)")
    ap.add_argument("--importtime", action="store_true", help="also print the slowest imports of the first command")
    ap.add_argument("--compare", type=Path, metavar="DIR", help="another checkout of dflash-graph (e.g. before a "
                    "change): each check runs from both, alternating")
    a = ap.parse_args(argv)
    commands = [a.graph] if a.graph else DEFAULT
    py = sys.executable
    rows = [*measure("python -c pass", [py, "-c", "pass"], a.repeat),
            *measure('python -c "import sympy"', [py, "-c", "import sympy"], a.repeat)]
    for args in commands:
        rows += measure("check " + " ".join(args), [py, "-m", "dflash_graph", "check", *args], a.repeat,
                        a.compare and a.compare.resolve())
    load = os.getloadavg()
    print(f"least of {a.repeat} runs per command; {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} at the end; python {sys.version.split()[0]}")
    print(f"| {'command':<56} | CPU s, least | CPU s, median | wall s, least | exit |")
    print(f"|{'-' * 58}|-------------:|--------------:|--------------:|-----:|")
    for r in rows:
        print(f"| {r['label']:<56} | {r['cpu_min']:12.2f} | {r['cpu_median']:13.2f} | {r['wall_min']:13.2f} | "
              f"{','.join(map(str, r['rc'])):>4} |")
    if a.importtime:
        print(f"\nslowest imports of `check {' '.join(commands[0])}` (cumulative, -X importtime, one run):")
        for us, name in importtime(commands[0]):
            print(f"  {us / 1e6:6.3f} s  {name}")
    return rows


if __name__ == "__main__":
    main()
