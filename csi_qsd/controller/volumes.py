"""The controller side of the domain: create, delete, look up and list volumes.

No gRPC types here. Every step records intent in the catalog before it acts,
so a crash leaves a row the start-up reconcile can finish or undo.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from csi_qsd import validate
from csi_qsd.catalog import Catalog, VolumeRecord, VolumeState, now
from csi_qsd.controller import chains
from csi_qsd.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    OutOfRange,
    ResourceExhausted,
)
from csi_qsd.params import Capability, QoS, VolumeParameters, choose_size, unsupported_capability
from csi_qsd.pools.base import NewImage, Pool, settle_image
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints
from csi_qsd.sys.filesystems import MINIMUM_BYTES
from csi_qsd.sys.locks import KeyedLocks
from csi_qsd.sys.volume_keys import VolumeKey

log = logging.getLogger(__name__)

# How long after a CreateVolume its image is made durable, with every other created meanwhile (`_settle_later`).
SETTLE_DELAY = 0.1
# How long after a DeleteVolume its storage is freed, with every other deleted meanwhile (`_free_later`).
FREE_DELAY = 0.1

def _room_for_filesystem(wanted: int, limit: int, caps: list[Capability]) -> int:
    """`wanted` bytes (0: the default size), raised to the least a filesystem the capabilities name can be
    made on, so that the volume can be staged (CSI lets a volume be larger than required, within the limit).
    Raises OutOfRange if the limit leaves no room for it."""
    fs_type, least = max(((cap.fs_type, MINIMUM_BYTES.get(cap.fs_type, 0)) for cap in caps if not cap.block),
                         key=lambda pair: pair[1], default=("", 0))
    if least and limit and limit < least:
        raise OutOfRange(f"a {fs_type} filesystem needs at least {least} bytes, above limit_bytes {limit}: "
                         "allow a larger volume or use ext4")
    return max(wanted, least) if wanted > 0 else wanted  # 0: the default size; below: choose_size refuses


def _fits(record: VolumeRecord, required: int, limit: int) -> bool:
    return record.capacity >= required and (not limit or record.capacity <= limit)


class Volumes:
    """Volume lifecycle on the node's pools, serialized per name and per volume.

    `pool` is the file pool ("default"); `pools` adds device pools by ID. A
    volume goes to the pool its parameters name and is deleted through the
    pool its row records.
    """

    def __init__(
        self, catalog: Catalog, pool: Pool, volume_locks: KeyedLocks, failpoints: Failpoints = NO_FAILPOINTS,
        pools: Mapping[str, Pool] | None = None,
    ) -> None:
        self._failpoints = failpoints
        self._catalog = catalog
        self._pool = pool
        self._pools: dict[str, Pool] = {**(pools or {}), pool.id: pool}
        self._volume_locks = volume_locks
        # One lock per volume name for every CreateVolume, also of volumes copied from another node
        # (`csi_qsd.controller.copy_targets.CopyTargets` holds these too): a second call for a name is ABORTED.
        self.name_locks = KeyedLocks("volume name")
        # Asked under the volume's lock before a delete: raises while something outside this catalog's
        # chains reads the volume (a clone on another node: `csi_qsd.controller.copy_sources.CopySources`).
        self.before_delete: Callable[[str], Awaitable[None]] | None = None
        self._unsettled: dict[str, VolumeRecord] = {}  # created, image not yet written or not known durable
        self._settling: dict[str, VolumeRecord] = {}  # the batch being written and synced now
        self._batch_done = asyncio.Event()
        self._settler: asyncio.Task[None] | None = None
        self._deleting: dict[str, asyncio.Task[None]] = {}  # marked DELETING: the batch that frees its storage
        # The batch still waiting for FREE_DELAY, and its task.
        self._to_free: tuple[dict[str, VolumeRecord], asyncio.Task[None]] | None = None
        self._free_now = asyncio.Event()  # someone waits for storage: the waiting batch goes at once

    async def create(
        self, name: str, required: int, limit: int, params: VolumeParameters, caps: list[Capability],
        *, base: Path | None = None, base_size: int = 0, source: str = "",
        make_base: Callable[[], Awaitable[Path]] | None = None, qos: QoS = QoS(), key: VolumeKey | None = None,
        key_version: str = "",
    ) -> VolumeRecord:
        """Create (or return the existing identical) volume called `name`.

        With `base`, the volume is a thin overlay on that image (a restore or a
        clone, O(1)) of at least `base_size` bytes; `source` says where it
        came from. `make_base` produces the base only after every check has
        passed (a clone cuts its source then). `qos` are the I/O limits from
        the request's mutable parameters; `key` the passphrase of an encrypted
        volume (`params.encrypted`), which every image of it is made with, labelled `key_version` (the
        Secret's `keyVersion`, recorded). Raises InvalidArgument,
        OutOfRange, AlreadyExists, ResourceExhausted, Aborted.
        """
        for cap in caps:
            reason = unsupported_capability(cap, params)
            if reason:
                raise InvalidArgument(reason)
        pool = self.pool_for(params.pool)
        pool.check_parameters(params)
        if params.encrypted and key is None:
            raise InvalidArgument(f"volume {name!r} is encrypted: its passphrase must come with the request")
        key = key if params.encrypted else None
        async with self.name_locks.hold(name):
            existing = await self._same_volume(name, required, limit, params, source, qos)
            if existing is not None:
                return existing
            size = choose_size(_room_for_filesystem(required or base_size, limit, caps), limit)
            if size < base_size:
                raise OutOfRange(f"volume {name!r} must hold at least the {base_size} bytes of its source")
            if make_base is not None:
                base = await make_base()
            volume_id = validate.new_volume_id()
            record = VolumeRecord(
                id=volume_id, name=name, capacity=size, params=params,
                image=pool.image_path(volume_id, params.format), state=VolumeState.CREATING, pool=pool.id,
                created_at=now(), backing=str(base) if base is not None else "", source=source, qos=qos,
                key_version=key_version if params.encrypted else "",
            )
            if base is None and pool.settles_later(params):
                return await self._create_blank(pool, record)
            return await self._create_image(pool, record, base, key)

    async def _same_volume(self, name: str, required: int, limit: int, params: VolumeParameters, source: str,
                           qos: QoS) -> VolumeRecord | None:
        """The READY volume called `name` if it is the one asked for; None once no other is in the way (one being
        deleted is waited for, a crashed earlier attempt discarded). Raises AlreadyExists, Aborted. Under the
        name's lock."""
        existing = await self._catalog.volume_by_name(name)
        if existing is None:
            return None
        if existing.state is VolumeState.READY:
            if (existing.params != params or not _fits(existing, required, limit) or existing.source != source
                    or existing.qos != qos):
                raise AlreadyExists(
                    f"volume named {name!r} exists ({existing.id}, {existing.capacity} bytes) "
                    "with other parameters or capacity"
                )
            return existing
        if existing.state is VolumeState.DELETING:
            await self._wait_deleted(existing.id, name)
        else:
            await self._discard(existing)  # a crashed earlier attempt
        return None

    async def _create_image(self, pool: Pool, record: VolumeRecord, base: Path | None,
                            key: VolumeKey | None) -> VolumeRecord:
        """The intent row, then the image (an overlay on `base`, or blank), then READY; undone on any failure."""
        name, size, params = record.name, record.capacity, record.params
        async with self._volume_locks.hold(record.id):
            await self._catalog.add_volume(record, durable=False)  # the READY commit makes it durable
            self._failpoints.hit("create.after_intent")
            try:
                if base is not None:
                    await pool.create_overlay(record.image, base, size, params.granularity, key=key)
                else:
                    await self._with_room(pool, lambda: pool.create(record.image, size, params, key=key))
            except ResourceExhausted as exc:
                await self._discard(record)
                raise ResourceExhausted(f"cannot create volume {name!r} of {size} bytes: {exc}") from exc
            except BaseException:
                await self._discard(record)
                raise
            self._failpoints.hit("create.after_image")
            await self._catalog.set_volume_state(record.id, VolumeState.READY)
        log.info("event=volume_created volume_id=%s name=%s bytes=%d", record.id, name, size)
        return dataclasses.replace(record, state=VolumeState.READY)

    async def _create_blank(self, pool: Pool, record: VolumeRecord) -> VolumeRecord:
        """A volume with no source, answered once its row is durable; its image is written and settled after.

        The row records that the image may not be on the disk yet. Until
        `settled`, the volume holds no data, so whatever a crash or a power
        loss left of its image (nothing, or a file not synced), the reconcile
        writes it again and loses nothing.
        """
        record = dataclasses.replace(record, state=VolumeState.READY, image_pending=True)

        async def add() -> None:
            await pool.check_room(record.capacity)
            await self._catalog.add_volume(record)

        async with self._volume_locks.hold(record.id):
            try:
                await self._with_room(pool, add)
            except ResourceExhausted as exc:
                raise ResourceExhausted(
                    f"cannot create volume {record.name!r} of {record.capacity} bytes: {exc}") from exc
            self._failpoints.hit("create.before_settle")
            self._settle_later(record)
        log.info("event=volume_created volume_id=%s name=%s bytes=%d", record.id, record.name, record.capacity)
        return record

    def _settle_later(self, record: VolumeRecord) -> None:
        """Queue `record`'s image for the next batch, which starts SETTLE_DELAY seconds after the first.

        A burst of creates then pays one fsync of the pool directory and one
        catalog commit for all of it, after the burst: fsyncs run one at a
        time on a filesystem, and each would stall the next create's commit.
        """
        self._unsettled[record.id] = record
        if self._settler is None or self._settler.done():
            self._settler = asyncio.create_task(self._settle_batches())

    async def _settle_batches(self) -> None:
        while self._unsettled:
            await asyncio.sleep(SETTLE_DELAY)
            batch, self._unsettled = self._unsettled, {}
            self._settling = batch
            try:
                await self._settle_all(list(batch.values()))
            except Exception:
                log.exception("event=settle_failed volumes=%d (each is settled before it is used)", len(batch))
            finally:
                self._settling = {}
                self._batch_done.set()
                self._batch_done = asyncio.Event()

    async def _settle_all(self, records: list[VolumeRecord]) -> None:
        by_pool: dict[str, list[VolumeRecord]] = {}
        for record in records:
            by_pool.setdefault(record.pool, []).append(record)
        settled: set[Path] = set()
        for pool_id, group in by_pool.items():
            settled.update(await self._pools[pool_id].settle([NewImage.of(r) for r in group]))
        self._failpoints.hit("create.after_images_settled")
        await self._catalog.set_images_settled([r.id for r in records if r.image in settled])

    async def _out_of_batches(self, volume_id: str) -> None:
        """Return once no settling batch may still write `volume_id`'s image (deleted: it must stay gone)."""
        while volume_id in self._settling:
            await self._batch_done.wait()

    async def settled(self, volume: VolumeRecord) -> None:
        """Return once `volume`'s image is durable (`settle_image`). Raises OSError if it cannot be made so."""
        await settle_image(self._catalog, self._pool_of(volume), volume)

    async def delete(self, volume_id: str) -> None:
        """Delete a volume; a missing one is success. FailedPrecondition while it is staged.

        Answered once the deletion is durable in the catalog: the volume is
        gone for the CO from then on. Its storage is freed shortly after, in
        the background, with that of the other deletions meanwhile (a crash
        leaves that to the start-up reconcile).
        """
        async with self._volume_locks.hold(volume_id):
            record = await self._catalog.volume(volume_id)
            if record is None:
                return
            if record.state is VolumeState.DELETING and volume_id in self._deleting:
                return
            if await self._catalog.stage(volume_id) is not None:
                raise FailedPrecondition(f"volume {volume_id} is still staged on node; unstage it first")
            if self.before_delete is not None:
                await self.before_delete(volume_id)
            self._unsettled.pop(volume_id, None)  # gone with the volume: never written
            await self._catalog.set_volume_state(volume_id, VolumeState.DELETING)
            self._failpoints.hit("delete.after_intent")
            self._free_later(record)

    def _free_later(self, record: VolumeRecord) -> None:
        """Queue `record`'s storage for the next batch, freed FREE_DELAY seconds after the first of it.

        A burst of deletes then pays one fsync of the pool directory and one
        catalog commit for all of it, and none of that runs beside the calls
        of the burst (each would stall the next call's commit).
        """
        if self._to_free is None:
            batch: dict[str, VolumeRecord] = {}
            self._to_free = (batch, asyncio.create_task(self._free_batch(batch)))
        batch, task = self._to_free
        batch[record.id] = record
        self._deleting[record.id] = task

    async def _free_batch(self, batch: dict[str, VolumeRecord]) -> None:
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._free_now.wait(), FREE_DELAY)
            self._free_now.clear()
            self._to_free = None  # deletes from now on go to the next batch
            await self._free_all(list(batch.values()))
        except Exception:
            log.exception("event=delete_failed volumes=%d (the start-up reconcile finishes them)", len(batch))
        finally:
            for volume_id in batch:
                if self._deleting.get(volume_id) is asyncio.current_task():
                    del self._deleting[volume_id]

    async def _free_all(self, records: list[VolumeRecord]) -> None:
        """Free volumes marked DELETING, together: their storage (one durable step per pool), then their rows (one
        commit); a pool that fails frees its volumes one by one, and what still fails is left to the reconcile."""
        by_pool: dict[str, list[VolumeRecord]] = {}
        for record in records:
            await self._out_of_batches(record.id)
            by_pool.setdefault(record.pool, []).append(record)
        freed: list[VolumeRecord] = []
        for group in by_pool.values():
            try:
                await self._pool_of(group[0]).delete_all([record.image for record in group])
                freed += group
            except Exception:
                for record in group:  # one at a time: one that fails keeps its row for the reconcile
                    try:
                        await self._free(record)
                    except Exception:
                        log.exception("event=delete_failed volume_id=%s (the start-up reconcile finishes it)",
                                      record.id)
        if not freed:
            return
        self._failpoints.hit("delete.after_image")
        await self._catalog.delete_volumes([record.id for record in freed])
        for record in freed:
            log.info("event=volume_deleted volume_id=%s", record.id)
            try:
                await chains.reclaim(self._catalog, self._pool_of(record), record.backing)
            except Exception:
                log.exception("event=reclaim_failed volume_id=%s image=%s (the start-up reconcile finishes it)",
                              record.id, record.backing)

    async def _free(self, record: VolumeRecord) -> None:
        """Remove a volume marked DELETING: its storage, then its row, then what only it kept alive."""
        pool = self._pool_of(record)
        await self._out_of_batches(record.id)
        await pool.delete(record.image)
        self._failpoints.hit("delete.after_image")
        await self._catalog.delete_volume(record.id)
        log.info("event=volume_deleted volume_id=%s", record.id)
        await chains.reclaim(self._catalog, pool, record.backing)

    async def _wait_deleted(self, volume_id: str, name: str) -> None:
        """Wait for the background deletion of `volume_id`; Aborted if it is not under way or did not finish."""
        task = self._deleting.get(volume_id)
        if task is not None:
            self._free_now.set()
            await asyncio.shield(task)
        if task is None or await self._catalog.volume(volume_id) is not None:
            raise Aborted(f"volume named {name!r} ({volume_id}) is being deleted; retry later")

    async def _with_room(self, pool: Pool, create: Callable[[], Awaitable[None]]) -> None:
        """`create`, once more after the deletions under way have freed their storage if it found no room."""
        try:
            await create()
        except ResourceExhausted:
            if not self._deleting:
                raise
            await self.freed()
            await create()

    async def freed(self) -> None:
        """Wait for every background deletion under way: their storage is free once this returns."""
        while self._deleting:
            self._free_now.set()
            await asyncio.gather(*map(asyncio.shield, set(self._deleting.values())))

    async def close(self, timeout: float = 10.0) -> None:
        """Let background settling and deletions finish (each is redone at start-up if cut off)."""
        if self._unsettled:
            batch, self._unsettled = list(self._unsettled.values()), {}
            await self._settle_all(batch)
        self._free_now.set()
        pending = [*set(self._deleting.values()), *([self._settler] if self._settler is not None else [])]
        if not pending:
            return
        _done, unfinished = await asyncio.wait(pending, timeout=timeout)
        for task in unfinished:
            task.cancel()

    async def get(self, volume_id: str) -> VolumeRecord | None:
        record = await self._catalog.volume(volume_id)
        return record if record is not None and record.state is VolumeState.READY else None

    async def page(self, starting_token: str, max_entries: int) -> tuple[list[VolumeRecord], str]:
        """One page of ready volumes and the token for the next ('' at the end).

        Raises Aborted for a token this driver did not issue.
        """
        if max_entries < 0:
            raise InvalidArgument("max_entries must not be negative")
        if starting_token and not validate.VOLUME_ID_RE.match(starting_token):
            raise Aborted(f"starting_token {starting_token!r} is not one this driver issued")
        records = await self._catalog.volumes(
            after_id=starting_token, limit=max_entries + 1 if max_entries else 0, state=VolumeState.READY
        )
        if max_entries and len(records) > max_entries:
            return records[:max_entries], records[max_entries - 1].id
        return records, ""

    @property
    def pools(self) -> Mapping[str, Pool]:
        """Every pool of this node by ID: the file pool and the device pools."""
        return self._pools

    def available_bytes(self, pool_id: str = "") -> int:
        """Free bytes of a pool (default: the file pool); 0 for a pool this node does not have."""
        pool = self._pools.get(pool_id or self._pool.id)
        return pool.usage().available if pool is not None else 0

    def largest_volume(self, pool_id: str = "") -> int:
        """The largest volume a pool can hold now (a device pool: its largest free extent); 0 if unknown."""
        pool = self._pools.get(pool_id or self._pool.id)
        return pool.largest_volume() if pool is not None else 0

    def pool_for(self, pool_id: str) -> Pool:
        """The pool a StorageClass names. Raises InvalidArgument for one this node does not have."""
        pool = self._pools.get(pool_id)
        if pool is None:
            raise InvalidArgument(
                f"StorageClass parameter 'pool' is {pool_id!r}, which this node does not have; "
                f"pools here: {', '.join(sorted(self._pools))}"
            )
        return pool

    def _pool_of(self, record: VolumeRecord) -> Pool:
        pool = self._pools.get(record.pool)
        if pool is None:
            raise FailedPrecondition(
                f"volume {record.id} lives in pool {record.pool!r}, which this driver is not configured with "
                "(--device-pool)"
            )
        return pool

    async def reconcile(self) -> None:
        """Finish or undo what a crash left: half-created volumes go, half-deleted ones finish."""
        for leftover in (path for pool in self._pools.values() for path in pool.leftovers()):
            log.info("event=reconcile_remove_tmp path=%s", leftover)
            leftover.unlink(missing_ok=True)
        for record in await self._catalog.volumes():
            if record.pool not in self._pools:
                log.warning("event=reconcile_unknown_pool volume_id=%s pool=%s action=kept", record.id, record.pool)
            elif record.state is VolumeState.CREATING:
                log.info("event=reconcile_undo_create volume_id=%s", record.id)
                await self._discard(record)
            elif record.state is VolumeState.DELETING:
                log.info("event=reconcile_finish_delete volume_id=%s", record.id)
                await self._free(record)
            elif record.image_pending:
                # Never staged, so it never held data: whatever a crash left of its image is written again.
                log.info("event=reconcile_settle_image volume_id=%s", record.id)
                pool = self._pool_of(record)
                await pool.delete(record.image)
                await pool.create(record.image, record.capacity, record.params)
                await self._catalog.set_images_settled([record.id])
        known = {r.image for r in await self._catalog.volumes()}
        known |= {r.image for r in await self._catalog.snapshots()}
        for pool in self._pools.values():
            for image in pool.images():
                if image in known:
                    continue
                if await asyncio.to_thread(pool.holds_no_data, image):
                    # A create cut off by power before its intent reached the disk: never anyone's data.
                    log.info("event=reconcile_remove_empty_image path=%s", image)
                    await pool.delete(image)
                else:
                    log.warning("event=reconcile_unknown_image path=%s action=kept", image)

    async def _discard(self, record: VolumeRecord) -> None:
        """Remove a volume that never reached READY: its image holds no user data yet."""
        await self._pool_of(record).delete(record.image)
        await self._catalog.delete_volume(record.id)
