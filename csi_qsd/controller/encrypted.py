"""The keys a controller call needs for an encrypted volume's new images, checked before anything is made.

Every image of an encrypted volume has a LUKS header of its own, made with
the volume's passphrase: a snapshot's new top, a restore's or a clone's
overlay. A wrong key here would make an image no stage could open with the
volume's Secret, so each key is tried on the image it will stand on first.
Never logs or shows a key.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from csi_qsd.catalog import VolumeRecord
from csi_qsd.errors import InvalidArgument, PermissionDenied
from csi_qsd.params import PROVISIONER_SECRET, SECRET_KEY, SNAPSHOTTER_SECRET, VolumeParameters
from csi_qsd.pools.base import Pool
from csi_qsd.qcow2 import keyed
from csi_qsd.sys.volume_keys import KeyStore, VolumeKey


def _secret(name: str) -> str:
    return f"the passphrase in entry {SECRET_KEY!r} of the Secret named by {name!r}"


async def image_encrypted(image: Path) -> bool:
    """Whether `image`'s qcow2 header says LUKS (a snapshot's image: its volume may be gone). Raises OSError."""
    return await asyncio.to_thread(keyed.encrypted, image)


async def check_source(
    pool: Pool, image: Path, what: str, params: VolumeParameters, key: VolumeKey | None, *, source_encrypted: bool,
) -> None:
    """Refuse a source (`what`, at `image`) encrypted otherwise than the new volume, or that `key` does not open.

    Raises InvalidArgument, PermissionDenied.
    """
    if source_encrypted != params.encrypted:
        raise InvalidArgument(
            f"{what} is {'' if source_encrypted else 'not '}encrypted and the new volume's StorageClass says "
            f"encrypted={str(params.encrypted).lower()}: a volume and its source are encrypted alike")
    if key is not None and not await pool.opens_with(image, key):
        raise PermissionDenied(f"{_secret(PROVISIONER_SECRET)} does not open {what}")


async def keys_for(
    pool: Pool, held: KeyStore, volumes: list[VolumeRecord], given: VolumeKey | None,
) -> dict[str, VolumeKey]:
    """The key of each encrypted volume to snapshot: the one held while it is staged here, else `given`, checked.

    Raises InvalidArgument when there is none, PermissionDenied when `given` does not open the volume.
    """
    keys: dict[str, VolumeKey] = {}
    for volume in volumes:
        if not volume.params.encrypted:
            continue
        staged_with = await asyncio.to_thread(held.get, volume.id)
        if staged_with is not None and (given is None or given == staged_with):
            keys[volume.id] = staged_with
            continue
        if given is None:
            raise InvalidArgument(
                f"volume {volume.id} is encrypted and not staged here: a snapshot of it needs "
                f"{_secret(SNAPSHOTTER_SECRET)}")
        if not await pool.opens_with(volume.image, given):
            raise PermissionDenied(f"{_secret(SNAPSHOTTER_SECRET)} does not open volume {volume.id}")
        keys[volume.id] = given
    return keys
