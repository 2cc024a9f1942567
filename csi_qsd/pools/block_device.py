"""The host block device under a device pool: found by its stable path, labelled, claimed, probed, zeroed.

Thin wrappers over udev, the kernel's O_EXCL test, `blkid -p` and
`blkdiscard -z`, for `csi_qsd.pools.device` (and, for the label and the
probe, the pools QSD reaches instead, `csi_qsd.pools.through_qsd`). The
label is the pool's own mark at the start of the device: a restart
recognises the device by it, and a device without it is probed for
someone else's data first.
"""


from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import stat
from pathlib import Path

import pyudev

from csi_qsd.errors import StartupError
from csi_qsd.sys.run import run

log = logging.getLogger(__name__)


LABEL_MAGIC = b"CSI-QSD-DEVICE-POOL\0"
LABEL_SIZE = 4096
LABEL_VERSION = 1
SCRUB_TIMEOUT = 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class BlockDevice:
    """What udev knows of the device a stable path names."""

    path: Path  # as configured (stable: /dev/disk/by-id/…)
    node: Path  # what it resolves to now (/dev/nvme0n1)
    rdev: int
    size: int
    optimal_io_size: int


def find_block_device(path: Path) -> BlockDevice:
    """Resolve `path` to a block device known to udev. Raises StartupError naming what is wrong."""
    try:
        node = path.resolve(strict=True)
        st = os.stat(node)
    except OSError as exc:
        raise StartupError(f"device pool path {path} does not exist: {exc.strerror}") from None
    if not stat.S_ISBLK(st.st_mode):
        raise StartupError(f"device pool path {path} ({node}) is not a block device")
    try:
        device = pyudev.Devices.from_device_number(pyudev.Context(), "block", st.st_rdev)
    except pyudev.DeviceNotFoundError:
        raise StartupError(f"udev does not know the block device {path} ({node})") from None
    sys_path = Path(device.sys_path)
    size = int((sys_path / "size").read_text()) * 512  # sysfs counts 512-byte sectors whatever the device's
    queue = sys_path / "queue" if device.device_type != "partition" else sys_path.parent / "queue"
    try:
        optimal = int((queue / "optimal_io_size").read_text())
    except (OSError, ValueError):
        optimal = 0
    return BlockDevice(path=path, node=node, rdev=st.st_rdev, size=size, optimal_io_size=optimal)


def read_label(node: Path) -> dict[str, object] | None:
    """The pool label at the start of the device, or None if it carries none."""
    with open(node, "rb", buffering=0) as f:
        head = f.read(LABEL_SIZE)
    if not head.startswith(LABEL_MAGIC):
        return None
    text = head[len(LABEL_MAGIC):].split(b"\0", 1)[0]
    try:
        label = json.loads(text)
    except ValueError:
        return None
    return label if isinstance(label, dict) else None


def write_label(node: Path, label: dict[str, object]) -> None:
    body = LABEL_MAGIC + json.dumps(label, sort_keys=True).encode() + b"\0"
    if len(body) > LABEL_SIZE:
        raise ValueError("pool label too long")
    fd = os.open(node, os.O_WRONLY)
    try:
        os.pwrite(fd, body.ljust(LABEL_SIZE, b"\0"), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def claim_exclusively(node: Path) -> None:
    """Refuse a device that is mounted or held by another driver (the kernel's O_EXCL test)."""
    try:
        fd = os.open(node, os.O_RDONLY | os.O_EXCL)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise StartupError(f"device {node} is in use (mounted, or held by another driver)") from None
        raise StartupError(f"cannot open device {node}: {exc.strerror}") from None
    os.close(fd)


async def foreign_signatures(node: Path) -> str:
    """What `blkid -p` finds on the device ('' if nothing): a partition table, filesystem, RAID member…"""
    code, out = await run("blkid", "-p", "-o", "export", str(node), check=False)
    if code == 2:  # blkid: nothing was identified
        return ""
    if code != 0:
        return f"blkid -p could not tell what the device holds (exit {code})"
    found = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    kinds = [f"{key}={found[key]}" for key in ("PTTYPE", "TYPE", "USAGE") if key in found]
    return ", ".join(kinds) or "an unnamed signature"


async def zero_range(node: Path, start: int, length: int) -> None:
    """Write zeroes over [start, start+length), letting the device deallocate (BLKZEROOUT)."""
    await run("blkdiscard", "--zeroout", "--offset", str(start), "--length", str(length), str(node),
              timeout=SCRUB_TIMEOUT)
