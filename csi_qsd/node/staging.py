"""The staging orchestrator: stage, publish, unpublish, unstage, expand, stats; the rebuild after a QSD (re)connect.

Each operation holds the volume's lock, records intent in the catalog, asks
the volume's export path (`csi_qsd.exports`) to bring QSD and the host into
the wanted shape with idempotent steps, then commits. A row that adds host
state (staged, published) is not waited for on disk: a power loss takes the
mounts, loop devices and QSD it describes with it, and kubelet stages and
publishes again after the reboot, while a crash of the driver keeps it. A
row's removal is durable: after a reboot, a row the CO had removed would
bring back host state nobody unstages. The same steps rebuild
everything after a QSD restart. No gRPC types here, no QMP, no mounts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from csi_qsd.catalog import (
    AccessType,
    Catalog,
    CopyRole,
    PublishRecord,
    PublishState,
    StageRecord,
    StageState,
    VolumeRecord,
    VolumeState,
)
from csi_qsd.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    Unavailable,
)
from csi_qsd.exports.base import ExportPath, VolumeStats
from csi_qsd.exports.export_kinds import ExportPaths
from csi_qsd.node import moves, placement
from csi_qsd.node.cut_off import CutOffTargets
from csi_qsd.node.rebuild import Backoff, GraphRebuild
from csi_qsd.params import NODE_STAGE_SECRET, SECRET_KEY, choose_size
from csi_qsd.pools.base import Pool, settle_image
from csi_qsd.qsd import attach
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.daemon import Rebuild
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints
from csi_qsd.sys.locks import KeyedLocks
from csi_qsd.sys.volume_keys import VolumeKey

log = logging.getLogger(__name__)

__all__ = ["Staging", "PublishSpec", "StageSpec", "VolumeStats"]


@dataclasses.dataclass(frozen=True)
class StageSpec:
    volume_id: str
    staging_path: Path
    block: bool
    fs_type: str
    mount_flags: tuple[str, ...]
    mount_group: str = ""
    key: VolumeKey | None = dataclasses.field(default=None, repr=False)  # an encrypted volume's passphrase
    # The Secret's `previousKey`: what a volume a key rotation has not reached yet still opens with.
    previous_key: VolumeKey | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class PublishSpec:
    volume_id: str
    staging_path: Path
    target_path: Path
    block: bool
    readonly: bool
    mount_flags: tuple[str, ...]
    mount_group: str = ""
    single_writer: bool = False  # SINGLE_NODE_SINGLE_WRITER: no other target may hold the volume


class Staging:
    """Stage and publish volumes on this node; the export path of each volume does the work."""

    def __init__(
        self, catalog: Catalog, pool: Pool, exports: ExportPaths, locks: KeyedLocks,
        failpoints: Failpoints = NO_FAILPOINTS, on_unstaged: Callable[[str], None] = lambda volume_id: None,
        retry: Backoff = Backoff(),
    ) -> None:
        self._catalog = catalog
        self._pool = pool
        self._exports = exports
        self._qsd = exports.host.qsd
        self._locks = locks
        self._failpoints = failpoints
        self._on_unstaged = on_unstaged
        self._rebuild = GraphRebuild(catalog, exports, locks, retry)

    async def stage(self, spec: StageSpec) -> None:
        """Raises NotFound, InvalidArgument, FailedPrecondition, AlreadyExists, Unavailable, Aborted."""
        async with self._locks.hold(spec.volume_id), self._transient_if_qsd_lost(spec.volume_id):
            volume = await self.volume(spec.volume_id)
            await settle_image(self._catalog, self._exports.host.pools[volume.pool], volume)
            kind = self._exports.of(volume)
            kind.check_access(volume, spec.block)
            fs_type = kind.fs_type(spec.block, spec.fs_type)
            access = AccessType.BLOCK if spec.block else AccessType.MOUNT
            existing = await self._catalog.stage(spec.volume_id)
            if existing is not None and existing.state is StageState.STAGED:
                _check_restage(spec, existing, access, fs_type)
                client = self._client(existing)
                await self._hold_key(volume, spec, client, staged=True)
                brought = await kind.bring_up(volume, existing, await self._catalog.publishes(volume.id), client)
                if brought != existing:  # a lost export came back on a new loop device: unstage must find it
                    await self._catalog.put_stage(brought)
                self._rebuild.forget(volume.id)
                return
            if existing is not None:
                await kind.tear_down(volume, existing, self._client(existing), thorough=True)
            record = StageRecord(
                volume_id=spec.volume_id, staging_path=spec.staging_path, access_type=access, fs_type=fs_type,
                mount_flags=spec.mount_flags, mount_group=spec.mount_group, state=StageState.STAGING,
                shard=await placement.shard_for(self._catalog, volume, self._qsd.count),
            )
            client = self._client(record)
            await self._hold_key(volume, spec, client, staged=False)
            await self._catalog.put_stage(record, durable=False)
            self._failpoints.hit("stage.after_intent")
            try:
                record = await kind.bring_up(volume, record, [], client)
            except BaseException:
                await self._undo_stage(kind, volume, record)
                await self._drop_key(volume.id)
                raise
            # Not waited onto the disk: a power loss takes the mounts, loop devices and QSD the row
            # describes with it, and kubelet stages again after the reboot. A crash keeps the row.
            await self._catalog.put_stage(dataclasses.replace(record, state=StageState.STAGED), durable=False)
            log.info("event=staged volume_id=%s path=%s loop=%s", volume.id, spec.staging_path, record.loop_device)

    async def unstage(self, volume_id: str, staging_path: Path) -> None:
        """Raises NotFound for an unknown volume, FailedPrecondition while published."""
        async with self._locks.hold(volume_id), self._transient_if_qsd_lost(volume_id):
            volume = await self.volume(volume_id, any_state=True)
            record = await self._catalog.stage(volume_id)
            if record is None or record.staging_path != staging_path:
                return
            published = await self._catalog.publishes(volume_id)
            if published:
                raise FailedPrecondition(
                    f"volume {volume_id} is still published at {published[0].target_path}; unpublish it first"
                )
            client = self._client(record)
            await self._exports.of(volume).check_unused(volume, record)
            await self._catalog.put_stage(dataclasses.replace(record, state=StageState.UNSTAGING), durable=False)
            self._failpoints.hit("unstage.after_intent")
            await self._exports.of(volume).tear_down(volume, record, client, thorough=False)
            await self._drop_key(volume_id)
            await self._catalog.delete_stage(volume_id)
            self._qsd.forget(volume_id)
            self._rebuild.forget(volume_id)
            log.info("event=unstaged volume_id=%s path=%s", volume_id, staging_path)
        self._on_unstaged(volume_id)

    async def _drop_key(self, volume_id: str) -> None:
        """The key a stage held goes, unless the volume's copy from another node still fills (under the volume's
        lock, which `csi_qsd.node.copy_fill` takes to drop it once done)."""
        if await self._catalog.copy(volume_id, CopyRole.TARGET) is None:
            self._exports.host.keys.forget(volume_id)

    async def publish(self, spec: PublishSpec) -> None:
        """Raises NotFound, FailedPrecondition (not staged, single writer), AlreadyExists, Unavailable."""
        async with self._locks.hold(spec.volume_id), self._transient_if_qsd_lost(spec.volume_id):
            volume = await self.volume(spec.volume_id)
            stage = await self._catalog.stage(spec.volume_id)
            if stage is None or stage.state is not StageState.STAGED or stage.staging_path != spec.staging_path:
                raise FailedPrecondition(
                    f"volume {spec.volume_id} is not staged at {spec.staging_path}; call NodeStageVolume first"
                )
            if (stage.access_type is AccessType.BLOCK) != spec.block:
                raise InvalidArgument(
                    f"volume {spec.volume_id} is staged as {stage.access_type.value}; publish it the same way"
                )
            self._check_shard_ready(stage)
            stalled = self._rebuild.stalled(spec.volume_id)
            if stalled is not None:
                raise Unavailable(f"{stalled}; retry the publish then")
            kind = self._exports.of(volume)
            kind.check_publish(volume, stage, spec.mount_group)
            existing = await self._catalog.publish(spec.target_path)
            if existing is not None and existing.state is PublishState.PUBLISHED:
                _check_republish(spec, existing)
                await kind.publish(volume, stage, existing, [])
                return
            others = [p for p in await self._catalog.publishes(volume.id) if p.target_path != spec.target_path]
            _check_single_writer(spec, others)
            if existing is not None:
                await self._remove_publish(kind, volume, stage, existing)
            record = PublishRecord(
                target_path=spec.target_path, volume_id=spec.volume_id, readonly=spec.readonly,
                mount_flags=spec.mount_flags, state=PublishState.PUBLISHING, single_writer=spec.single_writer,
            )
            await self._catalog.put_publish(record, durable=False)
            self._failpoints.hit("publish.after_intent")
            try:
                record = await kind.publish(volume, stage, record, others)
            except BaseException:
                await self._remove_publish(kind, volume, stage, record)
                raise
            self._failpoints.hit("publish.after_bind")
            # Not waited onto the disk, as a stage's row (a power loss takes the bind mount with it).
            await self._catalog.put_publish(dataclasses.replace(record, state=PublishState.PUBLISHED), durable=False)
            log.info("event=published volume_id=%s target=%s readonly=%s", volume.id, spec.target_path, spec.readonly)

    async def _hold_key(self, volume: VolumeRecord, spec: StageSpec, client: QSDClient, *, staged: bool) -> None:
        """Keep an encrypted volume's key for every later open of its layers, once it is known to open them.

        A staged volume's key must be the one it was opened with. The
        Secret's `previousKey` stands in for its `key` while a rotation has
        not reached the volume (`csi_qsd.controller.key_rotation`). Raises
        InvalidArgument (no key), PermissionDenied (a key that does not open
        the volume, or another than the one it is open with); nothing changes.
        """
        if not volume.params.encrypted:
            return
        key, previous = spec.key, spec.previous_key
        if key is None:
            raise InvalidArgument(f"volume {volume.id} is encrypted: stage it with the Secret named by "
                                  f"{NODE_STAGE_SECRET!r}, entry {SECRET_KEY!r}")
        keys = self._exports.host.keys
        held = await asyncio.to_thread(keys.get, volume.id)
        if staged and held is not None:
            if held != key and (previous is None or held != previous):
                raise PermissionDenied(
                    f"the passphrase in entry {SECRET_KEY!r} of the Secret named by {NODE_STAGE_SECRET!r} is not the "
                    f"one volume {volume.id} is staged with")
            return
        top = self._exports.host.top_image(volume)
        try:
            await attach.check_key(client, dataclasses.replace(top, key=key))
        except PermissionDenied:
            if previous is None:
                raise
            await attach.check_key(client, dataclasses.replace(top, key=previous))
            log.info("event=staged_with_previous_key volume_id=%s key_version=%s", volume.id, volume.key_version)
            key = previous
        await asyncio.to_thread(keys.put, volume.id, key)

    async def unpublish(self, volume_id: str, target_path: Path) -> None:
        """Raises NotFound for an unknown volume; an unpublished target is success."""
        async with self._locks.hold(volume_id), self._transient_if_qsd_lost(volume_id):
            volume = await self.volume(volume_id, any_state=True)
            record = await self._catalog.publish(target_path)
            if record is None or record.volume_id != volume_id:
                return
            kind = self._exports.of(volume)
            await kind.check_unused(volume, await self._catalog.stage(volume_id))
            await self._catalog.put_publish(dataclasses.replace(record, state=PublishState.UNPUBLISHING), durable=False)
            self._failpoints.hit("unpublish.after_intent")
            await self._remove_publish(kind, volume, await self._catalog.stage(volume_id), record)
            self._rebuild.cut_off.released(target_path)
            log.info("event=unpublished volume_id=%s target=%s", volume_id, target_path)

    async def expand(self, volume_id: str, path: Path, required: int, limit: int) -> int:
        """Grow a staged (and possibly published, in use) volume; return its size in bytes.

        Raises NotFound, OutOfRange, FailedPrecondition, Unavailable, Aborted.
        """
        async with self._locks.hold(volume_id), self._transient_if_qsd_lost(volume_id):
            volume = await self.volume(volume_id)
            stage = await _stage_at(self._catalog, volume_id, path)
            if stage.state is not StageState.STAGED:
                raise NotFound(f"volume {volume_id} is not staged or published at {path}")
            size = max(choose_size(required, limit), volume.capacity)
            pool = self._exports.host.pools[volume.pool]
            available = (await asyncio.to_thread(pool.usage)).available
            if size - volume.capacity > available:
                raise OutOfRange(
                    f"volume {volume_id} cannot grow to {size} bytes: its pool has {available} bytes free"
                )
            self._check_shard_ready(stage)
            kind = self._exports.of(volume)
            publishes = await self._catalog.publishes(volume_id)
            await kind.check_expand(volume, stage, publishes, size)
            if size > volume.capacity and not await pool.grow(volume.image, size):
                # No room where it lies: move it, live, to a home with room (committed before QSD sees it).
                volume = await moves.move(self._exports.host, kind, volume, stage, publishes, size)
                if not await pool.grow(volume.image, size):
                    raise Internal(f"volume {volume_id} moved to a new home of pool {volume.pool} without room")
            await kind.expand(volume, stage, publishes, size)
            if size > volume.capacity:
                await self._catalog.set_volume(dataclasses.replace(volume, capacity=size))
                log.info("event=expanded volume_id=%s bytes=%d", volume_id, size)
            return size

    async def stats(self, volume_id: str, path: Path) -> VolumeStats:
        """Usage of a volume at its staging or target path. Raises NotFound."""
        volume = await self.volume(volume_id)
        stage = await _stage_at(self._catalog, volume_id, path)
        if not self._qsd.daemons[stage.shard].ready:
            return VolumeStats.restarting(volume.capacity)
        stalled = self._rebuild.stalled(volume_id)
        if stalled is not None:  # not served: nothing to measure through it
            return dataclasses.replace(VolumeStats.restarting(volume.capacity), message=stalled)
        stats = await self._exports.of(volume).stats(volume, stage, path)
        cut = self._rebuild.cut_off.at(path)
        if cut is not None and not stats.abnormal:  # served again, but not to the container that had it before
            return dataclasses.replace(stats, abnormal=True, message=cut.message())
        return stats

    @property
    def cut_off(self) -> CutOffTargets:
        """The targets whose consumers a QSD crash cut off, and who hears of each (`cut_off`)."""
        return self._rebuild.cut_off

    def stalled(self, volume_id: str) -> str | None:
        """Why a staged volume is not served after a QSD restart (its copy source does not answer), or None."""
        return self._rebuild.stalled(volume_id)

    async def close(self) -> None:
        """On driver shutdown: stop retrying stalled volumes (the next driver's rebuild takes them up)."""
        await self._rebuild.close()

    @property
    def exports(self) -> ExportPaths:
        """Each volume's export path and the host they share (QSDs, pools): for driving a step no call offers."""
        return self._exports

    def rebuild(self, shard: int) -> Rebuild:
        """The repair of one shard's volumes, run after every (re)connect to that shard's QSD (`rebuild`)."""
        return lambda client: self._rebuild.run(shard, client)

    async def _remove_publish(
        self, kind: ExportPath, volume: VolumeRecord, stage: StageRecord | None, record: PublishRecord,
    ) -> None:
        await kind.unpublish(volume, stage, record)
        await self._catalog.delete_publish(record.target_path)

    async def _undo_stage(self, kind: ExportPath, volume: VolumeRecord, record: StageRecord) -> None:
        try:
            await kind.tear_down(volume, record, self._client(record, required=False), thorough=True)
            await self._catalog.delete_stage(volume.id)
            self._qsd.forget(volume.id)
        except Exception:
            log.exception("event=undo_stage_failed volume_id=%s (the start-up reconcile will retry)", volume.id)

    async def volume(self, volume_id: str, *, any_state: bool = False) -> VolumeRecord:
        """The volume (ready, unless `any_state`: undoing needs no ready volume). Raises NotFound."""
        volume = await self._catalog.volume(volume_id)
        if volume is None or not (any_state or volume.state is VolumeState.READY):
            raise NotFound(f"volume {volume_id} does not exist")
        return volume

    @contextlib.asynccontextmanager
    async def _transient_if_qsd_lost(self, volume_id: str) -> AsyncIterator[None]:
        """A step that failed because QSD died under it is UNAVAILABLE (retry), not INTERNAL.

        A dead QSD's FUSE file answers ENOTCONN, so host tools fail too; the
        rebuild repairs the volume and the CO's retry succeeds. Decided by
        the daemon's state and the export's errno, never by a tool's message.
        """
        try:
            yield
        except (Internal, OSError) as exc:  # OSError: a host call on the dead FUSE file (ENOTCONN, EIO)
            if isinstance(exc, Unavailable):
                raise
            if self._qsd.of(volume_id).ready and not self._exports.export_broken(volume_id):
                raise
            raise Unavailable(f"qemu-storage-daemon went away during the call ({exc}); retry shortly") from exc

    def _client(self, stage: StageRecord, *, required: bool = True) -> QSDClient:
        """The QMP client of the shard that serves (or is to serve) the staged volume; records the placement.

        Raises Unavailable while that shard's QSD is starting or restarting, unless not `required`.
        """
        if required:
            self._check_shard_ready(stage)
        else:
            self._qsd.place(stage.volume_id, stage.shard)
        return self._qsd.daemons[stage.shard].client

    def _check_shard_ready(self, stage: StageRecord) -> None:
        """Record where the staged volume is served; raise Unavailable while that shard's QSD is starting or
        restarting (for a call that sends it nothing itself but must not go on without it)."""
        self._qsd.place(stage.volume_id, stage.shard)
        if not self._qsd.daemons[stage.shard].ready:
            raise Unavailable("qemu-storage-daemon is not ready (starting or restarting); retry shortly")


async def _stage_at(catalog: Catalog, volume_id: str, path: Path) -> StageRecord:
    """The volume's stage if `path` is its staging path or one of its targets; NotFound otherwise."""
    stage = await catalog.stage(volume_id)
    targets = {p.target_path for p in await catalog.publishes(volume_id)}
    if stage is None or (path != stage.staging_path and path not in targets):
        raise NotFound(f"volume {volume_id} is not staged or published at {path}")
    return stage


def _check_restage(spec: StageSpec, existing: StageRecord, access: AccessType, fs_type: str) -> None:
    """A stage of a staged volume: the same arguments are a retry. Raises FailedPrecondition, AlreadyExists."""
    if existing.staging_path != spec.staging_path:
        raise FailedPrecondition(f"volume {spec.volume_id} is already staged at {existing.staging_path}")
    if existing.access_type is not access or existing.fs_type != fs_type:
        raise AlreadyExists(
            f"volume {spec.volume_id} is staged as {existing.access_type.value}"
            f"{'/' + existing.fs_type if existing.fs_type else ''}; requested otherwise"
        )


def _check_republish(spec: PublishSpec, existing: PublishRecord) -> None:
    """A publish at a target that already holds a volume: the same arguments are a retry. Raises AlreadyExists."""
    if existing.volume_id != spec.volume_id:
        raise AlreadyExists(f"target {spec.target_path} already holds volume {existing.volume_id}")
    if existing.readonly != spec.readonly or existing.mount_flags != spec.mount_flags:
        raise AlreadyExists(
            f"volume {spec.volume_id} is already published at {spec.target_path} "
            f"with readonly={existing.readonly} and other flags"
        )


def _check_single_writer(spec: PublishSpec, others: list[PublishRecord]) -> None:
    """SINGLE_NODE_SINGLE_WRITER: one target at a time, either way round. Raises FailedPrecondition."""
    holder = next((p for p in others if spec.single_writer or p.single_writer), None)
    if holder is not None:
        raise FailedPrecondition(
            f"volume {spec.volume_id} is already published at {holder.target_path} and its access mode "
            "(SINGLE_NODE_SINGLE_WRITER) allows one target at a time: unpublish it there first"
        )
