"""Snapshots, group snapshots and clones: O(1) cuts of qcow2 backing chains, live.

A snapshot freezes a volume's current top image; the volume moves on to a new
thin overlay, switched live in QSD (one QMP transaction for a whole group, so
all members are cut at the same instant). Restores and clones are overlays on
a snapshot's image. A deleted snapshot that others still stand on is hidden
and reclaimed with its last dependant; chains deeper than MAX_CHAIN_DEPTH are
flattened in the background. Every step records intent first; `reconcile`
rolls an interrupted cut forward (the overlay exists) or back (it does not).
No gRPC types here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from csi_qsd import validate
from csi_qsd.catalog import Catalog, GroupRecord, SnapshotRecord, SnapshotState, VolumeRecord, VolumeState, now
from csi_qsd.controller import chains, encrypted
from csi_qsd.controller.live import LiveImages
from csi_qsd.controller.volumes import Volumes
from csi_qsd.errors import Aborted, AlreadyExists, DriverError, FailedPrecondition, InvalidArgument, NotFound
from csi_qsd.params import Capability, ImageFormat, QoS, VolumeParameters
from csi_qsd.pools.base import Pool
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints
from csi_qsd.sys.locks import KeyedLocks
from csi_qsd.sys.volume_keys import KeyStore, VolumeKey

log = logging.getLogger(__name__)

# Reads through more images than this trigger a background flatten of the volume.
MAX_CHAIN_DEPTH = 8
FLATTEN_RETRIES = 600
FLATTEN_RETRY_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class Group(GroupRecord):
    """A group snapshot's row and its members."""

    members: tuple[SnapshotRecord, ...]


