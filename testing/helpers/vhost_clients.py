"""VM clients coming and going while other volumes change: the churn the vhost test and its bench both run.

A client connects to a published VM volume's vhost-user socket and leaves,
again and again (`come_and_go`), while other VM volumes are made, staged,
snapshotted and taken away (`graph_round`): every round adds and removes
block nodes, the graph changes that aborted QSD 10.0.13 under an export in
an iothread.
"""

from __future__ import annotations

import asyncio
import contextlib

from csi_qsd.cli.client import CSIClient
from testing.harness import Sandbox

MIB = 1 << 20
VM = {"export": "vhost-user-blk"}  # the parameters of a VM volume
CONNECTIONS = 500  # the bar the runtime's move to iothreads was decided by


async def come_and_go(socket: str, stop: asyncio.Event, count: list[int]) -> None:
    """Connect to the export and leave, again and again, as VMs starting and stopping do; counted in `count`."""
    while not stop.is_set():
        _, writer = await asyncio.open_unix_connection(socket)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        count[0] += 1
        await asyncio.sleep(0.005)


async def graph_round(csi: CSIClient, box: Sandbox, i: int) -> None:
    """Another VM volume made, staged, snapshotted and taken away again: block nodes added and removed."""
    other = (await csi.create_volume(f"pvc-other-{i}", 32 * MIB, VM)).volume_id
    other_staging = box.staging(f"other-{i}")
    await csi.stage(other, str(other_staging))
    snapshot = await csi.create_snapshot(f"snap-other-{i}", other)
    await csi.delete_snapshot(snapshot.snapshot_id)
    await csi.unstage(other, str(other_staging))
    await csi.delete_volume(other)
