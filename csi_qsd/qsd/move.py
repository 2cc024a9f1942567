"""QSD's side of moving a volume to a new home while its exports stay up (`csi_qsd.node.moves` orders the steps).

The old top (`old`: format node over the old window) and the new one
(`new`: the next generation's nodes over the new window, at the same size)
sit side by side under the volume's throttle filter, which every export
stands on; the switch gives the filter the new top as its child, so
exports, guests and mounts never see a gap.

Two ways to copy, because QEMU 10.0 refuses a mirror job under a writable
FUSE export (the export holds the RESIZE permission, which the job's
filter node does not share: "Permission conflict on node ...: permissions
'resize' are both required by an unnamed block device ... and unshared by
mirror job"):

* `mirror` (vhost-user-blk exports): blockdev-mirror from the filter in
  write-blocking mode, which the caller commits once QEMU reports it
  actively synced (every write from then on lands in both homes before it
  is acknowledged); block-job-complete then replaces the old top.
* `copy_converging` + `copy_rest` + `switch` (FUSE exports): a dirty
  bitmap and a full blockdev-backup started in one transaction, then
  incremental backups of what was written meanwhile until little is left;
  the last copy runs while the caller holds the writers still (a frozen
  filesystem) and must leave nothing dirty, and a blockdev-reopen of the
  filter switches it to the new top.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from csi_qsd.errors import Aborted, QSDError
from csi_qsd.qsd import graph
from csi_qsd.qsd.attach import TopImage
from csi_qsd.qsd.client import JOB_BY_HAND, QSDClient

log = logging.getLogger(__name__)

BITMAP = "csi-qsd-move"  # on the old top's format node: what was written since the last copy
GRANULARITY = 64 * 1024
ROUNDS = 8  # incremental copies before the still copy at most
STILL_ENOUGH = 64 * 1024 * 1024  # dirty bytes left that are copied with the writers held still
POLL = 0.05
# Copies in flight per backup. QEMU's default (64) fills the device's queue: a pod's synced 64 KiB writes
# then waited up to 1.6-2.9 s during a 1 GiB move; with 2, at most 0.18 s (the frozen last copy), the move
# taking 1.9-2.3x a dd of the same bytes instead of 1.1-2.0x (`e2e.bench.grow_by_move`, three runs each).
COPY_WORKERS = 2


async def open_new_home(client: QSDClient, new: TopImage) -> None:
    """The next generation's window and format node, beside the old ones; idempotent."""
    nodes = new.nodes
    present = await client.node_names()
    if nodes.file not in present:
        await client.blockdev_add(new.storage.protocol_blockdev(nodes, new.params, read_only=False))
    if nodes.format not in present:
        await client.blockdev_add(graph.format_blockdev(nodes, new.params, read_only=False))


async def serves(client: QSDClient, top: TopImage) -> bool:
    """True if the volume's throttle filter (under every export) reads `top`'s format node."""
    return await client.child_of(top.nodes.throttle) == top.nodes.format


# mirror ----------------------------------------------------------------


