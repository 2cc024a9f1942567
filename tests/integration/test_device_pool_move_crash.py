"""SIGKILL inside every step of a device pool volume's move while a pod writes: nothing lost, nothing leaked.

The driver runs as a process with one crash point of the move armed: after
the new extent is taken, with the filesystem frozen for the last copy,
after QSD switched to the new extent, after the catalog committed, and
before the old extent's scrub. QSD lives on. After the restart the move is
finished or undone: exactly one extent is the volume's, free space is whole
again, whichever extent the volume left is zeroed, the filesystem is no
longer frozen, the writer's every block is there, and kubelet's retry grows
the volume. The VM volume's mirror is cut off after the commit.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from testing.harness import DriverProcess, Sandbox, until
from testing.helpers.nvme_pools import PATTERN, FakeNVMe, extent_rows, free
from testing.helpers.writers import Writer, fs_bytes

MIB = 1 << 20


@pytest.fixture
def big_nvme() -> Iterator[FakeNVMe]:
    device = FakeNVMe(1024 * MIB)  # xfs needs 300 MiB
    try:
        yield device
    finally:
        device.close()


def frozen(mount: Path) -> bool:
    """True if the filesystem at `mount` was frozen (thawing it answers so; a thawed one refuses)."""
    return subprocess.run(["fsfreeze", "--unfreeze", str(mount)], capture_output=True).returncode == 0


def own_rows(box: Sandbox, volume_id: str) -> list[tuple[int, int, str]]:
    return [(start, length, state) for start, length, vid, state in extent_rows(box) if vid == volume_id]


@pytest.mark.parametrize("point", ["move.after_reserve", "move.held", "move.after_switch", "move.after_commit",
                                   "move.after_release"])
async def test_crash_while_a_filesystem_moves(box: Sandbox, big_nvme: FakeNVMe, point: str) -> None:
    process = DriverProcess(box, "--device-pool", f"fast={big_nvme.link}")
    await process.start()
    try:
        async with CSIClient(box.endpoint, timeout=120) as csi:
            total = await free(csi)
            fs = await csi.create_volume("pvc-fs", 320 * MIB, {"pool": "fast"}, fs_type="xfs")
            neighbour = await csi.create_volume("pvc-next", 16 * MIB, {"pool": "fast"}, block=True)
            ((old_start, old_length, _),) = own_rows(box, fs.volume_id)
            ((next_start, next_length, _),) = own_rows(box, neighbour.volume_id)
            staging, target = box.staging("fs"), box.target("fs")
            await csi.stage(fs.volume_id, str(staging), fs_type="xfs")
            await csi.publish(fs.volume_id, str(staging), str(target), fs_type="xfs")
            (target / "before").write_bytes(PATTERN)
            before = fs_bytes(target)

            await process.stop()  # QSD stays: the plugin container restarts beside it
            await process.start(failpoints=point)
            async with Writer(target / "log") as writer:
                with pytest.raises(grpc.aio.AioRpcError):
                    await csi.expand(fs.volume_id, str(target), 400 * MIB)
                assert await process.wait_exit() != 0
                assert f"event=failpoint name={point}" in process.log()
                await process.start()
                assert not frozen(target), "the restart left the filesystem frozen"
                rows = own_rows(box, fs.volume_id)
                assert len(rows) == 1 and rows[0][2] == "used", rows
                moved = rows[0][0] != old_start
                assert moved == (point in ("move.after_switch", "move.after_commit", "move.after_release"))
                assert await free(csi) == total - rows[0][1] - 16 * MIB
                # Undone, the new extent (the one gap, after the neighbour) was scrubbed; done, the old one.
                left = (old_start, old_length) if moved else (next_start + next_length, 400 * MIB)
                assert big_nvme.read(*left) == bytes(left[1]), "the extent the volume left was not scrubbed"
                going = writer.blocks
                await asyncio.wait_for(_until_more(writer, going + 4), 60)

                assert await csi.expand(fs.volume_id, str(target), 400 * MIB) == 400 * MIB  # kubelet's retry
                assert fs_bytes(target) > before + 70 * MIB
            writer.verify()
            assert (target / "before").read_bytes() == PATTERN
            ((start, length, state),) = own_rows(box, fs.volume_id)
            assert length == 400 * MIB and state == "used" and start != old_start
            assert await free(csi) == total - 416 * MIB

            await csi.unpublish(fs.volume_id, str(target))
            await csi.unstage(fs.volume_id, str(staging))
            await csi.stage(fs.volume_id, str(staging), fs_type="xfs")  # from the device, nothing cached
            writer.path = staging / "log"
            writer.verify()
            await csi.unstage(fs.volume_id, str(staging))
            for vid in (fs.volume_id, neighbour.volume_id):
                await csi.delete_volume(vid)
            await until(lambda: extent_rows(box) == [], "the deleted volumes' storage to be freed", 10)
            assert await free(csi) == total
    finally:
        await process.stop()
    os.sync()


async def test_crash_after_a_mirror_commits(box: Sandbox, big_nvme: FakeNVMe) -> None:
    """The VM disk's mirror job outlives the driver; the restart completes it."""
    process = DriverProcess(box, "--device-pool", f"fast={big_nvme.link}")
    await process.start()
    try:
        async with CSIClient(box.endpoint, timeout=120) as csi:
            total = await free(csi)
            vm = await csi.create_volume("pvc-vm", 16 * MIB, {"pool": "fast", "export": "vhost-user-blk"})
            neighbour = await csi.create_volume("pvc-next", 16 * MIB, {"pool": "fast"}, block=True)
            ((old_start, old_length, _),) = own_rows(box, vm.volume_id)
            with open(big_nvme.node, "r+b", buffering=0) as device:
                device.seek(old_start + 3 * MIB)
                device.write(PATTERN)
            staging = box.staging("vm")
            await csi.stage(vm.volume_id, str(staging))

            await process.stop()
            await process.start(failpoints="move.after_commit")
            with pytest.raises(grpc.aio.AioRpcError):
                await csi.expand(vm.volume_id, str(staging), 32 * MIB)
            assert await process.wait_exit() != 0
            await process.start()
            ((start, length, state),) = own_rows(box, vm.volume_id)
            assert start != old_start and state == "used"
            assert big_nvme.read(start + 3 * MIB, len(PATTERN)) == PATTERN
            assert big_nvme.read(old_start, old_length) == bytes(old_length)
            assert await csi.expand(vm.volume_id, str(staging), 32 * MIB) == 32 * MIB
            assert await free(csi) == total - 48 * MIB
            await csi.unstage(vm.volume_id, str(staging))
            for vid in (vm.volume_id, neighbour.volume_id):
                await csi.delete_volume(vid)
            await until(lambda: extent_rows(box) == [], "the deleted volumes' storage to be freed", 10)
            assert await free(csi) == total
    finally:
        await process.stop()


async def _until_more(writer: Writer, blocks: int) -> None:
    while writer.blocks < blocks:
        await asyncio.sleep(0.05)
