"""The SQLite catalog: rows survive a close and reopen from disk, in every state, and constraints hold.

Like csi-driver-host-path's state_test.go, the round trip reopens the
database from its file instead of trusting the open connection.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd.catalog import (
    SCHEMA_VERSION,
    AccessType,
    Catalog,
    GroupRecord,
    PublishRecord,
    PublishState,
    StageRecord,
    StageState,
    VolumeState,
)
from csi_qsd.catalog import connection as catalog_store
from csi_qsd.errors import StartupError, Unavailable
from csi_qsd.params import ExportKind, ImageFormat, VolumeParameters
from tests.fakes.sample_records import volume

MIB = 1 << 20


@pytest.fixture
async def catalog(tmp_path: Path) -> AsyncIterator[Catalog]:
    async with Catalog(tmp_path / "state" / "catalog.db") as value:
        yield value


async def reopen(catalog: Catalog, path: Path) -> Catalog:
    await catalog.close()
    fresh = Catalog(path)
    await fresh.open()
    return fresh


async def test_round_trip_through_disk_in_every_state(tmp_path: Path) -> None:
    path = tmp_path / "state" / "catalog.db"
    catalog = Catalog(path)
    await catalog.open()
    vhost = VolumeParameters(format=ImageFormat.RAW, export=ExportKind.VHOST_USER_BLK, num_queues=2,
                             iothread_poll_max_ns=0)
    volumes = [volume(1, VolumeState.CREATING), volume(2, VolumeState.READY, params=vhost),
               volume(3, VolumeState.DELETING), volume(4), volume(5)]
    for record in volumes:
        await catalog.add_volume(record)
    stages = [
        StageRecord(volumes[1].id, Path("/k/plugins/staging/a b"), AccessType.MOUNT, "", (), "1000",
                    StageState.STAGED),
        StageRecord(volumes[3].id, Path("/k/staging/blk"), AccessType.BLOCK, "", (), "", StageState.STAGING,
                    loop_device="/dev/loop7", shard=3),
        StageRecord(volumes[4].id, Path("/k/staging/fs"), AccessType.MOUNT, "xfs", ("noatime", "discard"), "",
                    StageState.UNSTAGING, loop_device="/dev/loop8"),
    ]
    for stage in stages:
        await catalog.put_stage(stage)
    publishes = [
        PublishRecord(Path("/k/pods/p1/volume"), volumes[4].id, False, ("nosuid",), PublishState.PUBLISHED),
        PublishRecord(Path("/k/pods/p2/volume"), volumes[4].id, True, (), PublishState.PUBLISHING,
                      loop_device="/dev/loop9"),
        PublishRecord(Path("/k/pods/p3/volume"), volumes[3].id, False, (), PublishState.UNPUBLISHING),
    ]
    for publish in publishes:
        await catalog.put_publish(publish)

    catalog = await reopen(catalog, path)
    try:
        assert await catalog.volumes() == volumes
        for record in volumes:
            assert await catalog.volume(record.id) == record
            assert await catalog.volume_by_name(record.name) == record
        assert (await catalog.volume(volumes[1].id)).params == vhost  # type: ignore[union-attr]
        assert await catalog.stages() == sorted(stages, key=lambda s: s.volume_id)
        for stage in stages:
            assert await catalog.stage(stage.volume_id) == stage
        assert await catalog.publishes() == publishes
        assert await catalog.publishes(volumes[4].id) == publishes[:2]
        for publish in publishes:
            assert await catalog.publish(publish.target_path) == publish
        assert await catalog.volume("vol-" + "f" * 24) is None
        assert await catalog.stage(volumes[0].id) is None
        assert await catalog.publish(Path("/k/pods/none")) is None
    finally:
        await catalog.close()


async def test_transitions_are_committed_one_by_one(tmp_path: Path) -> None:
    """Each state change is on disk when the call returns: what a crash between steps would leave."""
    path = tmp_path / "catalog.db"
    catalog = Catalog(path)
    await catalog.open()
    record = volume(7, VolumeState.CREATING)
    await catalog.add_volume(record)
    for state in (VolumeState.CREATING, VolumeState.READY, VolumeState.DELETING):
        await catalog.set_volume_state(record.id, state)
        catalog = await reopen(catalog, path)
        assert (await catalog.volume(record.id)) == dataclasses.replace(record, state=state)
    await catalog.set_volume(dataclasses.replace(record, capacity=99 * MIB))
    stage = StageRecord(record.id, Path("/k/s"), AccessType.MOUNT, "ext4", (), "", StageState.STAGING)
    for state in (StageState.STAGING, StageState.STAGED, StageState.UNSTAGING):
        await catalog.put_stage(dataclasses.replace(stage, state=state))
        catalog = await reopen(catalog, path)
        got = await catalog.stage(record.id)
        assert got is not None and got.state is state
    publish = PublishRecord(Path("/k/t"), record.id, True, (), PublishState.PUBLISHING)
    for pstate in (PublishState.PUBLISHING, PublishState.PUBLISHED, PublishState.UNPUBLISHING):
        await catalog.put_publish(dataclasses.replace(publish, state=pstate))
        catalog = await reopen(catalog, path)
        pgot = await catalog.publish(Path("/k/t"))
        assert pgot is not None and pgot.state is pstate
    await catalog.delete_publish(Path("/k/t"))
    await catalog.delete_stage(record.id)
    catalog = await reopen(catalog, path)
    try:
        assert await catalog.publishes() == [] and await catalog.stages() == []
        assert (await catalog.volume(record.id)).capacity == 99 * MIB  # type: ignore[union-attr]
    finally:
        await catalog.close()


async def test_rewriting_a_volume_never_marks_its_image_pending_again(catalog: Catalog) -> None:
    """`set_volume` writes every column but `image_pending`: a record read before the settle cannot undo it."""
    read_before = volume(1, image_pending=True)
    await catalog.add_volume(read_before)
    await catalog.set_images_settled([read_before.id, volume(9).id])  # an ID with no row is passed over
    await catalog.set_volume(dataclasses.replace(read_before, capacity=99 * MIB, backing="/pool/base.qcow2"))
    assert await catalog.volume(read_before.id) == dataclasses.replace(
        read_before, capacity=99 * MIB, backing="/pool/base.qcow2", image_pending=False)
    assert await catalog.pending_images() == []
    await catalog.set_volume(volume(2))  # no row: none is made
    await catalog.set_volume_state(volume(3).id, VolumeState.DELETING)
    assert [r.id for r in await catalog.volumes()] == [read_before.id]


async def test_groups_are_records_found_by_id_or_name(catalog: Catalog) -> None:
    group = GroupRecord("group-1", "snap-group", 1700000000.5)
    await catalog.add_group(group)
    assert await catalog.group(group_id="group-1") == group
    assert await catalog.group(name="snap-group") == group
    with pytest.raises(sqlite3.IntegrityError):
        await catalog.add_group(GroupRecord("group-2", "snap-group", 1.0))
    await catalog.delete_group("group-1")
    await catalog.delete_group("group-1")  # gone already: no error
    assert await catalog.group(group_id="group-1") is None and await catalog.group(name="snap-group") is None


async def test_durable_commits_leave_the_event_loop_while_the_disk_is_slow(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch,
) -> None:
    on_loop: list[bool] = []

    def commit(db: sqlite3.Connection) -> None:
        on_loop.append(threading.current_thread() is threading.main_thread())

    async def commits(n: int) -> list[bool]:
        on_loop.clear()
        for _ in range(n):
            await catalog._run(commit)
        return list(on_loop)

    monkeypatch.setattr(catalog_store, "LOOP_COMMIT_MAX", 10.0)  # every commit is fast
    assert (await commits(3))[1:] == [True, True]
    monkeypatch.setattr(catalog_store, "LOOP_COMMIT_MAX", 0.0)  # every commit is slow
    assert await commits(3) == [True, False, False]  # the slow one on the loop sends the next ones away
    monkeypatch.setattr(catalog_store, "LOOP_COMMIT_MAX", 10.0)
    assert await commits(2) == [False, True]  # back once one in a worker thread was fast
    on_loop.clear()
    await catalog._run(commit, durable=False)
    assert on_loop == [True]  # an intent never waits for the disk


async def test_listing_is_ordered_paged_and_filtered(catalog: Catalog) -> None:
    records = [volume(n, VolumeState.READY if n % 3 else VolumeState.CREATING) for n in (9, 3, 7, 1, 5, 6, 2)]
    for record in records:
        await catalog.add_volume(record)
    ready = sorted((r for r in records if r.state is VolumeState.READY), key=lambda r: r.id)
    assert [r.id for r in await catalog.volumes()] == sorted(r.id for r in records)
    assert await catalog.volumes(state=VolumeState.READY) == ready
    assert await catalog.volumes(state=VolumeState.READY, limit=2) == ready[:2]
    assert await catalog.volumes(state=VolumeState.READY, after_id=ready[1].id) == ready[2:]
    assert await catalog.volumes(after_id=ready[-1].id, state=VolumeState.READY) == []


async def test_names_are_unique_and_a_failed_write_changes_nothing(catalog: Catalog) -> None:
    await catalog.add_volume(volume(1))
    with pytest.raises(sqlite3.IntegrityError):
        await catalog.add_volume(volume(2, name="pvc-1"))
    with pytest.raises(sqlite3.IntegrityError):
        await catalog.add_volume(volume(1, name="other"))
    assert [r.id for r in await catalog.volumes()] == [volume(1).id]


async def test_stage_and_publish_need_their_volume(catalog: Catalog) -> None:
    ghost = "vol-" + "9" * 24
    with pytest.raises(sqlite3.IntegrityError):
        await catalog.put_stage(StageRecord(ghost, Path("/k/s"), AccessType.MOUNT, "", (), "", StageState.STAGED))
    with pytest.raises(sqlite3.IntegrityError):
        await catalog.put_publish(PublishRecord(Path("/k/t"), ghost, False, (), PublishState.PUBLISHED))


async def test_deleting_a_volume_deletes_its_stage_and_publishes(catalog: Catalog) -> None:
    keep, gone = volume(1), volume(2)
    for record in (keep, gone):
        await catalog.add_volume(record)
        await catalog.put_stage(StageRecord(record.id, Path(f"/k/s{record.capacity}"), AccessType.MOUNT, "ext4",
                                            (), "", StageState.STAGED))
        await catalog.put_publish(PublishRecord(Path(f"/k/t{record.capacity}"), record.id, False, (),
                                                PublishState.PUBLISHED))
    await catalog.delete_volume(gone.id)
    assert await catalog.volume(gone.id) is None and await catalog.stage(gone.id) is None
    assert await catalog.publishes(gone.id) == []
    assert [s.volume_id for s in await catalog.stages()] == [keep.id]
    assert [p.volume_id for p in await catalog.publishes()] == [keep.id]


async def test_durability_settings_and_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    async with Catalog(path) as catalog:
        assert catalog.usable()
        await catalog.add_volume(volume(1))
    assert not catalog.usable()
    with pytest.raises(Unavailable, match="closed"):  # a call racing the driver's stop may be retried
        await catalog.volumes()
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
        db.commit()
    finally:
        db.close()
    newer = Catalog(path)
    with pytest.raises(StartupError, match="newer than this driver"):
        await newer.open()


# What a driver killed without closing the catalog does: commits over the laid-out WAL, then no close at all.
_KILLED_WRITER = """
import asyncio, os, sys
from pathlib import Path
from csi_qsd.catalog import Catalog
from tests.fakes.sample_records import volume

