"""Key rotation of encrypted volumes: a keyslot for the new key on every layer, the old one erased, live.

ControllerModifyVolume with the mutable parameter `keyVersion` lands here
(`qos.VolumeLimits` hands it over, holding the volume's lock). The request's
Secret carries the new key (`key`), its label (`keyVersion`, which must be
the one asked for) and, for a volume this node has not open, the key it has
now (`previousKey`); a staged volume's current key is the one the node
holds. LUKS keeps the volume's master key, so no data is rewritten: each
layer of the chain gets a keyslot for the new key, then loses its slots for
the old one. The top of a staged volume is amended in QSD (`x-blockdev-amend`,
its exports serving throughout); every other layer by qemu-img, which QSD
never lets write its open top but which may write the keyslots of the
read-only layers below (`FilePool.add_key`).

A layer that another volume also reads through (a restore's or a clone's
source) keeps the old key beside the new one until every volume reading
through it has the new version: the others still open it with theirs.

Order, so that a crash anywhere leaves a volume that opens and a retry that
finishes: every layer gets the new key first, then the node holds the new key
(the rebuild after a QSD crash opens with it), then the old slots go, then
the catalog records the version. A retry skips what is done (each step
checks what a key opens first). Never logs or shows a key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

from csi_qsd.catalog import Catalog, StageState, VolumeRecord, VolumeState
from csi_qsd.controller import chains
from csi_qsd.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from csi_qsd.params import (
    CONTROLLER_MODIFY_SECRET,
    KEY_VERSION,
    PREVIOUS_KEY,
    SECRET_KEY,
    key_version,
    previous_key,
    volume_key,
)
from csi_qsd.pools.base import Pool
from csi_qsd.qsd import encryption, graph
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.shards import QSDShards
from csi_qsd.sys.volume_keys import KeyStore, VolumeKey

log = logging.getLogger(__name__)


class KeyRotation:
    """Bring encrypted volumes to the key of a Secret's version; the caller holds the volume's lock."""

    def __init__(self, catalog: Catalog, pool: Pool, qsd: QSDShards, keys: KeyStore) -> None:
        self._catalog = catalog
        self._pool = pool
        self._qsd = qsd
        self._keys = keys

    async def rotate(self, volume: VolumeRecord, version: str, secrets: Mapping[str, str]) -> VolumeRecord:
        """Make every layer of `volume` open with the Secret's key of `version` and no longer with the old one.

        Raises InvalidArgument (a plain volume; no key; no current key for a
        volume not staged here), FailedPrecondition (the Secret holds another
        version), PermissionDenied (no key given or held opens a layer),
        Unavailable (QSD restarting), QSDError and HostCommandError.
        """
        if not volume.params.encrypted:
            raise InvalidArgument(f"mutable parameter {KEY_VERSION!r} applies only to encrypted volumes; volume "
                                  f"{volume.id} is not encrypted")
        key = volume_key(secrets, f"volume {volume.id}", CONTROLLER_MODIFY_SECRET)
        held_version = key_version(secrets, CONTROLLER_MODIFY_SECRET)
        if held_version != version:
            raise FailedPrecondition(
                f"volume {volume.id}: the VolumeAttributesClass asks for key version {version!r}, and entry "
                f"{KEY_VERSION!r} of the Secret named by {CONTROLLER_MODIFY_SECRET!r} says "
                f"{held_version or 'nothing'!r}: put the new key and its version in the Secret first")
        if volume.key_version == version and await self._pool.opens_with(volume.image, key):
            return volume  # done already: the version is recorded only once every layer has the key
        client = await self._live_client(volume)
        held = await asyncio.to_thread(self._keys.get, volume.id) if client is not None else None
        olds = [k for k in _distinct(held, previous_key(secrets)) if k != key]
        layers = [volume.image, *await chains.from_backing(self._catalog, volume.backing)]
        for layer in layers:
            if await self._pool.opens_with(layer, key):
                continue
            opener = await self._opener(layer, olds, volume)
            await self._amend(client, volume, layer, opener, key, add=True)
        if client is not None:
            await asyncio.to_thread(self._keys.put, volume.id, key)
        shared = await self._shared_layers(volume, version)
        kept = []
        for layer in layers:
            if layer in shared:
                kept.append(layer.name)
                continue
            for old in olds:
                if await self._pool.opens_with(layer, old):
                    await self._amend(client, volume, layer, key, old, add=False)
        volume = dataclasses.replace(volume, key_version=version)
        await self._catalog.set_volume(volume)
        log.info("event=key_rotated volume_id=%s key_version=%s layers=%d live=%s kept_old_key_in=%s",
                 volume.id, version, len(layers), client is not None, ",".join(kept) or "-")
        return volume

    async def _live_client(self, volume: VolumeRecord) -> QSDClient | None:
        """The client of the QSD that has the volume open (staged here), or None."""
        stage = await self._catalog.stage(volume.id)
        if stage is None:
            return None
        daemon = self._qsd.daemons[stage.shard]
        if stage.state is not StageState.STAGED or not daemon.ready:
            raise Unavailable(f"volume {volume.id} is being staged or unstaged, or qemu-storage-daemon is "
                              "restarting; retry shortly")
        return daemon.client

    async def _opener(self, layer: Path, olds: list[VolumeKey], volume: VolumeRecord) -> VolumeKey:
        for old in olds:
            if await self._pool.opens_with(layer, old):
                return old
        if not olds:
            raise InvalidArgument(
                f"volume {volume.id} is not staged on this node: the key it has now must come in entry "
                f"{PREVIOUS_KEY!r} of the Secret named by {CONTROLLER_MODIFY_SECRET!r}, beside the new one in "
                f"{SECRET_KEY!r}")
        raise PermissionDenied(
            f"neither entry {SECRET_KEY!r} nor {PREVIOUS_KEY!r} of the Secret named by {CONTROLLER_MODIFY_SECRET!r}"
            f"{' nor the key the node holds' if len(olds) > 1 else ''} opens image {layer.name} of volume {volume.id}")

    async def _amend(self, client: QSDClient | None, volume: VolumeRecord, layer: Path, opened_by: VolumeKey,
                     key: VolumeKey, *, add: bool) -> None:
        """Add `key` to `layer` or erase it: in QSD for the top of a staged volume, else by qemu-img."""
        if client is not None and layer == volume.image:
            node = graph.nodes_for(volume.id, volume.generation)
            await encryption.amend_live(client, node.format, node.secret, opened_by, key, add=add)
        elif add:
            await self._pool.add_key(layer, opened_by, key, in_use=layer != volume.image)
        else:
            await self._pool.remove_key(layer, opened_by, key, in_use=layer != volume.image)

    async def _shared_layers(self, volume: VolumeRecord, version: str) -> set[Path]:
        """The images of `volume`'s chain that another volume not yet at `version` reads through."""
        shared: set[Path] = set()
        for other in await self._catalog.volumes(state=VolumeState.READY):
            if other.id != volume.id and other.params.encrypted and other.key_version != version and other.backing:
                shared.update(await chains.from_backing(self._catalog, other.backing))
        return shared


def _distinct(*keys: VolumeKey | None) -> list[VolumeKey]:
    found: list[VolumeKey] = []
    for key in keys:
        if key is not None and key not in found:
            found.append(key)
    return found
