"""The controller's view of a volume: published_node_ids and VOLUME_CONDITION, each broken on purpose.

Breaks are real: the image file deleted or its qcow2 metadata overwritten on
disk, the export removed from QSD over QMP. ControllerGetVolume and
ListVolumes must say so, naming the volume and what is wrong.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.qsd import graph
from csi_qsd.server import Driver
from csi_qsd.sys import loop
from testing.harness import Sandbox, until

MIB = 1 << 20
RPC = pb.ControllerServiceCapability.RPC


async def get(csi: CSIClient, vid: str) -> Any:
    response: Any = await csi.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vid), timeout=60)
    return response.status


async def listed(csi: CSIClient, vid: str) -> Any:
    response: Any = await csi.controller.ListVolumes(pb.ListVolumesRequest(), timeout=60)
    return next(e.status for e in response.entries if e.volume.volume_id == vid)


def image_of(box: Sandbox, vid: str) -> Path:
    return box.state_dir / "pool" / f"{vid}.qcow2"


async def test_capabilities_are_advertised(csi: CSIClient) -> None:
    caps = await csi.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest())
    kinds = {c.rpc.type for c in caps.capabilities}
    assert {RPC.GET_VOLUME, RPC.LIST_VOLUMES_PUBLISHED_NODES, RPC.VOLUME_CONDITION, RPC.MODIFY_VOLUME} <= kinds


async def test_published_node_ids_follow_publish_and_unpublish(box: Sandbox, csi: CSIClient) -> None:
    vid = (await csi.create_volume("pvc-pub", 32 * MIB)).volume_id
    staging, target = box.staging("pub"), box.target("pub")
    assert list((await get(csi, vid)).published_node_ids) == []
    await csi.stage(vid, str(staging))
    assert list((await get(csi, vid)).published_node_ids) == []  # staged is not published
    await csi.publish(vid, str(staging), str(target))
    for status in (await get(csi, vid), await listed(csi, vid)):
        assert list(status.published_node_ids) == ["node-a"]
        assert not status.volume_condition.abnormal and status.volume_condition.message
    await csi.unpublish(vid, str(target))
    assert list((await listed(csi, vid)).published_node_ids) == []
    await csi.unstage(vid, str(staging))


async def test_export_removed_over_qmp_while_staged(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    drv, csi = driver
    vid = (await csi.create_volume("pvc-noexport", 32 * MIB, block=True)).volume_id
    staging = box.staging("noexport")
    await csi.stage(vid, str(staging), block=True)
    assert not (await get(csi, vid)).volume_condition.abnormal
    export_id = graph.nodes_for(vid).fuse_export
    await drv.daemon.client.export_del(export_id)
    for status in (await get(csi, vid), await listed(csi, vid)):
        condition = status.volume_condition
        assert condition.abnormal and vid in condition.message and export_id in condition.message, condition
    first = (await drv.catalog.stage(vid)).loop_device  # type: ignore[union-attr]
    await csi.stage(vid, str(staging), block=True)  # the kubelet's re-stage brings the export back
    assert not (await get(csi, vid)).volume_condition.abnormal
    again = (await drv.catalog.stage(vid)).loop_device  # type: ignore[union-attr]
    export = box.state_dir / "exports" / vid / "disk"
    # The loop device on the dead export is gone (its number may serve the new one), and the catalog knows the new one.
    assert loop.backing_of(Path(first)) in (None, export) and loop.backing_of(Path(again)) == export
    await csi.unstage(vid, str(staging))
    assert loop.backing_of(Path(again)) is None, "unstage finds the loop device the re-stage made"


async def test_image_deleted_idle_and_while_staged(box: Sandbox, csi: CSIClient) -> None:
    idle = (await csi.create_volume("pvc-gone-idle", 32 * MIB)).volume_id
    staged = (await csi.create_volume("pvc-gone-staged", 32 * MIB, block=True)).volume_id
    staging = box.staging("gone")
    await csi.stage(staged, str(staging), block=True)
    assert not (await get(csi, idle)).volume_condition.abnormal  # its image may not be written yet: no data
    await until(image_of(box, idle).exists, "the idle volume's image to be written", 10)
    for vid in (idle, staged):
        assert not (await get(csi, vid)).volume_condition.abnormal
        image_of(box, vid).unlink()  # QSD keeps the staged one open: its I/O still works, the data is doomed

        async def reported() -> bool:  # once the image is recorded durable (right after it is written)
            return bool((await get(csi, vid)).volume_condition.abnormal)

        await until(reported, "the deleted image to be reported", 10)
        for status in (await get(csi, vid), await listed(csi, vid)):
            condition = status.volume_condition
            assert condition.abnormal and "missing" in condition.message, condition
            assert vid in condition.message and str(image_of(box, vid)) in condition.message
    await csi.unstage(staged, str(staging))


def zero_first_refcount_block(image: Path) -> None:
    """Overwrite the qcow2's first refcount block with zeros: every allocated cluster now has refcount 0."""
    with open(image, "r+b") as f:
        header = f.read(104)
        cluster_bits = struct.unpack(">I", header[20:24])[0]
        table = struct.unpack(">Q", header[48:56])[0]
        f.seek(table)
        block = struct.unpack(">Q", f.read(8))[0]
        assert block
        f.seek(block)
        f.write(bytes(1 << cluster_bits))
        f.flush()
        os.fsync(f.fileno())


async def test_idle_image_corrupt_or_unreadable(box: Sandbox, csi: CSIClient) -> None:
    vid = (await csi.create_volume("pvc-corrupt", 32 * MIB, block=True)).volume_id
    staging, target = box.staging("corrupt"), box.target("corrupt")
    await csi.stage(vid, str(staging), block=True)
    await csi.publish(vid, str(staging), str(target), block=True)
    with open(target, "r+b") as device:
        device.write(os.urandom(MIB))
        os.fsync(device.fileno())
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))
    assert not (await get(csi, vid)).volume_condition.abnormal  # checked once; the result is cached
    zero_first_refcount_block(image_of(box, vid))
    condition = (await get(csi, vid)).volume_condition  # the file changed: checked again
    assert condition.abnormal and "corrupt" in condition.message and vid in condition.message, condition
    assert (await listed(csi, vid)).volume_condition == condition
    with open(image_of(box, vid), "r+b") as f:
        f.write(b"garbage!")  # no qcow2 magic any more
    condition = (await get(csi, vid)).volume_condition
    assert condition.abnormal and "cannot be opened" in condition.message, condition
    await csi.delete_volume(vid)
