"""Device pools: one block device carved into raw extents, served by the one QSD.

The "NVMe" is a loop device over a sparse file, reached through a symlink
that stands for its /dev/disk/by-id name. Checks: every export kind works on
an extent and lands at its offset on the device; capacity per pool, in
GetCapacity and in /metrics; foreign data refused unless forced; the label
recognised after a restart; a deleted volume's bytes never reach the next
tenant; snapshots and clones refused with the right code; a vanished device
reported, not hung on.
"""

from __future__ import annotations

import os
import subprocess

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.errors import StartupError
from csi_qsd.params import ImageFormat
from csi_qsd.pools.regions import Region
from csi_qsd.qsd import export_nodes, graph
from testing.harness import Sandbox, free_port, in_process_driver, qsd_pid, running_driver, until
from testing.helpers.metrics_scrape import Scrape, scrape
from testing.helpers.nvme_pools import (
    DEVICE_BYTES,
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

MIB = 1 << 20


async def test_volumes_of_every_kind_live_in_their_extents(box: Sandbox, nvme: FakeNVMe) -> None:
    async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
        pool = pool_of(driver)
        total, largest = await capacity(csi, "fast")
        assert total == largest == pool.layout.data_size
        fs = await csi.create_volume("pvc-fs", 64 * MIB, {"pool": "fast"})
        blk = await csi.create_volume("pvc-blk", 32 * MIB, {"pool": "fast"}, block=True)
        vm = await csi.create_volume("pvc-vm", 16 * MIB, {"pool": "fast", "export": "vhost-user-blk"})
        assert fs.volume_context["format"] == "raw"
        extents = {v.volume_id: pool.extent_of(v.volume_id) for v in (fs, blk, vm)}
        assert all(e is not None for e in extents.values())
        assert await capacity(csi, "fast") == (total - 112 * MIB, total - 112 * MIB)
        # The file pool is untouched and reported on its own.
        default_free, _ = await capacity(csi, "default")
        assert default_free != total - 112 * MIB

        staging, target = box.staging("fs"), box.target("fs")
        await csi.stage(fs.volume_id, str(staging))
        await csi.publish(fs.volume_id, str(staging), str(target))
        (target / "hello.txt").write_text("on an extent\n")
        bstaging, btarget = box.staging("blk"), box.target("blk")
        await csi.stage(blk.volume_id, str(bstaging), block=True)
        await csi.publish(blk.volume_id, str(bstaging), str(btarget), block=True)
        write_block(btarget, PATTERN, 4 * MIB)
        extent = extents[blk.volume_id]
        assert extent is not None
        assert nvme.read(extent.start + 4 * MIB, len(PATTERN)) == PATTERN  # at its offset on the device
        vstaging, vtarget = box.staging("vm"), box.target("vm")
        await csi.stage(vm.volume_id, str(vstaging))
        await csi.publish(vm.volume_id, str(vstaging), str(vtarget))
        assert (vtarget / "vhost-user-blk.sock").is_socket()

        # A neighbour holds the space after it: growing needs a move, which a raw device in use cannot make.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await csi.expand(blk.volume_id, str(bstaging), 64 * MIB)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert blk.volume_id in (err.value.details() or "") and "unpublish" in (err.value.details() or "")

        for vid, st, tg in ((fs.volume_id, staging, target), (blk.volume_id, bstaging, btarget),
                            (vm.volume_id, vstaging, vtarget)):
            await csi.unpublish(vid, str(tg))
            await csi.unstage(vid, str(st))
    # A restart finds the label and the extents; the data is where it was.
    async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
        assert {v.volume_id for v in await csi.list_volumes()} == {fs.volume_id, blk.volume_id, vm.volume_id}
        await csi.stage(fs.volume_id, str(staging))
        await csi.publish(fs.volume_id, str(staging), str(target))
        assert (target / "hello.txt").read_text() == "on an extent\n"
        await csi.unpublish(fs.volume_id, str(target))
        await csi.unstage(fs.volume_id, str(staging))
        for vid in (fs.volume_id, blk.volume_id, vm.volume_id):
            await csi.delete_volume(vid)
        await driver.volumes.freed()
        assert await capacity(csi, "fast") == (total, total)
        assert pool_of(driver).images() == []


async def test_refusals_name_the_reason(box: Sandbox, nvme: FakeNVMe) -> None:
    async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
        vol = await csi.create_volume("pvc-raw", 16 * MIB, {"pool": "fast"})
        cases = [
            (csi.create_volume("pvc-q", 16 * MIB, {"pool": "fast", "format": "qcow2"}),
             grpc.StatusCode.INVALID_ARGUMENT, "device pool"),
            (csi.create_volume("pvc-x", 16 * MIB, {"pool": "nosuch"}), grpc.StatusCode.INVALID_ARGUMENT, "nosuch"),
            (csi.create_volume("pvc-big", 4096 * MIB, {"pool": "fast"}), grpc.StatusCode.RESOURCE_EXHAUSTED, "fast"),
            (csi.create_snapshot("snap", vol.volume_id), grpc.StatusCode.FAILED_PRECONDITION, vol.volume_id),
            (csi.create_volume("pvc-clone", 16 * MIB, from_volume=vol.volume_id),
             grpc.StatusCode.FAILED_PRECONDITION, vol.volume_id),
            (csi.create_volume("pvc-clone2", 16 * MIB, {"pool": "fast"}, from_volume=vol.volume_id),
             grpc.StatusCode.INVALID_ARGUMENT, "qcow2"),
        ]
        for call, code, word in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == code, err.value.details()
            assert word in (err.value.details() or "")
        assert await capacity(csi, "nosuch") == (0, 0)
        assert len(pool_of(driver).images()) == 1
        await csi.delete_volume(vol.volume_id)


async def test_foreign_data_refused_unless_forced(box: Sandbox, nvme: FakeNVMe) -> None:
    subprocess.run(["mkfs.ext4", "-q", "-F", str(nvme.node)], check=True, capture_output=True)
    with pytest.raises(StartupError, match="holds data .*TYPE=ext4"):
        async with in_process_driver(box, device_pools=spec(nvme)):
            pass
    assert b"\x53\xef" == nvme.read(1024 + 56, 2)  # the ext4 superblock is untouched
    async with in_process_driver(box, device_pools=spec(nvme, force=True)) as (driver, csi):
        vol = await csi.create_volume("pvc-forced", 16 * MIB, {"pool": "fast"}, block=True)
        extent = pool_of(driver).extent_of(vol.volume_id)
        assert extent is not None
        assert nvme.read(extent.start, 16 * MIB).count(0) == 16 * MIB  # the old filesystem is gone from it
    # The label makes the device the pool's own: no force needed any more, another name refused.
    async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
        assert [v.volume_id for v in await csi.list_volumes()] == [vol.volume_id]
    with pytest.raises(StartupError, match="belongs to device pool 'fast'"):
        async with in_process_driver(box, device_pools=spec(nvme, name="other")):
            pass


async def test_a_deleted_tenants_bytes_never_reach_the_next(box: Sandbox, nvme: FakeNVMe) -> None:
    """Tenant A fills its volume with a pattern and deletes it; B gets the same extent and reads zeroes."""
    async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
        pool = pool_of(driver)
        # Block: A writes everywhere, B reads everything back through its own export.
        a = await csi.create_volume("pvc-a", 32 * MIB, {"pool": "fast"}, block=True)
        a_extent = pool.extent_of(a.volume_id)
        st, tg = box.staging("a"), box.target("a")
        await csi.stage(a.volume_id, str(st), block=True)
        await csi.publish(a.volume_id, str(st), str(tg), block=True)
        for offset in range(0, 32 * MIB, len(PATTERN)):
            write_block(tg, PATTERN, offset)
        await csi.unpublish(a.volume_id, str(tg))
        await csi.unstage(a.volume_id, str(st))
        await csi.delete_volume(a.volume_id)
        await driver.volumes.freed()  # A's extent is scrubbed and free once DeleteVolume's background work ends
        b = await csi.create_volume("pvc-b", 32 * MIB, {"pool": "fast"}, block=True)
        assert pool.extent_of(b.volume_id) == a_extent, "B must get A's extent for the test to mean anything"
        st, tg = box.staging("b"), box.target("b")
        await csi.stage(b.volume_id, str(st), block=True)
        await csi.publish(b.volume_id, str(st), str(tg), block=True)
        data = read_block(tg, 32 * MIB)
        assert data.count(0) == len(data) == 32 * MIB
        await csi.unpublish(b.volume_id, str(tg))
        await csi.unstage(b.volume_id, str(st))
        await csi.delete_volume(b.volume_id)
        await driver.volumes.freed()

        # Filesystem: A's file content must not appear anywhere under C's filesystem or its device.
        a = await csi.create_volume("pvc-fa", 32 * MIB, {"pool": "fast"})
        st, tg = box.staging("fa"), box.target("fa")
        await csi.stage(a.volume_id, str(st))
        await csi.publish(a.volume_id, str(st), str(tg))
        (tg / "secret").write_bytes(PATTERN * 64)
        os.sync()
        await csi.unpublish(a.volume_id, str(tg))
        await csi.unstage(a.volume_id, str(st))
        await csi.delete_volume(a.volume_id)
        await driver.volumes.freed()
        c = await csi.create_volume("pvc-fc", 32 * MIB, {"pool": "fast"})
        assert pool.extent_of(c.volume_id) == a_extent
        st, tg = box.staging("fc"), box.target("fc")
        await csi.stage(c.volume_id, str(st))
        await csi.publish(c.volume_id, str(st), str(tg))
        assert not (tg / "secret").exists()
        assert a_extent is not None and PATTERN[:16] not in nvme.read(a_extent.start, a_extent.length)
        await csi.unpublish(c.volume_id, str(tg))
        await csi.unstage(c.volume_id, str(st))
        await csi.delete_volume(c.volume_id)


async def test_a_vanished_device_is_reported_not_waited_on(box: Sandbox, nvme: FakeNVMe) -> None:
    async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
        vol = await csi.create_volume("pvc-v", 16 * MIB, {"pool": "fast"})
        pool = pool_of(driver)
        image = pool.image_path(vol.volume_id, ImageFormat.RAW)
        assert await pool.check(image, in_use=False) == ""
        nvme.link.unlink()  # udev drops the by-id link when the device goes
        problem = await pool.check(image, in_use=False)
        assert "is gone" in problem and "fast" in problem
        nvme.link.symlink_to(nvme.node)
        assert await pool.check(image, in_use=False) == ""
        await csi.delete_volume(vol.volume_id)


async def test_volumes_grow_in_place_while_in_use(box: Sandbox) -> None:
    """Each kind grows into the free space after its extent, live; a taken neighbour refuses it, naming why."""
    nvme = FakeNVMe(1024 * MIB)  # xfs needs 300 MiB
    try:
        async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
            pool = pool_of(driver)
            fs = await csi.create_volume("pvc-fs", 320 * MIB, {"pool": "fast"}, fs_type="xfs")
            gap1 = await csi.create_volume("pvc-gap1", 80 * MIB, {"pool": "fast"}, block=True)
            blk = await csi.create_volume("pvc-blk", 16 * MIB, {"pool": "fast"}, block=True)
            gap2 = await csi.create_volume("pvc-gap2", 16 * MIB, {"pool": "fast"}, block=True)
            vm = await csi.create_volume("pvc-vm", 16 * MIB, {"pool": "fast", "export": "vhost-user-blk"})
            for gap in (gap1, gap2):
                await csi.delete_volume(gap.volume_id)
            await driver.volumes.freed()
            starts = [pool.extent_of(v.volume_id) for v in (fs, blk, vm)]
            assert [(e.start, e.length) for e in starts if e is not None] == [
                (MIB, 320 * MIB), (401 * MIB, 16 * MIB), (433 * MIB, 16 * MIB)], "the layout this test needs"
            total, _ = await capacity(csi, "fast")

            # A filesystem in use by a pod grows while the pod keeps writing.
            staging, target, before = await published_xfs(csi, box, fs.volume_id)
            await grow_while_writing(csi, fs.volume_id, target, 400 * MIB)
            assert fs_bytes(target) > before + 70 * MIB
            assert (target / "before").read_bytes() == PATTERN
            (target / "tail").write_bytes(b"\1" * (60 * MIB))  # only fits in the grown part
            os.sync()
            assert pool.extent_of(fs.volume_id) == Region(MIB, 400 * MIB)

            # A block volume in use grows into the next 16 MiB; its new tail lands right after the old extent.
            bstaging, btarget = box.staging("blk"), box.target("blk")
            await csi.stage(blk.volume_id, str(bstaging), block=True)
            await csi.publish(blk.volume_id, str(bstaging), str(btarget), block=True)
            write_block(btarget, PATTERN)
            assert await csi.expand(blk.volume_id, str(btarget), 32 * MIB) == 32 * MIB
            assert window_bytes(btarget) == 32 * MIB
            write_block(btarget, PATTERN, 24 * MIB)
            assert read_block(btarget, len(PATTERN)) == PATTERN
            assert nvme.read(401 * MIB + 24 * MIB, len(PATTERN)) == PATTERN
            # More than the pool holds is refused, naming the volume and what is free.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await csi.expand(blk.volume_id, str(btarget), 900 * MIB)
            details = err.value.details() or ""
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE, details
            assert blk.volume_id in details and str(pool.usage().available) in details
            assert window_bytes(btarget) == 32 * MIB and pool.extent_of(blk.volume_id).length == 32 * MIB

            # A VM disk: QSD cannot tell a running guest that a fixed window grew, so only an unpublished one grows.
            client = driver.daemon.client
            pid = qsd_pid(box)
            vstaging, vtarget = box.staging("vm"), box.target("vm")
            await csi.stage(vm.volume_id, str(vstaging))
            await csi.publish(vm.volume_id, str(vstaging), str(vtarget))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await csi.expand(vm.volume_id, str(vtarget), 32 * MIB)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert vm.volume_id in (err.value.details() or "") and "unpublish" in (err.value.details() or "")
            assert pool.extent_of(vm.volume_id).length == 16 * MIB  # refused before anything changed
            await csi.unpublish(vm.volume_id, str(vtarget))
            assert await csi.expand(vm.volume_id, str(vstaging), 32 * MIB) == 32 * MIB
            nodes = graph.nodes_for(vm.volume_id)
            assert (await client.named_nodes())[nodes.throttle]["virtual_size"] == 32 * MIB
            assert await export_nodes.has_export(client, nodes.vhost_export)
            assert qsd_pid(box) == pid, "QSD died under the growth"
            assert await csi.expand(vm.volume_id, str(vstaging), 32 * MIB) == 32 * MIB  # a retry changes nothing

            assert await capacity(csi, "fast") == (total - 112 * MIB, pool.layout.data_end - 465 * MIB)
            got = await csi.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=blk.volume_id))
            assert got.volume.capacity_bytes == 32 * MIB
            await csi.unpublish(fs.volume_id, str(target))
            await csi.unpublish(blk.volume_id, str(btarget))
            for vid, st in ((fs.volume_id, staging), (blk.volume_id, bstaging), (vm.volume_id, vstaging)):
                await csi.unstage(vid, str(st))
        # A restart opens every volume at its grown size, data in place.
        async with in_process_driver(box, device_pools=spec(nvme)) as (driver, csi):
            await csi.stage(fs.volume_id, str(staging), fs_type="xfs")
            assert (staging / "before").read_bytes() == PATTERN and (staging / "tail").stat().st_size == 60 * MIB
            await csi.unstage(fs.volume_id, str(staging))
            await csi.stage(blk.volume_id, str(bstaging), block=True)
            await csi.publish(blk.volume_id, str(bstaging), str(btarget), block=True)
            assert window_bytes(btarget) == 32 * MIB and read_block(btarget, len(PATTERN), 24 * MIB) == PATTERN
            await csi.unpublish(blk.volume_id, str(btarget))
            await csi.unstage(blk.volume_id, str(bstaging))
            for vid in (fs.volume_id, blk.volume_id, vm.volume_id):
                await csi.delete_volume(vid)
            await driver.volumes.freed()
            assert pool_of(driver).images() == []
            assert (await capacity(csi, "fast"))[0] == pool_of(driver).layout.data_size
    finally:
        nvme.close()


