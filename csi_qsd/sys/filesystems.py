"""Probe for and create filesystems on block devices."""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import re
import struct
from pathlib import Path

from csi_qsd.errors import FailedPrecondition, HostCommandError, InvalidArgument, Unavailable
from csi_qsd.sys.loop import device_size
from csi_qsd.sys.run import run

SUPPORTED = ("ext4", "xfs")
DEFAULT = "ext4"
# mkfs.xfs (xfsprogs >= 5.19) refuses filesystems smaller than this ("larger than 300MB": MiB); ext4 fits any
# volume we make.
MINIMUM_BYTES = {"xfs": 300 * 1024 * 1024}


def check_fs_type(fs_type: str) -> str:
    """The filesystem to use for a request's fs_type ('' means the default)."""
    chosen = fs_type or DEFAULT
    if chosen not in SUPPORTED:
        raise InvalidArgument(f"fs_type {fs_type!r} is not supported; use one of {', '.join(SUPPORTED)}")
    return chosen


# Read from the start of a device before calling it empty: blkid also answers "nothing found" for a
# device it cannot read (a loop device over a dead FUSE export reads as end-of-file), and "empty" leads to mkfs.
READABLE_PROBE_BYTES = 64 << 10


async def probe(device: Path) -> str:
    """The filesystem type on `device`, or '' when blkid finds none on a device that reads.

    Raises Unavailable when the device cannot be read: never taken for empty.
    """
    code, out = await run("blkid", "--probe", "--output", "value", "--match-tag", "TYPE", str(device), check=False)
    if code == 2:  # nothing found, or nothing could be read
        await asyncio.to_thread(_check_readable, device)
        return ""
    return out.strip()


