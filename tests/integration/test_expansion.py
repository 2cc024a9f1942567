"""NodeExpandVolume: the image grows in QSD, the loop device and the filesystem follow."""

from __future__ import annotations

import os

import pytest

from csi_qsd.csi_client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.server import Driver
from tests.harness import Sandbox

MIB = 1 << 20


async def expand(csi: CSIClient, vid: str, path: str, size: int) -> int:
    response = await csi.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=vid, volume_path=path, capacity_range=pb.CapacityRange(required_bytes=size)))
    return int(response.capacity_bytes)


async def test_plugin_advertises_offline_expansion(driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    caps = await csi.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
    kinds = [c.volume_expansion.type for c in caps.capabilities if c.HasField("volume_expansion")]
    assert kinds == [pb.PluginCapability.VolumeExpansion.OFFLINE]


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
async def test_expand_staged_filesystem(box: Sandbox, driver: tuple[Driver, CSIClient], fs_type: str) -> None:
    _, csi = driver
    vid = (await csi.create_volume("pvc-grow", 320 * MIB, fs_type=fs_type)).volume_id
    staging, target = box.staging("grow"), box.target("grow")
    await csi.stage(vid, str(staging), fs_type=fs_type)
    await csi.publish(vid, str(staging), str(target), fs_type=fs_type)
    (target / "keep").write_bytes(b"survives expansion")
    os.sync()
    await csi.unpublish(vid, str(target))
    before = os.statvfs(staging).f_blocks * os.statvfs(staging).f_frsize
    assert await expand(csi, vid, str(staging), 640 * MIB) == 640 * MIB
    after = os.statvfs(staging).f_blocks * os.statvfs(staging).f_frsize
    assert after > before + 250 * MIB
    got = await csi.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vid))
    assert got.volume.capacity_bytes == 640 * MIB
    assert await expand(csi, vid, str(staging), 100 * MIB) == 640 * MIB  # never shrinks
    await csi.publish(vid, str(staging), str(target), fs_type=fs_type)
    assert (target / "keep").read_bytes() == b"survives expansion"
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))
    await csi.stage(vid, str(staging), fs_type=fs_type)  # the new size persists
    assert os.statvfs(staging).f_blocks * os.statvfs(staging).f_frsize > before + 250 * MIB
    await csi.unstage(vid, str(staging))


async def test_expand_block_volume(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    vid = (await csi.create_volume("pvc-grow-blk", 32 * MIB, block=True)).volume_id
    staging, target = box.staging("gb"), box.target("gb")
    await csi.stage(vid, str(staging), block=True)
    await csi.publish(vid, str(staging), str(target), block=True)
    assert await expand(csi, vid, str(target), 96 * MIB) == 96 * MIB
    fd = os.open(target, os.O_RDWR)
    try:
        assert os.lseek(fd, 0, os.SEEK_END) == 96 * MIB
        os.pwrite(fd, b"z" * 4096, 90 * MIB)
        os.fsync(fd)
    finally:
        os.close(fd)
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))
