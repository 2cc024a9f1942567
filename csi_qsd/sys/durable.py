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
EXCLUSIVE_TRIES = 3  # a name someone keeps planting again is given up on, not fought over forever


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


def unlink_all(directory: Path, paths: list[Path]) -> None:
    """Remove `paths`, all in `directory` (missing ones are fine), durably: one fsync of the directory for all."""
    for path in paths:
        if path.parent != directory:
            raise ValueError(f"{path} is not in {directory}")
        path.unlink(missing_ok=True)
    fsync_path(directory)


def exclusive(path: Path, mode: int = 0o600) -> int:
    """A descriptor of a new, empty regular file at `path`, which this call made: never what was there.

    A leftover at `path` (an earlier run's, or a link someone planted in a
    directory others may write) is unlinked, never opened: `O_EXCL` with
    `O_CREAT` fails rather than follow a link, so the write cannot be
    redirected to the link's target. Raises FileExistsError if the name is
    planted again each time, OSError otherwise.
    """
    for _ in range(EXCLUSIVE_TRIES):
        path.unlink(missing_ok=True)
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except FileExistsError:
            continue
    raise FileExistsError(f"{path} reappeared each time it was removed; refusing to write through it")


def create(path: Path, fill: Callable[[int], object], *, sync: bool = True) -> None:
    """A new file at `path`, written by `fill` through a descriptor: whole under its name or not there at all.

    Written at `path` + TMP_SUFFIX, made by `exclusive` (a link planted
    there is removed, not followed), then renamed; with `sync`, its data
    and its name are on disk before this returns.
    """
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = exclusive(tmp)
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
