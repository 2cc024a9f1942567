"""The node side of the domain: stage, publish, unpublish, unstage, stats, rebuild.

Each operation records intent in the catalog, then brings QSD and the host
into the wanted shape with idempotent "ensure" steps, then commits. The same
steps rebuild everything after a QSD restart: a lost FUSE export leaves dead
loop devices and mounts behind, which are dropped lazily and made anew.
No gRPC types here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from csi_qsd.catalog import (
    AccessType, Catalog, PublishRecord, PublishState, StageRecord, StageState, VolumeRecord, VolumeState,
)
from csi_qsd.config import Config
from csi_qsd.errors import AlreadyExists, FailedPrecondition, Internal, InvalidArgument, NotFound, Unavailable
from csi_qsd.failpoints import NONE as NO_FAILPOINTS, Failpoints
from csi_qsd.locks import KeyedLocks
from csi_qsd.params import ExportKind
from csi_qsd.publish import block, filesystem, vhost_user
from csi_qsd.qsd import attach, graph
from csi_qsd.qsd.client import BlockNodeInfo, QSDClient
from csi_qsd.qsd.daemon import QSDDaemon
from csi_qsd.sys import filesystems, loop, mounts
from csi_qsd.volumes import choose_size

log = logging.getLogger(__name__)

# How long the rebuild after a QSD restart waits for a call still holding a volume.
REBUILD_LOCK_WAIT = 30.0


@dataclasses.dataclass(frozen=True)
class StageSpec:
    volume_id: str
    staging_path: Path
    block: bool
    fs_type: str
    mount_flags: tuple[str, ...]
    mount_group: str = ""


@dataclasses.dataclass(frozen=True)
class PublishSpec:
    volume_id: str
    staging_path: Path
    target_path: Path
    block: bool
    readonly: bool
    mount_flags: tuple[str, ...]
    mount_group: str = ""


@dataclasses.dataclass(frozen=True)
class VolumeStats:
    block: bool
    total_bytes: int
    available_bytes: int
    used_bytes: int
    total_inodes: int = 0
    available_inodes: int = 0
    used_inodes: int = 0
    abnormal: bool = False
    message: str = ""


class NodeVolumes:
    """Stage and publish volumes of one pool on this node."""

    def __init__(
        self, config: Config, catalog: Catalog, daemon: QSDDaemon, locks: KeyedLocks,
        failpoints: Failpoints = NO_FAILPOINTS,
    ) -> None:
        self._failpoints = failpoints
        self.unstaged_listeners: list[Callable[[str], None]] = []
        self._config = config
        self._catalog = catalog
        self._daemon = daemon
        self._locks = locks

    # paths --------------------------------------------------------------

    def export_dir(self, volume_id: str) -> Path:
        return self._config.exports_dir / volume_id

    def export_file(self, volume_id: str) -> Path:
        return self.export_dir(volume_id) / "disk"

    def socket_dir(self, volume_id: str) -> Path:
        return self.export_dir(volume_id) / "vhost"

    # operations ---------------------------------------------------------

    async def stage(self, spec: StageSpec) -> None:
        """Raises NotFound, FailedPrecondition, AlreadyExists, Unavailable, Aborted."""
        async with self._locks.hold(spec.volume_id), self._transient_if_qsd_lost():
            volume = await self._volume(spec.volume_id)
            self._require_qsd()
            self._check_kind(volume, spec.block)
            fs_type = "" if spec.block or _is_vhost(volume) else filesystems.check_fs_type(spec.fs_type)
            access = AccessType.BLOCK if spec.block else AccessType.MOUNT
            existing = await self._catalog.stage(spec.volume_id)
            if existing is not None and existing.state is StageState.STAGED:
                if existing.staging_path != spec.staging_path:
                    raise FailedPrecondition(
                        f"volume {spec.volume_id} is already staged at {existing.staging_path}"
                    )
                if existing.access_type is not access or existing.fs_type != fs_type:
                    raise AlreadyExists(
                        f"volume {spec.volume_id} is staged as {existing.access_type.value}"
                        f"{'/' + existing.fs_type if existing.fs_type else ''}; requested otherwise"
                    )
                await self._bring_up(volume, existing, await self._catalog.publishes(volume.id))
                return
            if existing is not None:
                await self._tear_down(volume, existing)
            record = StageRecord(
                volume_id=spec.volume_id, staging_path=spec.staging_path, access_type=access,
                fs_type=fs_type, mount_flags=spec.mount_flags, mount_group=spec.mount_group,
                state=StageState.STAGING,
            )
            await self._catalog.put_stage(record)
            self._failpoints.hit("stage.after_intent")
            try:
                record = await self._bring_up(volume, record, [])
            except BaseException:
                await self._undo_stage(volume, record)
                raise
            await self._catalog.put_stage(dataclasses.replace(record, state=StageState.STAGED))
            log.info("event=staged volume_id=%s path=%s loop=%s", volume.id, spec.staging_path, record.loop_device)

    async def unstage(self, volume_id: str, staging_path: Path) -> None:
        """Raises NotFound for an unknown volume, FailedPrecondition while published."""
        async with self._locks.hold(volume_id), self._transient_if_qsd_lost():
            volume = await self._catalog.volume(volume_id)
            if volume is None:
                raise NotFound(f"volume {volume_id} does not exist")
            record = await self._catalog.stage(volume_id)
            if record is None or record.staging_path != staging_path:
                return
            published = [p for p in await self._catalog.publishes(volume_id)]
            if published:
                raise FailedPrecondition(
                    f"volume {volume_id} is still published at {published[0].target_path}; unpublish it first"
                )
            self._require_qsd()
            await self._catalog.put_stage(dataclasses.replace(record, state=StageState.UNSTAGING))
            self._failpoints.hit("unstage.after_intent")
            await self._tear_down(volume, record, thorough=False)
            await self._catalog.delete_stage(volume_id)
            log.info("event=unstaged volume_id=%s path=%s", volume_id, staging_path)
        for listener in self.unstaged_listeners:
            listener(volume_id)

    async def publish(self, spec: PublishSpec) -> None:
        """Raises NotFound, FailedPrecondition (not staged), AlreadyExists (incompatible), Unavailable."""
        async with self._locks.hold(spec.volume_id), self._transient_if_qsd_lost():
            volume = await self._volume(spec.volume_id)
            stage = await self._catalog.stage(spec.volume_id)
            if stage is None or stage.state is not StageState.STAGED or stage.staging_path != spec.staging_path:
                raise FailedPrecondition(
                    f"volume {spec.volume_id} is not staged at {spec.staging_path}; call NodeStageVolume first"
                )
            if (stage.access_type is AccessType.BLOCK) != spec.block:
                raise InvalidArgument(
                    f"volume {spec.volume_id} is staged as {stage.access_type.value}; publish it the same way"
                )
            self._require_qsd()
            existing = await self._catalog.publish(spec.target_path)
            if existing is not None and existing.state is PublishState.PUBLISHED:
                if existing.volume_id != spec.volume_id:
                    raise AlreadyExists(f"target {spec.target_path} already holds volume {existing.volume_id}")
                if existing.readonly != spec.readonly or existing.mount_flags != spec.mount_flags:
                    raise AlreadyExists(
                        f"volume {spec.volume_id} is already published at {spec.target_path} "
                        f"with readonly={existing.readonly} and other flags"
                    )
                await self._ensure_published(volume, stage, existing)
                return
            if existing is not None:
                await self._remove_publish(volume, existing)
            record = PublishRecord(
                target_path=spec.target_path, volume_id=spec.volume_id, readonly=spec.readonly,
                mount_flags=spec.mount_flags, state=PublishState.PUBLISHING,
            )
            await self._catalog.put_publish(record)
            self._failpoints.hit("publish.after_intent")
            try:
                record = await self._ensure_published(volume, stage, record)
            except BaseException:
                await self._remove_publish(volume, record)
                raise
            self._failpoints.hit("publish.after_bind")
            await self._catalog.put_publish(dataclasses.replace(record, state=PublishState.PUBLISHED))
            log.info("event=published volume_id=%s target=%s readonly=%s", volume.id, spec.target_path, spec.readonly)

    async def unpublish(self, volume_id: str, target_path: Path) -> None:
        """Raises NotFound for an unknown volume; an unpublished target is success."""
        async with self._locks.hold(volume_id), self._transient_if_qsd_lost():
            volume = await self._catalog.volume(volume_id)
            if volume is None:
                raise NotFound(f"volume {volume_id} does not exist")
            record = await self._catalog.publish(target_path)
            if record is None or record.volume_id != volume_id:
                return
            await self._catalog.put_publish(dataclasses.replace(record, state=PublishState.UNPUBLISHING))
            self._failpoints.hit("unpublish.after_intent")
            await self._remove_publish(volume, record)
            log.info("event=unpublished volume_id=%s target=%s", volume_id, target_path)

    async def expand(self, volume_id: str, path: Path, required: int, limit: int) -> int:
        """Grow a staged volume's image, device and filesystem; return its new size in bytes.

        The image grows live in QSD (block_resize) and the loop device and
        filesystem follow. A vhost-user-blk export keeps the size it had when
        it was added (QSD 7.2), so it is re-added: a VM started afterwards
        sees the new size, a running one does not (hence OFFLINE expansion).
        Raises NotFound, OutOfRange, FailedPrecondition, Unavailable, Aborted.
        """
        async with self._locks.hold(volume_id), self._transient_if_qsd_lost():
            volume = await self._volume(volume_id)
            stage, paths = await self._stage_at(volume_id, path)
            if stage.state is not StageState.STAGED:
                raise NotFound(f"volume {volume_id} is not staged or published at {path}")
            size = max(choose_size(required, limit), volume.capacity)
            self._require_qsd()
            top = top_image(volume)
            if _is_vhost(volume):
                # The export goes first: block_resize under a vhost-user-blk export stalls
                # QSD's iothread (every VM on it) on 7.2, and an export keeps its size anyway.
                await self._daemon.client.export_del(top.nodes.vhost_export)
            if size > volume.capacity:
                await attach.ensure_top(self._daemon.client, top)
                await self._daemon.client.block_resize(top.nodes.format, size)
                await self._catalog.update_volume(dataclasses.replace(volume, capacity=size))
                log.info("event=expanded volume_id=%s bytes=%d", volume_id, size)
            if _is_vhost(volume):
                publishes = await self._catalog.publishes(volume_id)
                await self._bring_up(dataclasses.replace(volume, capacity=size), stage, publishes)
                return size
            device = Path(stage.loop_device)
            await loop.refresh_capacity(device, size)
            if stage.access_type is AccessType.MOUNT:
                if stage.fs_type == "ext4" and not paths:
                    # Offline growth needs no CAP_SYS_RESOURCE and no pod uses the volume.
                    await filesystem.unstage(stage.staging_path)
                    await filesystem.ensure_staged(device, stage.staging_path, stage.fs_type, list(stage.mount_flags))
                else:
                    await filesystems.grow(stage.staging_path, stage.fs_type, device)
            return size

    async def _stage_at(self, volume_id: str, path: Path) -> tuple[StageRecord, set[Path]]:
        """The volume's stage and publish targets, if `path` is one of them; NotFound otherwise."""
        stage = await self._catalog.stage(volume_id)
        targets = {p.target_path for p in await self._catalog.publishes(volume_id)}
        if stage is None or (path != stage.staging_path and path not in targets):
            raise NotFound(f"volume {volume_id} is not staged or published at {path}")
        return stage, targets

    async def stats(self, volume_id: str, path: Path) -> VolumeStats:
        """Usage of a volume at its staging or target path. Raises NotFound."""
        volume = await self._volume(volume_id)
        stage, _targets = await self._stage_at(volume_id, path)
        abnormal, message = await self._condition(volume)
        if stage.access_type is AccessType.BLOCK or _is_vhost(volume):
            return VolumeStats(block=True, total_bytes=volume.capacity, available_bytes=0, used_bytes=0,
                               abnormal=abnormal, message=message)
        if mounts.mounted_at(path) is None:
            raise NotFound(f"volume {volume_id} has no filesystem mounted at {path}")
        st = await asyncio.to_thread(os.statvfs, path)
        return VolumeStats(
            block=False, total_bytes=st.f_blocks * st.f_frsize, available_bytes=st.f_bavail * st.f_frsize,
            used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize, total_inodes=st.f_files,
            available_inodes=st.f_favail, used_inodes=st.f_files - st.f_ffree, abnormal=abnormal, message=message,
        )

    async def switch_tops(self, switches: list[tuple[VolumeRecord, attach.TopImage]]) -> None:
        """Move staged volumes onto their new top images live, at one instant.

        Mounted filesystems are frozen (fsfreeze) around the switch, so the
        image left behind is consistent; a filesystem that cannot be frozen
        aborts the switch with nothing changed. VM volumes are cut
        crash-consistent: what the guest had acknowledged is in the image.
        Volumes that are not staged need nothing here.
        """
        live: list[tuple[VolumeRecord, attach.TopImage, StageRecord]] = []
        for volume, top in switches:
            stage = await self._catalog.stage(volume.id)
            if stage is not None and stage.state is StageState.STAGED:
                live.append((volume, top, stage))
        if not live:
            return
        self._require_qsd()
        frozen: list[Path] = []
        try:
            for volume, _top, stage in live:
                if stage.access_type is AccessType.MOUNT and not _is_vhost(volume):
                    await filesystems.freeze(stage.staging_path)
                    frozen.append(stage.staging_path)
            await attach.switch_tops(self._daemon.client, [(volume.generation, top) for volume, top, _ in live])
        finally:
            for path in frozen:
                await filesystems.thaw(path)

    async def on_new_tops(self, tops: list[attach.TopImage]) -> bool:
        """True if QSD already has any of `tops` open (a switch happened even though it reported failure)."""
        if not tops or not self._daemon.ready:
            return False
        try:
            present = await self._daemon.client.node_names()
        except Exception:
            return False
        return any(top.nodes.format in present for top in tops)

    async def stream_backing_if_staged(self, volume: VolumeRecord) -> bool:
        """Flatten a staged volume's chain live; False if it is not staged here.

        QSD's block-stream copies everything below the volume's backing image
        (its newest snapshot) into that image, which then stands alone: the
        volume reads through two images again. The top node is left alone on
        purpose: QSD 7.2's writable FUSE export holds the 'resize' permission
        that a stream into the top must deny. Streaming keeps every image's
        content as it was, so snapshots and clones standing on it see no change.
        Raises FailedPrecondition if QSD does not have the backing image open.
        """
        stage = await self._catalog.stage(volume.id)
        if stage is None or stage.state is not StageState.STAGED or not volume.backing:
            return False
        self._require_qsd()
        base = _format_node_of(await self._daemon.client.named_nodes(), volume.backing)
        if not base:
            raise FailedPrecondition(f"the backing image of volume {volume.id} is not open in qemu-storage-daemon")
        job = f"stream-{volume.id}"
        await self._daemon.client.run_job("block-stream", {"job-id": job, "device": base}, job)
        return True

    async def rebuild(self, client: QSDClient) -> None:
        """Make QSD and the host match the catalog; called after every (re)connect to QSD.

        Finishes or undoes transitional rows a crash left, re-creates lost
        exports, loop devices and mounts, and removes our graph nodes that no
        staged volume needs. Image files are never touched.
        """
        wanted: set[str] = set()
        volume_ids = {p.volume_id for p in await self._catalog.publishes()}
        volume_ids |= {s.volume_id for s in await self._catalog.stages()}
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
        for publish in await self._catalog.publishes(volume_id):
            if publish.state is not PublishState.PUBLISHED and volume is not None:
                log.info("event=reconcile_publish volume_id=%s target=%s state=%s",
                         publish.volume_id, publish.target_path, publish.state.value)
                await self._remove_publish(volume, publish, client)
        stage = await self._catalog.stage(volume_id)
        if stage is None:
            return False
        if volume is None:
            await self._catalog.delete_stage(volume_id)
            return False
        if stage.state is not StageState.STAGED:
            log.info("event=reconcile_stage volume_id=%s state=%s", volume_id, stage.state.value)
            await self._tear_down(volume, stage, client)
            await self._catalog.delete_stage(volume_id)
            return False
        try:
            publishes = await self._catalog.publishes(volume_id)
            stage = await self._bring_up(volume, stage, publishes, client)
            await self._catalog.put_stage(stage)
            for publish in publishes:
                updated = await self._ensure_published(volume, stage, publish)
                await self._catalog.put_publish(updated)
        except Exception:
            log.exception("event=rebuild_failed volume_id=%s", volume_id)
        return True

    # steps --------------------------------------------------------------

    async def _bring_up(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord],
        client: QSDClient | None = None,
    ) -> StageRecord:
        """Ensure the volume's nodes, export, loop device and staging mount; return the stage with its loop."""
        client = client or self._daemon.client
        top = top_image(volume)
        nodes = top.nodes
        if _is_vhost(volume):
            await attach.ensure_top(client, top)
            socket_dir = self.socket_dir(volume.id)
            vhost_user.prepare_dir(socket_dir, stage.mount_group)
            socket = socket_dir / vhost_user.SOCKET_NAME
            writable = not any(p.readonly for p in publishes)  # the one publish's mode (see _claim_vhost_export)
            await attach.ensure_vhost_export(client, top, socket, writable=writable)
            vhost_user.restrict_socket(socket, stage.mount_group)
            return stage
        export_file = self.export_file(volume.id)
        fresh_export = not await attach.has_export(client, nodes.fuse_export)
        if fresh_export:
            await self._drop_stale_host_state(volume, stage, publishes)
        await attach.ensure_top(client, top)
        if fresh_export:
            await attach.add_fuse_export(client, top, export_file, writable=True)
        self._failpoints.hit("stage.after_export")
        device = await self._loop_for(export_file, stage.loop_device, fresh_export)
        self._failpoints.hit("stage.after_loop")
        stage = dataclasses.replace(stage, loop_device=str(device))
        if stage.access_type is AccessType.MOUNT:
            fs_type = await filesystem.ensure_staged(device, stage.staging_path, stage.fs_type, list(stage.mount_flags))
            self._failpoints.hit("stage.after_mount")
            if stage.mount_group:
                await asyncio.to_thread(_apply_group, stage.staging_path, stage.mount_group)
            if fs_type != stage.fs_type:
                stage = dataclasses.replace(stage, fs_type=fs_type)
        return stage

    async def _ensure_published(self, volume: VolumeRecord, stage: StageRecord, record: PublishRecord) -> PublishRecord:
        if _is_vhost(volume):
            if record.state is PublishState.PUBLISHING:
                await self._claim_vhost_export(volume, stage, record)
            await vhost_user.ensure_published(self.socket_dir(volume.id), record.target_path)
            return record
        if stage.access_type is AccessType.MOUNT:
            await filesystem.ensure_published(
                stage.staging_path, record.target_path, readonly=record.readonly, flags=list(record.mount_flags)
            )
            return record
        if record.readonly:
            export_file = self.export_file(volume.id)
            loops = [lp.device for lp in loop.find_loop(export_file, readonly=True)]
            device = Path(record.loop_device) if record.loop_device and Path(record.loop_device) in loops else None
            if device is None:
                device = await loop.attach(export_file, readonly=True, direct_io=self._daemon.loop_direct_io)
                record = dataclasses.replace(record, loop_device=str(device))
        else:
            device = Path(stage.loop_device)
        await block.ensure_published(device, record.target_path, readonly=record.readonly)
        return record

    async def _claim_vhost_export(self, volume: VolumeRecord, stage: StageRecord, record: PublishRecord) -> None:
        """Give a new publish of a VM volume the export, read-only if the publish is.

        A vhost-user-blk socket serves one VM at a time (QSD 7.2 leaves a second
        client's QEMU hanging at start-up), so a second publish is refused. With
        no other publish no VM is connected, so the export is re-added in the
        publish's mode: a guest then sees a read-only disk for a readonly publish.
        Raises FailedPrecondition.
        """
        others = [p for p in await self._catalog.publishes(volume.id) if p.target_path != record.target_path]
        if others:
            raise FailedPrecondition(
                f"volume {volume.id} is already published at {others[0].target_path}; a vhost-user-blk "
                "volume serves one VM at a time: unpublish it there first"
            )
        top = top_image(volume)
        socket = self.socket_dir(volume.id) / vhost_user.SOCKET_NAME
        await self._daemon.client.export_del(top.nodes.vhost_export)
        await attach.ensure_vhost_export(self._daemon.client, top, socket, writable=not record.readonly)
        vhost_user.restrict_socket(socket, stage.mount_group)

    async def _remove_publish(
        self, volume: VolumeRecord, record: PublishRecord, client: QSDClient | None = None
    ) -> None:
        if _is_vhost(volume):
            await vhost_user.unpublish(record.target_path)
        elif record.target_path.is_dir():
            await filesystem.unpublish(record.target_path)
        else:
            await block.unpublish(record.target_path)
        self._failpoints.hit("unpublish.after_unmount")
        if record.loop_device:
            await loop.detach(Path(record.loop_device))
        await self._catalog.delete_publish(record.target_path)

    async def _loop_for(self, export_file: Path, recorded: str, fresh_export: bool) -> Path:
        """The volume's read-write loop device: the recorded one, a new one, or (after a crash) a found one."""
        if recorded and loop.backing_of(Path(recorded)) == export_file:
            return Path(recorded)
        if not fresh_export:
            found = loop.find_loop(export_file, readonly=False)
            if found:
                return found[0].device
        return await loop.attach(export_file, direct_io=self._daemon.loop_direct_io)

    async def _tear_down(
        self, volume: VolumeRecord, stage: StageRecord, client: QSDClient | None = None, *, thorough: bool = True
    ) -> None:
        """Undo everything staging did, in reverse; safe on a partly staged volume.

        `thorough` also looks for loop devices the catalog never recorded (a
        crash between attaching and committing); a clean unstage skips that scan.
        """
        client = client or self._daemon.client
        export_file = self.export_file(volume.id)
        if stage.access_type is AccessType.MOUNT and not _is_vhost(volume):
            entry = mounts.mounted_at(stage.staging_path)
            if entry is not None and _is_loop_over(entry.source, export_file):
                await filesystem.unstage(stage.staging_path)
        self._failpoints.hit("unstage.after_unmount")
        devices = {Path(stage.loop_device)} if stage.loop_device else set()
        if thorough:
            devices |= {lp.device for lp in loop.find_loop(export_file)}
        for device in sorted(devices):
            if loop.backing_of(device) == export_file:
                await loop.detach(device)
        self._failpoints.hit("unstage.after_detach")
        await attach.remove_volume(client, volume.id)
        if mounts.mounted_at(export_file) is not None:
            await mounts.unmount(export_file, lazy=True)
        await asyncio.to_thread(shutil.rmtree, self.export_dir(volume.id), True)

    async def _undo_stage(self, volume: VolumeRecord, record: StageRecord) -> None:
        try:
            await self._tear_down(volume, record)
            await self._catalog.delete_stage(volume.id)
        except Exception:
            log.exception("event=undo_stage_failed volume_id=%s (the start-up reconcile will retry)", volume.id)

    async def _drop_stale_host_state(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord]
    ) -> None:
        """After QSD lost the export: lazily drop mounts and loops that point at the dead FUSE file."""
        export_file = self.export_file(volume.id)
        if not os.path.lexists(export_file.parent):
            return  # never exported on this node: nothing can be stale
        stale = loop.find_loop(export_file)
        if not stale and mounts.mounted_at(export_file) is None:
            return
        log.warning("event=drop_stale volume_id=%s loops=%s", volume.id, [str(s.device) for s in stale])
        for publish in publishes:
            await mounts.unmount(publish.target_path, lazy=True)
        if stage.access_type is AccessType.MOUNT:
            entry = mounts.mounted_at(stage.staging_path)
            if entry is not None and _is_loop_over(entry.source, export_file):
                await mounts.unmount(stage.staging_path, lazy=True)
        for lp in stale:
            await loop.detach(lp.device)
        await mounts.unmount(export_file, lazy=True)

    async def _condition(self, volume: VolumeRecord) -> tuple[bool, str]:
        if not self._daemon.ready:
            return True, "qemu-storage-daemon is restarting; I/O will resume when it is back"
        nodes = graph.nodes_for(volume.id)
        export_id = nodes.vhost_export if _is_vhost(volume) else nodes.fuse_export
        if not await attach.has_export(self._daemon.client, export_id):
            return True, f"export {export_id} is missing from qemu-storage-daemon"
        return False, "volume is healthy"

    async def _volume(self, volume_id: str) -> VolumeRecord:
        volume = await self._catalog.volume(volume_id)
        if volume is None or volume.state is not VolumeState.READY:
            raise NotFound(f"volume {volume_id} does not exist")
        return volume

    @contextlib.asynccontextmanager
    async def _transient_if_qsd_lost(self) -> AsyncIterator[None]:
        """A step that failed because QSD died under it is UNAVAILABLE (retry), not INTERNAL.

        The FUSE file of a dead export answers ENOTCONN, so host tools fail
        too; the rebuild repairs the volume and the CO's retry succeeds.
        """
        try:
            yield
        except Internal as exc:
            if isinstance(exc, Unavailable):
                raise
            if self._daemon.ready and "Transport endpoint is not connected" not in str(exc):
                raise
            raise Unavailable(f"qemu-storage-daemon went away during the call ({exc}); retry shortly") from exc

    def _require_qsd(self) -> None:
        if not self._daemon.ready:
            raise Unavailable("qemu-storage-daemon is not ready (starting or restarting); retry shortly")

    @staticmethod
    def _check_kind(volume: VolumeRecord, block_access: bool) -> None:
        if _is_vhost(volume) and block_access:
            raise InvalidArgument(
                f"volume {volume.id} is a vhost-user-blk volume: stage it with the mount access type"
            )


