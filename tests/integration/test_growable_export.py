"""A growable FUSE export (QEMU 11's only way to FUSE_ASYNC_DIO) changes nothing a volume is.

QEMU 11.1.3 asks the kernel for FUSE_ASYNC_DIO only on a `growable` export,
and a growable export lets whoever opens its file grow the image by writing
past the end, shrink it by truncating, or empty it with O_TRUNC (no longer
atomic there: the kernel truncates to 0 after the open). The driver puts
such an export on a raw node of fixed size, so each of those is refused,
and a resize or a QSD crash moves that size with the volume. Here on the
real QSD 11 the install bundles, through the driver as kubelet drives it.
"""

from __future__ import annotations

import errno
import os

import pytest

from csi_qsd.exports import fuse_loop
from csi_qsd.qsd import graph
from csi_qsd.sys.tools import bundled
from testing import tiers
from testing.harness import Sandbox, crash_qsd, in_process_driver

MIB = 1 << 20
QSD11 = bundled("qemu-storage-daemon-11")

pytestmark = tiers.needs("integration", "" if os.path.exists(QSD11) else QSD11)


def refused(action: str, call: object) -> None:
    """`call` must fail with an errno: the export refuses what would change the image's size."""
    assert callable(call)
    with pytest.raises(OSError) as caught:
        call()
    assert caught.value.errno in (errno.EOPNOTSUPP, errno.EPERM, errno.EACCES, errno.EINVAL), (action, caught.value)


def size_of(path: os.PathLike[str] | str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


async def test_a_growable_export_cannot_change_the_volume_size(box: Sandbox) -> None:
    async with in_process_driver(box, qsd_binary=QSD11) as (driver, csi):
        assert driver.daemon.fuse_paths.growable, f"QSD 11 offers FUSE_ASYNC_DIO growable only: " \
                                                  f"{driver.daemon.fuse_paths.describe()}"
        vid = (await csi.create_volume("pvc-growable", 32 * MIB, block=True)).volume_id
        staging, target = box.staging("g"), box.target("g")
        await csi.stage(vid, str(staging), block=True)
        await csi.publish(vid, str(staging), str(target), block=True)
        client = driver.daemon.client
        nodes = graph.nodes_for(vid)
        exports = await client.exports()
        assert nodes.fuse_export in exports
        assert nodes.size_guard in await client.node_names(), "the growable export stands on the size guard"
        export = fuse_loop.export_file(box.state_dir / "exports", vid)
        fd = os.open(target, os.O_RDWR)
        try:
            os.pwrite(fd, b"d" * 4096, 0)
            os.fsync(fd)
        finally:
            os.close(fd)

        fd = os.open(export, os.O_RDWR)
        try:
            refused("write past the end", lambda: os.pwrite(fd, b"x" * 4096, 64 * MIB))
            refused("grow by truncate", lambda: os.ftruncate(fd, 64 * MIB))
            refused("shrink by truncate", lambda: os.ftruncate(fd, 8 * MIB))
        finally:
            os.close(fd)
        refused("open with O_TRUNC", lambda: os.close(os.open(export, os.O_WRONLY | os.O_TRUNC)))
        assert size_of(export) == size_of(target) == 32 * MIB
        assert (await client.named_nodes())[nodes.format]["virtual_size"] == 32 * MIB
        fd = os.open(target, os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == b"d" * 4096, "the data stayed"
        finally:
            os.close(fd)

        # A resize goes through the guard and leaves it fixed at the new size.
        assert await csi.expand(vid, str(target), 96 * MIB) == 96 * MIB
        assert size_of(target) == size_of(export) == 96 * MIB
        fd = os.open(export, os.O_RDWR)
        try:
            refused("write past the new end", lambda: os.pwrite(fd, b"x" * 4096, 128 * MIB))
        finally:
            os.close(fd)

        # A QSD crash: the rebuild stands the export on a guard of the volume's size again.
        await crash_qsd(box, csi, vid, target)
        assert nodes.size_guard in await driver.daemon.client.node_names()
        assert size_of(export) == 96 * MIB
        refused("O_TRUNC after the rebuild", lambda: os.close(os.open(export, os.O_WRONLY | os.O_TRUNC)))
        fd = os.open(target, os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == b"d" * 4096
        finally:
            os.close(fd)
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        assert not {n for n in await driver.daemon.client.node_names() if graph.volume_of(n) == vid}
        await csi.delete_volume(vid)