async def mirror(
    client: QSDClient, old: TopImage, new: TopImage, synced: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Mirror the volume into `new` under its exports; call `synced` once every write reaches both, then switch.

    Picks up a mirror job a crash left running. Raises QSDError if QEMU
    ends the job with an error; the caller decides what is left to undo.
    """
    job = old.nodes.move_job
    if await client.job(job) is None:
        await client.execute("blockdev-mirror", {
            "job-id": job, "device": old.nodes.throttle, "target": new.nodes.format,
            "replaces": old.nodes.format, "sync": "full", "copy-mode": "write-blocking", **JOB_BY_HAND,
        })
    while not _synced(await client.job(job)):
        await asyncio.sleep(POLL)
    if synced is not None:
        await synced()
    await client.execute("block-job-complete", {"device": job})
    await client.finish_job(job)


def _synced(info: dict[str, Any] | None) -> bool:
    """True once the mirror copied everything and mirrors each write before acknowledging it.

    QEMU before 8.2 does not report `actively-synced`; there a ready
    write-blocking mirror is in sync.
    """
    if info is None or info["status"] == "concluded":
        raise QSDError(f"the mirror job ended before it was in sync: {info and info.get('error')}")
    return bool(info.get("ready")) and bool(info.get("actively-synced", True))


# backup: for exports that forbid a mirror ------------------------------


async def copy_converging(client: QSDClient, old: TopImage, new: TopImage) -> None:
    """Copy the old top into the new one while writes go on, until little is left to copy."""
    source = old.nodes.format
    await cancel(client, old)
    await _drop_bitmap(client, source)
    await client.run_job("transaction", {"actions": [
        {"type": "block-dirty-bitmap-add", "data": {"node": source, "name": BITMAP, "granularity": GRANULARITY}},
        {"type": "blockdev-backup", "data": _backup(old, new, {"sync": "full"})},
    ]}, old.nodes.move_job)
    for _ in range(ROUNDS):
        left = await dirty_bytes(client, source)
        if left is not None and left <= STILL_ENOUGH:
            return
        await _copy_dirty(client, old, new)


async def copy_rest(client: QSDClient, old: TopImage, new: TopImage) -> None:
    """With the writers held still: copy what is left, and prove nothing is. Raises Aborted if writes went on."""
    source = old.nodes.format
    if await dirty_bytes(client, source) is None:
        await copy_converging(client, old, new)  # the record of writes is gone (a restarted copy): begin again
    await _copy_dirty(client, old, new)
    left = await dirty_bytes(client, source)
    if left:
        raise Aborted(f"volume {old.volume_id} was written to while it was to be held still ({left} bytes); "
                      "the move was undone, retry")


async def switch(client: QSDClient, new: TopImage) -> None:
    """Make the throttle filter (and so every export) read the new top, live."""
    await client.execute("blockdev-reopen", {"options": [graph.throttle_blockdev(new.nodes)]})


async def dirty_bytes(client: QSDClient, node: str) -> int | None:
    """Bytes written to `node` since the last copy; None if it has no move bitmap."""
    for item in await client.execute("query-named-block-nodes", {"flat": True}):
        if item["node-name"] == node:
            for bitmap in item.get("dirty-bitmaps", []):
                if bitmap["name"] == BITMAP:
                    return int(bitmap["count"])
    return None


def _backup(old: TopImage, new: TopImage, extra: dict[str, Any]) -> dict[str, Any]:
    return {"job-id": old.nodes.move_job, "device": old.nodes.format, "target": new.nodes.format,
            "x-perf": {"max-workers": COPY_WORKERS}, **JOB_BY_HAND, **extra}


async def _copy_dirty(client: QSDClient, old: TopImage, new: TopImage) -> None:
    """One incremental backup: what the bitmap marks; the bitmap then holds only the writes made meanwhile."""
    await client.run_job("blockdev-backup", _backup(old, new, {
        "sync": "bitmap", "bitmap": BITMAP, "bitmap-mode": "on-success"}), old.nodes.move_job)


async def _drop_bitmap(client: QSDClient, node: str) -> None:
    if await dirty_bytes(client, node) is not None:
        await client.execute("block-dirty-bitmap-remove", {"node": node, "name": BITMAP})


# ends ------------------------------------------------------------------


async def drop_old(client: QSDClient, old: TopImage) -> None:
    """Close the old top, which nothing reads any more; idempotent."""
    present = await client.node_names()
    for node in (old.nodes.format, old.nodes.file):
        if node in present:
            await client.blockdev_del(node)


async def abandon(client: QSDClient, old: TopImage, new: TopImage) -> None:
    """Undo a move that did not commit: stop its job, forget its bitmap, close the new top; idempotent."""
    await cancel(client, old)
    if old.nodes.format in await client.node_names():
        await _drop_bitmap(client, old.nodes.format)
    await drop_old(client, new)


async def cancel(client: QSDClient, old: TopImage) -> None:
    """Stop the volume's move job if one runs (a mirror is cancelled before it switched: the old top stays)."""
    job = old.nodes.move_job
    info = await client.job(job)
    if info is None:
        return
    if info["status"] != "concluded":
        await client.execute("block-job-cancel", {"device": job, "force": True})
    try:
        await client.finish_job(job)
    except QSDError:
        pass  # a cancelled job ends with an error: that is what was asked for
