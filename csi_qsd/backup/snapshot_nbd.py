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

It runs in the foreground until SIGINT or SIGTERM. Only snapshots this
node's catalog holds can be served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from csi_qsd.qcow2 import image_bitmaps

from csi_qsd import validate
from csi_qsd.catalog import Catalog, SnapshotState
from csi_qsd.errors import InvalidArgument, NotFound
from csi_qsd.qcow2.imagemap import qcow2_spec
from csi_qsd.sys.signals import stop_event


async def served_contexts(qemu_img: str, image: Path) -> list[str]:
    """The bitmaps worth offering: every consistent persistent bitmap of the snapshot's own image."""
    info = (await image_bitmaps.chain_info(qemu_img, image))[0]
    return sorted(name for name, bitmap in image_bitmaps.bitmaps_of(info).items() if bitmap.consistent)


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
    """Serve the snapshot until SIGINT/SIGTERM; print one JSON line saying where and what first. qemu-nbd's code."""
    image = await snapshot_image(catalog_path, snapshot_id)
    bitmaps = await served_contexts(qemu_img, image)
    argv = [qemu_nbd, "--read-only", "--persistent", "--shared=16", "--allocation-depth", "--socket", str(socket)]
    for name in bitmaps:
        argv += ["--bitmap", name]
    socket.unlink(missing_ok=True)
    process = await asyncio.create_subprocess_exec(*argv, qcow2_spec(image, read_only=True), stdin=asyncio.subprocess.DEVNULL)
    try:
        while not socket.exists() and process.returncode is None:
            await asyncio.sleep(0.02)
        print(json.dumps({
            "snapshot_id": snapshot_id, "uri": f"nbd+unix:///?socket={socket}",
            "contexts": ["base:allocation", "qemu:allocation-depth", *(f"qemu:dirty-bitmap:{b}" for b in bitmaps)],
        }), flush=True)
        stop = stop_event()
        ended = asyncio.create_task(process.wait())
        await asyncio.wait([ended, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if not ended.done():
            process.terminate()
        return await process.wait()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        socket.unlink(missing_ok=True)
