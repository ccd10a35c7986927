"""Every example in README.md and docs/ is what the program prints.

A ```console block holds `$ dflash-graph ...` lines, each followed by what it prints. The test runs each
command and checks that the printed text contains the example's text, in order; `...` stands for text left
out, and line breaks and indentation in the example are free (long lines are wrapped in the docs). Every
`dflash-graph` line of a ```bash block must at least parse: no flag in the docs that the program does not have.
"""

import re
import shlex
from pathlib import Path

import pytest

from dflash_graph.cli.main import main, parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(kind):
    for page in PAGES:
        for m in FENCE.finditer(page.read_text()):
            if m.group(1) == kind:
                yield page, m.group(2)


def console_examples():
    out = []
    for page, body in blocks("console"):
        cmd, lines = None, []
        for ln in body.splitlines() + ["$ end"]:
            if ln.startswith("$ "):
                if cmd is not None and cmd.startswith("dflash-graph "):
                    out.append(pytest.param(cmd, "\n".join(lines), id=f"{page.name}: {cmd[:60]}"))
                cmd, lines = ln[2:].split("  #")[0].strip(), []
            else:
                lines.append(ln)
    return out


def chunks(expected: str) -> list[str]:
    parts = re.split(r"\.\.\.(?=\s|$)", expected)
    return [" ".join(p.split()) for p in parts if p.split()]


def norm(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("cmd,expected", console_examples())
def test_console_example(cmd, expected, in_repo, capsys):
    main(shlex.split(cmd, comments=True)[1:])
    got = capsys.readouterr()
    text = norm(got.out + "\n" + got.err)
    pos = 0
    for c in chunks(expected):
        i = text.find(c, pos)
        assert i >= 0, f"`{cmd}` no longer prints:\n  {c}\nafter:\n  {text[pos:pos + 400]}"
        pos = i + len(c)


def bash_commands():
    out = []
    for page, body in blocks("bash"):
        for ln in body.replace("\\\n", " ").splitlines():      # continued lines are one command
            ln = ln.strip()
            for part in ln.split("&&"):
                part = part.strip()
                if part.startswith("dflash-graph "):
                    out.append(pytest.param(part, id=f"{page.name}: {part[:60]}"))
    return out


@pytest.mark.parametrize("cmd", bash_commands())
def test_documented_commands_parse(cmd):
    argv = shlex.split(cmd, comments=True)[1:]
    if argv[:1] == ["launch"]:   # torchrun's flags by torchrun's own parser, then the command it starts on every rank
        from dflash_graph.cli import torchrun

        _, argv = torchrun.split(argv[1:], parser().subcommands)
    args, unknown = parser().parse_known_args(argv)
    assert not unknown, f"`{cmd}` uses flags the program does not have: {unknown}"
    assert args.cmd is not None
