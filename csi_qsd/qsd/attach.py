"""Bring a volume's nodes and exports into QSD, or take them out, idempotently.

Each function first looks at the live graph, so it is safe to call again after
a crash at any point: it finishes what is missing and leaves what is there.
"""

from __future__ import annotations

from pathlib import Path

from csi_qsd.params import VolumeParameters
from csi_qsd.qsd import graph
from csi_qsd.qsd.client import QSDClient


async def ensure_nodes(
    client: QSDClient, volume_id: str, image: Path, params: VolumeParameters, *, read_only: bool = False
) -> None:
    nodes = graph.nodes_for(volume_id)
    present = await client.named_nodes()
    if nodes.file not in present:
        await client.blockdev_add(graph.file_blockdev(nodes, image, params, read_only=read_only))
    if nodes.format not in present:
        try:
            await client.blockdev_add(graph.format_blockdev(nodes, params, read_only=read_only))
        except Exception:
            if nodes.file not in present:
                await client.blockdev_del(nodes.file)
            raise


async def has_export(client: QSDClient, export_id: str) -> bool:
    exports = await client.exports()
    return export_id in exports and not exports[export_id]["shutting_down"]


async def ensure_fuse_export(client: QSDClient, volume_id: str, mountpoint: Path, *, writable: bool) -> bool:
    """Export over FUSE at `mountpoint` (a regular file); True if it had to be added."""
    nodes = graph.nodes_for(volume_id)
    if await has_export(client, nodes.fuse_export):
        return False
    mountpoint.parent.mkdir(parents=True, exist_ok=True)
    mountpoint.touch(mode=0o600, exist_ok=True)
    await client.export_add(graph.fuse_export(nodes, mountpoint, writable=writable))
    return True


async def ensure_vhost_export(
    client: QSDClient, volume_id: str, socket: Path, params: VolumeParameters, *, writable: bool
) -> bool:
    """Export over vhost-user-blk at `socket`; True if it had to be added."""
    nodes = graph.nodes_for(volume_id)
    if await has_export(client, nodes.vhost_export):
        return False
    socket.unlink(missing_ok=True)
    await client.export_add(graph.vhost_user_blk_export(nodes, socket, params, writable=writable))
    return True


async def remove_volume(client: QSDClient, volume_id: str) -> None:
    """Remove every export and node of `volume_id` that QSD still has."""
    nodes = graph.nodes_for(volume_id)
    for export_id in (nodes.fuse_export, nodes.vhost_export):
        await client.export_del(export_id)
    present = await client.named_nodes()
    for node in nodes.all_nodes:
        if node in present:
            await client.blockdev_del(node)


async def volumes_in_graph(client: QSDClient) -> set[str]:
    """IDs of every volume that has a node or export of ours in QSD."""
    names = set(await client.named_nodes()) | set(await client.exports())
    return {vid for vid in map(graph.volume_of, names) if vid is not None}
