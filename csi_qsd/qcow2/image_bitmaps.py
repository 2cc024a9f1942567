"""Layer bitmaps in image files, through qemu-img and qemu-nbd: for images QSD does not write.

Adds the tracking bitmap to a new image, carries merged layers' records into
an image before an offline flatten (`csi_qsd.qcow2.layer_bitmaps` says which),
and reads a record's ranges: qemu-nbd serves the frozen image read-only
with the bitmap as a `qemu:dirty-bitmap:` context, and `qemu-img map` over
that export reports its dirty ranges as `"data": false` (QEMU's
`x-dirty-bitmap` reading aid). A frozen image may be open in QSD as a
backing file, so reads share it (`force-share`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from csi_qsd.errors import HostCommandError
from csi_qsd.qcow2 import keyed, layer_bitmaps
from csi_qsd.qcow2.extents import Extent
from csi_qsd.qcow2.imagemap import layer_spec, qcow2_spec
from csi_qsd.qcow2.layer_bitmaps import Bitmap
from csi_qsd.sys import nbd_unix
from csi_qsd.sys.run import run
from csi_qsd.sys.volume_keys import VolumeKey


async def add_tracking(qemu_img: str, image: Path, granularity: int, *, key: VolumeKey | None = None) -> None:
    """Give a new qcow2 image its own record: an enabled persistent bitmap QSD marks on every write.

    The image is opened without its backing chain: a chain QSD has open (a live top) would refuse qemu-img's lock.
    An encrypted image (`key`) is opened with its key on stdin: QEMU opens a LUKS image for writing only
    unlocked. The bitmap, like all qcow2 metadata, is in guest offsets: the volume's changed blocks.
    """
    if key is None:
        await run(qemu_img, "bitmap", "--add", "--enable", "-g", str(granularity), layer_spec(image),
                  layer_bitmaps.OWN)
        return
    await run(qemu_img, "bitmap", "--object", keyed.SECRET, "--add", "--enable", "-g", str(granularity),
              keyed.json_name(keyed.layer(image, None, read_only=False)), layer_bitmaps.OWN,
              stdin=key.base64().encode())


def bitmaps_of(info: dict[str, Any]) -> dict[str, Bitmap]:
    """The persistent bitmaps in one image's `qemu-img info` JSON; in-use ones are inconsistent."""
    found = info.get("format-specific", {}).get("data", {}).get("bitmaps", []) or []
    return {b["name"]: Bitmap(b["name"], int(b["granularity"]), "in-use" not in b.get("flags", []))
            for b in found}


async def chain_info(qemu_img: str, image: Path) -> list[dict[str, Any]]:
    """`qemu-img info` of `image` and every image below it, newest first."""
    _, out = await run(qemu_img, "info", "-U", "--backing-chain", "--output=json", str(image))
    parsed = json.loads(out)
    return parsed if isinstance(parsed, list) else [parsed]


async def carry_before_flatten(qemu_img: str, image: Path) -> None:
    """Freeze `image`'s own record and copy the records of every layer below it into it (offline).

    Each step is one qemu-img call and idempotent: a flatten cut off here is
    redone from the start, skipping the records already carried.
    """
    chain = await chain_info(qemu_img, image)
    own = bitmaps_of(chain[0])
    layers = [(Path(entry["filename"]).name, bitmaps_of(entry)) for entry in chain[1:]]
    if (mine := own.get(layer_bitmaps.OWN)) is not None and mine.consistent:
        await run(qemu_img, "bitmap", "--disable", layer_spec(image), layer_bitmaps.OWN)
    for step in layer_bitmaps.plan_carry(layers, set(own)):
        argv = [qemu_img, "bitmap", "--add", "-g", str(step.granularity)]
        if step.source is not None:
            source = chain[1 + step.layer]
            argv += ["--merge", step.source, "-b", source["filename"], "-F", source["format"]]
        await run(*argv, "--disable", layer_spec(image), step.target)


async def read(qemu_img: str, qemu_nbd: str, image: Path, names: list[str], *,
               key: VolumeKey | None = None) -> list[list[Extent]]:
    """The dirty ranges of each bitmap `names` of a frozen `image`, in that order.

    qemu-nbd serves the image read-only with those bitmaps on a private
    socket until every `qemu-img map` has read its one; an encrypted image
    is opened with its `key` (its chain each layer keyed: QEMU opens it for I/O).
    """
    spec = qcow2_spec(image, read_only=True) if key is None else keyed.json_name(keyed.chain_spec(image))
    with tempfile.TemporaryDirectory(prefix="csi-qsd-bitmap-") as work:
        socket = Path(work) / "nbd.sock"
        async with nbd_unix.serving(qemu_nbd, spec, socket, persistent=True, bitmaps=names,
                                    secret=keyed.SECRET if key else "", stdin=key.base64().encode() if key else None):
            return [await _dirty_ranges(qemu_img, image, socket, name) for name in names]


async def _dirty_ranges(qemu_img: str, image: Path, socket: Path, name: str) -> list[Extent]:
    opts = f"driver=nbd,server.type=unix,server.path={socket},x-dirty-bitmap=qemu:dirty-bitmap:{name}"
    _, out = await run(qemu_img, "map", "--output=json", "--image-opts", opts, timeout=3600)
    try:
        entries = json.loads(out)
    except json.JSONDecodeError as exc:
        raise HostCommandError(f"qemu-img map of bitmap {name} of {image}: {exc}") from exc
    return [(int(e["start"]), int(e["length"])) for e in entries if not e["data"]]
