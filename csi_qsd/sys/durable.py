"""Files made, replaced and removed so that a crash right after leaves them as the caller last saw them.

A rename or an unlink lives in the directory: it survives a power loss only
once the directory itself is fsynced, and a file's data only once the file
is. Every step here blocks: callers run it in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

TMP_SUFFIX = ".tmp"  # where `create` writes a file before it has its name


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


def create(path: Path, fill: Callable[[int], object], *, sync: bool = True) -> None:
    """A new file at `path`, written by `fill` through a descriptor: whole under its name or not there at all.

    Written at `path` + TMP_SUFFIX, then renamed; with `sync`, its data and
    its name are on disk before this returns.
    """
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        fill(fd)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.rename(tmp, path)
    if sync:
        fsync_path(path.parent)
