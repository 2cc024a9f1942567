"""Loop devices over export files: attach, find (via udev's view of sysfs), detach.

Direct or buffered I/O is the caller's choice (see `csi_qsd.datapath`): a
direct-I/O loop device over the FUSE export of a QSD older than 10.0.8
corrupts parallel writes, so the mode is always passed explicitly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pyudev

from csi_qsd.errors import HostCommandError
from csi_qsd.sys.run import run


@dataclasses.dataclass(frozen=True)
class LoopDevice:
    device: Path
    backing_file: Path
    readonly: bool


def loop_devices() -> list[LoopDevice]:
    """Every attached loop device with its backing file, read through pyudev."""
    found = []
    for dev in pyudev.Context().list_devices(subsystem="block"):
        if not dev.sys_name.startswith("loop") or dev.device_node is None:
            continue
        backing = dev.attributes.get("loop/backing_file")
        if not backing:
            continue
        # The kernel appends " (deleted)" when the file was unlinked.
        path = backing.decode(errors="replace").strip().removesuffix(" (deleted)")
        readonly = dev.attributes.get("ro") == b"1"
        found.append(LoopDevice(Path(dev.device_node), Path(path), readonly))
    return found


def find_loop(backing_file: Path, *, readonly: bool | None = None) -> list[LoopDevice]:
    """Loop devices over `backing_file`, read straight from sysfs.

    Enumerating every block device through udev costs tens of milliseconds on
    a node with hundreds of devices; only attached loop devices have a
    `loop/backing_file`, so a glob over those is enough here.
    """
    found = []
    for attribute in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            path = attribute.read_text().strip().removesuffix(" (deleted)")
            ro = (attribute.parent.parent / "ro").read_text().strip() == "1"
        except OSError:
            continue  # detached meanwhile
        if Path(path) != backing_file or (readonly is not None and ro != readonly):
            continue
        found.append(LoopDevice(Path("/dev") / attribute.parent.parent.name, Path(path), ro))
    return found


async def attach(backing_file: Path, *, readonly: bool = False, direct_io: bool = False) -> Path:
    argv = ["losetup", "--find", "--show", f"--direct-io={'on' if direct_io else 'off'}"]
    if readonly:
        argv.append("--read-only")
    _, out = await run(*argv, str(backing_file))
    device = Path(out.strip())
    if not device.name.startswith("loop"):
        raise HostCommandError(f"losetup gave an unexpected device {out.strip()!r}")
    return device


async def detach(device: Path) -> None:
    """Detach `device`; one still held open is detached by the kernel on last close."""
    if not device.exists():
        return
    code, _ = await run("losetup", "--detach", str(device), check=False)
    if code != 0 and _backing(device) is not None:
        raise HostCommandError(f"cannot detach loop device {device}")


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
    return Path(raw.removesuffix(" (deleted)")) if raw else None


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

    The FUSE export's file attributes may be cached for a moment, so this
    retries until the device reports the size (bounded).
    """
    for _ in range(50):
        await run("losetup", "--set-capacity", str(device))
        if device_size(device) >= size:
            return
        await asyncio.sleep(0.1)
    raise HostCommandError(f"loop device {device} still reports {device_size(device)} bytes, expected {size}")
