"""Records to rows and back: the one statement that writes each kind of record whole, and the parse of each row.

A statement written here is the only copy of it: `store.Catalog` calls these
inside its transactions. Nothing here opens, commits or waits.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from pathlib import Path

from csi_qsd.catalog.records import (
    AccessType,
    CopyRecord,
    CopyRole,
    CopyState,
    ExtentRecord,
    ExtentState,
    GroupRecord,
    PublishRecord,
    PublishState,
    SnapshotRecord,
    SnapshotState,
    StageRecord,
    StageState,
    VolumeRecord,
    VolumeState,
)
from csi_qsd.params import QoS, VolumeParameters

# writes --------------------------------------------------------------------


def add_volume(db: sqlite3.Connection, record: VolumeRecord) -> None:
    """A new volume row, `image_pending` included; sqlite3.IntegrityError if its ID or name is taken."""
    db.execute(
        "INSERT INTO volumes (id, name, capacity, params, image, state, created_at, backing, generation, source,"
        " pool, qos, image_pending, key_version) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (record.id, record.name, record.capacity, record.params.to_json(), str(record.image),
         record.state.value, record.created_at, record.backing, record.generation, record.source, record.pool,
         record.qos.to_json(), int(record.image_pending), record.key_version),
    )


def set_volume(db: sqlite3.Connection, record: VolumeRecord) -> None:
    """Every column of the volume's row but `image_pending` (see `Catalog.set_volume`); no row: no change."""
    db.execute(
        "UPDATE volumes SET name=?, capacity=?, params=?, image=?, state=?, created_at=?, backing=?,"
        " generation=?, source=?, pool=?, qos=?, key_version=? WHERE id=?",
        (record.name, record.capacity, record.params.to_json(), str(record.image), record.state.value,
         record.created_at, record.backing, record.generation, record.source, record.pool, record.qos.to_json(),
         record.key_version, record.id),
    )


def write_snapshot(db: sqlite3.Connection, record: SnapshotRecord, *, replace: bool) -> None:
    """A snapshot row; a row holding its ID, name or image is replaced (`replace`) or refused (IntegrityError)."""
    db.execute(
        f"INSERT {'OR REPLACE ' if replace else ''}INTO snapshots (id, name, source_volume_id, image, backing, size,"
        " created_at, state, hidden, group_id, overlay) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (record.id, record.name, record.source_volume_id, str(record.image), record.backing, record.size,
         record.created_at, record.state.value, int(record.hidden), record.group_id, record.overlay),
    )


def put_stage(db: sqlite3.Connection, record: StageRecord) -> None:
    db.execute(
        "INSERT OR REPLACE INTO stages (volume_id, staging_path, access_type, fs_type, mount_flags, mount_group,"
        " state, loop_device, shard) VALUES (?,?,?,?,?,?,?,?,?)",
        (record.volume_id, str(record.staging_path), record.access_type.value, record.fs_type,
         json.dumps(list(record.mount_flags)), record.mount_group, record.state.value, record.loop_device,
         record.shard),
    )


def put_publish(db: sqlite3.Connection, record: PublishRecord) -> None:
    db.execute(
        "INSERT OR REPLACE INTO publishes (target_path, volume_id, readonly, mount_flags, state, loop_device,"
        " single_writer) VALUES (?,?,?,?,?,?,?)",
        (str(record.target_path), record.volume_id, int(record.readonly), json.dumps(list(record.mount_flags)),
         record.state.value, record.loop_device, int(record.single_writer)),
    )


def put_copy(db: sqlite3.Connection, record: CopyRecord) -> None:
    db.execute(
        "INSERT OR REPLACE INTO copies (volume_id, role, node, source, snapshot_id, address, image, state,"
        " created_at) VALUES (?,?,?,?,?,?,?,?,?)",
        (record.volume_id, record.role.value, record.node, record.source, record.snapshot_id, record.address,
         record.image, record.state.value, record.created_at),
    )


def add_extent(db: sqlite3.Connection, record: ExtentRecord) -> None:
    db.execute("INSERT INTO extents (pool, start, length, volume_id, state) VALUES (?,?,?,?,?)",
               (record.pool, record.start, record.length, record.volume_id, record.state.value))


def add_group(db: sqlite3.Connection, record: GroupRecord) -> None:
    db.execute("INSERT INTO groups (id, name, created_at) VALUES (?,?,?)", (record.id, record.name, record.created_at))


# reads ---------------------------------------------------------------------


def pool_extents(db: sqlite3.Connection, pool: str) -> list[ExtentRecord]:
    """Every extent row of a device pool, by start."""
    return [extent(row) for row in db.execute("SELECT * FROM extents WHERE pool=? ORDER BY start", (pool,))]


# Parsed once per distinct text (both are frozen): most volumes share a StorageClass's few parameter sets, and a
# node call reads its volume's row two or three times.
_parsed_params = functools.lru_cache(maxsize=1024)(VolumeParameters.from_json)
_parsed_qos = functools.lru_cache(maxsize=1024)(QoS.from_json)


def volume(row: sqlite3.Row) -> VolumeRecord:
    return VolumeRecord(
        id=row["id"], name=row["name"], capacity=row["capacity"],
        params=_parsed_params(row["params"]), image=Path(row["image"]),
        state=VolumeState(row["state"]), created_at=row["created_at"], backing=row["backing"],
        generation=row["generation"], source=row["source"], pool=row["pool"], qos=_parsed_qos(row["qos"]),
        image_pending=bool(row["image_pending"]), key_version=row["key_version"],
    )


def extent(row: sqlite3.Row) -> ExtentRecord:
    return ExtentRecord(pool=row["pool"], start=row["start"], length=row["length"], volume_id=row["volume_id"],
                        state=ExtentState(row["state"]))


def snapshot(row: sqlite3.Row) -> SnapshotRecord:
    return SnapshotRecord(
        id=row["id"], name=row["name"], source_volume_id=row["source_volume_id"], image=Path(row["image"]),
        backing=row["backing"], size=row["size"], created_at=row["created_at"], state=SnapshotState(row["state"]),
        hidden=bool(row["hidden"]), group_id=row["group_id"], overlay=row["overlay"],
    )


def group(row: sqlite3.Row) -> GroupRecord:
    return GroupRecord(id=row["id"], name=row["name"], created_at=row["created_at"])


def stage(row: sqlite3.Row) -> StageRecord:
    return StageRecord(
        volume_id=row["volume_id"], staging_path=Path(row["staging_path"]),
        access_type=AccessType(row["access_type"]), fs_type=row["fs_type"],
        mount_flags=tuple(json.loads(row["mount_flags"])), mount_group=row["mount_group"],
        state=StageState(row["state"]), loop_device=row["loop_device"], shard=row["shard"],
    )


def publish(row: sqlite3.Row) -> PublishRecord:
    return PublishRecord(
        target_path=Path(row["target_path"]), volume_id=row["volume_id"], readonly=bool(row["readonly"]),
        mount_flags=tuple(json.loads(row["mount_flags"])), state=PublishState(row["state"]),
        loop_device=row["loop_device"], single_writer=bool(row["single_writer"]),
    )


def copy(row: sqlite3.Row) -> CopyRecord:
    return CopyRecord(
        volume_id=row["volume_id"], role=CopyRole(row["role"]), node=row["node"], source=row["source"],
        state=CopyState(row["state"]), created_at=row["created_at"], snapshot_id=row["snapshot_id"],
        address=row["address"], image=row["image"],
    )