def _format_node_of(nodes: dict[str, BlockNodeInfo], image: str) -> str:
    """The qcow2 node QSD reads `image` through, or ''.

    A node QEMU opened from a backing chain reports the image's file name; an
    overlay we attached with blockdev-snapshot reports a json: pseudo-name,
    so it is found through its file node, whose name follows our scheme.
    """
    for name, info in nodes.items():
        if info["drv"] == "qcow2" and info["file"] == image:
            return name
        volume_id, generation = graph.volume_of(name), graph.generation_of(name)
        if info["drv"] == "file" and info["file"] == image and volume_id is not None and generation is not None:
            candidate = graph.nodes_for(volume_id, generation).format
            if candidate in nodes:
                return candidate
    return ""


def top_image(volume: VolumeRecord) -> attach.TopImage:
    return attach.TopImage(volume.id, volume.generation, volume.image, volume.params)


def _is_vhost(volume: VolumeRecord) -> bool:
    return volume.params.export is ExportKind.VHOST_USER_BLK


def _is_loop_over(source: str, export_file: Path) -> bool:
    """True if mount source `source` is a loop device whose backing file is `export_file`."""
    return source.startswith("/dev/loop") and loop.backing_of(Path(source)) == export_file


def _apply_group(root: Path, group: str) -> None:
    """Give the filesystem's root to the pod's group (setgid, group-writable): VOLUME_MOUNT_GROUP."""
    gid = int(group)
    st = os.stat(root)
    if st.st_gid != gid:
        os.chown(root, -1, gid)
    os.chmod(root, (st.st_mode & 0o7777) | 0o2070)
