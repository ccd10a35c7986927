"""One broken graph per error kind (tests/graphs/bad/*.toml), each with its expected message (the .expected
file next to it: golden text). Regenerate after an intended wording change with
`python tests/test_bad_graphs.py --update` and review the diff.

A fixture whose first line is `# args: --set KEY=VALUE ...` is checked with those flags: the error then names
the flag, not a line of the file."""

import subprocess
import sys
from pathlib import Path

import pytest

from dflash_graph.cli.main import main

BAD = Path(__file__).parent / "graphs" / "bad"
CASES = sorted(p.stem for p in BAD.glob("*.toml"))


def args_of(path: str) -> list[str]:
    if not Path(path).is_file():
        return []
    first = Path(path).read_text(encoding="utf-8", errors="replace").split("\n", 1)[0]
    return first.removeprefix("# args:").split() if first.startswith("# args:") else []


def run_check(path: str, capsys) -> tuple[int, str, str]:
    code = main(["check", path, *args_of(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_enough_cases():
    assert len(CASES) >= 12


@pytest.mark.parametrize("name", CASES)
def test_bad_graph_message(name, in_repo, capsys):
    path = f"tests/graphs/bad/{name}.toml"
    code, out, err = run_check(path, capsys)
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    assert err.startswith(path), "every message starts with the file (and line)"
    expected = (BAD / f"{name}.expected").read_text()
    assert err == expected


@pytest.mark.parametrize("name", ["cycle", "shape_mismatch", "unknown_key", "no_transfer", "duplicate_id"])
def test_messages_carry_a_line(name, in_repo, capsys):
    _, _, err = run_check(f"tests/graphs/bad/{name}.toml", capsys)
    first = err.splitlines()[0]
    line = first.split(":")[1]
    assert line.isdigit()


def test_missing_file_and_directory(in_repo, capsys):
    code, _, err = run_check("graphs/nope.toml", capsys)
    assert code == 2 and "no such file: graphs/nope.toml" in err
    code, _, err = run_check("graphs", capsys)
    assert code == 2 and "is a directory" in err


def test_cli_process_never_shows_a_traceback(in_repo):
    for name in ("binary_junk", "syntax_error", "cycle"):
        p = subprocess.run([sys.executable, "-m", "dflash_graph", "check", f"tests/graphs/bad/{name}.toml"],
                           capture_output=True, text=True)
        assert p.returncode == 2
        assert "Traceback" not in p.stderr and p.stderr.strip()


if __name__ == "__main__" and "--update" in sys.argv:
    import contextlib
    import io
    import os

    os.chdir(Path(__file__).resolve().parent.parent)
    for name in CASES:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(["check", f"tests/graphs/bad/{name}.toml", *args_of(f"tests/graphs/bad/{name}.toml")])
        (BAD / f"{name}.expected").write_text(err.getvalue())
        print("wrote", name)
