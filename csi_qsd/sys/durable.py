"""Files made, replaced and removed so that a crash right after leaves them as the caller last saw them.

A rename or an unlink lives in the directory: it survives a power loss only
once the directory itself is fsynced, and a file's data only once the file
is. Every step here blocks: callers run it in a worker thread.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by its path."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(tmp: Path, final: Path) -> None:
    """Make `tmp`'s data durable, then put it at `final` (replacing what is there), durably."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def unlink(path: Path) -> None:
    """Remove `path` (a missing one is fine), durably."""
    path.unlink(missing_ok=True)
    fsync_path(path.parent)
