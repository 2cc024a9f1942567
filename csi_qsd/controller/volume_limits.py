"""I/O limits of volumes: the mutable parameters, stored in the catalog and applied live in QSD.

ControllerModifyVolume lands here; its `keyVersion` goes on to the key
rotation (`key_rotation`), under the same lock. The catalog is written first, so a
restarted QSD (or a restarted driver) rebuilds each staged volume's throttle
group with the limits the last answered call asked for; then a staged
volume's group is changed in the running QSD, with its export and consumer
(mount, loop device, VM) left connected. No gRPC types here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from csi_qsd.catalog import Catalog, StageState, VolumeRecord, VolumeState
from csi_qsd.controller.key_rotation import KeyRotation
from csi_qsd.errors import NotFound, Unavailable, Unimplemented
from csi_qsd.params import KEY_VERSION, parse_mutable_parameters, wanted_key_version
from csi_qsd.qsd import attach
from csi_qsd.qsd.shards import QSDShards
from csi_qsd.sys.locks import KeyedLocks

log = logging.getLogger(__name__)


class VolumeLimits:
    """Change volumes' I/O limits; one call per volume at a time (the volume's lock)."""

    def __init__(self, catalog: Catalog, qsd: QSDShards, locks: KeyedLocks, rotation: KeyRotation | None = None) -> None:
        self._catalog = catalog
        self._qsd = qsd
        self._locks = locks
        self._rotation = rotation

    async def modify(self, volume_id: str, mutable: Mapping[str, str], secrets: Mapping[str, str] | None = None,
                     ) -> VolumeRecord:
        """Apply `mutable` (only the keys given change) and return the volume as it now is.

        A retry is harmless: the limits are set again to the same values. No
        keys (a VolumeAttributesClass without parameters) change nothing and
        touch nothing, once the volume is known to exist.
        A `keyVersion` rotates an encrypted volume's key to the one `secrets`
        carry, once the limits are set (`KeyRotation.rotate`, which raises more).
        Raises NotFound, InvalidArgument (naming the key), Aborted (another
        call holds the volume), Unavailable (QSD is restarting: the catalog
        holds the new limits, and the retry applies them live).
        """
        async with self._locks.hold(volume_id):
            volume = await self._catalog.volume(volume_id)
            if volume is None or volume.state is not VolumeState.READY:
                raise NotFound(f"volume {volume_id} does not exist")
            if not mutable:
                return volume
            qos = parse_mutable_parameters(mutable, volume.qos)
            version = wanted_key_version(mutable)
            if version is not None and self._rotation is None:
                raise Unimplemented(f"mutable parameter {KEY_VERSION!r}: this driver rotates no keys")
            if qos != volume.qos:
                volume = dataclasses.replace(volume, qos=qos)
                await self._catalog.set_volume(volume)
            stage = await self._catalog.stage(volume_id)
            live = False
            if stage is not None and stage.state is StageState.STAGED:
                daemon = self._qsd.daemons[stage.shard]
                if not daemon.ready:
                    raise Unavailable(
                        f"volume {volume_id} is staged and qemu-storage-daemon is restarting; retry shortly"
                    )
                live = await attach.set_limits(daemon.client, volume_id, qos)
            log.info("event=volume_modified volume_id=%s live=%s qos=%s", volume_id, live, qos.to_json())
            if version is not None and self._rotation is not None:
                volume = await self._rotation.rotate(volume, version, secrets or {})
            return volume
