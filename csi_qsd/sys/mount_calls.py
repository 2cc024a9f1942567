"""mount(2) and umount2(2) called directly: a mount costs microseconds, not a `mount` process.

Each `mount` or `umount` process costs 2-4 ms (more on a loaded node), and a
stage, publish, unpublish and unstage run up to five of them. The kernel
call takes the flags `mount(8)` would derive from the option names, and
the filesystem-specific rest as one data string; that split is done here,
with the table of per-mount flags from mount(2). Options that only mean
something to mount(8)'s own bookkeeping (`nofail`, `x-…`, `comment=…`) are
dropped, as mount(8) drops them. Every call blocks, so callers run it in a
worker thread. Errors carry the errno and the options, never a guess.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from pathlib import Path

from csi_qsd.errors import HostCommandError

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_SYNCHRONOUS = 16
MS_REMOUNT = 32
MS_MANDLOCK = 64
MS_DIRSYNC = 128
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_SILENT = 32768
MS_RELATIME = 1 << 21
MS_I_VERSION = 1 << 23
MS_STRICTATIME = 1 << 24
MS_LAZYTIME = 1 << 25
MNT_DETACH = 2

# option -> (flag, set?) as mount(8) reads it: "ro" sets MS_RDONLY, "rw" clears it.
FLAG_OPTIONS: dict[str, tuple[int, bool]] = {
    "ro": (MS_RDONLY, True), "rw": (MS_RDONLY, False),
    "nosuid": (MS_NOSUID, True), "suid": (MS_NOSUID, False),
    "nodev": (MS_NODEV, True), "dev": (MS_NODEV, False),
    "noexec": (MS_NOEXEC, True), "exec": (MS_NOEXEC, False),
    "sync": (MS_SYNCHRONOUS, True), "async": (MS_SYNCHRONOUS, False),
    "mand": (MS_MANDLOCK, True), "nomand": (MS_MANDLOCK, False),
    "dirsync": (MS_DIRSYNC, True),
    "noatime": (MS_NOATIME, True), "atime": (MS_NOATIME, False),
    "nodiratime": (MS_NODIRATIME, True), "diratime": (MS_NODIRATIME, False),
    "relatime": (MS_RELATIME, True), "norelatime": (MS_RELATIME, False),
    "strictatime": (MS_STRICTATIME, True), "nostrictatime": (MS_STRICTATIME, False),
    "lazytime": (MS_LAZYTIME, True), "nolazytime": (MS_LAZYTIME, False),
    "silent": (MS_SILENT, True), "loud": (MS_SILENT, False),
    "iversion": (MS_I_VERSION, True), "noiversion": (MS_I_VERSION, False),
}
# mount(8)'s own bookkeeping, never passed to the kernel.
USERSPACE_ONLY = frozenset({"auto", "noauto", "nofail", "_netdev", "user", "nouser", "users", "owner", "group"})

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.statx.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_NO_AUTOMOUNT = 0x800
STATX_ATTR_MOUNT_ROOT = 0x2000
_STATX_SIZE = 256  # struct statx
_STATX_ATTRIBUTES = slice(8, 16)  # __u64 stx_attributes
_STATX_ATTRIBUTES_MASK = slice(56, 64)  # __u64 stx_attributes_mask


def is_mount_root(path: Path) -> bool | None:
    """Whether `path` is the root of a mount (statx's STATX_ATTR_MOUNT_ROOT); None if the kernel does not say.

    Exact and cheap (one system call), where reading the mount table costs
    a parse of every mount on the node. A missing path is no mount root.
    """
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    if _libc.statx(AT_FDCWD, os.fsencode(path), AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT, 0, buffer) != 0:
        error = ctypes.get_errno()
        if error in (errno.ENOENT, errno.ENOTDIR):
            return False
        return None
    raw = buffer.raw
    if not int.from_bytes(raw[_STATX_ATTRIBUTES_MASK], sys.byteorder) & STATX_ATTR_MOUNT_ROOT:
        return None
    return bool(int.from_bytes(raw[_STATX_ATTRIBUTES], sys.byteorder) & STATX_ATTR_MOUNT_ROOT)


def split_options(options: list[str]) -> tuple[int, str]:
    """(MS_* flags, filesystem data) of mount(8)-style option names, applied left to right."""
    flags = 0
    data: list[str] = []
    for option in options:
        if option in FLAG_OPTIONS:
            flag, on = FLAG_OPTIONS[option]
            flags = flags | flag if on else flags & ~flag
        elif option in USERSPACE_ONLY or option.startswith(("x-", "comment=")):
            continue
        else:
            data.append(option)
    return flags, ",".join(data)


def _call(what: str, result: int) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise HostCommandError(f"{what} failed: {os.strerror(errno)} (errno {errno})")


def mount(source: Path, target: Path, fs_type: str, options: list[str]) -> None:
    flags, data = split_options(options)
    _call(f"mount -t {fs_type} -o {','.join(options) or 'defaults'} {source} {target}",
          _libc.mount(os.fsencode(source), os.fsencode(target), fs_type.encode(), flags, data.encode() or None))


def bind(source: Path, target: Path, options: list[str]) -> None:
    """Bind `source` on `target`; with options, remount the bind with their per-mount flags."""
    _call(f"mount --bind {source} {target}", _libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None))
    if options:
        flags, _data = split_options(options)  # a bind remount takes per-mount flags only
        _call(f"mount -o remount,bind,{','.join(options)} {target}",
              _libc.mount(None, os.fsencode(target), None, MS_REMOUNT | MS_BIND | flags, None))


def unmount(target: Path, *, lazy: bool) -> None:
    _call(f"umount{' --lazy' if lazy else ''} {target}", _libc.umount2(os.fsencode(target), MNT_DETACH if lazy else 0))
