"""Device pools: a volume whose neighbour holds the space after it grows by moving, live, to a larger free extent.

Real QSD, loop device standing in for the NVMe, real xfs and a writer
thread: the filesystem volume moves while a pod writes to it (backups
under the FUSE export, the last copy with the filesystem frozen), the VM
volume moves by a mirror under its vhost-user-blk export. Each time the
data is checked on the device at the new extent, the old extent is zeroed
and free, and nothing changed for the neighbours.
"""

from __future__ import annotations

import grpc
import pytest

from csi_qsd.qsd import export_nodes, graph
from testing.harness import Sandbox, in_process_driver, qsd_pid
from testing.helpers.nvme_pools import (
    MIB,
    PATTERN,
    FakeNVMe,
    capacity,
    grow_while_writing,
    pool_of,
    published_xfs,
    read_block,
    spec,
    window_bytes,
    write_block,
)
from testing.helpers.writers import fs_bytes


async def test_a_filesystem_in_use_moves_to_grow(box: Sandbox) -> None:
    """The pod keeps writing through the move; every byte is at the new extent; the old one is zeroed and free."""
    nvme = FakeNVMe(1024 * MIB)
    try:
        async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
            pool = pool_of(driver)
            fs = await csi.create_volume("pvc-fs", 320 * MIB, {"pool": "fast"}, fs_type="xfs")
            neighbour = await csi.create_volume("pvc-next", 16 * MIB, {"pool": "fast"}, block=True)
            old = pool.extent_of(fs.volume_id)
            assert old is not None and pool.extent_of(neighbour.volume_id).start == old.end
            total, _ = await capacity(csi, "fast")
            pid = qsd_pid(box)

            staging, target, before = await published_xfs(csi, box, fs.volume_id)
            writer = await grow_while_writing(csi, fs.volume_id, target, 400 * MIB)
            new = pool.extent_of(fs.volume_id)
            assert new is not None and new.length == 400 * MIB and not new.overlaps(old)
            assert fs_bytes(target) > before + 70 * MIB
            assert qsd_pid(box) == pid, "QSD died under the move"
            assert nvme.read(old.start, old.length) == bytes(old.length), "the old extent was not scrubbed"
            assert await capacity(csi, "fast") == (total - 80 * MIB, pool.largest_volume())
            graph_nodes = await driver.daemon.client.node_names()
            assert graph.nodes_for(fs.volume_id, 0).format not in graph_nodes, "the old top is still open"

            # From the device itself: unstage, and stage again over the new extent.
            await csi.unpublish(fs.volume_id, str(target))
            await csi.unstage(fs.volume_id, str(staging))
            await csi.stage(fs.volume_id, str(staging), fs_type="xfs")
            assert (staging / "before").read_bytes() == PATTERN
            writer.path = staging / "log"
            writer.verify()
            (staging / "tail").write_bytes(b"\1" * (60 * MIB))  # only fits in the grown part
            await csi.unstage(fs.volume_id, str(staging))
        async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
            await csi.stage(fs.volume_id, str(staging), fs_type="xfs")
            assert (staging / "before").read_bytes() == PATTERN and (staging / "tail").stat().st_size == 60 * MIB
            await csi.unstage(fs.volume_id, str(staging))
            for vid in (fs.volume_id, neighbour.volume_id):
                await csi.delete_volume(vid)
            await driver.volumes.freed()
            assert (await capacity(csi, "fast"))[0] == pool_of(driver).layout.data_size
    finally:
        nvme.close()


