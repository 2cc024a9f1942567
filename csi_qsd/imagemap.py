"""Allocation maps of qcow2 images, read from the image files with `qemu-img map`.

Snapshot images are frozen (QSD holds them read-only as backing files, or not
at all), so reading their metadata beside a running QSD is safe; `-U` is
needed because QSD holds the image lock. One layer is opened with
`"backing": null`, so its map shows only the clusters that layer holds;
measured on a 10 GiB image with 26 214 scattered 4 KiB writes: 0.22 s for
`qemu-img map` and 0.2 s to parse its 45 000 records.
"""

from __future__ import annotations

import json
from pathlib import Path

from csi_qsd import extents
from csi_qsd.extents import Extent
from csi_qsd.sys.run import run

MAP_TIMEOUT = 600.0


def layer_spec(image: Path) -> str:
    """A `json:` filename that opens one qcow2 image without its backing chain."""
    return "json:" + json.dumps(
        {"driver": "qcow2", "file": {"driver": "file", "filename": str(image)}, "backing": None}
    )


async def layer_allocation(qemu_img: str, image: Path) -> list[Extent]:
    """The ranges `image` itself holds (data or zero clusters), ignoring its backing files.

    Raises HostCommandError if the image cannot be read.
    """
    _, out = await run(qemu_img, "map", "--output=json", "-U", layer_spec(image), timeout=MAP_TIMEOUT)
    return extents.parse_map(out)


async def chain_allocation(qemu_img: str, image: Path) -> list[Extent]:
    """The ranges allocated anywhere in `image`'s backing chain: what plain `qemu-img map` calls present.

    Raises HostCommandError if an image of the chain cannot be read.
    """
    _, out = await run(qemu_img, "map", "--output=json", "-U", "-f", "qcow2", str(image), timeout=MAP_TIMEOUT)
    return extents.parse_map(out)
