"""A read-only NBD export of a snapshot for backup tools, on a UNIX socket of the operator's choosing.

qemu-nbd serves the snapshot's frozen image with its backing chain,
sharing it with QSD (which may read it as a volume's backing file), with
these NBD metadata contexts:

* `base:allocation`: what reads as data or zeros;
* `qemu:allocation-depth`: the layer of the chain each range comes from (1 is
  the snapshot's own image), so a client can tell what changed since an older
  snapshot that is still a layer of this one;
* `qemu:dirty-bitmap:cbt`: what changed since the snapshot before it
  (`csi_qsd.qcow2.layer_bitmaps`), and `qemu:dirty-bitmap:cbt-NNN-IMAGE` for the
  layers a flatten merged into it. Bitmaps QSD left inconsistent are not offered.

It runs until SIGINT or SIGTERM (`csi_qsd.sys.nbd_unix` starts and stops
the server). Only snapshots this node's catalog holds can be served, and
not those of encrypted volumes (a backup of them stays encrypted instead).

`--socket` names a path the server binds; qemu-nbd removes whatever is there
first, and so does the way out. Both are refused (before qemu-nbd starts)
unless the path is missing or a socket: a mistyped path must not cost the
operator a file, and a link must not make the driver remove another one.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

from csi_qsd import validate
from csi_qsd.catalog import Catalog, SnapshotState
from csi_qsd.errors import InvalidArgument, NBDError, NotFound
from csi_qsd.qcow2 import image_bitmaps, keyed
from csi_qsd.qcow2.imagemap import qcow2_spec
from csi_qsd.sys import nbd_unix
from csi_qsd.sys.signals import stop_event


async def served_contexts(qemu_img: str, image: Path) -> list[str]:
    """The bitmaps worth offering: every consistent persistent bitmap of the snapshot's own image."""
    info = (await image_bitmaps.chain_info(qemu_img, image))[0]
    return sorted(name for name, bitmap in image_bitmaps.bitmaps_of(info).items() if bitmap.consistent)


def remove_stale_socket(socket: Path) -> None:
    """Remove a socket left at `socket` (nothing there is fine). Raises InvalidArgument if something else is,
    a symbolic link included (never followed)."""
    try:
        mode = os.lstat(socket).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise InvalidArgument(f"{socket} exists and is not a socket ({stat.filemode(mode)}): give a path that is "
                              "free or holds a socket left by an earlier export; nothing was removed")
    socket.unlink(missing_ok=True)


async def snapshot_image(catalog_path: Path, snapshot_id: str) -> Path:
    """The frozen image of a visible, ready snapshot in this node's catalog. Raises InvalidArgument, NotFound."""
    validate.snapshot_id(snapshot_id, "snapshot_id")
    if not catalog_path.exists():
        raise InvalidArgument(f"no driver catalog at {catalog_path}: serve the snapshot on its node")
    async with Catalog(catalog_path) as catalog:
        record = await catalog.snapshot(snapshot_id)
    if record is None or record.hidden or record.state is not SnapshotState.READY:
        raise NotFound(f"snapshot {snapshot_id} is not in the catalog at {catalog_path}")
    return record.image


async def serve(
    catalog_path: Path, snapshot_id: str, socket: Path, *, qemu_img: str = "qemu-img", qemu_nbd: str = "qemu-nbd",
) -> int:
    """Serve the snapshot until SIGINT/SIGTERM, having printed one JSON line saying where and what; 0 then.

    Raises InvalidArgument, NotFound, HostCommandError if qemu-nbd cannot
    start, NBDError if it ends by itself.
    """
    image = await snapshot_image(catalog_path, snapshot_id)
    if await asyncio.to_thread(keyed.encrypted, image):
        # An NBD client reads plaintext: that would be the way around the volume's key.
        raise InvalidArgument(
            f"snapshot {snapshot_id} is of an encrypted volume: nbd-export would serve its data in the clear; "
            "back it up with `csi-qsd volume backup --key-file` instead (the backup stays encrypted)")
    bitmaps = await served_contexts(qemu_img, image)
    remove_stale_socket(socket)
    try:
        async with nbd_unix.serving(qemu_nbd, qcow2_spec(image, read_only=True), socket, persistent=True,
                                           clients=16, bitmaps=bitmaps, allocation_depth=True) as server:
            print(json.dumps({
                "snapshot_id": snapshot_id, "uri": f"nbd+unix:///?socket={socket}",
                "contexts": ["base:allocation", "qemu:allocation-depth", *(f"qemu:dirty-bitmap:{b}" for b in bitmaps)],
            }), flush=True)
            stop = stop_event()
            ended = asyncio.create_task(server.ended())
            stopped = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait([ended, stopped], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (ended, stopped):
                    task.cancel()
                await asyncio.gather(ended, stopped, return_exceptions=True)
            if not stop.is_set():
                raise NBDError(f"qemu-nbd serving snapshot {snapshot_id} on {socket} ended by itself")
    finally:
        remove_stale_socket(socket)
    return 0
