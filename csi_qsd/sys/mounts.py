"""Read the mount table and mount, bind and unmount paths.

The mount table comes from /proc/self/mountinfo, parsed here, so checks are
exact (octal escapes decoded) and cost no subprocess; mounts are made with
the system calls themselves (`mount_calls`), in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

from csi_qsd.errors import HostCommandError
from csi_qsd.sys import mount_calls


@dataclasses.dataclass(frozen=True)
class MountEntry:
    mount_point: Path
    root: str
    fs_type: str
    source: str
    options: frozenset[str]
    major_minor: str

    @property
    def readonly(self) -> bool:
        return "ro" in self.options


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(text: str) -> str:
    """Decode the kernel's octal escapes (\\040 for a space, ...) in a mountinfo field."""
    if "\\" not in text:
        return text
    return _OCTAL.sub(lambda match: chr(int(match.group(1), 8)), text)


def _escape(path: str) -> str:
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


def parse_mountinfo(text: str) -> list[MountEntry]:
    entries = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        tail = right.split()
        if len(fields) < 6 or len(tail) < 2:
            continue
        entries.append(MountEntry(
            mount_point=Path(_unescape(fields[4])), root=_unescape(fields[3]), fs_type=tail[0],
            source=_unescape(tail[1]), options=frozenset(fields[5].split(",")), major_minor=fields[2],
        ))
    return entries


def read_mountinfo() -> str:
    return Path("/proc/self/mountinfo").read_text()


def mount_table() -> list[MountEntry]:
    return parse_mountinfo(read_mountinfo())


def mounted_at(path: Path) -> MountEntry | None:
    """The topmost mount at `path`, or None (parses only the lines that can match).

    A path the kernel says is no mount root costs no read of the table.
    """
    if mount_calls.is_mount_root(path) is False:
        return None
    needle = f" {_escape(str(path))} "
    lines = [line for line in read_mountinfo().splitlines() if needle in line]
    found = None
    for entry in parse_mountinfo("\n".join(lines)):
        if entry.mount_point == path:
            found = entry
    return found


def filesystem_of(path: Path, table: list[MountEntry] | None = None) -> str:
    """The type of the filesystem holding `path` (the deepest mount above it); "" if none is listed."""
    resolved = path.resolve()
    best: MountEntry | None = None
    for entry in mount_table() if table is None else table:
        if resolved.is_relative_to(entry.mount_point) and (
                best is None or len(entry.mount_point.parts) >= len(best.mount_point.parts)):
            best = entry
    return best.fs_type if best is not None else ""


def is_mounted(path: Path) -> bool:
    """Whether anything is mounted at `path`: one statx where the kernel says, else the mount table."""
    root = mount_calls.is_mount_root(path)
    return mounted_at(path) is not None if root is None else root


async def mount(source: Path, target: Path, *, fs_type: str, options: list[str]) -> None:
    await asyncio.to_thread(mount_calls.mount, source, target, fs_type, options)


async def bind(source: Path, target: Path, *, readonly: bool, options: list[str]) -> None:
    """Bind-mount `source` on `target`, then remount with read-only and the flags if asked."""
    extra = (["ro"] if readonly else []) + options
    try:
        await asyncio.to_thread(mount_calls.bind, source, target, extra)
    except HostCommandError:
        if mounted_at(target) is not None:
            await unmount(target)
        raise


async def unmount(target: Path, *, lazy: bool = False) -> None:
    """Unmount every mount stacked at `target`; a path with nothing mounted is fine."""
    while is_mounted(target):
        await asyncio.to_thread(mount_calls.unmount, target, lazy=lazy)
