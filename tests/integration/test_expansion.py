"""NodeExpandVolume: the image grows in QSD, the loop device and the filesystem follow."""

from __future__ import annotations

import os

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.qsd import features
from csi_qsd.server import Driver
from csi_qsd.sys import caps
from testing.harness import Sandbox, crash_qsd, qsd_pid, until
from testing.helpers.writers import Writer, fs_bytes

MIB = 1 << 20


async def test_plugin_advertises_online_expansion(driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    caps = await csi.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
    kinds = [c.volume_expansion.type for c in caps.capabilities if c.HasField("volume_expansion")]
    assert kinds == [pb.PluginCapability.VolumeExpansion.ONLINE]


ONLINE_EXT4 = caps.has(caps.CAP_SYS_RESOURCE)


@pytest.mark.parametrize("fs_type", [
    pytest.param("ext4", marks=pytest.mark.skipif(
        not ONLINE_EXT4, reason="the kernel grows a mounted ext4 only for CAP_SYS_RESOURCE, which this host withholds")),
    "xfs",
])
async def test_expand_published_filesystem_in_use(box: Sandbox, driver: tuple[Driver, CSIClient], fs_type: str) -> None:
    _, csi = driver
    vid = (await csi.create_volume("pvc-online", 320 * MIB, fs_type=fs_type)).volume_id
    staging, target = box.staging("on"), box.target("on")
    await csi.stage(vid, str(staging), fs_type=fs_type)
    await csi.publish(vid, str(staging), str(target), fs_type=fs_type)
    before = fs_bytes(target)
    async with Writer(target / "log") as writer:
        assert await csi.expand(vid, str(target), 640 * MIB) == 640 * MIB
        assert fs_bytes(target) > before + 250 * MIB
        grown_at = writer.blocks
        await until(lambda: writer.blocks >= grown_at + 4, "writes after the growth")
    writer.verify()
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))


@pytest.mark.skipif(ONLINE_EXT4, reason="this host grants CAP_SYS_RESOURCE: ext4 grows online here")
async def test_expand_published_ext4_without_cap_sys_resource_is_refused(
    box: Sandbox, driver: tuple[Driver, CSIClient]
) -> None:
    _, csi = driver
    vid = (await csi.create_volume("pvc-nocap", 64 * MIB)).volume_id
    staging, target = box.staging("nc"), box.target("nc")
    await csi.stage(vid, str(staging))
    await csi.publish(vid, str(staging), str(target))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await csi.expand(vid, str(target), 128 * MIB)
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "CAP_SYS_RESOURCE" in str(caught.value.details()) and vid in str(caught.value.details())
    got = await csi.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vid))
    assert got.volume.capacity_bytes == 64 * MIB  # nothing changed
    await csi.unpublish(vid, str(target))
    assert await csi.expand(vid, str(staging), 128 * MIB) == 128 * MIB  # not in use: grown offline
    assert fs_bytes(staging) > 100 * MIB
    await csi.unstage(vid, str(staging))


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
    assert await csi.expand(vid, str(staging), 640 * MIB) == 640 * MIB
    after = os.statvfs(staging).f_blocks * os.statvfs(staging).f_frsize
    assert after > before + 250 * MIB
    got = await csi.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vid))
    assert got.volume.capacity_bytes == 640 * MIB
    assert await csi.expand(vid, str(staging), 100 * MIB) == 640 * MIB  # never shrinks
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
    assert await csi.expand(vid, str(target), 96 * MIB) == 96 * MIB
    fd = os.open(target, os.O_RDWR)
    try:
        assert os.lseek(fd, 0, os.SEEK_END) == 96 * MIB
        os.pwrite(fd, b"z" * 4096, 90 * MIB)
        os.fsync(fd)
    finally:
        os.close(fd)
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))


async def test_expand_after_a_qsd_crash(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    """A QSD SIGKILL leaves the volume's changed-block bitmap inconsistent, which QEMU will not resize beside.

    The record is lost either way: the growth drops it and goes through, and the data stays.
    """
    _, csi = driver
    vid = (await csi.create_volume("pvc-grow-crash", 32 * MIB, block=True)).volume_id
    staging, target = box.staging("gc"), box.target("gc")
    await csi.stage(vid, str(staging), block=True)
    await csi.publish(vid, str(staging), str(target), block=True)
    fd = os.open(target, os.O_RDWR)
    try:
        os.pwrite(fd, b"k" * 4096, 8 * MIB)
        os.fsync(fd)
    finally:
        os.close(fd)
    await crash_qsd(box, csi, vid, target)
    assert await csi.expand(vid, str(target), 96 * MIB) == 96 * MIB
    fd = os.open(target, os.O_RDONLY)
    try:
        assert os.lseek(fd, 0, os.SEEK_END) == 96 * MIB
        assert os.pread(fd, 4096, 8 * MIB) == b"k" * 4096
    finally:
        os.close(fd)
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))


async def test_expand_vm_volume_that_no_guest_ever_opened(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    """A VM volume grows, published or not, before any VM connected: QSD must survive it.

    QSD 10.0.13 segfaults on block_resize under a vhost-user-blk export no
    client has ever connected to; the driver greets every new export once.
    """
    daemon, csi = driver
    pid, restarts = qsd_pid(box), daemon.daemon.restarts
    vid = (await csi.create_volume("pvc-grow-vm", 32 * MIB, {"export": "vhost-user-blk"})).volume_id
    staging, target = box.staging("gv"), box.target("gv")
    await csi.stage(vid, str(staging))
    await csi.publish(vid, str(staging), str(target))
    published = 64 * MIB if features.live_resize_reaches_guest(daemon.daemon.version) else 32 * MIB
    if published > 32 * MIB:
        assert await csi.expand(vid, str(target), published) == published
    await csi.unpublish(vid, str(target))
    assert await csi.expand(vid, str(staging), 96 * MIB) == 96 * MIB
    assert (qsd_pid(box), daemon.daemon.restarts) == (pid, restarts), "QSD died under the resize"
    got = await csi.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vid))
    assert got.volume.capacity_bytes == 96 * MIB
    await csi.unstage(vid, str(staging))


async def test_expanding_a_published_ext4_volume_to_the_size_it_has_succeeds(
    box: Sandbox, driver: tuple[Driver, CSIClient]
) -> None:
    """NodeExpandVolume is idempotent: a call repeated once a pod has the volume (kubelet retrying after a lost
    answer, or a volume grown while no pod used it) has nothing to grow and succeeds, with or without
    CAP_SYS_RESOURCE (before, it was refused while published on a host without it)."""
    _, csi = driver
    vid = (await csi.create_volume("pvc-again", 64 * MIB)).volume_id
    staging, target = box.staging("again"), box.target("again")
    await csi.stage(vid, str(staging))
    assert await csi.expand(vid, str(staging), 256 * MIB) == 256 * MIB  # no pod: grown offline
    await csi.publish(vid, str(staging), str(target))
    (target / "keep").write_bytes(b"survives the repeated call")
    assert await csi.expand(vid, str(target), 256 * MIB) == 256 * MIB
    assert fs_bytes(target) > 200 * MIB
    assert (target / "keep").read_bytes() == b"survives the repeated call"
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))
