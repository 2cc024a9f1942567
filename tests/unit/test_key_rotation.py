"""Key rotation's order and choices, over a pool of keyslots in memory: every layer, shared layers kept, retries."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd.catalog import Catalog, SnapshotRecord, SnapshotState, VolumeRecord
from csi_qsd.controller.key_rotation import KeyRotation
from csi_qsd.errors import FailedPrecondition, HostCommandError, InvalidArgument, PermissionDenied
from csi_qsd.params import VolumeParameters
from csi_qsd.qsd.shards import QSDShards
from csi_qsd.sys.volume_keys import KeyStore, VolumeKey
from tests.fakes.pools import FakePool
from tests.fakes.sample_records import volume

OLD, NEW = VolumeKey("old"), VolumeKey("new")
ROTATED = {"key": "new", "keyVersion": "2", "previousKey": "old"}


class SlotPool(FakePool):
    """Each image's keyslots as a list of keys; every amend is recorded, and one may be made to fail."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.slots: dict[Path, list[VolumeKey]] = {}
        self.amends: list[tuple[str, str]] = []
        self.fail_on: tuple[str, str] | None = None

    async def opens_with(self, image: Path, key: VolumeKey) -> bool:
        return key in self.slots[image]

    async def add_key(self, image: Path, opened_by: VolumeKey, key: VolumeKey, *, in_use: bool) -> None:
        assert opened_by in self.slots[image]
        self._amend("add", image)
        self.slots[image].append(key)

    async def remove_key(self, image: Path, opened_by: VolumeKey, key: VolumeKey, *, in_use: bool) -> None:
        assert opened_by in self.slots[image] and opened_by != key, "QEMU refuses to erase the last keyslot"
        self._amend("remove", image)
        self.slots[image] = [k for k in self.slots[image] if k != key]

    def _amend(self, what: str, image: Path) -> None:
        if (what, image.name) == self.fail_on:
            self.fail_on = None
            raise HostCommandError(f"qemu-img amend of {image.name} killed")
        self.amends.append((what, image.name))


@pytest.fixture
async def catalog(tmp_path: Path) -> AsyncIterator[Catalog]:
    async with Catalog(tmp_path / "catalog.db") as opened:
        yield opened


async def _chain(catalog: Catalog, pool: SlotPool) -> tuple[VolumeRecord, VolumeRecord, Path]:
    """Volume 1 (top over its snapshot's image, version 1) and volume 2, a restore of that snapshot (version 1)."""
    params = VolumeParameters(encrypted=True)
    snap = pool.directory / "vol-1.qcow2"
    first = volume(1, params=params, image=pool.directory / "vol-1.1.qcow2", backing=str(snap), key_version="1",
                   generation=1)
    restore = volume(2, params=params, image=pool.directory / "vol-2.qcow2", backing=str(snap), key_version="1")
    for record in (first, restore):
        await catalog.add_volume(record)
    await catalog.put_snapshots([SnapshotRecord("snap-1", "snap", first.id, snap, "", 1 << 20, 0.0,
                                                SnapshotState.READY)])
    for image in (snap, first.image, restore.image):
        pool.slots[image] = [OLD]
    return first, restore, snap


def _rotation(catalog: Catalog, pool: SlotPool) -> KeyRotation:
    return KeyRotation(catalog, pool, QSDShards.__new__(QSDShards), KeyStore(None))


async def test_every_layer_gets_the_new_key_and_a_layer_another_volume_reads_keeps_the_old_until_it_rotates(
        tmp_path: Path, catalog: Catalog) -> None:
    pool = SlotPool(tmp_path)
    first, restore, snap = await _chain(catalog, pool)
    rotation = _rotation(catalog, pool)
    done = await rotation.rotate(first, "2", ROTATED)
    assert done.key_version == "2" and (await catalog.volume(first.id)) == done
    assert pool.slots[first.image] == [NEW] and pool.slots[snap] == [OLD, NEW]
    assert pool.amends == [("add", first.image.name), ("add", snap.name), ("remove", first.image.name)]
    assert await rotation.rotate(done, "2", ROTATED) == done  # again: done, nothing amended
    assert len(pool.amends) == 3
    await rotation.rotate(restore, "2", ROTATED)  # the last reader of the snapshot's image: the old key goes
    assert pool.slots[snap] == [NEW] and pool.slots[restore.image] == [NEW]


async def test_a_rotation_cut_short_is_finished_by_the_retry(tmp_path: Path, catalog: Catalog) -> None:
    pool = SlotPool(tmp_path)
    first, _restore, snap = await _chain(catalog, pool)
    await catalog.set_volume(dataclasses.replace(_restore, key_version="2"))
    rotation = _rotation(catalog, pool)
    pool.fail_on = ("remove", snap.name)  # every layer has both keys: either opens the volume
    with pytest.raises(HostCommandError):
        await rotation.rotate(first, "2", ROTATED)
    assert (await catalog.volume(first.id)).key_version == "1"  # type: ignore[union-attr]
    assert pool.slots[first.image] == [NEW] and pool.slots[snap] == [OLD, NEW]
    await rotation.rotate(first, "2", ROTATED)
    assert pool.slots[snap] == [NEW] and pool.slots[first.image] == [NEW]
    assert (await catalog.volume(first.id)).key_version == "2"  # type: ignore[union-attr]


async def test_refusals_change_nothing(tmp_path: Path, catalog: Catalog) -> None:
    pool = SlotPool(tmp_path)
    first, _restore, _snap = await _chain(catalog, pool)
    rotation = _rotation(catalog, pool)
    before = {image: list(keys) for image, keys in pool.slots.items()}
    with pytest.raises(FailedPrecondition, match="'3'.*keyVersion.*'2'"):
        await rotation.rotate(first, "3", ROTATED)
    with pytest.raises(InvalidArgument, match="previousKey"):
        await rotation.rotate(first, "2", {"key": "new", "keyVersion": "2"})
    with pytest.raises(PermissionDenied, match="previousKey"):
        await rotation.rotate(first, "2", {**ROTATED, "previousKey": "wrong"})
    with pytest.raises(InvalidArgument, match="not encrypted"):
        await rotation.rotate(dataclasses.replace(first, params=VolumeParameters()), "2", ROTATED)
    assert pool.slots == before and not pool.amends
