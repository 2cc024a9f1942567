"""A VM's disk on a device pool moves to another extent under a running guest that keeps writing.

The move is the one NodeExpandVolume makes when a neighbour holds the space
after a disk (`csi_qsd.node.moves`): blockdev-mirror in write-blocking mode under
the vhost-user-blk export, committed once actively synced, then switched.
NodeExpandVolume refuses a published VM disk on a device pool (QEMU cannot
tell a running guest that a fixed window grew), so the test calls the move
itself on the published volume, with a busybox guest (TCG) writing paced
1 MiB O_DIRECT blocks through it the whole time. Checked: the guest saw no
error and read back every block; every acknowledged block is on the device
at the new extent; the old extent is zeroed and free.
"""

from __future__ import annotations

from csi_qsd.catalog import Catalog
from csi_qsd.node import moves
from e2e.conftest import e2e_marks
from testing.guest import (
    BLOCK_SIZE,
    GuestImage,
    VhostUserDisk,
    count_kernel_io_errors,
    guest_script,
    pattern_block,
    start_vm,
    verify_pattern,
)
from testing.guest.writes import DEVICE, VM_TIMEOUT_S, assert_clean_run, paced_writes, wait_for_block
from testing.harness import in_process_driver, sandbox
from testing.helpers.nvme_pools import FakeNVMe, pool_of, spec

pytestmark = e2e_marks()

MIB = 1 << 20


async def test_a_vm_keeps_writing_while_its_disk_moves(guest_image: GuestImage) -> None:
    nvme = FakeNVMe(256 * MIB)
    try:
        with sandbox() as box:
            async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
                pool = pool_of(driver)
                vol = await csi.create_volume("pvc-vm", 32 * MIB, {"pool": "fast", "export": "vhost-user-blk"})
                neighbour = await csi.create_volume("pvc-next", 16 * MIB, {"pool": "fast"}, block=True)
                old = pool.extent_of(vol.volume_id)
                after = pool.extent_of(neighbour.volume_id)
                assert old is not None and after is not None and after.start == old.end
                staging, target = box.staging("vm"), box.target("vm")
                await csi.stage(vol.volume_id, str(staging))
                await csi.publish(vol.volume_id, str(staging), str(target))

                seed, blocks = 515, 28
                script = guest_script(*paced_writes(seed, blocks, pause=0.3), verify_pattern(DEVICE, seed, blocks),
                                      count_kernel_io_errors())
                vm = await start_vm(guest_image, [VhostUserDisk(target / "vhost-user-blk.sock")], script,
                                    timeout=VM_TIMEOUT_S)
                async with vm:
                    await wait_for_block(vm, 3)
                    catalog: Catalog = driver.catalog
                    volume = await catalog.volume(vol.volume_id)
                    stage = await catalog.stage(vol.volume_id)
                    assert volume is not None and stage is not None
                    exports = driver.node.exports
                    moved = await moves.move(exports.host, exports.of(volume), volume, stage,
                                             await catalog.publishes(vol.volume_id), 48 * MIB)
                    moved_at = len(vm.output.splitlines())
                    result = await vm.wait()
                assert result.exit_code == 0, result.output
                acked = assert_clean_run(result.output, blocks)
                assert acked[-1] == blocks - 1 and "WROTE" in "\n".join(result.output.splitlines()[moved_at:]), (
                    "the guest stopped writing before the move ended: the move was not under load")

                new = pool.extent_of(vol.volume_id)
                assert new is not None and new.length == 48 * MIB and not new.overlaps(old)
                assert moved.generation == 1 and pool.moves_under_way() == {}
                for i in acked:
                    assert nvme.read(new.start + i * BLOCK_SIZE, BLOCK_SIZE) == pattern_block(seed, i), f"block {i}"
                assert nvme.read(old.start, old.length) == bytes(old.length), "the old extent was not scrubbed"

                await csi.unpublish(vol.volume_id, str(target))
                await csi.unstage(vol.volume_id, str(staging))
                for vid in (vol.volume_id, neighbour.volume_id):
                    await csi.delete_volume(vid)
    finally:
        nvme.close()
