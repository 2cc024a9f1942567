"""A volume's exports over its open nodes: FUSE (a growable one on its size guard) and vhost-user-blk.

`csi_qsd.qsd.attach` opens the nodes an export stands on; here the export
is added over them, and what it needs first: the FUSE file to mount on,
the size guard's length, the iothread a vhost-user-blk export runs in.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from csi_qsd.errors import QSDError
from csi_qsd.params import ImageFormat
from csi_qsd.qcow2 import header
from csi_qsd.qsd import graph, vhost_greeting
from csi_qsd.qsd.attach import TopImage
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.iothreads import IOThreadPool
from csi_qsd.qsd.storage import ImageFile

SECTOR = 512  # QEMU gives a node a length in whole sectors


async def has_export(client: QSDClient, export_id: str) -> bool:
    exports = await client.exports()
    return export_id in exports and not exports[export_id]["shutting_down"]


def fuse_export(top: TopImage, mountpoint: Path, *, writable: bool, iothreads: list[str] | None = None,
                io_uring: bool = False, growable: bool = False) -> graph.QMPArgs:
    """The block-export-add arguments of a FUSE export at `mountpoint`, made ready for it (a regular file),
    served by `iothreads` or QSD's main loop, over io_uring where `io_uring`."""
    mountpoint.parent.mkdir(parents=True, exist_ok=True)
    mountpoint.touch(mode=0o600, exist_ok=True)
    return graph.fuse_export(top.nodes, mountpoint, writable=writable, iothreads=iothreads, io_uring=io_uring,
                             growable=growable)


async def add_fuse_export(client: QSDClient, top: TopImage, spec: graph.QMPArgs) -> None:
    """Add the FUSE export `spec` over `top`'s open nodes, with the size guard a growable one stands on."""
    nodes = top.nodes
    if spec["node-name"] != nodes.size_guard:
        await client.export_add(spec)
        return
    steps: list[tuple[str, graph.QMPArgs]] = []
    if nodes.size_guard not in await client.node_names():
        steps.append(("blockdev-add", graph.size_guard_blockdev(nodes, await _throttle_length(client, top))))
    # In one round trip: the export names the guard, so it is refused if the guard was.
    answers = await client.execute_in_turn([*steps, ("block-export-add", spec)])
    refused = [answer for answer in answers if isinstance(answer, QSDError)]
    if refused:
        raise refused[0]


async def _throttle_length(client: QSDClient, top: TopImage) -> int:
    """The length of the volume's throttle filter: a qcow2 image file's virtual size from its header, else QSD's.

    QEMU gives a qcow2 node the header's size in whole sectors, and writes
    the header before a resize returns. Reading it spares asking QSD for
    every node's full image info (`query-named-block-nodes`), a cost that
    grows with every volume QSD serves: 8 ms with 20 staged.
    """
    if top.params.format is ImageFormat.QCOW2 and isinstance(top.storage, ImageFile):
        head = await asyncio.to_thread(header.read_file, top.storage.path)
        if head is not None:
            return head.size // SECTOR * SECTOR
    return (await client.named_nodes())[top.nodes.throttle]["virtual_size"]


async def ensure_vhost_export(
    client: QSDClient, top: TopImage, socket: Path, *, writable: bool, iothreads: IOThreadPool | None,
) -> bool:
    """Export over vhost-user-blk at `socket`, in a thread of the `iothreads` pool (the least loaded) or, for
    None, QSD's main loop; True if it had to be added."""
    nodes = top.nodes
    if await has_export(client, nodes.vhost_export):
        return False
    socket.unlink(missing_ok=True)
    pool_thread = iothreads.place(nodes.vhost_export, await client.exports()) if iothreads is not None else None
    own = graph.iothread_object(nodes, top.params) if iothreads is not None else None
    if own is not None and own["id"] not in await client.iothreads():
        await client.execute("object-add", own)
    await client.export_add(
        graph.vhost_user_blk_export(nodes, socket, top.params, writable=writable, pool_thread=pool_thread))
    await vhost_greeting.greet(socket)  # before any resize can reach it
    return True
