"""A volume's whole life through the CSI API, with a real QSD, FUSE, loop device and mount."""

from __future__ import annotations

import mmap
import os

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.server import Driver
from csi_qsd.sys import mounts
from testing.harness import Sandbox, until, write_synced

MIB = 1 << 20



@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
async def test_filesystem_volume_lifecycle(box: Sandbox, driver: tuple[Driver, CSIClient], fs_type: str) -> None:
    _, csi = driver
    volume = await csi.create_volume("pvc-fs", 320 * MIB, fs_type=fs_type)
    assert volume.capacity_bytes == 320 * MIB
    image = box.state_dir / "pool" / f"{volume.volume_id}.qcow2"
    await until(image.exists, "the created volume's image to be written (right after the answer)", 10)
    staging, target = box.staging("fs"), box.target("pod-1")

    await csi.stage(volume.volume_id, str(staging), fs_type=fs_type)
    entry = mounts.mounted_at(staging)
    assert entry is not None and entry.fs_type == fs_type
    await csi.publish(volume.volume_id, str(staging), str(target), fs_type=fs_type)
    payload = os.urandom(3 * MIB)
    write_synced(target / "data.bin", payload)
    (target / "dir").mkdir()
    write_synced(target / "dir" / "note.txt", b"hello from the pod\n")
    stats = await csi.stats(volume.volume_id, str(target))
    used = {u.unit: u for u in stats.usage}
    assert used[1].total > 250 * MIB and used[1].used >= 3 * MIB
    assert used[2].total > 0  # inodes

    await csi.unpublish(volume.volume_id, str(target))
    assert mounts.mounted_at(target) is None and not target.exists()
    await csi.unstage(volume.volume_id, str(staging))
    assert mounts.mounted_at(staging) is None

    await csi.stage(volume.volume_id, str(staging), fs_type=fs_type)
    target2 = box.target("pod-2")
    await csi.publish(volume.volume_id, str(staging), str(target2), fs_type=fs_type)
    assert (target2 / "data.bin").read_bytes() == payload
    assert (target2 / "dir" / "note.txt").read_bytes() == b"hello from the pod\n"
    await csi.unpublish(volume.volume_id, str(target2))
    await csi.unstage(volume.volume_id, str(staging))
    await csi.delete_volume(volume.volume_id)
    await until(lambda: not image.exists(), "the deleted volume's image to go", 10)
    assert await csi.list_volumes() == []


async def test_block_volume_lifecycle(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    volume = await csi.create_volume("pvc-block", 64 * MIB, block=True)
    staging, target = box.staging("blk"), box.target("pod-b")
    await csi.stage(volume.volume_id, str(staging), block=True)
    await csi.publish(volume.volume_id, str(staging), str(target), block=True)
    assert target.is_file() or target.is_block_device()
    pattern = bytes(range(256)) * 4096  # 1 MiB
    fd = os.open(target, os.O_RDWR)
    try:
        assert os.lseek(fd, 0, os.SEEK_END) == 64 * MIB
        os.pwrite(fd, pattern, 5 * MIB)
        os.fsync(fd)
    finally:
        os.close(fd)
    await csi.unpublish(volume.volume_id, str(target))
    await csi.unstage(volume.volume_id, str(staging))

    await csi.stage(volume.volume_id, str(staging), block=True)
    await csi.publish(volume.volume_id, str(staging), str(target), block=True)
    fd = os.open(target, os.O_RDONLY)
    try:
        assert os.pread(fd, len(pattern), 5 * MIB) == pattern
    finally:
        os.close(fd)
    stats = await csi.stats(volume.volume_id, str(target))
    assert stats.usage[0].total == 64 * MIB

    readonly_target = box.target("pod-ro")
    await csi.publish(volume.volume_id, str(staging), str(readonly_target), block=True, readonly=True)
    fd = os.open(readonly_target, os.O_WRONLY)
    try:
        with pytest.raises(OSError):  # a read-only loop device refuses writes (EPERM)
            os.pwrite(fd, b"x" * 4096, 0)
    finally:
        os.close(fd)
    fd = os.open(readonly_target, os.O_RDONLY)
    try:
        assert os.pread(fd, len(pattern), 5 * MIB) == pattern
    finally:
        os.close(fd)
    await csi.unpublish(volume.volume_id, str(readonly_target))
    await csi.unpublish(volume.volume_id, str(target))
    await csi.unstage(volume.volume_id, str(staging))
    await csi.delete_volume(volume.volume_id)


async def test_readonly_filesystem_publish(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    _, csi = driver
    volume = await csi.create_volume("pvc-ro", 64 * MIB)
    staging = box.staging("ro")
    await csi.stage(volume.volume_id, str(staging))
    rw, ro = box.target("writer"), box.target("reader")
    await csi.publish(volume.volume_id, str(staging), str(rw))
    await csi.publish(volume.volume_id, str(staging), str(ro), readonly=True)
    write_synced(rw / "shared.txt", b"visible to both")
    assert (ro / "shared.txt").read_bytes() == b"visible to both"
    with pytest.raises(OSError):
        (ro / "nope").write_bytes(b"x")
    for target in (rw, ro):
        await csi.unpublish(volume.volume_id, str(target))
    await csi.unstage(volume.volume_id, str(staging))
    await csi.delete_volume(volume.volume_id)


async def test_image_files_use_io_uring_where_qsd_can(box: Sandbox, driver: tuple[Driver, CSIClient]) -> None:
    """QSD >= 10 reads and writes image files with io_uring (asked of QSD itself), older ones with threads;
    a volume opened either way serves I/O."""
    drv, csi = driver
    volume = await csi.create_volume("pvc-aio", 64 * MIB, block=True)
    image = box.state_dir / "pool" / f"{volume.volume_id}.qcow2"
    expected = "io_uring" if drv.qsd.daemons[0].version >= (10, 0, 0) else "threads"
    assert drv.volumes.pools["default"].storage(image).aio == expected
    staging, target = box.staging("aio"), box.target("aio")
    await csi.stage(volume.volume_id, str(staging), block=True)
    await csi.publish(volume.volume_id, str(staging), str(target), block=True)
    payload = os.urandom(1 << 20)
    fd = os.open(target, os.O_RDWR | os.O_DIRECT)
    try:
        buffer = mmap.mmap(-1, len(payload))
        buffer.write(payload)
        assert os.pwritev(fd, [buffer], 4 * MIB) == len(payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    await csi.unpublish(volume.volume_id, str(target))
    await csi.unstage(volume.volume_id, str(staging))
    await csi.stage(volume.volume_id, str(staging), block=True)
    await csi.publish(volume.volume_id, str(staging), str(target), block=True)
    with open(target, "rb") as handle:
        handle.seek(4 * MIB)
        assert handle.read(len(payload)) == payload
    await csi.unpublish(volume.volume_id, str(target))
    await csi.unstage(volume.volume_id, str(staging))
    await csi.delete_volume(volume.volume_id)
