"""Files that survive a kill: fsync a file or a directory, and write JSON to a temporary beside its path, fsync it
and rename it over, so a reader finds the old file or the new one, never half of one. Used by the checkpoints
(train/checkpoint.py) and the hidden-state cache (train/hidden_cache.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(p: Path) -> None:
    """Make a rename inside `p` durable; a filesystem that cannot fsync a directory is let be."""
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write to a temporary beside `path`, fsync, rename over: a kill leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
