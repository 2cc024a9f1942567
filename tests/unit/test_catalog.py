"""The SQLite catalog: rows survive a close and reopen from disk, in every state, and constraints hold.

Like csi-driver-host-path's state_test.go, the round trip reopens the
database from its file instead of trusting the open connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd import catalog as catalog_module
from csi_qsd import validate
from csi_qsd.catalog import (
    SCHEMA_VERSION, AccessType, Catalog, PublishRecord, PublishState, StageRecord, StageState, VolumeRecord,
    VolumeState,
)
from csi_qsd.errors import StartupError, Unavailable
from csi_qsd.sys.locks import KeyedLocks
from csi_qsd.params import ExportKind, ImageFormat, VolumeParameters
from csi_qsd.pools.base import NewImage
from csi_qsd.pools.files import FilePool
from csi_qsd.controller.volumes import SETTLE_DELAY, Volumes

MIB = 1 << 20


def volume(n: int, state: VolumeState = VolumeState.READY, **changes: object) -> VolumeRecord:
    volume_id = f"vol-{n:024x}"
    record = VolumeRecord(
        id=volume_id, name=f"pvc-{n}", capacity=n * MIB, params=VolumeParameters(),
        image=Path(f"/pool/{volume_id}.qcow2"), state=state, created_at=1700000000.25 + n,
    )
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


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
    await catalog.update_volume(dataclasses.replace(record, capacity=99 * MIB))
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

    monkeypatch.setattr(catalog_module, "LOOP_COMMIT_MAX", 10.0)  # every commit is fast
    assert (await commits(3))[1:] == [True, True]
    monkeypatch.setattr(catalog_module, "LOOP_COMMIT_MAX", 0.0)  # every commit is slow
    assert await commits(3) == [True, False, False]  # the slow one on the loop sends the next ones away
    monkeypatch.setattr(catalog_module, "LOOP_COMMIT_MAX", 10.0)
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


# the start-up reconcile of transitional volume rows -----------------------


async def test_reconcile_finishes_or_undoes_transitional_volumes(tmp_path: Path) -> None:
    pool = FilePool(tmp_path / "pool")
    pool.prepare()
    async with Catalog(tmp_path / "catalog.db") as catalog:
        volumes = Volumes(catalog, pool, KeyedLocks("volume"))
        records = {}
        for n, state in ((1, VolumeState.CREATING), (2, VolumeState.READY), (3, VolumeState.DELETING)):
            volume_id = f"vol-{n:024x}"
            image = pool.image_path(volume_id, ImageFormat.QCOW2)
            image.write_bytes(b"image")
            records[state] = volume(n, state, image=image)
            await catalog.add_volume(records[state])
        leftover = pool.directory / f"{validate.new_volume_id()}.qcow2.tmp"
        leftover.write_bytes(b"half")
        stray = pool.directory / f"{validate.new_volume_id()}.raw"
        stray.write_bytes(b"user data nobody told us about")
        # What a create cut off by power can leave: an image no row names that holds nothing of its own.
        never_named = pool.directory / f"{validate.new_volume_id()}.qcow2"
        await pool.create(never_named, 64 << 20, VolumeParameters())
        sparse = pool.directory / f"{validate.new_volume_id()}.raw"
        sparse.touch()
        os.truncate(sparse, 64 << 20)

        await volumes.reconcile()

        assert [r.id for r in await catalog.volumes()] == [records[VolumeState.READY].id]
        assert records[VolumeState.READY].image.read_bytes() == b"image"
        assert not records[VolumeState.CREATING].image.exists()
        assert not records[VolumeState.DELETING].image.exists()
        assert not leftover.exists()
        assert stray.read_bytes() == b"user data nobody told us about"  # never lose what we did not make
        assert not never_named.exists() and not sparse.exists()
        await volumes.reconcile()  # idempotent
        assert [r.id for r in await catalog.volumes()] == [records[VolumeState.READY].id]


async def test_get_and_page_show_only_ready_volumes(tmp_path: Path) -> None:
    pool = FilePool(tmp_path / "pool")
    async with Catalog(tmp_path / "catalog.db") as catalog:
        volumes = Volumes(catalog, pool, KeyedLocks("volume"))
        creating, ready, deleting = volume(1, VolumeState.CREATING), volume(2), volume(3, VolumeState.DELETING)
        for record in (creating, ready, deleting):
            await catalog.add_volume(record)
        assert await volumes.get(creating.id) is None and await volumes.get(deleting.id) is None
        assert await volumes.get(ready.id) == ready
        assert await volumes.page("", 0) == ([ready], "")


# CreateVolume's image settled after the answer, DeleteVolume's storage freed after it -----------


async def test_a_created_volume_is_settled_right_after_and_a_pending_one_is_written_again(tmp_path: Path) -> None:
    pool = FilePool(tmp_path / "pool")
    pool.prepare()
    async with Catalog(tmp_path / "catalog.db") as catalog:
        volumes = Volumes(catalog, pool, KeyedLocks("volume"))
        created = [await volumes.create(f"pvc-{n}", 64 << 20, 0, VolumeParameters(), []) for n in range(3)]
        assert all(r.image_pending for r in created)  # answered before the images are known durable
        assert not any(r.image.exists() for r in created)  # nor even written: the batch writes them
        assert [r.image_pending for r in await catalog.pending_images()] == [True] * 3
        for _ in range(100):
            if not await catalog.pending_images():
                break
            await asyncio.sleep(SETTLE_DELAY / 4)
        assert await catalog.pending_images() == []  # one batch settled them all
        assert all(pool.reads_as_zeros(r.image) for r in created)

        # A stage (or snapshot) settles its own image at once, and the batch after it finds it whole.
        staged = await volumes.create("pvc-staged", 64 << 20, 0, VolumeParameters(), [])
        await volumes.settled(staged)
        assert pool.reads_as_zeros(staged.image) and await catalog.pending_images() == []
        await volumes.close()

        # A power loss that took pending images (one never written, one torn): the reconcile writes them again.
        never = dataclasses.replace(volume(8), image=pool.image_path(f"vol-{8:024x}", ImageFormat.QCOW2),
                                    image_pending=True)
        torn = dataclasses.replace(volume(9), image=pool.image_path(f"vol-{9:024x}", ImageFormat.QCOW2),
                                   image_pending=True)
        torn.image.write_bytes(b"QFI\xfb")
        await catalog.add_volume(never)
        await catalog.add_volume(torn)
        await Volumes(catalog, pool, KeyedLocks("volume")).reconcile()
        assert await catalog.pending_images() == []
        for record in (never, torn):
            assert pool.reads_as_zeros(record.image) and (await catalog.volume(record.id)) is not None


async def test_a_volume_deleted_while_its_batch_writes_leaves_no_image(tmp_path: Path) -> None:
    pool = FilePool(tmp_path / "pool")
    pool.prepare()
    entered, release = asyncio.Event(), asyncio.Event()
    settle = pool.settle

    async def held_settle(images: list[NewImage]) -> list[Path]:
        entered.set()
        await release.wait()
        return await settle(images)

    pool.settle = held_settle  # type: ignore[method-assign]
    async with Catalog(tmp_path / "catalog.db") as catalog:
        volumes = Volumes(catalog, pool, KeyedLocks("volume"))
        record = await volumes.create("pvc-short", 64 << 20, 0, VolumeParameters(), [])
        await asyncio.wait_for(entered.wait(), 5)
        await volumes.delete(record.id)  # answered while the batch holding its image is under way
        freeing = asyncio.create_task(volumes.freed())
        await asyncio.sleep(SETTLE_DELAY)
        assert not freeing.done()  # the storage is freed only once no batch can write it any more
        release.set()
        await asyncio.wait_for(freeing, 5)
        assert await catalog.volume(record.id) is None and not record.image.exists()
        assert list(pool.images()) == []
        await volumes.close()


async def test_delete_answers_before_the_storage_goes_and_a_repeat_is_ok(tmp_path: Path) -> None:
    pool = FilePool(tmp_path / "pool")
    pool.prepare()
    async with Catalog(tmp_path / "catalog.db") as catalog:
        volumes = Volumes(catalog, pool, KeyedLocks("volume"))
        record = await volumes.create("pvc-gone", 64 << 20, 0, VolumeParameters(), [])
        await volumes.delete(record.id)
        row = await catalog.volume(record.id)
        assert row is None or row.state is VolumeState.DELETING  # gone for the CO at once
        assert await volumes.get(record.id) is None
        await volumes.delete(record.id)  # the CO's retry while the storage is being freed
        await volumes.freed()
        assert await catalog.volume(record.id) is None and not record.image.exists()
        again = await volumes.create("pvc-gone", 64 << 20, 0, VolumeParameters(), [])  # the name is free again
        assert again.id != record.id
        await volumes.close()
