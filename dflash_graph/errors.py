"""Errors a user can act on: where (file, line, TOML path, node), what (expected vs actual), and how to fix it.

Every error raised for bad input is a `GraphError`. The CLI prints `str(err)` and exits 2; it never shows a
traceback for bad input.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class Location:
    file: str | None = None
    line: int | None = None
    path: str | None = None  # TOML path, e.g. "nodes[3].inputs.x"
    flag: str | None = None  # the command-line flag that wrote the value, e.g. "--set dims.seq=0"

    def render(self) -> str:
        """'FILE:LINE', 'FILE: FLAG' or 'FLAG'; '' when nothing is known (never a placeholder: the CLI gives a
        problem about the graph its file, GraphError.in_file)."""
        if self.flag is not None:   # the value came from the command line: the flag is where to fix it
            return f"{self.file}: {self.flag}" if self.file else self.flag
        where = self.file or ""
        if where and self.line is not None:
            where += f":{self.line}"
        return where


@attrs.frozen
class Problem:
    message: str
    loc: Location = Location()
    node: str | None = None
    expected: str | None = None
    actual: str | None = None
    hint: str | None = None
    context: str | None = None  # e.g. the current dim bindings

    def render(self, level: str = "error") -> str:
        where = self.loc.render()
        head = f"{where}: {level}" if where else level
        if self.loc.path:
            head += f" at {self.loc.path}"
        if self.node:
            head += f" (node '{self.node}')"
        lines = [f"{head}: {self.message}"]
        if self.expected is not None:
            lines.append(f"  expected: {self.expected}")
        if self.actual is not None:
            lines.append(f"  actual:   {self.actual}")
        if self.context:
            lines.append(f"  {self.context}")
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


class GraphError(Exception):
    """One or more problems with a graph or its command line. Exit code 2."""

    def __init__(self, problems: Problem | Sequence[Problem]):
        self.problems: tuple[Problem, ...] = (problems,) if isinstance(problems, Problem) else tuple(problems)
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(p.render() for p in self.problems)

    def in_file(self, file: str | None) -> GraphError:
        """The same problems, those about the graph (a TOML path, no file, no flag) located in `file`: what the
        CLI does for a problem raised where only the graph's keys were known (a [data] or [models] value read
        after loading)."""
        if not file or not any(p.loc.file is None and p.loc.flag is None and p.loc.path for p in self.problems):
            return self
        fixed = [attrs.evolve(p, loc=attrs.evolve(p.loc, file=file))
                 if p.loc.file is None and p.loc.flag is None and p.loc.path else p for p in self.problems]
        return GraphError(fixed).with_traceback(self.__traceback__)


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """' (did you mean X?)' when a close match exists, else ''."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def short(v: object, limit: int = 60) -> str:
    """repr of a value cut to `limit` characters: a value in a message may be megabytes long."""
    try:
        r = repr(v)
    except ValueError:    # an int over Python's 4,300-digit limit for str()
        return "a number too long to print"
    return r if len(r) <= limit else r[:limit - 10] + f"... ({len(r):,} characters)"
