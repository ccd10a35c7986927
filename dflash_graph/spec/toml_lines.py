"""Line numbers for TOML paths.

`tomllib` gives values but no positions, and every error we print must name a line. This scanner walks the
text once and records the line on which each table, array-of-tables entry and key is defined. It does not
validate TOML (tomllib already did); it only needs to agree with tomllib on valid files.
"""

from __future__ import annotations

import re

Path = tuple[str | int, ...]

_BARE = r"[A-Za-z0-9_\-]+"
_KEY = rf'(?:{_BARE}|"[^"]*"|\'[^\']*\')'
_DOTTED = rf"{_KEY}(?:\s*\.\s*{_KEY})*"
_TABLE_RE = re.compile(rf"^\s*\[\s*({_DOTTED})\s*\]")
_ARRAY_RE = re.compile(rf"^\s*\[\[\s*({_DOTTED})\s*\]\]")
_ASSIGN_RE = re.compile(rf"\s*({_DOTTED})\s*=")


def _split_key(dotted: str) -> list[str]:
    return [k.strip().strip("\"'") for k in re.findall(_KEY, dotted)]


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
        self._scan(text)

    def line_of(self, path: Path) -> int | None:
        """Line of `path`, or of its longest defined prefix."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None

    def _scan(self, text: str) -> None:
        current: Path = ()
        counts: dict[Path, int] = {}
        depth = 0  # open [ or { of a multi-line value
        in_multiline: str | None = None
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw
            if in_multiline:
                if in_multiline in line:
                    in_multiline = None
                continue
            if depth > 0:
                depth += _bracket_balance(line)
                continue
            if m := _ARRAY_RE.match(line):
                key = tuple(_split_key(m.group(1)))
                idx = counts.get(key, 0)
                counts[key] = idx + 1
                current = (*key, idx)
                self.lines.setdefault(key, lineno)
                self.lines[current] = lineno
                continue
            if m := _TABLE_RE.match(line):
                key = tuple(_split_key(m.group(1)))
                current = _resolve(key, counts)
                self.lines.setdefault(current, lineno)
                continue
            if m := _ASSIGN_RE.match(line):
                key = (*current, *_split_key(m.group(1)))
                self.lines.setdefault(key, lineno)
                rest = line[m.end():]
                for q in ('"""', "'''"):
                    if rest.count(q) == 1:
                        in_multiline = q
                if rest.lstrip().startswith("{"):
                    for sub in _ASSIGN_RE.finditer(rest.lstrip()[1:].replace(",", "\n,")):
                        self.lines.setdefault((*key, *_split_key(sub.group(1))), lineno)
                depth = max(0, _bracket_balance(rest))


def _resolve(key: Path, counts: dict[Path, int]) -> Path:
    # [nodes.params] after [[nodes]] refers to the last entry of the array
    out: list[str | int] = []
    for part in key:
        out.append(part)
        prefix = tuple(p for p in out if not isinstance(p, int))
        if prefix in counts and len(prefix) == len([p for p in out if not isinstance(p, int)]):
            out.append(counts[prefix] - 1)
    return tuple(out)


def _bracket_balance(s: str) -> int:
    bal, quote = 0, None
    for ch in s:
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            break
        elif ch in "[{":
            bal += 1
        elif ch in "]}":
            bal -= 1
    return bal
