"""Loop devices over export files: attach, find (through sysfs), detach.

Direct or buffered I/O is the caller's choice (see `csi_qsd.qsd.features`): a
direct-I/O loop device over the FUSE export of a QSD older than 10.0.8
corrupts parallel writes, so the mode is always passed explicitly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

from csi_qsd.errors import HostCommandError
from csi_qsd.sys import loop_ioctl
from csi_qsd.sys.run import run


@dataclasses.dataclass(frozen=True)
class LoopDevice:
    device: Path
    backing_file: Path
    readonly: bool


def loop_devices() -> list[LoopDevice]:
    """Every attached loop device with its backing file, read straight from sysfs.

    Only attached loop devices have a `loop/backing_file`, so a glob over
    those is enough: enumerating every block device (udev) costs tens of
    milliseconds on a node with hundreds of devices.
    """
    found = []
    for attribute in Path("/sys/block").glob("loop*/loop/backing_file"):
        device = Path("/dev") / attribute.parent.parent.name
        try:
            backing = _backing_path(attribute.read_text())
            ro = (attribute.parent.parent / "ro").read_text().strip() == "1"
        except OSError:
            continue  # detached meanwhile
        found.append(LoopDevice(device, backing, ro))
    return found


def file_identity(path: Path) -> tuple[int, int, int] | None:
    """(major, minor, inode) of `path`, or None if it cannot be stat'ed (gone, or a dead FUSE mount)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def find_loop(backing_file: Path, *, readonly: bool | None = None) -> list[LoopDevice]:
    """Loop devices over `backing_file`, optionally only read-only or read-write ones.

    Matched by the file's device and inode where it can be stat'ed, so a loop device attached through
    another mount namespace's view of the same file is found too (`loop_ioctl.backing_identity`); by
    sysfs' path otherwise.
    """
    identity = file_identity(backing_file)
    return [lp for lp in loop_devices()
            if (readonly is None or lp.readonly == readonly) and _over(lp.device, lp.backing_file, backing_file, identity)]


def serves(device: Path, backing_file: Path) -> bool:
    """True if loop device `device` is attached to `backing_file` (same device and inode, or same path)."""
    if not device.name.startswith("loop"):
        return False
    raw = _backing(device)
    if not raw:
        return False
    return _over(device, _backing_path(raw), backing_file, file_identity(backing_file))


def _over(device: Path, sysfs_path: Path, backing_file: Path, identity: tuple[int, int, int] | None) -> bool:
    if sysfs_path == backing_file:
        return True
    return identity is not None and loop_ioctl.backing_identity(device) == identity


async def attach(backing_file: Path, *, readonly: bool = False, direct_io: bool = False) -> Path:
    """A loop device over `backing_file` (`loop_ioctl`: the ioctls losetup makes). Raises HostCommandError."""
    return await asyncio.to_thread(loop_ioctl.attach, backing_file, readonly=readonly, direct_io=direct_io)


async def detach(device: Path) -> None:
    """Detach `device`; one still held open is detached by the kernel on last close."""
    if not device.exists():
        return
    try:
        await asyncio.to_thread(loop_ioctl.detach, device)
    except HostCommandError:
        if _backing(device) is not None:
            raise


def held_by_filesystem(device: Path) -> bool:
    """True while a mounted filesystem holds `device`, in this mount namespace or any other.

    Unmounting one mount point does not end a filesystem another namespace
    still has a copy of (a pod's, while its last process exits): its dirty
    data reaches the device only when the last copy goes. The kernel refuses
    an exclusive open until then.
    """
    try:
        fd = os.open(device, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError as err:
        if err.errno == errno.EBUSY:
            return True
        raise HostCommandError(f"open {device} exclusively: {err.strerror}") from err
    os.close(fd)
    return False


async def wait_unheld(device: Path, seconds: float) -> bool:
    """Wait up to `seconds` for no filesystem to hold `device`; False if one still does."""
    return await _wait_while(lambda: held_by_filesystem(device), seconds)


async def wait_released(device: Path, backing_file: Path, seconds: float) -> bool:
    """Wait up to `seconds` for a detached `device` to let go of `backing_file`; False if it still holds it.

    Detaching a device someone still has open only marks it: the kernel lets
    go (writing what that opener's page cache holds first) on its last close.
    """
    return await _wait_while(lambda: serves(device, backing_file), seconds)


async def _wait_while(check: Callable[[], bool], seconds: float) -> bool:
    """Poll `check` (in a thread: it reads sysfs or opens a device) until it is False; False if still True after
    `seconds`."""
    deadline = time.monotonic() + seconds
    while await asyncio.to_thread(check):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def uses_direct_io(device: Path) -> bool:
    """True if the loop device passes I/O to its backing file with O_DIRECT."""
    try:
        return Path(f"/sys/block/{device.name}/loop/dio").read_text().strip() == "1"
    except OSError:
        return False


def backing_of(device: Path) -> Path | None:
    """The file a loop device is attached to, or None (one sysfs read, no scan)."""
    if not device.name.startswith("loop"):
        return None
    raw = _backing(device)
    return _backing_path(raw) if raw else None


def _backing_path(raw: str) -> Path:
    """A sysfs backing_file value as a path: the kernel appends " (deleted)" once the file is unlinked."""
    return Path(raw.strip().removesuffix(" (deleted)"))


def _backing(device: Path) -> str | None:
    try:
        return Path(f"/sys/block/{device.name}/loop/backing_file").read_text().strip()
    except OSError:
        return None


def device_size(device: Path) -> int:
    """Size in bytes of a block device, from sysfs (512-byte sectors)."""
    name = os.path.basename(os.path.realpath(device))
    return int(Path(f"/sys/class/block/{name}/size").read_text()) * 512


async def refresh_capacity(device: Path, size: int) -> None:
    """Make the loop device see its backing file's new `size`.

    `losetup --set-capacity` takes a FUSE file's size from the kernel's
    cache, which asks QSD again only when the file is stat'ed after QSD's
    attribute timeout (1 s). A device pool's window grows by a reopen, not a
    truncate, so nothing invalidates that cache: the backing file is stat'ed
    before each try (measured on QSD 10.0.13: the stat sees the new size at
    once, or after up to 1 s), and the tries are bounded.
    """
    for _ in range(50):
        if (backing := backing_of(device)) is not None:
            with contextlib.suppress(OSError):  # a dead export: losetup says what is wrong
                await asyncio.to_thread(os.stat, backing)
        await run("losetup", "--set-capacity", str(device))
        if device_size(device) >= size:
            return
        await asyncio.sleep(0.1)
    raise HostCommandError(f"loop device {device} still reports {device_size(device)} bytes, expected {size}")
