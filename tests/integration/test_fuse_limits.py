"""A container volume's FUSE export may have as many requests in flight as its loop device queues.

The kernel's default (12 background requests per FUSE connection) cut a
pod's queue depth before QSD saw it; the driver raises it on every export
it adds (`csi_qsd.sys.fusectl`), also after QSD is replaced.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from csi_qsd.exports.fuse_loop import export_file
from csi_qsd.server import Driver
from csi_qsd.sys import fusectl
from testing.harness import Sandbox, qsd_pid, until, wait_new_qsd

MIB = 1 << 20


def max_background(export: Path) -> int:
    connection = fusectl.CONNECTIONS / str(os.minor(os.stat(export).st_dev))
    return int((connection / "max_background").read_text())


async def test_exports_get_the_loop_devices_queue_depth(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    server, csi = driver
    volume = await csi.create_volume("pvc-q", 16 * MIB, block=True)
    staging = box.staging("q")
    await csi.stage(volume.volume_id, str(staging), block=True)
    export = export_file(server.config.exports_dir, volume.volume_id)
    assert max_background(export) >= fusectl.MAX_BACKGROUND  # QEMU 11 sets more itself (65535), never lowered

    old = qsd_pid(box)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    await wait_new_qsd(box, old)
    await until(lambda: server.daemon.ready, "the new QSD rebuilt", 60)
    assert max_background(export) >= fusectl.MAX_BACKGROUND  # a new export, a new connection, raised again
    await csi.unstage(volume.volume_id, str(staging))
    await csi.delete_volume(volume.volume_id)
