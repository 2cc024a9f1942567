"""`Volumes` (controller/volumes.py) over a real catalog and file pool.

The start-up reconcile of transitional rows, Get and List showing only
ready volumes, CreateVolume's image settled after the answer and
DeleteVolume's storage freed after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd import validate
from csi_qsd.catalog import Catalog, VolumeState
from csi_qsd.controller import volumes as volumes_module
from csi_qsd.controller.volumes import FREE_DELAY, SETTLE_DELAY, Volumes
from csi_qsd.params import ImageFormat, VolumeParameters
from csi_qsd.pools.base import NewImage
from csi_qsd.pools.files import FilePool
from csi_qsd.sys.locks import KeyedLocks
from tests.fakes.sample_records import volume

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


@contextlib.asynccontextmanager
async def file_volumes(tmp_path: Path, pool: FilePool) -> AsyncIterator[tuple[Catalog, Volumes]]:
    """A catalog and `Volumes` over `pool` (prepared here), closed after."""
    pool.prepare()
    async with Catalog(tmp_path / "catalog.db") as catalog:
        volumes = Volumes(catalog, pool, KeyedLocks("volume"))
        yield catalog, volumes
        await volumes.close()


async def test_a_burst_of_deletes_frees_its_storage_together_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = FilePool(tmp_path / "pool")
    batches: list[list[Path]] = []
    delete_all = pool.delete_all

    async def counted(images: list[Path]) -> None:
        batches.append(list(images))
        await delete_all(images)

    pool.delete_all = counted  # type: ignore[method-assign]
    async with file_volumes(tmp_path, pool) as (catalog, volumes):
        created = [await volumes.create(f"pvc-{n}", 64 << 20, 0, VolumeParameters(), []) for n in range(4)]
        for record in created:
            await volumes.settled(record)
        for record in created:
            await volumes.delete(record.id)
        assert batches == []  # nothing freed beside the calls of the burst
        assert all(r.image.exists() for r in created)
        for _ in range(200):
            if not any(r.id in volumes._deleting for r in created):
                break
            await asyncio.sleep(FREE_DELAY / 4)
        assert batches == [[r.image for r in created]]  # one batch: one fsync of the pool directory
        assert [await catalog.volume(r.id) for r in created] == [None] * 4
        assert list(pool.images()) == []

        # Someone waiting for room does not wait out the delay.
        monkeypatch.setattr(volumes_module, "FREE_DELAY", 3600.0)
        record = await volumes.create("pvc-next", 64 << 20, 0, VolumeParameters(), [])
        await volumes.settled(record)
        await volumes.delete(record.id)
        await asyncio.wait_for(volumes.freed(), 30)
        assert not record.image.exists() and await catalog.volume(record.id) is None


async def test_a_batch_whose_pool_fails_frees_what_it_can_and_leaves_the_rest_marked(tmp_path: Path) -> None:
    pool = FilePool(tmp_path / "pool")
    async with file_volumes(tmp_path, pool) as (catalog, volumes):
        good, bad = [await volumes.create(f"pvc-{n}", 64 << 20, 0, VolumeParameters(), []) for n in range(2)]
        for record in (good, bad):
            await volumes.settled(record)
        delete = pool.delete

        async def refusing(image: Path) -> None:
            if image == bad.image:
                raise OSError(5, "Input/output error")
            await delete(image)

        async def failing_batch(images: list[Path]) -> None:
            raise OSError(5, "Input/output error")

        pool.delete = refusing  # type: ignore[method-assign]
        pool.delete_all = failing_batch  # type: ignore[method-assign]
        await volumes.delete(good.id)
        await volumes.delete(bad.id)
        await volumes.freed()
        assert await catalog.volume(good.id) is None and not good.image.exists()
        left = await catalog.volume(bad.id)
        assert left is not None and left.state is VolumeState.DELETING and bad.image.exists()  # the reconcile's
        pool.delete = delete  # type: ignore[method-assign]
        await Volumes(catalog, pool, KeyedLocks("volume")).reconcile()
        assert await catalog.volume(bad.id) is None and not bad.image.exists()
