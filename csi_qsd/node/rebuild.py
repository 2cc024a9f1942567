"""After every (re)connect to QSD: make QSD and the host match the catalog again.

A crash of the driver or of QSD can stop any call between its intent row
and its final commit. This finishes or undoes each such call from the
catalog's rows (moves first, then stages and publishes), re-creates what a
new QSD lacks (graph, exports, loop devices, mounts), and drops graph nodes
no staged volume needs. Images are never touched. Each volume is repaired
under its lock once a call still holding it is done; a call that holds it
longer than REBUILD_LOCK_WAIT does not stop the repair, which then runs
beside it without the lock (logged: `rebuild_lock_busy`). A move is settled
only under the lock: one whose call still runs settles itself.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from csi_qsd.catalog import Catalog, PublishState, StageState
from csi_qsd.exports.registry import ExportPaths
from csi_qsd.node import moves
from csi_qsd.qsd import attach
from csi_qsd.qsd.client import QSDClient
from csi_qsd.sys.locks import KeyedLocks

log = logging.getLogger(__name__)

# How long the rebuild after a QSD restart waits for a call still holding a volume.
REBUILD_LOCK_WAIT = 30.0


class GraphRebuild:
    """The repair of one node's volumes from the catalog, run by the QSD supervisor on each connect."""

    def __init__(self, catalog: Catalog, exports: ExportPaths, locks: KeyedLocks) -> None:
        self._catalog = catalog
        self._exports = exports
        self._locks = locks

    async def run(self, shard: int, client: QSDClient) -> Callable[[], Awaitable[None]] | None:
        """Make one shard's QSD and the host match the catalog; called after every (re)connect to it.

        Finishes or undoes what a crash left, re-creates lost exports, loop
        devices and mounts, and drops our graph nodes no volume staged on
        this shard needs; never touches images. If QSD kept every staged
        volume's export (only the driver restarted), the checks run in the
        background instead, each volume under its lock, so calls are served
        at once. Moves happen in device pools, which shard 0 serves.
        """
        if shard == 0:
            await self._settle_moves()
        stages = [s for s in await self._catalog.stages() if s.shard == shard]
        for stage in stages:
            self._exports.host.qsd.place(stage.volume_id, shard)
        staged = {s.volume_id for s in stages if s.state is StageState.STAGED}
        if staged and staged <= await attach.exported_volumes(client):
            return lambda: self._repair(shard, client)
        await self._repair(shard, client)
        return None

    async def _settle_moves(self) -> None:
        """Finish or undo every move a crash left, before anything else uses those volumes."""
        host = self._exports.host
        for pool in host.pools.values():
            for volume_id, committed in sorted(pool.moves_under_way().items()):
                async with self._locks.wait_hold(volume_id, REBUILD_LOCK_WAIT) as held:
                    volume = await self._catalog.volume(volume_id)
                    if volume is None or not held:
                        continue  # a move still running in this process settles itself when it fails
                    old, new = moves.tops_of(host, volume, committed=committed)
                    log.warning("event=reconcile_move volume_id=%s committed=%s", volume_id, committed)
                    await moves.settle(host, self._exports.of(volume), volume, await self._catalog.stage(volume_id),
                                       old, new, committed=committed)

    async def _repair(self, shard: int, client: QSDClient) -> None:
        wanted: set[str] = set()
        stages = await self._catalog.stages()
        volume_ids = {s.volume_id for s in stages if s.shard == shard}
        if shard == 0:  # publishes whose stage row is gone (a crash) are no shard's: the first takes them
            staged_anywhere = {s.volume_id for s in stages}
            volume_ids |= {p.volume_id for p in await self._catalog.publishes()} - staged_anywhere
        for volume_id in sorted(volume_ids):
            # A call cut off by the crash may still hold the volume; let it finish first.
            async with self._locks.wait_hold(volume_id, REBUILD_LOCK_WAIT) as held:
                if not held:
                    log.warning("event=rebuild_lock_busy volume_id=%s; rebuilding anyway", volume_id)
                if await self._rebuild_volume(client, volume_id):
                    wanted.add(volume_id)
        for volume_id in await attach.volumes_in_graph(client) - wanted:
            log.info("event=reconcile_remove_graph volume_id=%s", volume_id)
            await attach.remove_volume(client, volume_id)

    async def _rebuild_volume(self, client: QSDClient, volume_id: str) -> bool:
        """Repair one volume from its catalog rows; True if it stays staged (its graph is wanted)."""
        volume = await self._catalog.volume(volume_id)
        stage = await self._catalog.stage(volume_id)
        for publish in await self._catalog.publishes(volume_id):
            if publish.state is not PublishState.PUBLISHED and volume is not None:
                log.info("event=reconcile_publish volume_id=%s target=%s state=%s",
                         publish.volume_id, publish.target_path, publish.state.value)
                await self._exports.of(volume).unpublish(volume, stage, publish)
                await self._catalog.delete_publish(publish.target_path)
        if stage is None:
            return False
        if volume is None:
            await self._catalog.delete_stage(volume_id)
            self._exports.host.qsd.forget(volume_id)
            return False
        kind = self._exports.of(volume)
        if stage.state is not StageState.STAGED:
            log.info("event=reconcile_stage volume_id=%s state=%s", volume_id, stage.state.value)
            await kind.tear_down(volume, stage, client, thorough=True)
            await self._catalog.delete_stage(volume_id)
            self._exports.host.qsd.forget(volume_id)
            return False
        try:
            publishes = await self._catalog.publishes(volume_id)
            stage = await kind.bring_up(volume, stage, publishes, client)
            await self._catalog.put_stage(stage)
            for publish in publishes:
                await self._catalog.put_publish(await kind.publish(volume, stage, publish, []))
        except Exception:
            log.exception("event=rebuild_failed volume_id=%s", volume_id)
        return True