async def test_block_and_vm_volumes_move_to_grow(box: Sandbox) -> None:
    """A raw block device a pod holds is refused (it cannot be held still); unpublished, it moves; a VM disk mirrors."""
    nvme = FakeNVMe(256 * MIB)
    try:
        async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
            pool = pool_of(driver)
            client = driver.daemon.client
            blk = await csi.create_volume("pvc-blk", 16 * MIB, {"pool": "fast"}, block=True)
            vm = await csi.create_volume("pvc-vm", 16 * MIB, {"pool": "fast", "export": "vhost-user-blk"})
            last = await csi.create_volume("pvc-last", 16 * MIB, {"pool": "fast"}, block=True)
            blk_old, vm_old = pool.extent_of(blk.volume_id), pool.extent_of(vm.volume_id)
            assert blk_old is not None and vm_old is not None and blk_old.end == vm_old.start
            pid = qsd_pid(box)

            bstaging, btarget = box.staging("blk"), box.target("blk")
            await csi.stage(blk.volume_id, str(bstaging), block=True)
            await csi.publish(blk.volume_id, str(bstaging), str(btarget), block=True)
            write_block(btarget, PATTERN)
            write_block(btarget, PATTERN, 15 * MIB)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await csi.expand(blk.volume_id, str(btarget), 32 * MIB)
            details = err.value.details() or ""
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
            assert blk.volume_id in details and "unpublish" in details
            assert pool.extent_of(blk.volume_id) == blk_old and pool.moves_under_way() == {}
            await csi.unpublish(blk.volume_id, str(btarget))
            assert await csi.expand(blk.volume_id, str(bstaging), 32 * MIB) == 32 * MIB
            blk_new = pool.extent_of(blk.volume_id)
            assert blk_new is not None and blk_new.length == 32 * MIB and blk_new.start >= pool.extent_of(last.volume_id).end
            assert nvme.read(blk_new.start, len(PATTERN)) == PATTERN
            assert nvme.read(blk_new.start + 15 * MIB, len(PATTERN)) == PATTERN
            assert nvme.read(blk_old.start, blk_old.length) == bytes(blk_old.length)
            await csi.publish(blk.volume_id, str(bstaging), str(btarget), block=True)
            assert window_bytes(btarget) == 32 * MIB
            assert read_block(btarget, len(PATTERN), 15 * MIB) == PATTERN
            write_block(btarget, PATTERN, 31 * MIB)
            assert nvme.read(blk_new.start + 31 * MIB, len(PATTERN)) == PATTERN

            # The VM disk (staged, no VM running): mirrored to a new extent under its export, then grown.
            vstaging = box.staging("vm")
            await csi.stage(vm.volume_id, str(vstaging))
            with open(nvme.node, "r+b", buffering=0) as device:
                device.seek(vm_old.start + 5 * MIB)
                device.write(PATTERN)
            assert await csi.expand(vm.volume_id, str(vstaging), 32 * MIB) == 32 * MIB
            vm_new = pool.extent_of(vm.volume_id)
            assert vm_new is not None and vm_new.length == 32 * MIB and vm_new != vm_old
            assert nvme.read(vm_new.start + 5 * MIB, len(PATTERN)) == PATTERN
            assert nvme.read(vm_old.start, vm_old.length) == bytes(vm_old.length)
            nodes = graph.nodes_for(vm.volume_id, 1)
            assert (await client.named_nodes())[nodes.throttle]["virtual_size"] == 32 * MIB
            assert await export_nodes.has_export(client, nodes.vhost_export)
            assert graph.nodes_for(vm.volume_id, 0).format not in await client.node_names()
            assert qsd_pid(box) == pid, "QSD died under the moves"
            assert await csi.expand(vm.volume_id, str(vstaging), 32 * MIB) == 32 * MIB  # a retry changes nothing

            await csi.unpublish(blk.volume_id, str(btarget))
            for vid, st in ((blk.volume_id, bstaging), (vm.volume_id, vstaging)):
                await csi.unstage(vid, str(st))
            for vid in (blk.volume_id, vm.volume_id, last.volume_id):
                await csi.delete_volume(vid)
            await driver.volumes.freed()
            assert pool.images() == [] and pool.moves_under_way() == {}
            assert (await capacity(csi, "fast"))[0] == pool.layout.data_size
    finally:
        nvme.close()
