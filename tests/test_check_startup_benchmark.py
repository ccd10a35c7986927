"""benchmarks/check_startup.py runs the real `check` command and reports each run's CPU and exit code. Not a timing
test: the figures are recorded in benchmarks/README.md, never asserted here."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_check_startup_benchmark_runs_the_real_command(capsys):
    spec = importlib.util.spec_from_file_location("check_startup", ROOT / "benchmarks" / "check_startup.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--repeat", "1", "graphs/tiny.toml"])
    printed = capsys.readouterr().out
    assert [r["label"] for r in rows] == ["python -c pass", 'python -c "import sympy"', "check graphs/tiny.toml"]
    assert rows[-1]["rc"] == [0] and rows[-1]["cpu_min"] > 0      # it ran the command, and the command passed
    assert rows[-1]["checked_min"] > 0 and rows[0]["checked_min"] is None     # what check printed: "checked in X s"
    assert bench.commands(["a.toml", "--no-rewrite", "--set", "k=v.toml", "b.toml"]) == [
        ["a.toml", "--no-rewrite", "--set", "k=v.toml"], ["b.toml"]]
    assert "| check graphs/tiny.toml" in printed and "load average" in printed
