"""The SQLite catalog: the source of truth for volumes, stages and publishes.

WAL with synchronous=FULL, so a committed row survives a crash. Callers record
intent (a row in a transitional state) before they act and commit the final
state after; the start-up reconcile finishes or undoes what is left in a
transitional state. An intent may be committed without its own fsync
(`durable=False`, 0.3-0.8 ms saved per call): it survives the driver's crash
(the WAL is in the page cache), the final commit's fsync makes it durable
with itself, and what a power loss can leave without it is an image no row
names that holds no data of its own, which the reconcile removes.

Not all I/O runs in a worker thread. Writes do, and so do opening and
closing; a read runs on the event loop when the connection is free (tens of
microseconds, less than the hop), in a worker thread when a transaction
holds it. `usable()`, which Probe calls synchronously, always queries on the
event loop, and while a transaction holds the connection it waits there for
it (a commit's fsync included). This module knows nothing of QSD, mounts or
gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from csi_qsd.errors import StartupError, Unavailable
from csi_qsd.params import QoS, VolumeParameters

T = TypeVar("T")

SCHEMA_VERSION = 7
DEFAULT_POOL = "default"
# The whole schema as this release creates it; older catalogs reach it through _MIGRATIONS.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS volumes (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    capacity    INTEGER NOT NULL,
    params      TEXT NOT NULL,
    image       TEXT NOT NULL,
    state       TEXT NOT NULL,
    created_at  REAL NOT NULL,
    backing     TEXT NOT NULL DEFAULT '',
    generation  INTEGER NOT NULL DEFAULT 0,
    source      TEXT NOT NULL DEFAULT '',
    pool        TEXT NOT NULL DEFAULT 'default',
    qos         TEXT NOT NULL DEFAULT '{}',
    image_pending INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS snapshots (
    id               TEXT PRIMARY KEY,
    name             TEXT NOT NULL UNIQUE,
    source_volume_id TEXT NOT NULL,
    image            TEXT NOT NULL UNIQUE,
    backing          TEXT NOT NULL DEFAULT '',
    size             INTEGER NOT NULL,
    created_at       REAL NOT NULL,
    state            TEXT NOT NULL,
    hidden           INTEGER NOT NULL DEFAULT 0,
    group_id         TEXT NOT NULL DEFAULT '',
    overlay          TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS snapshots_by_source ON snapshots(source_volume_id);
CREATE INDEX IF NOT EXISTS snapshots_by_group ON snapshots(group_id);
CREATE TABLE IF NOT EXISTS groups (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    created_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS stages (
    volume_id    TEXT PRIMARY KEY REFERENCES volumes(id),
    staging_path TEXT NOT NULL,
    access_type  TEXT NOT NULL,
    fs_type      TEXT NOT NULL,
    mount_flags  TEXT NOT NULL,
    mount_group  TEXT NOT NULL,
    state        TEXT NOT NULL,
    loop_device  TEXT NOT NULL DEFAULT '',
    shard        INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS publishes (
    target_path TEXT PRIMARY KEY,
    volume_id   TEXT NOT NULL REFERENCES volumes(id),
    readonly    INTEGER NOT NULL,
    mount_flags TEXT NOT NULL,
    state       TEXT NOT NULL,
    loop_device TEXT NOT NULL DEFAULT '',
    single_writer INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS publishes_by_volume ON publishes(volume_id);
CREATE TABLE IF NOT EXISTS extents (
    pool      TEXT NOT NULL,
    start     INTEGER NOT NULL,
    length    INTEGER NOT NULL,
    volume_id TEXT NOT NULL,
    state     TEXT NOT NULL,
    PRIMARY KEY (pool, start)
);
CREATE INDEX IF NOT EXISTS extents_by_volume ON extents(volume_id);
CREATE TABLE IF NOT EXISTS copies (
    volume_id   TEXT NOT NULL,
    role        TEXT NOT NULL,
    node        TEXT NOT NULL,
    source      TEXT NOT NULL,
    snapshot_id TEXT NOT NULL DEFAULT '',
    address     TEXT NOT NULL DEFAULT '',
    image       TEXT NOT NULL DEFAULT '',
    state       TEXT NOT NULL,
    created_at  REAL NOT NULL,
    PRIMARY KEY (volume_id, role)
);
CREATE INDEX IF NOT EXISTS copies_by_snapshot ON copies(snapshot_id);
"""
# Statements that bring a catalog of schema N-1 to N, each run in one transaction with the version bump.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    2: (
        # Every volume of a release before pools lived in the one file pool.
        "ALTER TABLE volumes ADD COLUMN pool TEXT NOT NULL DEFAULT 'default'",
        "ALTER TABLE publishes ADD COLUMN single_writer INTEGER NOT NULL DEFAULT 0",
    ),
    3: (
        # I/O limits (mutable parameters); volumes of earlier releases have none.
        "ALTER TABLE volumes ADD COLUMN qos TEXT NOT NULL DEFAULT '{}'",
    ),
    4: (
        # Device pools: the extents volumes hold on each device; catalogs before them had none.
        "CREATE TABLE IF NOT EXISTS extents (pool TEXT NOT NULL, start INTEGER NOT NULL, length INTEGER NOT NULL,"
        " volume_id TEXT NOT NULL, state TEXT NOT NULL, PRIMARY KEY (pool, start))",
        "CREATE INDEX IF NOT EXISTS extents_by_volume ON extents(volume_id)",
    ),
    5: (
        # QSD shards: which of the node's QSDs serves a staged volume; before them there was one.
        "ALTER TABLE stages ADD COLUMN shard INTEGER NOT NULL DEFAULT 0",
    ),
    6: (
        # Copies across nodes: on the target, a volume being filled from another node's snapshot; on the
        # source, the read lease that snapshot is served under. Catalogs before them had none.
        "CREATE TABLE IF NOT EXISTS copies (volume_id TEXT NOT NULL, role TEXT NOT NULL, node TEXT NOT NULL,"
        " source TEXT NOT NULL, snapshot_id TEXT NOT NULL DEFAULT '', address TEXT NOT NULL DEFAULT '',"
        " image TEXT NOT NULL DEFAULT '', state TEXT NOT NULL, created_at REAL NOT NULL,"
        " PRIMARY KEY (volume_id, role))",
        "CREATE INDEX IF NOT EXISTS copies_by_snapshot ON copies(snapshot_id)",
    ),
    7: (
        # A blank image not yet written or fsynced (made durable after CreateVolume answers); before, none was.
        "ALTER TABLE volumes ADD COLUMN image_pending INTEGER NOT NULL DEFAULT 0",
    ),
}


