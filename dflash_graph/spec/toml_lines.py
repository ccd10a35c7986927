"""Line numbers for TOML paths.

`tomllib` gives values but no positions, and every error we print must name a line. This scanner walks the
text once, left to right, and records the line on which each table, array-of-tables entry, key and array element
is defined, and how deeply values nest. It does not validate TOML (tomllib does); it agrees with tomllib on valid
files and, on any text at all, finishes in time linear in its length (NOTE [Linear scan]).

An override (`--set KEY=VALUE`) is a place a value was written too: `set_by` maps the TOML paths the command
line set to the flag, so an error about such a value names the flag instead of a line of the file.
"""

from __future__ import annotations

import re

Path = tuple[str | int, ...]

_BARE = r"[A-Za-z0-9_\-]+"
_KEY = rf'(?:{_BARE}|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\')'
_DOTTED_RE = re.compile(rf"{_KEY}(?:[ \t]*\.[ \t]*{_KEY})*")
_KEY_RE = re.compile(_KEY)
_BASIC_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"?')
_LITERAL_RE = re.compile(r"'[^'\n]*'?")
_BARE_VALUE_RE = re.compile(r"[^\s,\]\}#]+")
_SPACE_RE = re.compile(r"[ \t]*")


def _split_key(dotted: str) -> list[str]:
    return [k.strip().strip("\"'") for k in _KEY_RE.findall(dotted)]


def render_path(path: Path) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = part if re.fullmatch(_BARE, part) else f'"{part}"'
            out += part if not out else f".{part}"
    return out