class Snapshots:
    """Snapshot lifecycle on one pool; shares the per-volume locks with volumes and staging."""

    def __init__(
        self, catalog: Catalog, pool: Pool, volumes: Volumes, live: LiveImages, locks: KeyedLocks,
        failpoints: Failpoints = NO_FAILPOINTS, keys: KeyStore | None = None,
    ) -> None:
        self._keys = keys if keys is not None else KeyStore(None)
        self._catalog = catalog
        self._pool = pool
        self._volumes = volumes
        self._live = live
        self._locks = locks
        self._failpoints = failpoints
        self._name_locks = KeyedLocks("snapshot name")
        # A restore reads through the snapshot's image from before its row exists until after: a delete must wait.
        self._snapshot_locks = KeyedLocks("snapshot")
        # Asked under the snapshot's lock before a delete: raises while something outside this catalog's
        # chains reads the snapshot (a copy on another node: `csi_qsd.controller.copy_sources.CopySources`).
        self.before_delete: Callable[[str], Awaitable[None]] | None = None
        self._flattening: dict[str, asyncio.Task[None]] = {}

    async def close(self) -> None:
        """Cancel background flattens; an interrupted flatten leaves the old chain, which is valid."""
        tasks = list(self._flattening.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # snapshots ----------------------------------------------------------

    async def create(self, name: str, source_volume_id: str, key: VolumeKey | None = None) -> SnapshotRecord:
        """Cut (or return the existing identical) snapshot `name` of a volume.

        An encrypted volume's new top needs its key: `key` (the request's
        Secret) or the one this node holds while the volume is staged.
        Raises NotFound, AlreadyExists, FailedPrecondition, Aborted, Unavailable, InvalidArgument, PermissionDenied.
        """
        async with self._name_locks.hold(name):
            existing = await self._existing(name, source_volume_id)
            if existing is not None:
                return existing
            (snapshot,) = await self._cut([(name, source_volume_id)], group_id="", key=key)
            return snapshot

    async def cut_hidden(self, name: str, source_volume_id: str) -> SnapshotRecord:
        """A hidden snapshot of a volume, for a clone made elsewhere (idempotent by name); deleted like any other.

        Raises NotFound, FailedPrecondition, Aborted, Unavailable.
        """
        async with self._name_locks.hold(name):
            existing = await self._catalog.snapshot_by_name(name)
            if existing is not None and existing.state is SnapshotState.READY:
                return existing
            (snapshot,) = await self._cut([(name, source_volume_id)], group_id="", hidden=True)
            return snapshot

    async def delete(self, snapshot_id: str) -> None:
        """Remove a snapshot from the user's view; its image goes once nothing stands on it."""
        snapshot = await self._catalog.snapshot(snapshot_id)
        if snapshot is None:
            return
        if snapshot.state is SnapshotState.CREATING:
            raise Aborted(f"snapshot {snapshot_id} is still being created; retry the delete")
        async with self._snapshot_locks.hold(snapshot_id):
            if self.before_delete is not None:
                await self.before_delete(snapshot_id)
            if await self._catalog.dependants(str(snapshot.image)) > 0:
                await self._catalog.put_snapshots([dataclasses.replace(snapshot, hidden=True)])
                log.info("event=snapshot_hidden snapshot_id=%s (images still depend on it)", snapshot_id)
                return
            await self._catalog.put_snapshots([dataclasses.replace(snapshot, state=SnapshotState.DELETING)])
            self._failpoints.hit("delete_snapshot.after_intent")
            await self._pool.delete(snapshot.image)
            await self._catalog.delete_snapshot(snapshot_id)
            log.info("event=snapshot_deleted snapshot_id=%s", snapshot_id)
            await chains.reclaim(self._catalog, self._pool, snapshot.backing)

    async def get(self, snapshot_id: str) -> SnapshotRecord | None:
        snapshot = await self._catalog.snapshot(snapshot_id)
        if snapshot is None or snapshot.hidden or snapshot.state is not SnapshotState.READY:
            return None
        return snapshot

    async def page(
        self, starting_token: str, max_entries: int, *, snapshot_id: str = "", source_volume_id: str = ""
    ) -> tuple[list[SnapshotRecord], str]:
        """One page of visible snapshots, optionally filtered; Aborted for a foreign token."""
        if max_entries < 0:
            raise InvalidArgument("max_entries must not be negative")
        if starting_token and not validate.SNAPSHOT_ID_RE.match(starting_token):
            raise Aborted(f"starting_token {starting_token!r} is not one this driver issued")
        visible = [
            s for s in await self._catalog.snapshots()
            if not s.hidden and s.state is SnapshotState.READY and s.id > starting_token
            and (not snapshot_id or s.id == snapshot_id)
            and (not source_volume_id or s.source_volume_id == source_volume_id)
        ]
        if max_entries and len(visible) > max_entries:
            return visible[:max_entries], visible[max_entries - 1].id
        return visible, ""

    # groups -------------------------------------------------------------

    async def create_group(self, name: str, volume_ids: list[str]) -> Group:
        """Cut every volume at the same instant (one QMP transaction); idempotent by name."""
        if not volume_ids:
            raise InvalidArgument("source_volume_ids must not be empty")
        if len(set(volume_ids)) != len(volume_ids):
            raise InvalidArgument("source_volume_ids lists a volume twice")
        async with self._name_locks.hold(name):
            found = await self._catalog.group(name=name)
            if found is not None:
                group = await self.get_group(found.id)
                assert group is not None
                if sorted(s.source_volume_id for s in group.members) != sorted(volume_ids):
                    raise AlreadyExists(f"group snapshot {name!r} exists with other source volumes")
                return group
            group_id = validate.new_group_id()
            created = now()
            await self._catalog.add_group(GroupRecord(group_id, name, created))
            try:
                members = await self._cut([(f"{name}.{vid}", vid) for vid in volume_ids], group_id=group_id)
            except BaseException:
                await self._catalog.delete_group(group_id)
                raise
            return Group(group_id, name, created, tuple(members))

    async def get_group(self, group_id: str) -> Group | None:
        found = await self._catalog.group(group_id=group_id)
        if found is None:
            return None
        members = tuple(m for m in await self._catalog.group_members(group_id) if m.state is SnapshotState.READY)
        return Group(found.id, found.name, found.created_at, members)

    def holding(self, snapshot_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        """The snapshot's lock, as deletes and restores take it (Aborted while another call holds it)."""
        return self._snapshot_locks.hold(snapshot_id)

    async def delete_group(self, group_id: str) -> None:
        """Delete every member; refused before any goes while one of them may not (FailedPrecondition)."""
        members = await self._catalog.group_members(group_id)
        if self.before_delete is not None:
            for member in members:
                await self.before_delete(member.id)
        for member in members:
            await self.delete(member.id)
        await self._catalog.delete_group(group_id)

    # volumes from snapshots and volumes --------------------------------

    async def volume_from(
        self, name: str, required: int, limit: int, params: VolumeParameters, caps: list[Capability],
        *, snapshot_id: str = "", volume_id: str = "", qos: QoS = QoS(), key: VolumeKey | None = None,
        key_version: str = "",
    ) -> VolumeRecord:
        """A new volume over a snapshot, or over a fresh hidden snapshot of a volume (a clone): O(1).

        An encrypted one (`key`, from the provisioner's Secret) stands on an
        encrypted source that `key` opens, a plain one on a plain source.
        """
        if params.format is not ImageFormat.QCOW2:
            raise InvalidArgument("volumes made from a snapshot or another volume must use format 'qcow2'")
        source = f"snapshot:{snapshot_id}" if snapshot_id else f"volume:{volume_id}"
        existing = await self._catalog.volume_by_name(name)
        if existing is not None and existing.state is VolumeState.READY:
            return await self._volumes.create(name, required, limit, params, caps, source=source, qos=qos, key=key,
                                              key_version=key_version)
        if snapshot_id:
            async with self._snapshot_locks.hold(snapshot_id):
                snapshot = await self.get(snapshot_id)
                if snapshot is None:
                    raise NotFound(f"snapshot {snapshot_id} does not exist")
                await encrypted.check_source(self._pool, snapshot.image, f"snapshot {snapshot_id}", params, key,
                                             source_encrypted=await encrypted.image_encrypted(snapshot.image))
                volume = await self._volumes.create(
                    name, required, limit, params, caps, base=snapshot.image, base_size=snapshot.size, source=source,
                    qos=qos, key=key, key_version=key_version,
                )
        else:
            origin = await self._catalog.volume(volume_id)
            if origin is None or origin.state is not VolumeState.READY:
                raise NotFound(f"volume {volume_id} does not exist")
            await encrypted.check_source(self._pool, origin.image, f"volume {volume_id}", params, key,
                                         source_encrypted=origin.params.encrypted)

            async def cut_origin() -> Path:
                # Runs only once the request has passed every check: a refused
                # clone must not leave a cut behind on the source.
                (snapshot,) = await self._cut(
                    [(f"clone.{validate.new_snapshot_id()}", volume_id)], group_id="", hidden=True, key=key,
                )
                return snapshot.image

            volume = await self._volumes.create(
                name, required, limit, params, caps, base_size=origin.capacity, source=source, make_base=cut_origin,
                qos=qos, key=key, key_version=key_version,
            )
        self._maybe_flatten(volume)
        return volume

    # the cut ------------------------------------------------------------

    async def _existing(self, name: str, source_volume_id: str) -> SnapshotRecord | None:
        existing = await self._catalog.snapshot_by_name(name)
        if existing is None:
            return None
        if existing.source_volume_id != source_volume_id:
            raise AlreadyExists(
                f"snapshot {name!r} exists ({existing.id}) of another volume ({existing.source_volume_id})"
            )
        if existing.state is SnapshotState.READY and not existing.hidden:
            return existing
        raise FailedPrecondition(f"snapshot {name!r} ({existing.id}) is being created or deleted; retry later")

    async def _cut(
        self, requests: list[tuple[str, str]], *, group_id: str, hidden: bool = False, key: VolumeKey | None = None,
    ) -> list[SnapshotRecord]:
        async with contextlib.AsyncExitStack() as stack:
            volumes: list[VolumeRecord] = []
            for _name, vid in requests:
                await stack.enter_async_context(self._locks.hold(vid))
                volume = await self._catalog.volume(vid)
                if volume is None or volume.state is not VolumeState.READY:
                    raise NotFound(f"volume {vid} does not exist")
                if volume.params.format is not ImageFormat.QCOW2:
                    raise FailedPrecondition(f"volume {vid} is a raw image; snapshots need format 'qcow2'")
                await self._volumes.settled(volume)
                volumes.append(volume)
            keys = await encrypted.keys_for(self._pool, self._keys, volumes, key)
            created = now()
            snapshots = [
                SnapshotRecord(
                    id=validate.new_snapshot_id(), name=name, source_volume_id=volume.id, image=volume.image,
                    backing=volume.backing, size=volume.capacity, created_at=created, state=SnapshotState.CREATING,
                    hidden=hidden, group_id=group_id,
                    overlay=str(self._pool.image_path(volume.id, ImageFormat.QCOW2, volume.generation + 1)),
                )
                for (name, _), volume in zip(requests, volumes)
            ]
            await self._catalog.put_snapshots(snapshots)
            self._failpoints.hit("snapshot.after_intent")
            moved: list[VolumeRecord] = []
            try:
                for snapshot, volume in zip(snapshots, volumes):
                    await self._pool.create_overlay(
                        Path(snapshot.overlay), volume.image, volume.capacity, volume.params.granularity,
                        key=keys.get(volume.id),
                    )
                self._failpoints.hit("snapshot.after_overlay")
                moved = [_moved(volume, snapshot) for volume, snapshot in zip(volumes, snapshots)]
                await self._live.switch_tops(list(zip(volumes, moved)))
            except BaseException:
                # A switch QSD carried out although its answer was lost must roll forward:
                # the volume already writes to the overlay.
                if not await self._live.any_switched(moved):
                    await self._undo_cut(snapshots)
                    raise
                log.warning("event=snapshot_switch_answer_lost; rolling forward")
            self._failpoints.hit("snapshot.after_switch")
            ready = [dataclasses.replace(s, state=SnapshotState.READY, overlay="") for s in snapshots]
            await self._catalog.put_snapshots(ready, tuple(moved))
        for snapshot, volume in zip(ready, moved):
            log.info("event=snapshot_created snapshot_id=%s volume_id=%s image=%s", snapshot.id, volume.id, snapshot.image)
            self._maybe_flatten(volume)
        return ready

    async def _undo_cut(self, snapshots: list[SnapshotRecord]) -> None:
        for snapshot in snapshots:
            await self._pool.delete(Path(snapshot.overlay))
            await self._catalog.delete_snapshot(snapshot.id)

    async def reconcile(self) -> None:
        """Roll interrupted cuts forward (overlay made) or back (not made); finish interrupted deletes."""
        for snapshot in await self._catalog.snapshots():
            if snapshot.state is SnapshotState.CREATING:
                volume = await self._catalog.volume(snapshot.source_volume_id)
                overlay = Path(snapshot.overlay)
                if volume is not None and overlay.exists() and volume.image == snapshot.image:
                    log.info("event=reconcile_snapshot_forward snapshot_id=%s", snapshot.id)
                    await self._catalog.put_snapshots(
                        [dataclasses.replace(snapshot, state=SnapshotState.READY, overlay="")],
                        (_moved(volume, snapshot),),
                    )
                else:
                    log.info("event=reconcile_snapshot_back snapshot_id=%s", snapshot.id)
                    await self._undo_cut([snapshot])
            elif snapshot.state is SnapshotState.DELETING:
                await self._pool.delete(snapshot.image)
                await self._catalog.delete_snapshot(snapshot.id)
                await chains.reclaim(self._catalog, self._pool, snapshot.backing)
        # A flatten that finished but was not recorded: the image's header no longer names a backing file.
        for volume in await self._catalog.volumes(state=VolumeState.READY):
            if volume.backing and volume.image.exists() and not await self._pool.backing_of(volume.image):
                log.info("event=reconcile_flattened volume_id=%s", volume.id)
                await self._catalog.set_volume(dataclasses.replace(volume, backing=""))
                await chains.reclaim(self._catalog, self._pool, volume.backing)
        for snapshot in await self._catalog.snapshots():
            if snapshot.backing and snapshot.image.exists() and not await self._pool.backing_of(snapshot.image):
                log.info("event=reconcile_flattened snapshot_id=%s", snapshot.id)
                await self._catalog.put_snapshots([dataclasses.replace(snapshot, backing="")])
                await chains.reclaim(self._catalog, self._pool, snapshot.backing)

    # flattening ---------------------------------------------------------

    def flatten_later(self, volume_id: str) -> None:
        """Flatten a deep chain once the volume is free (called when a volume is unstaged)."""
        if volume_id not in self._flattening:
            task = asyncio.create_task(self._flatten_if_deep(volume_id), name=f"flatten-{volume_id}")
            self._flattening[volume_id] = task
            task.add_done_callback(self._forget_flatten)

    def _maybe_flatten(self, volume: VolumeRecord) -> None:
        if volume.id not in self._flattening:
            task = asyncio.create_task(self._flatten_if_deep(volume.id), name=f"flatten-{volume.id}")
            self._flattening[volume.id] = task
            task.add_done_callback(self._forget_flatten)

    def _forget_flatten(self, task: asyncio.Task[None]) -> None:
        self._flattening.pop(task.get_name().removeprefix("flatten-"), None)

    async def _flatten_if_deep(self, volume_id: str) -> None:
        """Background task: flatten once the volume is free; give up quietly if it cannot be done live."""
        for _attempt in range(FLATTEN_RETRIES):
            try:
                volume = await self._catalog.volume(volume_id)
                if volume is None or await chains.depth(self._catalog, volume) <= MAX_CHAIN_DEPTH:
                    return
                await self.flatten(volume_id)
                return
            except asyncio.CancelledError:
                raise
            except Aborted:
                await asyncio.sleep(FLATTEN_RETRY_SECONDS)  # another call holds the volume; try again
            except DriverError as exc:
                log.info("event=flatten_deferred volume_id=%s reason=%r", volume_id, str(exc))
                return
            except Exception:
                log.exception("event=flatten_failed volume_id=%s", volume_id)
                return

    async def flatten(self, volume_id: str) -> None:
        """Copy the chain below a volume's newest snapshot into that snapshot's image; live if staged.

        The volume then reads through two images. The merged layers'
        changed-block records are carried into the image (`csi_qsd.qcow2.layer_bitmaps`).
        """
        async with self._locks.hold(volume_id):
            volume = await self._catalog.volume(volume_id)
            if volume is None or not volume.backing:
                return
            if volume.params.encrypted:
                # qemu-img would need the key of every layer, and QSD names an encrypted layer by a json: filename
                # that `block_jobs.stream_into_backing` does not look for: the chain stays as it is.
                raise FailedPrecondition(f"volume {volume_id} is encrypted: its chain is not flattened")
            log.info("event=flatten_start volume_id=%s", volume_id)
            base = await self._catalog.snapshot_by_image(volume.backing)
            live = await self._live.stream_backing_if_staged(volume)
            if base is not None and base.backing:
                if not live:
                    # Into the newest snapshot's image, as live: a frozen image's own changed-block record
                    # stays exact, where the volume's top would have its record mixed with the merged data.
                    await self._pool.flatten(base.image)
                await self._catalog.put_snapshots([dataclasses.replace(base, backing="")])
                log.info("event=flatten_done volume_id=%s live=%s into=%s", volume_id, str(live).lower(), base.id)
                await chains.reclaim(self._catalog, self._pool, base.backing)
                return
            if live:
                return
            await self._pool.flatten(volume.image)
            await self._catalog.set_volume(dataclasses.replace(volume, backing=""))
            log.info("event=flatten_done volume_id=%s live=false", volume_id)
            await chains.reclaim(self._catalog, self._pool, volume.backing)


def _moved(volume: VolumeRecord, snapshot: SnapshotRecord) -> VolumeRecord:
    """The volume after the cut: on its new overlay, one generation on, standing on the snapshot."""
    return dataclasses.replace(
        volume, image=Path(snapshot.overlay), generation=volume.generation + 1, backing=str(snapshot.image)
    )