class VolumeState(enum.Enum):
    CREATING = "creating"
    READY = "ready"
    DELETING = "deleting"


class SnapshotState(enum.Enum):
    CREATING = "creating"
    READY = "ready"
    DELETING = "deleting"


class StageState(enum.Enum):
    STAGING = "staging"
    STAGED = "staged"
    UNSTAGING = "unstaging"


class PublishState(enum.Enum):
    PUBLISHING = "publishing"
    PUBLISHED = "published"
    UNPUBLISHING = "unpublishing"


class ExtentState(enum.Enum):
    """What an extent of a device pool holds; every state but USED is kept from new volumes.

    USED: a volume's bytes. SCRUBBING: freed, still holding the last
    tenant's bytes until zeroed. MOVING: the new home of a volume being
    moved, filled but not yet its own (scrubbed if the move is undone).
    RETIRING: a moved volume's old home, which QSD may still read until it
    has switched to the new one (then scrubbed).
    """

    USED = "used"
    SCRUBBING = "scrubbing"
    MOVING = "moving"
    RETIRING = "retiring"


class AccessType(enum.Enum):
    MOUNT = "mount"
    BLOCK = "block"


@dataclasses.dataclass(frozen=True)
class VolumeRecord:
    id: str
    name: str
    capacity: int
    params: VolumeParameters
    image: Path
    state: VolumeState
    created_at: float
    backing: str = ""  # the image the volume's top image is an overlay on ('' = none)
    generation: int = 0  # how many times the top image was replaced by a new overlay
    source: str = ""  # "snapshot:<id>" or "volume:<id>" it was made from
    pool: str = DEFAULT_POOL  # the pool the volume's images live in
    qos: QoS = QoS()  # I/O limits, the mutable parameters (ControllerModifyVolume changes them)
    image_pending: bool = False  # the image may not be written or on disk yet (`Catalog.add_volume`)


@dataclasses.dataclass(frozen=True)
class ExtentRecord:
    """`length` bytes from `start` of device pool `pool`, taken by `volume_id` (kept while it is scrubbed)."""

    pool: str
    start: int
    length: int
    volume_id: str
    state: ExtentState


