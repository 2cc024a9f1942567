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

A staged volume that reads data not yet copied from another node whose copy
server does not greet cannot be opened (the open would hold QSD's monitor,
`csi_qsd.controller.copy_targets.CopyLinkCheck`): the rebuild leaves it *stalled*,
staged without its export, and retries it on its own with a bounded
back-off (`Backoff`), since kubelet, believing it staged, sends no new
NodeStageVolume. Each retry asks the source for its greeting without the
volume's lock, then brings the volume back under the lock exactly as the
rebuild does (export, loop device, mounts, publishes). It stops when the
volume is back, unstaged or deleted, and on driver shutdown. Meanwhile the
volume reports abnormal, naming the source node (`stalled`).

A filesystem or block volume whose FUSE export QSD lost (it died) comes back
on a new loop device; the containers of its published targets still hold the
old one. The rebuild records them (`cut_off.CutOffTargets`): the volume reports
abnormal at those targets and the listeners (the pod healer) hear of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Awaitable, Callable

from csi_qsd.catalog import AccessType, Catalog, PublishState, StageRecord, StageState, VolumeRecord
from csi_qsd.errors import SourceUnreachable, StillInUse
from csi_qsd.exports.export_kinds import ExportPaths
from csi_qsd.node import moves
from csi_qsd.node.cut_off import CutOff, CutOffTargets
from csi_qsd.qsd import attach
from csi_qsd.qsd.client import QSDClient
from csi_qsd.sys.locks import KeyedLocks

log = logging.getLogger(__name__)

