"""docs/ stays true: the generated reference pages match the declarations, and every graph shipped checks."""

import re
from pathlib import Path

from dflash_graph.cli.reference import ops_reference, toml_reference

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_toml_reference_is_current():
    assert (DOCS / "toml-reference.md").read_text() == toml_reference(), "run: python tools/gen_docs.py"


def test_ops_reference_is_current():
    assert (DOCS / "ops.md").read_text() == ops_reference(), "run: python tools/gen_docs.py"


def test_every_schema_key_is_documented():
    from dflash_graph.spec import schema

    text = (DOCS / "toml-reference.md").read_text()
    for sec in schema.SECTIONS:
        for k in sec.keys:
            assert f"`{k.name}`" in text


# NOTE [Measured times]: a time depends on the machine and on what else runs on it (the tiny run takes 47 s on an
# idle 2-core machine and over 5 minutes when six programs share it), so a doc never states one as a fact about
# the program: every time figure says where and when it was measured ("measured on <machine>, <YYYY-MM-DD>", in
# its paragraph or its section's heading), or is in README.md's "Measured times" table. The times of settings
# (a timeout) are not measurements: SETTINGS lists them.
ROOT = DOCS.parent
TIME_PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
TIME = re.compile(r"(?<![\w.,])\d+(?:[.,]\d+)*(?:\s*(?:to|–|-)\s*\d+(?:[.,]\d+)*)?\s*"
                  r"(?:ms|s|sec|seconds?|min|minutes?|h|hours?)(?![\w(])"
                  r"|\b(?:about|under|in|within|over) (?:half )?a (?:second|minute)\b")
MARK = re.compile(r"measured on (?:(?!\.\s)[^;]){0,240}?\b\d{4}-\d{2}-\d{2}\b", re.S | re.I)
SETTINGS = {
    "docs/rules/proofs.md": ["solver timeout, 30 s per query"],
    "docs/distributed.md": ["no heartbeat for 5 s", "within 5 s", "(default 30 s)", "30 s to handle its SIGTERM",
                            "wait up to 6 s"],
}


def _sections(page: Path):
    """(heading, paragraph) for each paragraph of prose (code blocks left out)."""
    heading = ""
    for para in re.split(r"\n\s*\n", FENCE.sub("", page.read_text())):
        lines = para.strip().splitlines()
        if lines and lines[0].startswith("#"):
            heading = lines[0]
        yield heading, para


def unmarked_time_figures(page: Path) -> list[str]:
    rel = page.relative_to(ROOT).as_posix()
    out = []
    for heading, para in _sections(page):
        if rel == "README.md" and heading == "## Measured times":
            continue
        text = para
        for s in SETTINGS.get(rel, []):
            text = text.replace(s, "")
        if TIME.search(text) and not (MARK.search(para) or MARK.search(heading)):
            out.append(f"{rel}: {TIME.findall(text)} in: {' '.join(para.split())[:160]}")
    return out


def test_time_figures_say_where_and_when_they_were_measured():
    bad = [b for page in TIME_PAGES for b in unmarked_time_figures(page)]
    assert not bad, ("time figures without 'measured on <machine>, <YYYY-MM-DD>' (NOTE [Measured times]):\n  "
                     + "\n  ".join(bad))


def test_the_time_check_finds_an_unmarked_figure(tmp_path):
    page = tmp_path / "x.md"
    page.write_text("# x\n\ncheck answers in about a second.\n\nA run takes 47 s.\n\n"
                    "A run took 135 s (measured on a 2-core machine at load 1.6, 2026-12-03).\n\n"
                    "```console\n$ checked in 0.9 s\n```\n\nCall min(a, b) at 10, min(c).\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        found = unmarked_time_figures(page)
    finally:
        ROOT = root
    assert len(found) == 2 and "about a second" in found[0] and "47 s" in found[1], found


# What the commands README.md shows need beyond `pip install -e .`: an extra of pyproject.toml, or a program
NEEDS = {"--plot": "plot", "run": "run", "eval": "run", "export": "run", "prove": "prove", "--tensorboard": "tensorboard"}


def _extras(spec: str, table: dict) -> set[str]:
    """The extras `.[a,b]` installs, the ones they name (`dflash-graph[run,plot]`) included."""
    out, todo = set(), spec.split(",")
    while todo:
        e = todo.pop()
        if e in out:
            continue
        out.add(e)
        for req in table.get(e, []):
            m = re.match(r"dflash-graph\[([\w,]+)\]", req)
            todo += m.group(1).split(",") if m else []
    return out


def test_readme_first_command_installs_what_the_readme_shows():
    """Issue 21: `check --plot` failed after the README's install (matplotlib was in `.[plot]` only). Every
    `dflash-graph` command README.md shows, in a block or in the text, works after its first command, or its
    paragraph says what to add."""
    import tomllib

    readme = (ROOT / "README.md").read_text()
    first = re.search(r"^```bash\n(.*?)\n", readme, re.M | re.S).group(1)
    extras = _extras(re.search(r'pip install -e "\.\[([\w,]+)\]"', first).group(1),
                     tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    missing = []
    for para in re.split(r"\n\s*\n", readme):
        for cmd in re.findall(r"dflash-graph (\w+)([^`\n]*)", para):
            words = [cmd[0], *cmd[1].split()]
            for w in words:
                need = NEEDS.get(w)
                if need and need not in extras and f"[{need}]" not in para and f"install {need}" not in para:
                    missing.append(f"`dflash-graph {' '.join(words)}` needs {need}")
            if cmd[0] == "draw" and re.search(r"\.(svg|png)\b", cmd[1]) and "graphviz" not in para.lower():
                missing.append(f"`dflash-graph draw{cmd[1]}` needs Graphviz's dot, and its paragraph does not say so")
    assert not missing, f"README's first command installs {sorted(extras)}, and:\n  " + "\n  ".join(missing)


def test_the_guides_bounds_are_the_ones_the_code_enforces():
    """The guide's table of check's bounds quotes the constants the code enforces: each figure is compared."""
    from dflash_graph.analysis import infer, memory
    from dflash_graph.ir import dims
    from dflash_graph.rewrite import engine
    from dflash_graph.spec import loader

    guide = (DOCS / "guide.md").read_text()
    rows = {r.split("|")[1].strip(): r for r in guide.splitlines() if r.startswith("| ") and r.count("|") == 4}
    expect = {
        "nodes in a graph": [f"{infer.MAX_NODES:,}"],
        "nodes in a graph to rewrite": [f"{engine.MAX_REWRITE_NODES:,}"],
        "full replays while rewriting": [f"{engine.REPLAY_BUDGET:,} node replays"],
        "layers of a model": [f"{infer.MAX_LAYERS:,}"],
        "hooked layers written out": [f"{infer.MAX_LAYER_REPLAYS:,}"],
        "a dim or size": [f"2**{dims.MAX_DIM.bit_length() - 1}", f"{dims.MAX_EXPR_CHARS} characters"],
        "a graph file": [f"{loader.MAX_FILE_BYTES // 2**20} MiB", f"nested {loader.MAX_DEPTH} deep"],
        "`--plot`, `--memory-snapshot`": [f"{memory.MAX_DRAWN_EVENTS:,} events"],
    }
    assert dims.MAX_DIM == 2 ** (dims.MAX_DIM.bit_length() - 1) and loader.MAX_FILE_BYTES % 2**20 == 0
    for what, figures in expect.items():
        assert what in rows, f"docs/guide.md's bounds table has no row '{what}'"
        for f in figures:
            assert f in rows[what], f"docs/guide.md: the bound for '{what}' should say {f}: {rows[what]}"
