"""Minimal writer for the "newc" cpio format the Linux initramfs loader reads.

Written in Python rather than shelling out to ``cpio`` so the harness needs no
host tool beyond what Debian's base system and QEMU bring, and so entries can
carry ownership, modes and device nodes (``/dev/console``) without the host
process being root or the files existing on the host at all.

Format reference: the kernel's Documentation/driver-api/early-userspace/
buffer-format.rst. Every header and every file body is padded to 4 bytes; the
archive ends with a ``TRAILER!!!`` entry.
"""

from __future__ import annotations

import stat
from typing import Protocol

_MAGIC = b"070701"
_TRAILER = "TRAILER!!!"


class Writable(Protocol):
    """Anything with ``write(bytes)``: a file, a ``GzipFile``, a ``BytesIO``."""

    def write(self, data: bytes, /) -> object: ...


def _pad4(length: int) -> bytes:
    return b"\0" * (-length % 4)


class CpioWriter:
    """Streams newc entries into a binary file object.

    Entries are written in call order; the kernel extracts them in that order,
    so parents must be added before children. Timestamps are fixed to 0 so the
    same inputs always give byte-identical archives (useful for cache keys).
    """

    def __init__(self, out: Writable) -> None:
        self._out = out
        self._next_ino = 1
        self._closed = False

    def _entry(
        self,
        name: str,
        mode: int,
        data: bytes = b"",
        *,
        rdev: tuple[int, int] = (0, 0),
        nlink: int = 1,
    ) -> None:
        if self._closed:
            raise ValueError("cpio archive already finished")
        name = name.lstrip("/") or "."
        encoded = name.encode() + b"\0"
        fields = (
            self._next_ino if name != _TRAILER else 0,
            mode,
            0,  # uid
            0,  # gid
            nlink,
            0,  # mtime
            len(data),
            0,  # devmajor
            0,  # devminor
            rdev[0],
            rdev[1],
            len(encoded),
            0,  # check
        )
        self._next_ino += 1
        header = _MAGIC + b"".join(b"%08X" % f for f in fields)
        self._out.write(header + encoded + _pad4(len(header) + len(encoded)))
        self._out.write(data + _pad4(len(data)))

    def add_dir(self, name: str, perm: int = 0o755) -> None:
        self._entry(name, stat.S_IFDIR | perm, nlink=2)

    def add_file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | perm, data)

    def add_symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def add_chardev(self, name: str, major: int, minor: int, perm: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | perm, rdev=(major, minor))

    def finish(self) -> None:
        """Writes the trailer; the writer rejects further entries afterwards."""
        self._entry(_TRAILER, 0, nlink=1)
        self._closed = True
