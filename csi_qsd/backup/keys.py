"""The passphrase of an encrypted volume's backups: read from the operator's file, checked before anything is written.

A backup of an encrypted volume's snapshot is itself an encrypted qcow2
(LUKS, the volume's passphrase), and so is the image a restore of such
backups writes. The operator gives the passphrase as a file
(`--key-file FILE`: its bytes exactly, as the Secret's entry `key` holds
them), never on the command line. Whether images are encrypted is read from
their headers; a key is checked by opening one image alone with it
(`csi_qsd.qcow2.keyed.opens_with`). Nothing here prints a key.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from csi_qsd.errors import InvalidArgument, PermissionDenied
from csi_qsd.qcow2 import keyed
from csi_qsd.sys.volume_keys import VolumeKey

FLAG = "--key-file"


def read_key_file(path: Path) -> VolumeKey:
    """The passphrase `path` holds (UTF-8, every byte: a trailing newline is part of it). Raises InvalidArgument."""
    try:
        text = path.read_bytes().decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{FLAG} {path}: cannot read a UTF-8 passphrase from it ({exc})") from exc
    if not text:
        raise InvalidArgument(f"{FLAG} {path} is empty: put the volume's passphrase (the Secret's entry 'key') in it")
    return VolumeKey(text)


async def encrypted_with(qemu_img: str, images: list[Path], key: VolumeKey | None, what: str) -> bool:
    """Whether `images` (all of one backup or one restore) are encrypted, and `key` opens them if they are.

    `what` names them in messages. Raises InvalidArgument for images of
    both kinds, an encrypted one without a key, a key for plain ones, an
    unreadable header; PermissionDenied for a key that opens one of them not.
    """
    try:
        kinds = [await asyncio.to_thread(keyed.encrypted, image) for image in images]
    except OSError as exc:
        raise InvalidArgument(f"{what}: cannot read {exc.filename} ({exc.strerror})") from exc
    if any(kinds) and not all(kinds):
        plain = [str(image) for image, kind in zip(images, kinds) if not kind]
        raise InvalidArgument(f"{what}: {', '.join(plain)} not encrypted, the others encrypted: give backups "
                              "of one volume")
    if not any(kinds):
        if key is not None:
            raise InvalidArgument(f"{what} is not encrypted: drop {FLAG}")
        return False
    if key is None:
        raise InvalidArgument(f"{what} is encrypted: give the volume's passphrase (the Secret's entry 'key') "
                              f"with {FLAG} FILE; nothing was written")
    for image in images:
        if not await keyed.opens_with(qemu_img, image, key):
            raise PermissionDenied(f"the passphrase in {FLAG} does not open {image} ({what}): give the volume's "
                                   "key (its bytes exactly; a trailing newline counts); nothing was written")
    return True
