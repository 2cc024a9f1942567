"""What a qcow2 chain names below it, read from the images' headers: never opened through QEMU.

A volume copied from another node reads through a local copy image whose
backing file is the source node's NBD export (a `json:` name). QSD opens
that link whenever it opens any image whose chain reaches the copy image,
and waits for it with its monitor silent, so the driver must know the links
of a chain before it asks QSD to open it. This module only reads headers;
it never opens a link.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from csi_qsd.qcow2 import header

MAX_NAME = 4096  # QEMU's limit on a backing file name (PATH_MAX)
MAX_DEPTH = 256


def backing_name(image: Path) -> str:
    """The backing file name `image`'s qcow2 header holds ('' for none, or for an image that is not qcow2).

    Raises OSError.
    """
    with open(image, "rb") as f:
        head = header.parse(f.read(header.STRUCT.size))
        if head is None or head.backing_offset == 0 or head.backing_size == 0 or head.backing_size > MAX_NAME:
            return ""
        f.seek(head.backing_offset)
        return f.read(head.backing_size).decode("utf-8", "replace")


def names_backing(image: Path) -> bool:
    """True while a qcow2 image's header names a backing file (a copy image until it stands alone). Raises OSError."""
    head = header.read_file(image)
    return head is not None and head.backing_offset != 0


def nbd_address(name: str) -> str:
    """host:port of the NBD server (over TCP) a `json:` backing name reads from; '' for any other name."""
    if not name.startswith("json:"):
        return ""
    try:
        spec: Any = json.loads(name[5:])
    except ValueError:
        return ""
    while isinstance(spec, dict):
        if spec.get("driver") == "nbd":
            server = spec.get("server")
            if isinstance(server, dict) and server.get("type") == "inet":
                host = str(server.get("host", ""))
                return f"[{host}]:{server.get('port')}" if ":" in host else f"{host}:{server.get('port')}"
            return ""
        spec = spec.get("file")
    return ""


def nbd_links(image: Path) -> list[str]:
    """The NBD servers (host:port) that opening `image` with its backing chain would connect to.

    Follows the chain from header to header (relative names from the image's
    directory) until an image names none, names an NBD export, or cannot be
    read (what QEMU would then refuse to open is not a link).
    """
    links: list[str] = []
    current = image
    for _ in range(MAX_DEPTH):
        try:
            name = backing_name(current)
        except OSError:
            break
        if not name:
            break
        if name.startswith("json:"):
            address = nbd_address(name)
            if address:
                links.append(address)
            break
        current = Path(name) if name.startswith("/") else current.parent / name
    return links
