"""Encrypted qcow2 images opened by host tools (qemu-img, qemu-nbd): the key on stdin, every layer keyed.

An encrypted volume's images each hold a LUKS header of their own
(`encrypt.format=luks`), all opened by the volume's passphrase. A tool gets
the passphrase from its stdin, a pipe, as a `secret` object (`SECRET`):
never argv, a file or a log line. QEMU does not give a backing layer the
top's key, so a chain is opened from a `json:` spec naming each layer with
the secret (`chain_spec`), built from the images' headers. What the
qcow2 metadata says (allocation, bitmaps, the backing name) is not
encrypted: reading it needs no key (`csi_qsd.qcow2.tables`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from csi_qsd.errors import FailedPrecondition
from csi_qsd.qcow2 import backing, header
from csi_qsd.sys.run import run
from csi_qsd.sys.volume_keys import VolumeKey

SECRET_ID = "key"
SECRET = f"secret,id={SECRET_ID},file=/dev/stdin,format=base64"  # a tool's `--object`: the key from its stdin
# PBKDF2 time QEMU spends per keyslot when it opens an encrypted layer, in QSD's main loop (its default is
# 2000 ms, per layer of a chain, stalling every export of that QSD): a passphrase from a Secret should be random,
# which no iteration count makes stronger or weaker. Adding a keyslot costs QEMU's benchmark of PBKDF2 (~1 s) more.
ITER_TIME_MS = 100
CREATE_OPTIONS = ["encrypt.format=luks", f"encrypt.key-secret={SECRET_ID}", f"encrypt.iter-time={ITER_TIME_MS}"]
CHECK_TIMEOUT = 60.0


def encrypted(image: Path) -> bool:
    """Whether `image` is a qcow2 with a LUKS header (from its header alone). Raises OSError."""
    head = header.read_file(image)
    return head is not None and head.crypt_method == header.CRYPT_LUKS


def local_chain(image: Path) -> tuple[list[Path], Path, str]:
    """The local images `image`'s header chain reads through (newest first, as their headers name them), the
    last of them (or `image`), and the `json:` name that one reads through next ("" where the chain ends here).

    Raises FailedPrecondition for a chain that loops; OSError if a header cannot be read.
    """
    found: list[Path] = []
    current = image
    while len(found) < backing.MAX_DEPTH:
        name = backing.backing_name(current)
        if not name or name.startswith("json:"):
            return found, current, name
        current = current.parent / name
        found.append(current)
    raise FailedPrecondition(f"image {image} reads through more than {backing.MAX_DEPTH} images")


def chain_below(image: Path) -> list[Path]:
    """The images `image`'s header chain reads through, newest first: all on this node (host tools read them).

    Raises FailedPrecondition for a chain that leaves the local filesystem
    (a `json:` name: a copy from another node still filling) or loops;
    OSError if a header cannot be read.
    """
    found, last, link = local_chain(image)
    if link:
        raise FailedPrecondition(f"image {last} reads through {link[:40]}…: a copy from another node is read "
                                 "here once it is whole")
    return found


def layer(image: Path, below: dict[str, Any] | None, *, read_only: bool = True) -> dict[str, Any]:
    """One encrypted qcow2 layer opened with the secret, reading through `below` (None: no backing)."""
    spec: dict[str, Any] = {"driver": "qcow2", "encrypt.key-secret": SECRET_ID,
                            "file": {"driver": "file", "filename": str(image.absolute())}, "backing": below}
    if read_only:
        spec.update({"read-only": True, "force-share": True})
    return spec


def chain_spec(image: Path, *, read_only: bool = True) -> dict[str, Any]:
    """A blockdev tree opening `image` and every layer below it, each with the secret: a frozen snapshot is
    read beside QSD (`read_only`: force-share). Raises FailedPrecondition, OSError (`chain_below`)."""
    spec: dict[str, Any] | None = None
    for below in reversed(chain_below(image)):
        spec = layer(below, spec)
    return layer(image, spec, read_only=read_only)


def json_name(spec: dict[str, Any]) -> str:
    return "json:" + json.dumps(spec)


async def opens_with(qemu_img: str, image: Path, key: VolumeKey) -> bool:
    """Whether `key` unlocks `image`'s LUKS header: `qemu-img check` of the image alone, which opens it for I/O.

    Without its backing (each layer has a header of its own) and sharing
    it (QSD may hold it), so a chain in use is checked too. qemu-img's
    exit code 1 is an open it refused (0, 2 and 3 report on an image it opened).
    """
    spec = {"driver": "qcow2", "encrypt.key-secret": SECRET_ID, "backing": None,
            "file": {"driver": "file", "filename": str(image)}}
    code, _ = await run(qemu_img, "check", "-q", "-U", "--object", SECRET, json_name(spec),
                        timeout=CHECK_TIMEOUT, check=False, stdin=key.base64().encode())
    return code != 1