@dataclasses.dataclass(frozen=True)
class SnapshotRecord:
    """A frozen image; `hidden` once deleted by the user while other images still depend on it."""

    id: str
    name: str
    source_volume_id: str
    image: Path
    backing: str
    size: int
    created_at: float
    state: SnapshotState
    hidden: bool = False
    group_id: str = ""
    overlay: str = ""  # while CREATING: the new top image the source volume moves to


@dataclasses.dataclass(frozen=True)
class StageRecord:
    volume_id: str
    staging_path: Path
    access_type: AccessType
    fs_type: str
    mount_flags: tuple[str, ...]
    mount_group: str
    state: StageState
    loop_device: str = ""
    shard: int = 0  # the node's QSD that serves the volume while it is staged (`csi_qsd.qsd.shards`)


@dataclasses.dataclass(frozen=True)
class PublishRecord:
    target_path: Path
    volume_id: str
    readonly: bool
    mount_flags: tuple[str, ...]
    state: PublishState
    loop_device: str = ""
    single_writer: bool = False  # published with SINGLE_NODE_SINGLE_WRITER: no other target allowed


class CopyRole(enum.Enum):
    """Which end of a cross-node copy a row records."""

    TARGET = "target"  # this node's volume is filled from another node's snapshot
    SOURCE = "source"  # this node serves one of its snapshots to a copy on another node (a read lease)


class CopyState(enum.Enum):
    """TARGET: LEASING (asking the source), STREAMING (usable, being made local), RELEASING (whole; lease to drop),
    LOST (the source dropped the lease before the copy was whole: what was not copied is gone).
    SOURCE: SERVING (the snapshot is exported for the copy), REVOKED (an operator dropped the lease: the copy may
    not have it again; the row, holding nothing, goes when the copy's node releases it or after the lease TTL)."""

    LEASING = "leasing"
    STREAMING = "streaming"
    RELEASING = "releasing"
    LOST = "lost"
    SERVING = "serving"
    REVOKED = "revoked"


@dataclasses.dataclass(frozen=True)
class CopyRecord:
    """One end of a copy of a snapshot from one node to another.

    `volume_id` is the copy (the volume on the target node) at both ends;
    `node` the other end's node; `source` what the CreateVolume named
    ("snapshot:<id>" or "volume:<id>"); `snapshot_id` the source node's
    snapshot served; `address` host:port of its NBD server; `image` on the
    target the local copy image being filled, on the source the image served.
    """

    volume_id: str
    role: CopyRole
    node: str
    source: str
    state: CopyState
    created_at: float
    snapshot_id: str = ""
    address: str = ""
    image: str = ""


_CLOSED = "the catalog is closed: the driver is stopping"
# Commits between two checkpoints of the WAL into the database (SQLite's own default is 1000 pages).
CHECKPOINT_EVERY = 200
# A durable commit that took longer than this (seconds) sends the next ones off the event loop (`Catalog._run`).
LOOP_COMMIT_MAX = 0.002