def _check_readable(device: Path) -> None:
    """Read the start of `device` past the page cache (O_DIRECT), which may still hold what it once read."""
    want = min(READABLE_PROBE_BYTES, device_size(device))
    buffer = mmap.mmap(-1, max(want, mmap.PAGESIZE))  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(device, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            got = os.preadv(fd, [memoryview(buffer)[:want]], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise Unavailable(f"{device} cannot be read ({exc.strerror}); its volume is being recovered, retry") from exc
    finally:
        buffer.close()
    if got < want:
        raise Unavailable(f"{device} read {got} of {want} bytes at its start; its volume is being recovered, retry")


def check_fits(fs_type: str, size: int) -> None:
    """Raise FailedPrecondition if a new `fs_type` filesystem cannot be made on `size` bytes."""
    minimum = MINIMUM_BYTES.get(fs_type, 0)
    if size < minimum:
        raise FailedPrecondition(
            f"a {fs_type} filesystem needs at least {minimum} bytes and the volume has {size}: "
            "use ext4 or a larger volume"
        )


# The first e2fsprogs whose mke2fs takes `-E assume_storage_prezeroed`.
PREZEROED_SINCE = (1, 47, 0)
_mke2fs_version: tuple[int, ...] | None = None


async def mke2fs_version() -> tuple[int, ...]:
    """The installed mke2fs's version, asked once (`mke2fs -V` prints "mke2fs 1.47.0 (5-Feb-2023)"); () if unread."""
    global _mke2fs_version
    if _mke2fs_version is None:
        try:
            _, out = await run("mke2fs", "-V", timeout=30, check=False, merge_stderr=True)  # its version: stderr
        except (OSError, HostCommandError):
            return ()  # asked again next time
        match = re.match(r"mke2fs (\d+)\.(\d+)(?:\.(\d+))?", out.strip())
        _mke2fs_version = tuple(int(part or 0) for part in match.groups()) if match else ()
    return _mke2fs_version


async def make(device: Path, fs_type: str, *, zeroed: bool = False) -> None:
    """Make a `fs_type` filesystem on `device`; `zeroed`: the device is known to read as zeros throughout.

    ext4 initialises its inode tables and journal at once (lazy init off), so
    nothing writes behind our back later. On a device known to read as zeros
    (a thin image nothing has written) mke2fs need not write those zeros
    (`assume_storage_prezeroed`): it marks the tables initialised and skips
    the journal's, which saves writing megabytes through the export and
    keeps the image as thin as the filesystem's metadata.
    """
    if fs_type == "ext4":
        options = "lazy_itable_init=0,lazy_journal_init=0,nodiscard"
        if zeroed and await mke2fs_version() >= PREZEROED_SINCE:
            options += ",assume_storage_prezeroed=1"
        await run("mkfs.ext4", "-q", "-F", "-E", options, str(device))
    elif fs_type == "xfs":
        await run("mkfs.xfs", "-q", "-f", "-K", str(device))
    else:
        raise InvalidArgument(f"fs_type {fs_type!r} is not supported")


async def freeze(mount_point: Path) -> None:
    """Flush and block writes to a mounted filesystem; raise FailedPrecondition if it cannot be frozen."""
    code, _ = await run("fsfreeze", "--freeze", str(mount_point), check=False, timeout=60)
    if code != 0:
        raise FailedPrecondition(f"cannot freeze the filesystem at {mount_point} for a consistent snapshot")


async def thaw(mount_point: Path) -> None:
    await run("fsfreeze", "--unfreeze", str(mount_point), check=False, timeout=60)


# ext4's superblock (the kernel's struct ext4_super_block): 1024 bytes at byte 1024.
EXT4_SUPERBLOCK = 1024
EXT4_MAGIC = 0xEF53
EXT4_INCOMPAT_64BIT = 0x80


async def ext4_size(device: Path) -> int:
    """Bytes an ext4 filesystem spans, read from its superblock (no dumpe2fs process).

    Raises HostCommandError if the device holds no ext4 superblock.
    """
    return await asyncio.to_thread(_ext4_size, device)


def _ext4_size(device: Path) -> int:
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
        try:
            sb = os.pread(fd, EXT4_SUPERBLOCK, EXT4_SUPERBLOCK)
        finally:
            os.close(fd)
    except OSError as exc:
        raise HostCommandError(f"cannot read the superblock of {device}: {exc.strerror}") from exc
    if len(sb) < EXT4_SUPERBLOCK or struct.unpack_from("<H", sb, 0x38)[0] != EXT4_MAGIC:
        raise HostCommandError(f"{device} holds no ext4 superblock")
    (blocks_lo,) = struct.unpack_from("<I", sb, 0x04)
    (log_block_size,) = struct.unpack_from("<I", sb, 0x18)
    (incompat,) = struct.unpack_from("<I", sb, 0x60)
    (blocks_hi,) = struct.unpack_from("<I", sb, 0x150)
    blocks = blocks_lo | (blocks_hi << 32 if incompat & EXT4_INCOMPAT_64BIT else 0)
    return int(blocks) * (1024 << int(log_block_size))


# resize2fs leaves out a last block group too small to hold its own metadata: a grown ext4 may end a few
# MiB short of its device, and counts as filling it.
EXT4_GROWTH_SLACK = 4 * 1024 * 1024


async def ext4_fills(device: Path, size: int) -> bool:
    """True if the ext4 filesystem on `device` already spans `size` bytes (growing it would add nothing)."""
    return await ext4_size(device) >= size - EXT4_GROWTH_SLACK


async def grow_ext4_offline(device: Path) -> bool:
    """Grow an unmounted ext4 filesystem to fill `device`; True if it grew."""
    if await ext4_size(device) >= device_size(device):
        return False
    await run("e2fsck", "-f", "-p", str(device), timeout=3600)
    await run("resize2fs", str(device), timeout=3600)
    return True


async def grow(mount_point: Path, fs_type: str, device: Path) -> None:
    if fs_type == "ext4":
        await run("resize2fs", str(device))
    elif fs_type == "xfs":
        await run("xfs_growfs", str(mount_point))


XFS_MAGIC = b"XFSB"  # the first bytes of an XFS filesystem: its primary superblock's magic number


def holds_xfs(path: Path) -> bool:
    """True if the file or device `path` starts with an XFS superblock. Raises OSError if it cannot be read."""
    with open(path, "rb") as file:
        return file.read(len(XFS_MAGIC)) == XFS_MAGIC


# XFS_IOC_FSGEOMETRY_V1, _IOR('X', 100, struct xfs_fsop_geom_v1): the mounted filesystem's geometry (112 bytes),
# its block size a u32 at 0 and its data blocks a u64 at 32 (the kernel's xfs_fs.h).
XFS_IOC_FSGEOMETRY_V1 = 0x80705864
_XFS_GEOMETRY = struct.Struct("=I28xQ72x")


async def xfs_size(mount_point: Path) -> int:
    """Bytes the XFS filesystem mounted at `mount_point` spans (its data section), asked of the kernel.

    Exact where the superblock on the device may lag the mounted filesystem
    (a grow sits in its log until written back). Raises HostCommandError if
    no XFS is mounted there.
    """
    return await asyncio.to_thread(_xfs_size, mount_point)


def _xfs_size(mount_point: Path) -> int:
    try:
        fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            raw = fcntl.ioctl(fd, XFS_IOC_FSGEOMETRY_V1, bytes(_XFS_GEOMETRY.size))
        finally:
            os.close(fd)
    except OSError as exc:
        raise HostCommandError(f"cannot read the XFS geometry at {mount_point}: {exc.strerror}") from exc
    block_size, data_blocks = _XFS_GEOMETRY.unpack(raw)
    return int(block_size) * int(data_blocks)
