"""The controller's view of volumes: where they are published and whether they can serve.

For ControllerGetVolume and ListVolumes (VOLUME_CONDITION,
LIST_VOLUMES_PUBLISHED_NODES). A volume is abnormal when what its pool holds
for it is gone or unreadable (an idle image is checked by the pool, at most
once per change of the file), and, while staged, when QSD is away, lost its
export, or found the image corrupt. Looking never changes anything and never
waits for a volume's lock. No gRPC types here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from csi_qsd.catalog import Catalog, PublishState, StageState, VolumeRecord
from csi_qsd.errors import QSDError
from csi_qsd.exports.base import ExportPath
from csi_qsd.exports.export_kinds import ExportPaths
from csi_qsd.qsd import graph

HEALTHY = "volume is healthy"


@dataclasses.dataclass(frozen=True)
class VolumeHealth:
    published: bool  # published on this node (at one target or more)
    abnormal: bool
    message: str


class HealthView:
    """Answers for one volume or a page of them, with one QSD query for corrupt images per call."""

    def __init__(self, catalog: Catalog, exports: ExportPaths,
                 stalled: Callable[[str], str | None] = lambda volume_id: None) -> None:
        self._catalog = catalog
        self._exports = exports
        self._stalled = stalled  # why a staged volume is not served after a QSD restart (`Staging.stalled`)

    async def of(self, volumes: list[VolumeRecord]) -> dict[str, VolumeHealth]:
        published = {p.volume_id for p in await self._catalog.publishes() if p.state is PublishState.PUBLISHED}
        staged = {s.volume_id for s in await self._catalog.stages() if s.state is StageState.STAGED}
        corrupt: set[str] | None = None
        found: dict[str, VolumeHealth] = {}
        for volume in volumes:
            is_staged = volume.id in staged
            if is_staged and corrupt is None:
                corrupt = await self._corrupt_nodes()
            abnormal, message = await self._condition(volume, is_staged, corrupt or set())
            found[volume.id] = VolumeHealth(volume.id in published, abnormal, message)
        return found

    async def _condition(self, volume: VolumeRecord, staged: bool, corrupt: set[str]) -> tuple[bool, str]:
        pool = self._exports.host.pools.get(volume.pool)
        if pool is None:
            return True, f"volume {volume.id} is in pool {volume.pool!r}, which this driver does not serve"
        if volume.image_pending and not staged:
            return False, HEALTHY  # created, its image not written yet: it holds no data, a stage writes it first
        problem = await pool.check(volume.image, in_use=staged)
        if problem:
            return True, f"volume {volume.id}: {problem}"
        if not staged:
            return False, HEALTHY
        if not self._exports.host.daemon_of(volume.id).ready:
            return True, f"volume {volume.id}: qemu-storage-daemon is restarting; I/O will resume when it is back"
        stalled = self._stalled(volume.id)
        if stalled is not None:
            return True, stalled
        if graph.nodes_for(volume.id, volume.generation).format in corrupt:
            return True, (f"volume {volume.id}: qemu-storage-daemon found its image {volume.image} corrupt "
                          "and stopped writing to it")
        kind: ExportPath = self._exports.of(volume)
        try:
            abnormal, message = await kind.condition(volume)
        except QSDError as exc:
            return True, f"volume {volume.id}: cannot ask qemu-storage-daemon about its export: {exc}"
        return (True, f"volume {volume.id} is staged, but {message}") if abnormal else (False, HEALTHY)

    async def _corrupt_nodes(self) -> set[str]:
        """Corrupt nodes of every shard that answers; node names carry the volume, so one set serves all."""
        corrupt: set[str] = set()
        for daemon in self._exports.host.qsd.daemons:
            if not daemon.ready:
                continue
            try:
                corrupt |= await daemon.client.corrupt_nodes()
            except QSDError:
                continue
        return corrupt