class Catalog:
    """Typed access to the catalog database; every method is a coroutine but `usable`, Probe's check."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._commits = 0  # since the last checkpoint
        self._fast_disk = False  # the last durable commit took under LOOP_COMMIT_MAX (`_run`)

    async def open(self) -> None:
        await asyncio.to_thread(self._open)

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    async def __aenter__(self) -> "Catalog":
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def usable(self) -> bool:
        """True while the database answers a trivial query (used by Probe).

        Runs on the caller's thread, the event loop: it waits there for a
        transaction that holds the connection.
        """
        try:
            self._call(lambda db: db.execute("SELECT 1").fetchone())
            return True
        except (sqlite3.Error, Unavailable):
            return False

    # volumes ------------------------------------------------------------

    async def add_volume(self, record: VolumeRecord, *, durable: bool = True) -> None:
        """`record.image_pending`: its image may not be written or on disk yet (`settle_images` says it is).

        Such a volume has never held data: it is not staged before its image
        is settled. So a power loss that takes the image with it loses
        nothing; the reconcile writes it again (`pending_images`).
        """
        await self._run(lambda db: _insert_volume(db, record), durable=durable)

    async def settle_images(self, volume_ids: list[str]) -> None:
        """Record, durably and in one commit, that these volumes' images are durable.

        Durably, because a volume may hold data from then on: a row still
        pending after a power loss must mean it never held any.
        """
        await self._run(lambda db: db.executemany(
            "UPDATE volumes SET image_pending=0 WHERE id=?", [(volume_id,) for volume_id in volume_ids]))

    async def pending_images(self) -> list[VolumeRecord]:
        """Volumes whose image is not recorded durable: not written yet, or a crash cut off their settling."""
        return [_volume(row) for row in await self._query("SELECT * FROM volumes WHERE image_pending=1", ())]

    async def update_volume(self, record: VolumeRecord) -> None:
        """Rewrite a volume's row (same ID) in one transaction."""
        await self._run(lambda db: _update_volume(db, record))

    async def set_volume_state(self, volume_id: str, state: VolumeState, *, durable: bool = True) -> None:
        await self._run(lambda db: db.execute("UPDATE volumes SET state=? WHERE id=?", (state.value, volume_id)),
                        durable=durable)

    async def delete_volume(self, volume_id: str) -> None:
        def delete(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM publishes WHERE volume_id=?", (volume_id,))
            db.execute("DELETE FROM stages WHERE volume_id=?", (volume_id,))
            db.execute("DELETE FROM volumes WHERE id=?", (volume_id,))
        await self._run(delete)

    async def volume(self, volume_id: str) -> VolumeRecord | None:
        rows = await self._query("SELECT * FROM volumes WHERE id=?", (volume_id,))
        return _volume(rows[0]) if rows else None

    async def volume_by_name(self, name: str) -> VolumeRecord | None:
        rows = await self._query("SELECT * FROM volumes WHERE name=?", (name,))
        return _volume(rows[0]) if rows else None

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
        return [_volume(row) for row in await self._query(sql, args)]

    # snapshots ----------------------------------------------------------

    async def put_snapshots(self, records: list[SnapshotRecord], volumes: tuple[VolumeRecord, ...] = ()) -> None:
        """Write snapshot rows and volume rows together, atomically."""
        def write(db: sqlite3.Connection) -> None:
            for record in records:
                db.execute(
                    "INSERT OR REPLACE INTO snapshots (id, name, source_volume_id, image, backing, size, created_at,"
                    " state, hidden, group_id, overlay) VALUES (?,?,?,?,?,?,?,?,?,?,?)", (
                    record.id, record.name, record.source_volume_id, str(record.image), record.backing,
                    record.size, record.created_at, record.state.value, int(record.hidden), record.group_id,
                    record.overlay,
                ))
            for volume in volumes:
                _update_volume(db, volume)
        await self._run(write)

    async def add_group(self, group_id: str, name: str, created_at: float) -> None:
        await self._run(lambda db: db.execute(
            "INSERT INTO groups (id, name, created_at) VALUES (?,?,?)", (group_id, name, created_at)))

    async def group(self, *, group_id: str = "", name: str = "") -> tuple[str, str, float] | None:
        rows = await self._query("SELECT * FROM groups WHERE id=? OR name=?", (group_id, name))
        return (rows[0]["id"], rows[0]["name"], rows[0]["created_at"]) if rows else None

    async def delete_group(self, group_id: str) -> None:
        await self._run(lambda db: db.execute("DELETE FROM groups WHERE id=?", (group_id,)))

    async def group_members(self, group_id: str) -> list[SnapshotRecord]:
        rows = await self._query("SELECT * FROM snapshots WHERE group_id=? ORDER BY id", (group_id,))
        return [_snapshot(row) for row in rows]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._run(lambda db: db.execute("DELETE FROM snapshots WHERE id=?", (snapshot_id,)))

    async def snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        rows = await self._query("SELECT * FROM snapshots WHERE id=?", (snapshot_id,))
        return _snapshot(rows[0]) if rows else None

    async def snapshot_by_name(self, name: str) -> SnapshotRecord | None:
        rows = await self._query("SELECT * FROM snapshots WHERE name=?", (name,))
        return _snapshot(rows[0]) if rows else None

    async def snapshot_by_image(self, image: str) -> SnapshotRecord | None:
        rows = await self._query("SELECT * FROM snapshots WHERE image=?", (image,))
        return _snapshot(rows[0]) if rows else None

    async def snapshots(self) -> list[SnapshotRecord]:
        return [_snapshot(row) for row in await self._query("SELECT * FROM snapshots ORDER BY id", ())]

    async def dependants(self, image: str) -> int:
        """How many volumes and snapshots have `image` as their backing image, and leases serve it to other nodes.

        A lease counts as a dependant so that no flatten or reclaim deletes an image qemu-nbd serves to a copy.
        """
        rows = await self._query(
            "SELECT (SELECT COUNT(*) FROM volumes WHERE backing=?) + (SELECT COUNT(*) FROM snapshots WHERE backing=?)"
            " + (SELECT COUNT(*) FROM copies WHERE role=? AND image=?)",
            (image, image, CopyRole.SOURCE.value, image),
        )
        return int(rows[0][0])

    # stages -------------------------------------------------------------

    async def put_stage(self, record: StageRecord, *, durable: bool = True) -> None:
        await self._run(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO stages (volume_id, staging_path, access_type, fs_type, mount_flags,"
                " mount_group, state, loop_device, shard) VALUES (?,?,?,?,?,?,?,?,?)",
                (record.volume_id, str(record.staging_path), record.access_type.value, record.fs_type,
                 json.dumps(list(record.mount_flags)), record.mount_group, record.state.value,
                 record.loop_device, record.shard),
            ),
            durable=durable,
        )

    async def delete_stage(self, volume_id: str) -> None:
        await self._run(lambda db: db.execute("DELETE FROM stages WHERE volume_id=?", (volume_id,)))

    async def stage(self, volume_id: str) -> StageRecord | None:
        rows = await self._query("SELECT * FROM stages WHERE volume_id=?", (volume_id,))
        return _stage(rows[0]) if rows else None

    async def stages(self) -> list[StageRecord]:
        return [_stage(row) for row in await self._query("SELECT * FROM stages ORDER BY volume_id", ())]

    # publishes ----------------------------------------------------------

    async def put_publish(self, record: PublishRecord, *, durable: bool = True) -> None:
        await self._run(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO publishes (target_path, volume_id, readonly, mount_flags, state,"
                " loop_device, single_writer) VALUES (?,?,?,?,?,?,?)",
                (str(record.target_path), record.volume_id, int(record.readonly),
                 json.dumps(list(record.mount_flags)), record.state.value, record.loop_device,
                 int(record.single_writer)),
            ),
            durable=durable,
        )

    async def delete_publish(self, target_path: Path) -> None:
        await self._run(lambda db: db.execute("DELETE FROM publishes WHERE target_path=?", (str(target_path),)))

    async def publish(self, target_path: Path) -> PublishRecord | None:
        rows = await self._query("SELECT * FROM publishes WHERE target_path=?", (str(target_path),))
        return _publish(rows[0]) if rows else None

    async def publishes(self, volume_id: str | None = None) -> list[PublishRecord]:
        if volume_id is None:
            rows = await self._query("SELECT * FROM publishes ORDER BY target_path", ())
        else:
            rows = await self._query(
                "SELECT * FROM publishes WHERE volume_id=? ORDER BY target_path", (volume_id,)
            )
        return [_publish(row) for row in rows]

    # extents ------------------------------------------------------------

    async def extents(self, pool: str) -> list[ExtentRecord]:
        rows = await self._query("SELECT * FROM extents WHERE pool=? ORDER BY start", (pool,))
        return [_extent(row) for row in rows]

    async def take_extent(
        self, pool: str, volume_id: str, choose: Callable[[list[ExtentRecord]], tuple[int, int] | None],
    ) -> ExtentRecord | None:
        """Give `volume_id` an extent of `pool`, in one transaction: the one it holds, or `choose`'s pick.

        `choose` sees every row of the pool (free space is what lies between
        them) and returns (start, length) or None when nothing fits. Reading
        and inserting under one write lock means two volumes can never be
        given overlapping extents, whatever runs concurrently.
        """
        return await self._take_extent(pool, volume_id, ExtentState.USED, choose)

    async def take_move_extent(
        self, pool: str, volume_id: str, choose: Callable[[list[ExtentRecord]], tuple[int, int] | None],
    ) -> ExtentRecord | None:
        """A MOVING extent for `volume_id` (the one it has, or `choose`'s pick), like `take_extent`."""
        return await self._take_extent(pool, volume_id, ExtentState.MOVING, choose)

    async def _take_extent(
        self, pool: str, volume_id: str, state: ExtentState,
        choose: Callable[[list[ExtentRecord]], tuple[int, int] | None],
    ) -> ExtentRecord | None:
        result: list[ExtentRecord | None] = [None]

        def take(db: sqlite3.Connection) -> None:
            rows = [_extent(r) for r in db.execute("SELECT * FROM extents WHERE pool=? ORDER BY start", (pool,))]
            held = [r for r in rows if r.volume_id == volume_id and r.state is state]
            if held:
                result[0] = held[0]
                return
            picked = choose(rows)
            if picked is None:
                return
            record = ExtentRecord(pool, picked[0], picked[1], volume_id, state)
            db.execute("INSERT INTO extents (pool, start, length, volume_id, state) VALUES (?,?,?,?,?)",
                       (pool, record.start, record.length, volume_id, record.state.value))
            result[0] = record

        await self._run(take)
        return result[0]

    async def commit_move(self, pool: str, volume_id: str, generation: int) -> bool:
        """The move's point of no return, in one transaction; False if `volume_id` has no MOVING extent.

        The MOVING extent becomes the volume's (USED), its old one RETIRING,
        and the volume's image generation `generation` (the names of the
        nodes QSD opens the new home through).
        """
        result = [False]

        def commit(db: sqlite3.Connection) -> None:
            moving = db.execute("SELECT 1 FROM extents WHERE pool=? AND volume_id=? AND state=?",
                                (pool, volume_id, ExtentState.MOVING.value)).fetchone()
            if moving is None:
                return
            db.execute("UPDATE extents SET state=? WHERE pool=? AND volume_id=? AND state=?",
                       (ExtentState.RETIRING.value, pool, volume_id, ExtentState.USED.value))
            db.execute("UPDATE extents SET state=? WHERE pool=? AND volume_id=? AND state=?",
                       (ExtentState.USED.value, pool, volume_id, ExtentState.MOVING.value))
            db.execute("UPDATE volumes SET generation=? WHERE id=?", (generation, volume_id))
            result[0] = True

        await self._run(commit)
        return result[0]

    async def scrub_extents(self, pool: str, volume_id: str, state: ExtentState) -> None:
        """Mark `volume_id`'s extents in `state` (an undone move's, a finished move's old home) SCRUBBING."""
        await self._run(lambda db: db.execute(
            "UPDATE extents SET state=? WHERE pool=? AND volume_id=? AND state=?",
            (ExtentState.SCRUBBING.value, pool, volume_id, state.value)))

    async def release_extents(self, pool: str, volume_id: str) -> None:
        """Mark what `volume_id` holds in `pool` as SCRUBBING: never handed out until its scrub is recorded."""
        await self._run(lambda db: db.execute(
            "UPDATE extents SET state=? WHERE pool=? AND volume_id=?",
            (ExtentState.SCRUBBING.value, pool, volume_id)))

    async def drop_extent(self, pool: str, start: int) -> None:
        """A scrubbed extent becomes free space (its row goes)."""
        await self._run(lambda db: db.execute(
            "DELETE FROM extents WHERE pool=? AND start=? AND state=?", (pool, start, ExtentState.SCRUBBING.value)))

    async def resize_extent(self, pool: str, start: int, length: int, fits: Callable[[list[ExtentRecord]], bool]) -> bool:
        """Set the length of the extent at `start` if `fits` (given every row of the pool) agrees, atomically."""
        result = [False]

        def grow(db: sqlite3.Connection) -> None:
            rows = [_extent(r) for r in db.execute("SELECT * FROM extents WHERE pool=? ORDER BY start", (pool,))]
            if fits(rows):
                db.execute("UPDATE extents SET length=? WHERE pool=? AND start=?", (length, pool, start))
                result[0] = True

        await self._run(grow)
        return result[0]

    # copies across nodes -------------------------------------------------

    async def put_copy(self, record: CopyRecord) -> None:
        await self._run(lambda db: _put_copy(db, record))

    async def copy(self, volume_id: str, role: CopyRole) -> CopyRecord | None:
        rows = await self._query("SELECT * FROM copies WHERE volume_id=? AND role=?", (volume_id, role.value))
        return _copy(rows[0]) if rows else None

    async def copies(self, role: CopyRole) -> list[CopyRecord]:
        rows = await self._query("SELECT * FROM copies WHERE role=? ORDER BY volume_id", (role.value,))
        return [_copy(row) for row in rows]

    async def delete_copy(self, volume_id: str, role: CopyRole) -> None:
        await self._run(lambda db: db.execute("DELETE FROM copies WHERE volume_id=? AND role=?",
                                              (volume_id, role.value)))

    async def add_copy_volume(self, volume: VolumeRecord, local_copy: SnapshotRecord, copy: CopyRecord) -> None:
        """A volume made from another node's snapshot, its local copy image (a hidden snapshot) and its copy row,
        in one transaction."""
        def write(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO snapshots (id, name, source_volume_id, image, backing, size, created_at,"
                " state, hidden, group_id, overlay) VALUES (?,?,?,?,?,?,?,?,?,?,?)", (
                    local_copy.id, local_copy.name, local_copy.source_volume_id, str(local_copy.image),
                    local_copy.backing, local_copy.size, local_copy.created_at, local_copy.state.value,
                    int(local_copy.hidden), local_copy.group_id, local_copy.overlay))
            _insert_volume(db, volume)
            _put_copy(db, copy)
        await self._run(write)

    # plumbing -----------------------------------------------------------

    def _open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA wal_autocheckpoint=0")  # durable commits checkpoint, off the event loop (`_run`)
        db.execute("PRAGMA foreign_keys=ON")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            db.close()
            raise StartupError(
                f"catalog {self._path} has schema {version}, newer than this driver's {SCHEMA_VERSION}"
            )
        if version == 0:
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        for target in range(version + 1, SCHEMA_VERSION + 1) if version else ():
            _migrate(db, target)
        self._db = db

    def _close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            if self._db is None:
                raise Unavailable(_CLOSED)
            return fn(self._db)

    async def _run(self, fn: Callable[[sqlite3.Connection], object], *, durable: bool = True) -> None:
        """`fn` in one transaction; `durable=False` commits an intent without waiting for its fsync.

        An intent writes the WAL without syncing it and never checkpoints, so
        it cannot wait for the disk: it runs on the event loop whenever the
        connection is free, saving the hop to a worker thread (0.15-0.35 ms
        measured). A durable commit runs there too while the disk answers
        fast (the last one took under LOOP_COMMIT_MAX: an fsync of a few WAL
        pages takes 0.1-0.3 ms on an SSD, less than the hop); one that took
        longer sends the next ones to a worker thread, until one there is
        fast again, so a slow or stalled disk holds a worker, not the loop.
        Checkpoints always run in a worker thread.
        """
        def transaction(db: sqlite3.Connection) -> None:
            started = time.monotonic()
            if not durable:
                db.execute("PRAGMA synchronous=NORMAL")
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    fn(db)
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            finally:
                if not durable:
                    db.execute("PRAGMA synchronous=FULL")
            self._commits += 1
            if durable:
                self._fast_disk = time.monotonic() - started < LOOP_COMMIT_MAX
                if self._commits >= CHECKPOINT_EVERY:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                    self._commits = 0
        on_loop = not durable or (self._fast_disk and self._commits + 1 < CHECKPOINT_EVERY)
        if on_loop and self._lock.acquire(blocking=False):
            try:
                if self._db is None:
                    raise Unavailable(_CLOSED)
                transaction(self._db)
            finally:
                self._lock.release()
            await asyncio.sleep(0)
            return
        await asyncio.to_thread(self._call, transaction)

    async def _query(self, sql: str, args: tuple[Any, ...]) -> list[sqlite3.Row]:
        """Rows of a read; on the event loop when the connection is free, else in a worker thread.

        A read by key from the WAL's cached pages takes tens of microseconds,
        less than the hop to a worker thread (0.15-0.35 ms measured), and a
        node call makes several. A connection busy with a transaction (whose
        commit may wait for the disk) is never waited for on the loop.
        """
        if self._lock.acquire(blocking=False):
            try:
                if self._db is None:
                    raise Unavailable(_CLOSED)
                rows = self._db.execute(sql, args).fetchall()
            finally:
                self._lock.release()
            await asyncio.sleep(0)  # still a point where other tasks run, as the hop was: no caller starves them
            return rows
        return await asyncio.to_thread(self._call, lambda db: db.execute(sql, args).fetchall())


def _migrate(db: sqlite3.Connection, target: int) -> None:
    """Bring the catalog from schema `target`-1 to `target`, atomically: all of it or none."""
    db.execute("BEGIN IMMEDIATE")
    try:
        for statement in _MIGRATIONS[target]:
            db.execute(statement)
        db.execute(f"PRAGMA user_version={target}")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _insert_volume(db: sqlite3.Connection, record: VolumeRecord) -> None:
    db.execute(
        "INSERT INTO volumes (id, name, capacity, params, image, state, created_at, backing, generation, source,"
        " pool, qos, image_pending) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (record.id, record.name, record.capacity, record.params.to_json(), str(record.image),
         record.state.value, record.created_at, record.backing, record.generation, record.source, record.pool,
         record.qos.to_json(), int(record.image_pending)),
    )


def _update_volume(db: sqlite3.Connection, record: VolumeRecord) -> None:
    db.execute(
        "UPDATE volumes SET name=?, capacity=?, params=?, image=?, state=?, created_at=?, backing=?,"
        " generation=?, source=?, pool=?, qos=? WHERE id=?",
        (record.name, record.capacity, record.params.to_json(), str(record.image), record.state.value,
         record.created_at, record.backing, record.generation, record.source, record.pool, record.qos.to_json(),
         record.id),
    )


# Parsed once per distinct text (both are frozen): most volumes share a StorageClass's few parameter sets, and a
# node call reads its volume's row two or three times.
_parsed_params = functools.lru_cache(maxsize=1024)(VolumeParameters.from_json)
_parsed_qos = functools.lru_cache(maxsize=1024)(QoS.from_json)


def _volume(row: sqlite3.Row) -> VolumeRecord:
    return VolumeRecord(
        id=row["id"], name=row["name"], capacity=row["capacity"],
        params=_parsed_params(row["params"]), image=Path(row["image"]),
        state=VolumeState(row["state"]), created_at=row["created_at"], backing=row["backing"],
        generation=row["generation"], source=row["source"], pool=row["pool"], qos=_parsed_qos(row["qos"]),
        image_pending=bool(row["image_pending"]),
    )


def _extent(row: sqlite3.Row) -> ExtentRecord:
    return ExtentRecord(pool=row["pool"], start=row["start"], length=row["length"], volume_id=row["volume_id"],
                        state=ExtentState(row["state"]))


def _snapshot(row: sqlite3.Row) -> SnapshotRecord:
    return SnapshotRecord(
        id=row["id"], name=row["name"], source_volume_id=row["source_volume_id"], image=Path(row["image"]),
        backing=row["backing"], size=row["size"], created_at=row["created_at"], state=SnapshotState(row["state"]),
        hidden=bool(row["hidden"]), group_id=row["group_id"], overlay=row["overlay"],
    )


def _stage(row: sqlite3.Row) -> StageRecord:
    return StageRecord(
        volume_id=row["volume_id"], staging_path=Path(row["staging_path"]),
        access_type=AccessType(row["access_type"]), fs_type=row["fs_type"],
        mount_flags=tuple(json.loads(row["mount_flags"])), mount_group=row["mount_group"],
        state=StageState(row["state"]), loop_device=row["loop_device"], shard=row["shard"],
    )


def _publish(row: sqlite3.Row) -> PublishRecord:
    return PublishRecord(
        target_path=Path(row["target_path"]), volume_id=row["volume_id"], readonly=bool(row["readonly"]),
        mount_flags=tuple(json.loads(row["mount_flags"])), state=PublishState(row["state"]),
        loop_device=row["loop_device"], single_writer=bool(row["single_writer"]),
    )


def _put_copy(db: sqlite3.Connection, record: CopyRecord) -> None:
    db.execute(
        "INSERT OR REPLACE INTO copies (volume_id, role, node, source, snapshot_id, address, image, state,"
        " created_at) VALUES (?,?,?,?,?,?,?,?,?)",
        (record.volume_id, record.role.value, record.node, record.source, record.snapshot_id, record.address,
         record.image, record.state.value, record.created_at),
    )


def _copy(row: sqlite3.Row) -> CopyRecord:
    return CopyRecord(
        volume_id=row["volume_id"], role=CopyRole(row["role"]), node=row["node"], source=row["source"],
        state=CopyState(row["state"]), created_at=row["created_at"], snapshot_id=row["snapshot_id"],
        address=row["address"], image=row["image"],
    )


def now() -> float:
    return time.time()
