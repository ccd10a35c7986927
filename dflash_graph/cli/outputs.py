"""Files the commands write (draw -o, check --plot and --memory-snapshot, plan --emit): refused before any work
when they cannot be written, with the flag that named them, rather than after a long check as a bare OSError."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import GraphError, Location, Problem


def output_file(path: str, flag: str) -> str:
    """`path` if a file can be written there (its directory exists and is writable, and it is not a directory);
    else a GraphError naming `flag`."""
    p = Path(path)
    loc = Location(flag=f"{flag} {path}")
    if p.is_dir():
        raise GraphError(Problem("a directory, not a file", loc, hint="name a file (inside that directory, if you like)"))
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise GraphError(Problem(f"its directory {parent} {what}", loc,
                                 hint=f"create it first (mkdir -p {parent}), or write somewhere else"))
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise GraphError(Problem(f"{p if p.exists() else parent} is not writable by this user", loc,
                                 hint="write somewhere else, or change the permissions"))
    return path