async def main() -> None:
    catalog = Catalog(Path(sys.argv[1]))
    await catalog.open()
    for n in range(1, 41):
        await catalog.add_volume(volume(n))
    await catalog.delete_volumes([volume(n).id for n in range(1, 11)])
    print(os.path.getsize(sys.argv[1] + "-wal"), flush=True)
    os._exit(0)  # no checkpoint, no close: the WAL holds the commits and, past them, the rolled-back frames

asyncio.run(main())
"""


async def test_commits_overwrite_a_laid_out_wal_and_survive_a_kill(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    async with Catalog(path) as catalog:
        wal = path.with_name(path.name + "-wal")
        laid_out = wal.stat().st_size
        assert laid_out >= catalog_store.WAL_ROOM  # laid out when the catalog opens
        for n in range(1, 21):
            await catalog.add_volume(volume(n))
        assert wal.stat().st_size == laid_out  # commits write over it: the file never grows
        await catalog.delete_volumes([volume(n).id for n in range(1, 21)])
    path.unlink()
    written = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).parents[2])
    assert int(written.stdout) >= catalog_store.WAL_ROOM
    async with Catalog(path) as catalog:  # recovery reads the commits and nothing past them
        assert [r.id for r in await catalog.volumes()] == [volume(n).id for n in range(11, 41)]
    db = sqlite3.connect(path)
    try:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "wal_room" not in tables and db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()