# How long the rebuild after a QSD restart waits for a call still holding a volume.
REBUILD_LOCK_WAIT = 30.0
# How long a retry of a stalled volume waits for a call holding it before trying again later.
RETRY_LOCK_WAIT = 5.0


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Seconds before each retry of a stalled volume: `first`, growing by `factor`, never above `cap`.

    Bounded both ways: no busy loop while a source stays down, and a source
    that comes back is noticed within `cap` seconds (plus one greeting).
    """

    first: float = 2.0
    factor: float = 1.5
    cap: float = 5.0

    def delay(self, attempt: int) -> float:
        """The wait before retry number `attempt` (0 for the first)."""
        return min(self.cap, self.first * self.factor ** min(attempt, 64))


@dataclasses.dataclass
class _Stalled:
    """A staged volume the rebuild could not bring back because its copy source did not greet."""

    shard: int
    node: str
    address: str
    task: asyncio.Task[None] | None = None
    retries: int = 0  # retries so far


class GraphRebuild:
    """The repair of one node's volumes from the catalog, run by the QSD supervisor on each connect."""

    def __init__(self, catalog: Catalog, exports: ExportPaths, locks: KeyedLocks, backoff: Backoff = Backoff()) -> None:
        self._catalog = catalog
        self.cut_off = CutOffTargets()
        self._exports = exports
        self._locks = locks
        self._backoff = backoff
        self._stalled: dict[str, _Stalled] = {}
        self._closed = False

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
            try:
                await kind.tear_down(volume, stage, client, thorough=True)
            except StillInUse as err:
                # Its export must stay until the filesystem has written what it holds; kubelet's retry of
                # NodeUnstageVolume (or a new NodeStageVolume) finishes the job.
                log.warning("event=reconcile_stage_deferred volume_id=%s: %s", volume_id, err)
                return True
            await self._catalog.delete_stage(volume_id)
            self._exports.host.qsd.forget(volume_id)
            return False
        try:
            await self._bring_back(client, volume, stage)
        except SourceUnreachable as exc:
            self._stall(volume_id, stage.shard, exc)
        except Exception:
            log.exception("event=rebuild_failed volume_id=%s", volume_id)
        else:
            self.forget(volume_id)
        return True

    async def _bring_back(self, client: QSDClient, volume: VolumeRecord, stage: StageRecord) -> None:
        """Export, loop device, mounts and publishes of a staged volume, as its stage and publishes made them.

        Raises SourceUnreachable (its copy source does not greet), DriverError, OSError.
        """
        kind = self._exports.of(volume)
        publishes = [p for p in await self._catalog.publishes(volume.id) if p.state is PublishState.PUBLISHED]
        # Asked before the export comes back: a dead FUSE file means every consumer's copy of it is dead too.
        lost = kind.export_broken(volume.id)
        stage = await kind.bring_up(volume, stage, publishes, client)
        await self._catalog.put_stage(stage)
        for publish in publishes:
            await self._catalog.put_publish(await kind.publish(volume, stage, publish, []))
        if lost and publishes:
            self.cut_off.add(CutOff(volume.id, stage.access_type is AccessType.BLOCK,
                                    tuple(p.target_path for p in publishes), datetime.datetime.now(datetime.UTC)))

    def stalled(self, volume_id: str) -> str | None:
        """Why a staged volume is not served (its copy source does not greet), or None if it is not stalled."""
        entry = self._stalled.get(volume_id)
        if entry is None:
            return None
        source = f"node {entry.node}" if entry.node else "another node"
        return (f"volume {volume_id} is staged but not served: qemu-storage-daemon restarted and cannot open it "
                f"while {source}, the source of its copy, does not answer at {entry.address}; the driver retries "
                f"every {self._backoff.cap:g} s at most (retried {entry.retries} times so far) and serves it again "
                f"once {source} answers")

    def forget(self, volume_id: str) -> None:
        """The volume is served again, unstaged or deleted: stop retrying it."""
        entry = self._stalled.pop(volume_id, None)
        if entry is not None and entry.task is not None and entry.task is not asyncio.current_task():
            entry.task.cancel()

    async def close(self) -> None:
        """On driver shutdown: cancel every retry and wait for it (the next driver's rebuild takes them up)."""
        self._closed = True
        tasks = [e.task for e in self._stalled.values() if e.task is not None]
        self._stalled.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _stall(self, volume_id: str, shard: int, exc: SourceUnreachable) -> None:
        entry = self._stalled.get(volume_id)
        if entry is None:
            entry = self._stalled[volume_id] = _Stalled(shard, exc.node, exc.address)
        else:
            entry.shard, entry.node, entry.address = shard, exc.node, exc.address
        log.warning("event=rebuild_stalled volume_id=%s node=%s address=%s; retrying", volume_id, exc.node,
                    exc.address)
        if not self._closed and (entry.task is None or entry.task.done()):
            entry.task = asyncio.create_task(self._retry(volume_id, entry), name=f"rebuild-retry-{volume_id}")

    async def _retry(self, volume_id: str, entry: _Stalled) -> None:
        """Retry a stalled volume until it is back, unstaged or deleted; never raises but CancelledError."""
        attempt = 0
        while self._stalled.get(volume_id) is entry:
            await asyncio.sleep(self._backoff.delay(attempt))
            attempt += 1
            try:
                if await self._retry_once(volume_id, entry):
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event=rebuild_retry_failed volume_id=%s", volume_id)

    async def _retry_once(self, volume_id: str, entry: _Stalled) -> bool:
        """One attempt; True once there is nothing more to do for the volume."""
        volume, stage = await self._catalog.volume(volume_id), await self._catalog.stage(volume_id)
        if volume is None or stage is None or stage.state is not StageState.STAGED:
            log.info("event=rebuild_retry_dropped volume_id=%s (unstaged or deleted)", volume_id)
            self._forget_entry(volume_id, entry)
            return True
        daemon = self._exports.host.qsd.daemons[stage.shard]
        if not daemon.ready:
            return False  # QSD is restarting: its rebuild takes the volume up again
        entry.retries += 1
        try:
            if self._exports.host.before_open is not None:
                await self._exports.host.before_open(volume)  # without the lock: a source still down costs no call
        except SourceUnreachable as exc:
            entry.node, entry.address = exc.node, exc.address
            return False
        async with self._locks.wait_hold(volume_id, RETRY_LOCK_WAIT) as held:
            if not held or self._stalled.get(volume_id) is not entry:
                return self._stalled.get(volume_id) is not entry
            volume, stage = await self._catalog.volume(volume_id), await self._catalog.stage(volume_id)
            if volume is None or stage is None or stage.state is not StageState.STAGED:
                self._forget_entry(volume_id, entry)
                return True
            try:
                await self._bring_back(daemon.client, volume, stage)
            except SourceUnreachable as exc:  # it went away again between the greeting and the open
                entry.node, entry.address = exc.node, exc.address
                return False
            self._forget_entry(volume_id, entry)
        log.warning("event=rebuild_retried volume_id=%s node=%s: served again", volume_id, entry.node)
        return True

    def _forget_entry(self, volume_id: str, entry: _Stalled) -> None:
        if self._stalled.get(volume_id) is entry:
            del self._stalled[volume_id]
