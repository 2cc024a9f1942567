"""Device pools over a stand-in NVMe drive, and what their tests read and write on it.

`FakeNVMe` stands in for the drive only: it is a real loop device over a
sparse file, reached through a symlink that stands for its
/dev/disk/by-id name, so it needs root and losetup, and its bytes can be
read from the host to see where a volume's data landed. The rest drives a
device pool as its tests check it: the pool behind a driver, capacity as
GetCapacity answers it, the catalog's extent rows, a published volume's
bytes, a filesystem grown while a writer appends to it.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

from csi_qsd.cli.client import CSIClient, capability
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pools.device import DevicePool
from csi_qsd.server import Driver
from testing import owner
from testing.harness import Sandbox, until
from testing.helpers.writers import Writer, fs_bytes

MIB = 1 << 20
DEVICE_BYTES = 512 * MIB
PATTERN = b"tenant A secret\n" * 4096  # 64 KiB


class FakeNVMe:
    """A loop device over a sparse file, and a stable-name symlink to it."""

    def __init__(self, size: int = DEVICE_BYTES) -> None:
        self.dir = owner.make_base("cqnvme")
        self.backing = self.dir / "nvme.img"
        with open(self.backing, "wb") as f:
            f.truncate(size)
        out = subprocess.run(["losetup", "--find", "--show", str(self.backing)], check=True,
                             capture_output=True, text=True)
        self.node = Path(out.stdout.strip())
        self.link = self.dir / "nvme-FAKE_SERIAL_0001"
        self.link.symlink_to(self.node)

    def read(self, offset: int, length: int) -> bytes:
        with open(self.backing, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def close(self) -> None:
        subprocess.run(["losetup", "-d", str(self.node)], check=False, capture_output=True)
        self.link.unlink(missing_ok=True)
        self.backing.unlink(missing_ok=True)
        owner.remove_base(self.dir)


def spec(device: FakeNVMe, name: str = "fast", force: bool = False) -> tuple[DevicePoolSpec, ...]:
    return (DevicePoolSpec(name, device.link, force),)


def pool_of(driver: Driver, name: str = "fast") -> DevicePool:
    pool = driver.pools[name]
    assert isinstance(pool, DevicePool)
    return pool


async def capacity(csi: CSIClient, pool: str) -> tuple[int, int]:
    response = await csi.controller.GetCapacity(pb.GetCapacityRequest(
        parameters={"pool": pool}, volume_capabilities=[capability()]))
    return response.available_capacity, response.maximum_volume_size.value


async def free(csi: CSIClient, pool: str = "fast") -> int:
    """The pool's available bytes, as GetCapacity answers."""
    return (await capacity(csi, pool))[0]


def extent_rows(box: Sandbox) -> list[tuple[int, int, str, str]]:
    """Every extent the catalog on disk records: (start, length, volume ID, state), by start."""
    db = sqlite3.connect(box.state_dir / "catalog.db")
    try:
        return list(db.execute("SELECT start, length, volume_id, state FROM extents ORDER BY start"))
    finally:
        db.close()


def write_block(path: Path, data: bytes, offset: int = 0) -> None:
    """`data` at `offset` of a device or file, then fsync."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_block(path: Path, length: int, offset: int = 0) -> bytes:
    with open(path, "rb", buffering=0) as f:  # a loop device attached at stage: nothing cached from before
        f.seek(offset)
        return f.read(length)


async def published_xfs(csi: CSIClient, box: Sandbox, volume_id: str) -> tuple[Path, Path, int]:
    """Stage and publish an xfs volume, PATTERN in its file "before": (staging, target, filesystem bytes)."""
    staging, target = box.staging("fs"), box.target("fs")
    await csi.stage(volume_id, str(staging), fs_type="xfs")
    await csi.publish(volume_id, str(staging), str(target), fs_type="xfs")
    (target / "before").write_bytes(PATTERN)
    return staging, target, fs_bytes(target)


async def grow_while_writing(csi: CSIClient, volume_id: str, target: Path, size: int) -> Writer:
    """Grow a published filesystem while a writer appends to it; the writer's blocks are verified after."""
    async with Writer(target / "log") as writer:
        assert await csi.expand(volume_id, str(target), size) == size
        grown_at = writer.blocks
        await until(lambda: writer.blocks >= grown_at + 4, "writes after the growth")
    writer.verify()
    return writer


def window_bytes(path: Path) -> int:
    """The size of a block device (or file), as seeking to its end finds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)