async def test_a_device_pool_reports_its_capacity_beside_the_file_pool(box: Sandbox, nvme: FakeNVMe) -> None:
    """Every pool the driver has is in /metrics, by its ID, with the capacity GetCapacity reports."""
    port = free_port()
    async with (
        running_driver(box, "--metrics-address", f"127.0.0.1:{port}", "--device-pool", f"fast={nvme.link}"),
        CSIClient(box.endpoint, timeout=60) as csi,
    ):
        empty = await scrape(port)
        assert {labels.get("pool") for labels in empty.matching("csi_qsd_pool_capacity_bytes")} == {"default", "fast"}
        data_area = empty.value("csi_qsd_pool_capacity_bytes", pool="fast")
        assert data_area == DEVICE_BYTES - MIB  # the device less the aligned unit that holds the pool's label
        assert empty.value("csi_qsd_pool_available_bytes", pool="fast") == (await capacity(csi, "fast"))[0]
        assert empty.value("csi_qsd_pool_available_bytes", pool="fast") == data_area
        assert empty.value("csi_qsd_pool_provisioned_bytes", pool="fast") == 0

        vid = (await csi.create_volume("pvc-fast", 64 * MIB, {"pool": "fast"})).volume_id
        taken = await scrape(port)
        assert taken.value("csi_qsd_pool_available_bytes", pool="fast") == data_area - 64 * MIB
        assert taken.value("csi_qsd_pool_available_bytes", pool="fast") == (await capacity(csi, "fast"))[0]
        assert taken.value("csi_qsd_pool_provisioned_bytes", pool="fast") == 64 * MIB
        assert taken.value("csi_qsd_pool_provisioned_bytes", pool="default") == 0
        assert taken.value("csi_qsd_pool_capacity_bytes", pool="default") == empty.value(
            "csi_qsd_pool_capacity_bytes", pool="default")
        assert taken.value("csi_qsd_volume_allocated_bytes", volume_id=vid) == 64 * MIB  # an extent, allocated whole

        await csi.delete_volume(vid)

        async def scraped_free() -> Scrape | None:
            got = await scrape(port)
            return got if got.value("csi_qsd_pool_available_bytes", pool="fast") == data_area else None
        freed = await until(scraped_free, "the deleted volume's extent to be free in /metrics", 10)
        assert not freed.matching("csi_qsd_volume_allocated_bytes", volume_id=vid)
