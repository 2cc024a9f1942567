"""Reading and zeroing a whole device that only QSD can reach (a namespace QSD drives over VFIO).

The host has no block device for such a namespace, so its size, its first
bytes (the pool label, foreign signatures) and its scrubs go through QSD.
Only QMP lives here; what the bytes mean is the pool's business.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from csi_qsd.errors import QSDError
from csi_qsd.qsd.client import JOB_BY_HAND, QSDClient


async def node_size(client: QSDClient, node_name: str) -> int:
    """A node's size as QSD sees it (`query-named-block-nodes`, image virtual-size). Raises QSDError."""
    info = (await client.named_nodes()).get(node_name)
    if info is None:
        raise QSDError(f"qemu-storage-daemon has no node {node_name}")
    return info["virtual_size"]


@contextlib.asynccontextmanager
async def view(client: QSDClient, node_name: str, mountpoint: Path, *, writable: bool = False) -> AsyncIterator[Path]:
    """The node as a regular file (a FUSE export at `mountpoint`), to read its start, probe it, write a label.

    Read-only, it takes neither the write nor the resize permission and can
    stand beside the windows of live volumes on the same node; writable, it
    takes both (QEMU's FUSE export), so only while the node has no windows.
    """
    export_id = f"{node_name}-view"
    mountpoint.parent.mkdir(parents=True, exist_ok=True)
    mountpoint.touch(mode=0o600, exist_ok=True)
    await client.export_add({"type": "fuse", "id": export_id, "node-name": node_name,
                             "mountpoint": str(mountpoint), "writable": writable, "allow-other": "off"})
    try:
        yield mountpoint
    finally:
        await client.export_del(export_id)
        mountpoint.unlink(missing_ok=True)


async def zero_range(client: QSDClient, node_name: str, start: int, length: int) -> None:
    """Write zeroes over [start, start+length) of `node_name`, issued by QSD itself. Raises QSDError.

    A backup job copies a `null-co` source that reads as zeroes into a
    temporary window over the range: the copy sees zero blocks and sends
    write-zeroes to the device. It works beside live windows (the job takes
    no resize permission); a crash midway leaves the extent marked for
    scrubbing, so the caller zeroes it again.
    """
    tag = f"z{start:x}"[:24]
    source, window = f"{tag}-src", f"{tag}-dst"
    await client.blockdev_add({"driver": "null-co", "node-name": source, "size": length, "read-zeroes": True})
    try:
        await client.blockdev_add({"driver": "raw", "node-name": window, "file": node_name,
                                   "offset": start, "size": length})
        try:
            await client.run_job("blockdev-backup", {"job-id": tag, "device": source, "target": window,
                                                     "sync": "full", **JOB_BY_HAND}, tag)
        finally:
            await client.blockdev_del(window)
    finally:
        await client.blockdev_del(source)
