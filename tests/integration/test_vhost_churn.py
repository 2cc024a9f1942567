"""VM clients connecting and leaving while other volumes come and go: QSD must live through it.

On QSD 10.0.13 a vhost-user-blk export in an iothread aborted QSD
(vhost_user_server_attach_aio_context: "Assertion `!co_ctx || co_ctx == ctx'
failed") when a client connected or left while a graph change (any
blockdev-add or blockdev-del, which drains every node) was under way: within
the first 1 to 43 connections. There the driver runs these exports in QSD's
main loop.
"""

from __future__ import annotations

import asyncio
import contextlib

from csi_qsd.csi_client import CSIClient
from csi_qsd.server import Driver
from tests.harness import Sandbox, qsd_pid

MIB = 1 << 20
VM = {"export": "vhost-user-blk"}


async def come_and_go(socket: str, stop: asyncio.Event) -> int:
    """Connect to the export and leave, again and again, as VMs starting and stopping do; how many times."""
    count = 0
    while not stop.is_set():
        _, writer = await asyncio.open_unix_connection(socket)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        count += 1
        await asyncio.sleep(0.005)
    return count


async def test_vm_clients_come_and_go_while_other_volumes_change(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    daemon, csi = driver
    pid, restarts = qsd_pid(box), daemon.daemon.restarts
    vid = (await csi.create_volume("pvc-vm-churn", 32 * MIB, VM)).volume_id
    staging, target = box.staging("vm-churn"), box.target("vm-churn")
    await csi.stage(vid, str(staging))
    await csi.publish(vid, str(staging), str(target))
    stop = asyncio.Event()
    clients = asyncio.create_task(come_and_go(str(target / "vhost-user-blk.sock"), stop))
    try:
        for i in range(10):  # each stage, snapshot and unstage adds or removes block nodes: graph changes
            other = (await csi.create_volume(f"pvc-other-{i}", 32 * MIB, VM)).volume_id
            other_staging = box.staging(f"other-{i}")
            await csi.stage(other, str(other_staging))
            snapshot = await csi.create_snapshot(f"snap-other-{i}", other)
            await csi.delete_snapshot(snapshot.snapshot_id)
            await csi.unstage(other, str(other_staging))
            await csi.delete_volume(other)
    finally:
        stop.set()
        connections = await clients
    assert connections > 20, "the clients must have come and gone throughout"
    assert (qsd_pid(box), daemon.daemon.restarts) == (pid, restarts), "QSD died under the VM clients"
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))
