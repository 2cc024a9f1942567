"""The driver under test for an e2e test, and VM volumes provisioned on it as the provisioner and kubelet do.

`serving` runs `csi-qsd serve` in a sandbox of its own, as in its pod;
`serving_in_process` runs the driver in the test's event loop, for tests
that also ask QSD, through the driver's own QMP client, what it holds.
Both hand back a `Served`: the sandbox, the driver and a CSI client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.server import Driver
from testing.harness import DriverProcess, Sandbox, in_process_driver, running_driver, sandbox

MIB = 1 << 20
SIZE = 64 * MIB
VM = {"export": "vhost-user-blk"}
SOCKET = "vhost-user-blk.sock"

D = TypeVar("D", DriverProcess, Driver)


@dataclass
class Served(Generic[D]):
    """A driver under test, its sandbox, and a CSI client on its socket.

    `driver` is the `csi-qsd serve` process (`serving`) or the in-process
    `Driver` (`serving_in_process`).
    """

    box: Sandbox
    driver: D
    csi: CSIClient


def require_root(*, fuse: bool = False) -> None:
    """Fail the test unless it runs as root (mounts, loop devices, socket ownership) and, with `fuse`, has FUSE."""
    if os.geteuid() != 0 or (fuse and not os.path.exists("/dev/fuse")):
        pytest.fail("e2e tests need root (mounts, loop devices, socket ownership)" + (" and /dev/fuse" if fuse else ""))


@contextlib.asynccontextmanager
async def serving(*driver_args: str, fuse: bool = False, timeout: float = 60) -> AsyncIterator[Served[DriverProcess]]:
    """`csi-qsd serve` with `driver_args` in a sandbox of its own, and a client whose calls time out after `timeout`."""
    require_root(fuse=fuse)
    with sandbox() as box:
        async with running_driver(box, *driver_args) as driver, CSIClient(box.endpoint, timeout=timeout) as csi:
            yield Served(box, driver, csi)


@contextlib.asynccontextmanager
async def serving_in_process() -> AsyncIterator[Served[Driver]]:
    """The driver in this event loop, in a sandbox of its own, and a client."""
    require_root()
    with sandbox() as box:
        async with in_process_driver(box) as (driver, csi):
            yield Served(box, driver, csi)


@dataclass(frozen=True)
class Volume:
    """A provisioned VM volume: its ID, where it is staged, and the published directory holding its socket."""

    id: str
    staging: Path
    target: Path

    @property
    def socket(self) -> Path:
        return self.target / SOCKET


async def provision(
    served: Served[DriverProcess], name: str, parameters: dict[str, str] | None = None, *, group: str = "",
    readonly: bool = False,
) -> Volume:
    """CreateVolume, NodeStageVolume and NodePublishVolume, as the provisioner and kubelet call them."""
    csi, box = served.csi, served.box
    vid = (await csi.create_volume(name, SIZE, {**VM, **(parameters or {})})).volume_id
    volume = Volume(vid, box.staging(name), box.target(name))
    await csi.stage(vid, str(volume.staging), mount_group=group)
    await csi.publish(vid, str(volume.staging), str(volume.target), mount_group=group, readonly=readonly)
    return volume


async def release(served: Served[DriverProcess], volume: Volume) -> None:
    """NodeUnpublishVolume and NodeUnstageVolume: QSD has closed the volume's image afterwards."""
    await served.csi.unpublish(volume.id, str(volume.target))
    await served.csi.unstage(volume.id, str(volume.staging))


async def run(*argv: str) -> str:
    """A host command's output (stdout and stderr); the test fails if it does."""
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, f"{' '.join(argv)} failed: {out.decode(errors='replace')}"
    return out.decode(errors="replace")


async def read_image(image: Path, scratch: Path) -> bytes:
    """Guest-visible bytes of a qcow2 image and its backing chain, read by qemu-img (not QSD)."""
    raw = scratch / f"{image.name}.raw"
    await run("qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(image), str(raw))
    try:
        return raw.read_bytes()
    finally:
        raw.unlink()


async def host_bytes(served: Served[DriverProcess], volume: Volume) -> bytes:
    """The volume's guest-visible bytes read by qemu-img from its image (QSD must have closed it)."""
    return await read_image(served.box.state_dir / "pool" / f"{volume.id}.qcow2", served.box.root)
