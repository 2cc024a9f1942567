"""Live changes to staged volumes' images in QSD, for the snapshot side of the domain.

A snapshot moves volumes onto new top images and a flatten streams a chain
into one image; where a volume is staged, both happen inside the running
QSD, with its consumer held still by its export path. Volumes that are not
staged need nothing here. No gRPC types here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from csi_qsd.catalog import Catalog, StageRecord, StageState, VolumeRecord
from csi_qsd.controller import chains
from csi_qsd.errors import FailedPrecondition, QSDError, Unavailable
from csi_qsd.exports.export_kinds import ExportPaths
from csi_qsd.qsd import attach, block_jobs


class LiveImages:
    """Switch and stream the images of staged volumes in QSD."""

    def __init__(self, catalog: Catalog, exports: ExportPaths) -> None:
        self._catalog = catalog
        self._exports = exports
        self._qsd = exports.host.qsd

    async def switch_tops(self, switches: list[tuple[VolumeRecord, VolumeRecord]]) -> None:
        """Move staged volumes (before, after) onto their new top images live, at one instant.

        Each export path quiesces its consumer around the switch (a mounted
        filesystem is frozen, so the image left behind is consistent; a VM is
        cut crash-consistent). One that cannot be quiesced aborts the switch
        with nothing changed. Raises FailedPrecondition, Unavailable.
        """
        live: list[tuple[VolumeRecord, VolumeRecord, StageRecord]] = []
        for before, after in switches:
            stage = await self._catalog.stage(before.id)
            if stage is not None and stage.state is StageState.STAGED:
                live.append((before, after, stage))
        if not live:
            return
        shards = {stage.shard for _, _, stage in live}
        if len(shards) > 1:
            raise FailedPrecondition(
                "volumes " + ", ".join(before.id for before, _, _ in live) + " are staged on different "
                "qemu-storage-daemon shards of this node, so no one transaction can cut them at one instant: "
                "give them one placement (the same namespace) or unstage all but one shard's, then retry")
        daemon = self._qsd.daemons[shards.pop()]
        self._require(daemon.ready)
        async with contextlib.AsyncExitStack() as stack:
            for before, _after, stage in live:
                await stack.enter_async_context(self._exports.of(before).quiesced(before, stage))
            await attach.switch_tops(
                daemon.client, [(before.generation, self._exports.host.top_image(after)) for before, after, _ in live]
            )

    async def any_switched(self, moved: list[VolumeRecord]) -> bool:
        """True if QSD already has any of `moved`'s new tops open (a switch whose answer was lost)."""
        for daemon in self._qsd.daemons:
            if not moved or not daemon.ready:
                continue
            try:
                if await attach.any_open(daemon.client, [self._exports.host.top_image(v) for v in moved]):
                    return True
            except QSDError:
                continue
        return False

    async def stream_backing_if_staged(self, volume: VolumeRecord) -> bool:
        """Flatten a staged volume's chain live; False if it is not staged here.

        QSD's block-stream copies everything below the volume's backing image
        (its newest snapshot) into that image, which then stands alone: the
        volume reads through two images again. Streaming keeps every image's
        content, so snapshots and clones standing on it see no change.
        Raises FailedPrecondition if QSD does not have the backing image open.
        """
        stage = await self._catalog.stage(volume.id)
        if stage is None or stage.state is not StageState.STAGED or not volume.backing:
            return False
        daemon = self._qsd.daemons[stage.shard]
        self._require(daemon.ready)
        layers = await chains.images_below(self._catalog, volume.backing)
        if not await block_jobs.stream_into_backing(daemon.client, volume.id, Path(volume.backing), layers):
            raise FailedPrecondition(f"the backing image of volume {volume.id} is not open in qemu-storage-daemon")
        return True

    @staticmethod
    def _require(ready: bool) -> None:
        if not ready:
            raise Unavailable("qemu-storage-daemon is not ready (starting or restarting); retry shortly")
