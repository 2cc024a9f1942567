"""SIGKILL inside every step of a device pool's extent bookkeeping: no extent lost, none given twice, none unscrubbed.

The driver runs as a process with a named crash point armed (take, release,
scrub, grow); after the restart the catalog's extents must account for exactly
the live volumes, free space must be whole again, and a deleted tenant's
bytes must be gone from the device before anyone can be given its extent.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from testing.harness import DriverProcess, Sandbox, until
from testing.helpers.nvme_pools import PATTERN, FakeNVMe, extent_rows, free, write_block

MIB = 1 << 20


@pytest.fixture
async def process(box: Sandbox, nvme: FakeNVMe) -> AsyncIterator[DriverProcess]:
    driver = DriverProcess(box, "--device-pool", f"fast={nvme.link}")
    await driver.start()
    try:
        yield driver
    finally:
        await driver.stop()


async def published_block_volume(
    csi: CSIClient, box: Sandbox, name: str, size: int,
) -> tuple[pb.Volume, int, int, Path, Path]:
    """A block volume of the pool, the only one, staged and published: (volume, start, length, staging, target)."""
    vol = await csi.create_volume(f"pvc-{name}", size, {"pool": "fast"}, block=True)
    ((start, length, _, _),) = extent_rows(box)
    staging, target = box.staging(name), box.target(name)
    await csi.stage(vol.volume_id, str(staging), block=True)
    await csi.publish(vol.volume_id, str(staging), str(target), block=True)
    return vol, start, length, staging, target


@pytest.mark.parametrize("point", ["extent.after_take"])
async def test_crash_while_taking_an_extent(box: Sandbox, process: DriverProcess, point: str) -> None:
    async with CSIClient(box.endpoint, timeout=60) as csi:
        total = await free(csi)
        await process.stop()
        await process.start(failpoints=point)
        with pytest.raises(grpc.aio.AioRpcError):
            await csi.create_volume("pvc-crash", 64 * MIB, {"pool": "fast"}, block=True)
        assert await process.wait_exit() != 0
        assert f"event=failpoint name={point}" in process.log()
        await process.start()
        assert await csi.list_volumes() == []
        assert extent_rows(box) == [] and await free(csi) == total
        vol = await csi.create_volume("pvc-crash", 64 * MIB, {"pool": "fast"}, block=True)  # the retry
        assert [r[2] for r in extent_rows(box)] == [vol.volume_id]
        await csi.delete_volume(vol.volume_id)
        await until(lambda: extent_rows(box) == [], "the deleted volumes' storage to be freed", 10)
        assert await free(csi) == total


@pytest.mark.parametrize("point", ["delete.after_intent", "extent.after_release", "extent.after_scrub",
                                   "delete.after_image"])
async def test_crash_while_freeing_an_extent(
    box: Sandbox, process: DriverProcess, nvme: FakeNVMe, point: str,
) -> None:
    async with CSIClient(box.endpoint, timeout=60) as csi:
        total = await free(csi)
        vol, start, length, staging, target = await published_block_volume(csi, box, "a", 32 * MIB)
        for offset in range(0, length, len(PATTERN)):
            write_block(target, PATTERN, offset)
        await csi.unpublish(vol.volume_id, str(target))
        await csi.unstage(vol.volume_id, str(staging))
        assert nvme.read(start, len(PATTERN)) == PATTERN

        await process.stop()
        await process.start(failpoints=point)
        if point == "delete.after_intent":
            with pytest.raises(grpc.aio.AioRpcError):
                await csi.delete_volume(vol.volume_id)
        else:  # freeing runs after the answer, in the background: answered unless the kill outran it
            with contextlib.suppress(grpc.aio.AioRpcError):
                await csi.delete_volume(vol.volume_id)
        assert await process.wait_exit() != 0
        assert f"event=failpoint name={point}" in process.log()
        await process.start()

        # The restart finished the delete and the scrub: nothing left, nothing readable.
        assert await csi.list_volumes() == []
        assert extent_rows(box) == [] and await free(csi) == total
        assert nvme.read(start, length).count(0) == length
        await csi.delete_volume(vol.volume_id)  # the provisioner's retry
        again = await csi.create_volume("pvc-b", 32 * MIB, {"pool": "fast"}, block=True)
        assert extent_rows(box)[0][:2] == (start, length)
        await csi.delete_volume(again.volume_id)
    os.sync()


async def test_crash_while_growing_an_extent(box: Sandbox, process: DriverProcess, nvme: FakeNVMe) -> None:
    """SIGKILL after the catalog extended the extent, before QSD saw it: the retry finishes, nothing leaks."""
    async with CSIClient(box.endpoint, timeout=60) as csi:
        total = await free(csi)
        vol, start, length, staging, target = await published_block_volume(csi, box, "g", 16 * MIB)
        write_block(target, PATTERN)

        await process.stop()
        await process.start(failpoints="extent.after_grow")
        with pytest.raises(grpc.aio.AioRpcError):
            await csi.expand(vol.volume_id, str(target), 32 * MIB)
        assert await process.wait_exit() != 0
        assert "event=failpoint name=extent.after_grow" in process.log()
        await process.start()

        # The extent is recorded grown, the volume not yet: space is accounted, nothing overlaps.
        assert extent_rows(box) == [(start, 32 * MIB, vol.volume_id, "used")]
        assert await free(csi) == total - 32 * MIB
        got = await csi.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vol.volume_id))
        assert got.volume.capacity_bytes == 16 * MIB
        assert await csi.expand(vol.volume_id, str(target), 32 * MIB) == 32 * MIB  # kubelet's retry
        fd = os.open(target, os.O_RDWR)
        try:
            assert os.lseek(fd, 0, os.SEEK_END) == 32 * MIB
            assert os.pread(fd, len(PATTERN), 0) == PATTERN
            os.pwrite(fd, PATTERN, 24 * MIB)
            os.fsync(fd)
        finally:
            os.close(fd)
        assert nvme.read(start + 24 * MIB, len(PATTERN)) == PATTERN
        assert length == 16 * MIB
        await csi.unpublish(vol.volume_id, str(target))
        await csi.unstage(vol.volume_id, str(staging))
        await csi.delete_volume(vol.volume_id)
        await until(lambda: extent_rows(box) == [], "the deleted volumes' storage to be freed", 10)
        assert await free(csi) == total
        assert nvme.read(start, 32 * MIB).count(0) == 32 * MIB  # the grown part was scrubbed with the rest
    os.sync()