class LineIndex:
    def __init__(self, text: str):
        self.lines: dict[Path, int] = {}
        self.set_by: dict[Path, str] = {}      # paths set by --set, to the flag as written
        self.max_depth = 0                     # the deepest nesting of tables, arrays and dotted keys
        self.deepest_line: int | None = None
        _Scanner(text, self).run()

    def line_of(self, path: Path) -> int | None:
        """Line of `path`, or of its longest defined prefix."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None

    def flag_of(self, path: Path) -> str | None:
        """The --set flag that wrote `path` (or the table it is in), if one did."""
        path = tuple(path)
        while path:
            if path in self.set_by:
                return self.set_by[path]
            path = path[:-1]
        return None


# NOTE [Linear scan]: every step consumes at least one character or closes a bracket it opened, and every regex
# is anchored at the current position and matches without backtracking over what it consumed, so the scan is
# linear in the text (the line-by-line regex scanner this replaced was quadratic in a long inline value: a 40,000
# character line took 50 s). Nesting is kept on an explicit stack, never on Python's, so 10,000 open brackets
# are counted (and refused by the loader), not a RecursionError.

class _Scanner:
    def __init__(self, text: str, index: LineIndex):
        self.t, self.n, self.pos, self.line, self.ix = text, len(text), 0, 1, index
        self.current: Path = ()
        self.counts: dict[Path, int] = {}

    # -- low level --------------------------------------------------------------------------------------------
    def advance_to(self, end: int) -> None:
        self.line += self.t.count("\n", self.pos, end)
        self.pos = end

    def skip_space(self, newlines: bool) -> None:
        t, n = self.t, self.n
        while self.pos < n:
            c = t[self.pos]
            if c in " \t\r":
                self.pos += 1
            elif c == "\n" and newlines:
                self.pos += 1
                self.line += 1
            elif c == "#" and newlines:
                end = t.find("\n", self.pos)
                self.pos = n if end < 0 else end
            else:
                return

    def skip_line(self) -> None:
        end = self.t.find("\n", self.pos)
        self.pos = self.n if end < 0 else end

    def record(self, path: Path, depth: int | None = None) -> None:
        self.ix.lines.setdefault(path, self.line)
        depth = len(path) if depth is None else depth
        if depth > self.ix.max_depth:
            self.ix.max_depth, self.ix.deepest_line = depth, self.line

    def key(self) -> list[str] | None:
        m = _DOTTED_RE.match(self.t, self.pos)
        if not m:
            return None
        self.pos = m.end()
        return _split_key(m.group(0))

    def string(self) -> None:
        t, p = self.t, self.pos
        for q in ('"""', "'''"):
            if t.startswith(q, p):
                i = p + 3
                while True:
                    j = t.find(q, i)
                    if j < 0:
                        self.advance_to(self.n)
                        return
                    if q == '"""':   # an odd run of backslashes escapes the quote
                        k = j
                        while k > p + 3 and t[k - 1] == "\\":
                            k -= 1
                        if (j - k) % 2:
                            i = j + 1
                            continue
                    end = j + 3
                    while end < self.n and end < j + 5 and t[end] == q[0]:   # """"" ends with quotes inside
                        end += 1
                    self.advance_to(end)
                    return
        m = (_BASIC_RE if t[p] == '"' else _LITERAL_RE).match(t, p)
        self.pos = m.end()

    # -- structure --------------------------------------------------------------------------------------------
    def run(self) -> None:
        t = self.t
        while True:
            self.skip_space(newlines=True)
            if self.pos >= self.n:
                return
            start_line = self.line
            if t.startswith("[[", self.pos):
                self.pos += 2
                self.skip_space(newlines=False)
                key = self.key()
                if key:
                    k = tuple(key[:_PATH_CAP])
                    idx = self.counts.get(k, 0)
                    self.counts[k] = idx + 1
                    self.current = (*k, idx)
                    self.ix.lines.setdefault(k, start_line)
                    self.ix.lines[self.current] = start_line
                    self.record(self.current)
            elif t[self.pos] == "[":
                self.pos += 1
                self.skip_space(newlines=False)
                key = self.key()
                if key:
                    self.current = _resolve(tuple(key[:_PATH_CAP]), self.counts)
                    self.record(self.current, len(key))
            else:
                key = self.key()
                if key:
                    self.skip_space(newlines=False)
                    if self.pos < self.n and t[self.pos] == "=":
                        self.pos += 1
                        self.value(_child(self.current, *key))
            self.skip_line()

    def value(self, path: Path) -> None:
        """One value for `path`, with everything nested in it; arrays and inline tables on an explicit stack."""
        t = self.t
        stack: list[list] = []          # [kind "a" | "t", path, next element index]
        want = "value"                  # value | key | after
        cur = path
        while True:
            self.skip_space(newlines=bool(stack))
            if self.pos >= self.n:
                return
            c = t[self.pos]
            if want == "value":
                self.record(cur, len(path) + len(stack))
                if c == "[":
                    self.pos += 1
                    stack.append(["a", cur, 0])
                    self.skip_space(newlines=True)
                    if self.pos < self.n and t[self.pos] == "]":
                        want = "after"   # which closes it
                        continue
                    cur = _child(cur, 0)
                    continue
                if c == "{":
                    self.pos += 1
                    stack.append(["t", cur, 0])
                    want = "key"
                    continue
                if c in "\"'":
                    self.string()
                else:
                    m = _BARE_VALUE_RE.match(t, self.pos)
                    self.pos = m.end() if m else self.pos + 1
                want = "after"
            elif want == "key":
                if c == "}":
                    self.pos += 1
                    stack.pop()
                    want = "after"
                    if not stack:
                        return
                    continue
                key = self.key()
                if key is None:
                    self.pos += 1
                    continue
                self.skip_space(newlines=False)
                if self.pos < self.n and t[self.pos] == "=":
                    self.pos += 1
                cur = _child(stack[-1][1], *key)
                want = "value"
            else:   # after a value
                if not stack:
                    return
                top = stack[-1]
                if c == ",":
                    self.pos += 1
                    if top[0] == "t":
                        want = "key"
                        continue
                    top[2] += 1
                    self.skip_space(newlines=True)
                    if self.pos < self.n and t[self.pos] == "]":
                        continue
                    cur = _child(top[1], top[2])
                    want = "value"
                elif (c == "]" and top[0] == "a") or (c == "}" and top[0] == "t"):
                    self.pos += 1
                    stack.pop()
                    if not stack:
                        return
                else:
                    self.pos += 1   # not TOML; tomllib says why. Consume it so that the scan always ends.


_PATH_CAP = 64   # paths are recorded this deep; deeper nesting is only counted (the loader refuses it)


def _child(path: Path, *parts: str | int) -> Path:
    return path if len(path) >= _PATH_CAP else (*path, *parts)[:_PATH_CAP]


def _resolve(key: Path, counts: dict[Path, int]) -> Path:
    # [nodes.params] after [[nodes]] refers to the last entry of the array
    out: list[str | int] = []
    longest = max(map(len, counts), default=0)
    for i, part in enumerate(key):
        out.append(part)
        if i < longest and key[:i + 1] in counts:
            out.append(counts[key[:i + 1]] - 1)
    return tuple(out)
