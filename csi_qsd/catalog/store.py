"""`Catalog`: the typed, transactional access to the catalog's rows, one verb per act on a table's rows.

Callers record intent (a row in a transitional state) before they act and
commit the final state after; the start-up reconcile finishes or undoes what
is left in a transitional state. The verbs stay on one class, grouped by
table, because each is one statement and callers use several tables in one
act; the connection underneath (durability, transactions, when I/O leaves
the event loop) is `csi_qsd.catalog.connection`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from csi_qsd.catalog import rows
from csi_qsd.catalog.connection import CatalogConnection
from csi_qsd.catalog.records import (
    CopyRecord,
    CopyRole,
    ExtentChoice,
    ExtentRecord,
    ExtentState,
    GroupRecord,
    PublishRecord,
    SnapshotRecord,
    StageRecord,
    VolumeRecord,
    VolumeState,
)

T = TypeVar("T")

# Given every extent row of a pool: where the extent to hand out goes, or None when nothing fits.
Choose = Callable[[list[ExtentRecord]], ExtentChoice | None]


class Catalog(CatalogConnection):
    """Typed access to the catalog database; every method is a coroutine but `usable`, Probe's check.

    One verb per act on rows:

    - `add_*` inserts new rows: sqlite3.IntegrityError, and nothing
      written, when an ID or a name is taken;
    - `put_*` writes whole rows by their key, inserting or replacing;
    - `set_*` changes rows that exist: a missing row stays missing, no error;
    - `delete_*` removes rows: a missing row is no error;
    - `take_*` hands out an extent of a device pool (the one held, or a new one).

    The steps of an extent's move and scrub are `set_*` and `delete_*` too
    (`set_extent_length`, `set_move_committed`, `set_extents_scrubbing`,
    `delete_extent`), each one transaction.

    Reads are named after what they return: a record or None (`volume`), or
    a list (`volumes`). Every write is one transaction, durable (fsynced)
    when it returns unless the method takes `durable=False` and is given it.
    Once closed, every call but `open` raises Unavailable (`usable` answers
    False).
    """

    # volumes ------------------------------------------------------------

    async def add_volume(self, record: VolumeRecord, *, durable: bool = True) -> None:
        """Insert a volume's row, durably unless `durable=False` (an intent); sqlite3.IntegrityError, nothing
        written, if its ID or name is taken.

        `record.image_pending`: its image may not be written or on disk yet
        (`set_images_settled` says it is). Such a volume has never held data:
        it is not staged before its image is settled. So a power loss that
        takes the image with it loses nothing; the reconcile writes it again
        (`pending_images`).
        """
        await self._run(lambda db: rows.add_volume(db, record), durable=durable)

    async def set_images_settled(self, volume_ids: list[str]) -> None:
        """Record, durably and in one commit, that these volumes' images are durable; IDs with no row are skipped.

        Durably, because a volume may hold data from then on: a row still
        pending after a power loss must mean it never held any.
        """
        await self._run(lambda db: db.executemany(
            "UPDATE volumes SET image_pending=0 WHERE id=?", [(volume_id,) for volume_id in volume_ids]))

    async def pending_images(self) -> list[VolumeRecord]:
        """Volumes whose image is not recorded durable: not written yet, or a crash cut off their settling."""
        return await self._read(_all(rows.volume, "SELECT * FROM volumes WHERE image_pending=1", ()))

    async def set_volume(self, record: VolumeRecord) -> None:
        """Rewrite the row of `record.id` from `record`, durably; a volume with no row stays without one.

        Every column but `image_pending`: only `add_volume` sets it and only
        `set_images_settled` clears it, so a record read before its image was
        settled cannot mark the image pending again.
        """
        await self._run(lambda db: rows.set_volume(db, record))

    async def set_volume_state(self, volume_id: str, state: VolumeState, *, durable: bool = True) -> None:
        """Change a volume's state (an intent with `durable=False`); a volume with no row stays without one."""
        await self._run(lambda db: db.execute("UPDATE volumes SET state=? WHERE id=?", (state.value, volume_id)),
                        durable=durable)

    async def delete_volume(self, volume_id: str) -> None:
        """Delete a volume's row with its stage and publishes, durably and in one transaction; none is no error."""
        await self.delete_volumes([volume_id])

    async def delete_volumes(self, volume_ids: list[str]) -> None:
        """Delete volumes' rows with their stages and publishes, durably and in one transaction; missing ones are
        no error."""
        keys = [(volume_id,) for volume_id in volume_ids]

        def delete(db: sqlite3.Connection) -> None:
            db.executemany("DELETE FROM publishes WHERE volume_id=?", keys)
            db.executemany("DELETE FROM stages WHERE volume_id=?", keys)
            db.executemany("DELETE FROM volumes WHERE id=?", keys)
        await self._run(delete)

    async def volume(self, volume_id: str) -> VolumeRecord | None:
        """The volume with this ID, in any state, or None."""
        return await self._read(_one(rows.volume, "SELECT * FROM volumes WHERE id=?", (volume_id,)))

    async def volume_by_name(self, name: str) -> VolumeRecord | None:
        """The volume with this name, in any state, or None."""
        return await self._read(_one(rows.volume, "SELECT * FROM volumes WHERE name=?", (name,)))

    async def volumes(
        self, *, after_id: str = "", limit: int = 0, state: VolumeState | None = None
    ) -> list[VolumeRecord]:
        """Volumes ordered by ID, starting after `after_id`, optionally in one state; `limit` 0 means all."""
        sql = "SELECT * FROM volumes WHERE id > ?"
        args: tuple[Any, ...] = (after_id,)
        if state is not None:
            sql += " AND state = ?"
            args += (state.value,)
        sql += " ORDER BY id"
        if limit:
            sql += " LIMIT ?"
            args += (limit,)
        return await self._read(_all(rows.volume, sql, args))

    # snapshots ----------------------------------------------------------

    async def put_snapshots(self, records: list[SnapshotRecord], volumes: Sequence[VolumeRecord] = ()) -> None:
        """Write snapshot rows and rewrite volume rows together, durably and in one transaction.

        A snapshot row replaces the row of its ID (and any other holding its
        name or image); a volume row is rewritten as `set_volume` does it, and
        one with no row stays without one.
        """
        def write(db: sqlite3.Connection) -> None:
            for record in records:
                rows.write_snapshot(db, record, replace=True)
            for volume in volumes:
                rows.set_volume(db, volume)
        await self._run(write)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot's row, durably; none is no error. Its images are the caller's to delete."""
        await self._run(lambda db: db.execute("DELETE FROM snapshots WHERE id=?", (snapshot_id,)))

    async def snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        """The snapshot with this ID, hidden or not and in any state, or None."""
        return await self._read(_one(rows.snapshot, "SELECT * FROM snapshots WHERE id=?", (snapshot_id,)))

    async def snapshot_by_name(self, name: str) -> SnapshotRecord | None:
        """The snapshot with this name, hidden or not and in any state, or None."""
        return await self._read(_one(rows.snapshot, "SELECT * FROM snapshots WHERE name=?", (name,)))

    async def snapshot_by_image(self, image: str) -> SnapshotRecord | None:
        """The snapshot whose image is this path, or None."""
        return await self._read(_one(rows.snapshot, "SELECT * FROM snapshots WHERE image=?", (image,)))

    async def snapshots(self) -> list[SnapshotRecord]:
        """Every snapshot, hidden ones and every state, ordered by ID."""
        return await self._read(_all(rows.snapshot, "SELECT * FROM snapshots ORDER BY id", ()))

    async def dependants(self, image: str) -> int:
        """How many volumes and snapshots have `image` as their backing image, and leases serve it to other nodes.

        A lease counts as a dependant so that no flatten or reclaim deletes an image qemu-nbd serves to a copy.
        """
        return await self._read(lambda db: int(db.execute(
            "SELECT (SELECT COUNT(*) FROM volumes WHERE backing=?) + (SELECT COUNT(*) FROM snapshots WHERE backing=?)"
            " + (SELECT COUNT(*) FROM copies WHERE role=? AND image=?)",
            (image, image, CopyRole.SOURCE.value, image),
        ).fetchone()[0]))

    # group snapshots ----------------------------------------------------

    async def add_group(self, record: GroupRecord) -> None:
        """Insert a group snapshot's row, durably; sqlite3.IntegrityError, nothing written, if its ID or name is
        taken."""
        await self._run(lambda db: rows.add_group(db, record))

    async def group(self, *, group_id: str = "", name: str = "") -> GroupRecord | None:
        """The group snapshot with this ID or this name, or None."""
        return await self._read(_one(rows.group, "SELECT * FROM groups WHERE id=? OR name=?", (group_id, name)))

    async def group_members(self, group_id: str) -> list[SnapshotRecord]:
        """The snapshots of a group, in every state, ordered by ID; none for an unknown group."""
        return await self._read(_all(rows.snapshot, "SELECT * FROM snapshots WHERE group_id=? ORDER BY id",
                                     (group_id,)))

    async def delete_group(self, group_id: str) -> None:
        """Delete a group's row (not its members' rows), durably; none is no error."""
        await self._run(lambda db: db.execute("DELETE FROM groups WHERE id=?", (group_id,)))

    # stages -------------------------------------------------------------

    async def put_stage(self, record: StageRecord, *, durable: bool = True) -> None:
        """Write a volume's stage row, inserted or replaced, durably unless `durable=False` (an intent);
        sqlite3.IntegrityError, nothing written, if the volume has no row."""
        await self._run(lambda db: rows.put_stage(db, record), durable=durable)

    async def delete_stage(self, volume_id: str) -> None:
        """Delete a volume's stage row, durably; none is no error."""
        await self._run(lambda db: db.execute("DELETE FROM stages WHERE volume_id=?", (volume_id,)))

    async def stage(self, volume_id: str) -> StageRecord | None:
        """The volume's stage row, in any state, or None."""
        return await self._read(_one(rows.stage, "SELECT * FROM stages WHERE volume_id=?", (volume_id,)))

    async def stages(self) -> list[StageRecord]:
        """Every stage row, in every state, ordered by volume ID."""
        return await self._read(_all(rows.stage, "SELECT * FROM stages ORDER BY volume_id", ()))

    # publishes ----------------------------------------------------------

    async def put_publish(self, record: PublishRecord, *, durable: bool = True) -> None:
        """Write a target path's publish row, inserted or replaced, durably unless `durable=False` (an intent);
        sqlite3.IntegrityError, nothing written, if the volume has no row."""
        await self._run(lambda db: rows.put_publish(db, record), durable=durable)

    async def delete_publish(self, target_path: Path) -> None:
        """Delete a target path's publish row, durably; none is no error."""
        await self._run(lambda db: db.execute("DELETE FROM publishes WHERE target_path=?", (str(target_path),)))

    async def publish(self, target_path: Path) -> PublishRecord | None:
        """The publish row of this target path, in any state, or None."""
        return await self._read(_one(rows.publish, "SELECT * FROM publishes WHERE target_path=?",
                                     (str(target_path),)))

    async def publishes(self, volume_id: str | None = None) -> list[PublishRecord]:
        """Every publish row (or only the volume's), in every state, ordered by target path."""
        if volume_id is None:
            return await self._read(_all(rows.publish, "SELECT * FROM publishes ORDER BY target_path", ()))
        return await self._read(_all(rows.publish, "SELECT * FROM publishes WHERE volume_id=? ORDER BY target_path",
                                     (volume_id,)))

    # extents ------------------------------------------------------------

    async def extents(self, pool: str) -> list[ExtentRecord]:
        """Every extent row of a device pool, in every state, ordered by start (free space lies between them)."""
        return await self._read(lambda db: rows.pool_extents(db, pool))

    async def take_extent(self, pool: str, volume_id: str, choose: Choose) -> ExtentRecord | None:
        """Give `volume_id` an extent of `pool`, durably in one transaction: the one it holds, or `choose`'s pick.

        `choose` sees every row of the pool (free space is what lies between
        them) and returns where the new extent goes (an ExtentChoice), or
        None when nothing fits (then None, nothing written). Reading and
        inserting under one write lock means two volumes can never be given
        overlapping extents, whatever runs concurrently.
        """
        return await self._take_extent(pool, volume_id, ExtentState.USED, choose)

    async def take_move_extent(self, pool: str, volume_id: str, choose: Choose) -> ExtentRecord | None:
        """A MOVING extent for `volume_id` (the one it has, or `choose`'s pick), like `take_extent`."""
        return await self._take_extent(pool, volume_id, ExtentState.MOVING, choose)

    async def _take_extent(self, pool: str, volume_id: str, state: ExtentState, choose: Choose) -> ExtentRecord | None:
        def take(db: sqlite3.Connection) -> ExtentRecord | None:
            extents = rows.pool_extents(db, pool)
            held = [r for r in extents if r.volume_id == volume_id and r.state is state]
            if held:
                return held[0]
            picked = choose(extents)
            if picked is None:
                return None
            record = ExtentRecord(pool, picked.start, picked.length, volume_id, state)
            rows.add_extent(db, record)
            return record

        return await self._run(take)

    async def set_move_committed(self, pool: str, volume_id: str, generation: int) -> bool:
        """Record a move committed, its point of no return, durably in one transaction; False, nothing written, if
        `volume_id` has no MOVING extent.

        The MOVING extent becomes the volume's (USED), its old one RETIRING,
        and the volume's image generation `generation` (the names of the
        nodes QSD opens the new home through).
        """
        def commit(db: sqlite3.Connection) -> bool:
            moving = db.execute("SELECT 1 FROM extents WHERE pool=? AND volume_id=? AND state=?",
                                (pool, volume_id, ExtentState.MOVING.value)).fetchone()
            if moving is None:
                return False
            _set_extents_state(db, pool, volume_id, ExtentState.RETIRING, ExtentState.USED)
            _set_extents_state(db, pool, volume_id, ExtentState.USED, ExtentState.MOVING)
            db.execute("UPDATE volumes SET generation=? WHERE id=?", (generation, volume_id))
            return True

        return await self._run(commit)

    async def set_extents_scrubbing(self, pool: str, volume_id: str, state: ExtentState | None = None) -> None:
        """Mark `volume_id`'s extents in `pool` SCRUBBING, durably: all it holds (a deleted volume's), or only
        those in `state` (an undone move's MOVING one, a finished move's RETIRING old home); none is no error.

        A SCRUBBING extent is never handed out until its scrub is recorded
        (`delete_extent`).
        """
        await self._run(lambda db: _set_extents_state(db, pool, volume_id, ExtentState.SCRUBBING, state))

    async def delete_extent(self, pool: str, start: int) -> None:
        """A scrubbed extent becomes free space: the SCRUBBING row at `start` goes, durably; a row in another
        state, or none, is left as it is."""
        await self._run(lambda db: db.execute(
            "DELETE FROM extents WHERE pool=? AND start=? AND state=?", (pool, start, ExtentState.SCRUBBING.value)))

    async def set_extent_length(
        self, pool: str, start: int, length: int, fits: Callable[[list[ExtentRecord]], bool],
    ) -> bool:
        """Set the length of the extent at `start` if `fits` (given every row of the pool) agrees, durably and
        atomically; returns whether `fits` agreed (no row at `start`: True, nothing changed)."""
        def resize(db: sqlite3.Connection) -> bool:
            if not fits(rows.pool_extents(db, pool)):
                return False
            db.execute("UPDATE extents SET length=? WHERE pool=? AND start=?", (length, pool, start))
            return True

        return await self._run(resize)

    # copies across nodes -------------------------------------------------

    async def put_copy(self, record: CopyRecord) -> None:
        """Write one end of a copy (keyed by volume ID and role), inserted or replaced, durably."""
        await self._run(lambda db: rows.put_copy(db, record))

    async def add_copy_volume(self, volume: VolumeRecord, local_copy: SnapshotRecord, copy: CopyRecord) -> None:
        """A volume made from another node's snapshot, its local copy image (a hidden snapshot) and its copy row,
        durably in one transaction; sqlite3.IntegrityError, nothing written, if the volume's or the snapshot's
        ID, name or image is taken (the copy row is put: inserted or replaced)."""
        def write(db: sqlite3.Connection) -> None:
            rows.write_snapshot(db, local_copy, replace=False)
            rows.add_volume(db, volume)
            rows.put_copy(db, copy)
        await self._run(write)

    async def copy(self, volume_id: str, role: CopyRole) -> CopyRecord | None:
        """This end's row of the copy to `volume_id`, in any state, or None."""
        return await self._read(_one(rows.copy, "SELECT * FROM copies WHERE volume_id=? AND role=?",
                                     (volume_id, role.value)))

    async def copies(self, role: CopyRole) -> list[CopyRecord]:
        """Every row of one end, in every state, ordered by volume ID."""
        return await self._read(_all(rows.copy, "SELECT * FROM copies WHERE role=? ORDER BY volume_id",
                                     (role.value,)))

    async def delete_copy(self, volume_id: str, role: CopyRole) -> None:
        """Delete one end's row of a copy, durably; none is no error."""
        await self._run(lambda db: db.execute("DELETE FROM copies WHERE volume_id=? AND role=?",
                                              (volume_id, role.value)))


def _one(
    parse: Callable[[sqlite3.Row], T], sql: str, args: tuple[Any, ...],
) -> Callable[[sqlite3.Connection], T | None]:
    """A read of the one row `sql` selects, parsed, or None."""
    def read(db: sqlite3.Connection) -> T | None:
        row = db.execute(sql, args).fetchone()
        return None if row is None else parse(row)
    return read


def _all(
    parse: Callable[[sqlite3.Row], T], sql: str, args: tuple[Any, ...],
) -> Callable[[sqlite3.Connection], list[T]]:
    """A read of every row `sql` selects, parsed, in its order."""
    return lambda db: [parse(row) for row in db.execute(sql, args)]


def _set_extents_state(
    db: sqlite3.Connection, pool: str, volume_id: str, state: ExtentState, was: ExtentState | None = None,
) -> None:
    """`volume_id`'s extents in `pool` (only those in state `was`, if given) to `state`."""
    db.execute("UPDATE extents SET state=? WHERE pool=? AND volume_id=?" + (" AND state=?" if was else ""),
               (state.value, pool, volume_id) + ((was.value,) if was else ()))
