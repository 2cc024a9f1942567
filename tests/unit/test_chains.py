"""Backing chains: hidden snapshots are reclaimed with their last dependant, layer after layer."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd.catalog import Catalog, SnapshotRecord, SnapshotState, VolumeRecord, VolumeState
from csi_qsd.controller import chains
from csi_qsd.params import VolumeParameters
from csi_qsd.pools.files import FilePool

MIB = 1 << 20


@pytest.fixture
async def catalog(tmp_path: Path) -> AsyncIterator[Catalog]:
    async with Catalog(tmp_path / "catalog.db") as value:
        yield value


def image(pool: Path, name: str) -> Path:
    path = pool / name
    path.write_bytes(b"qcow2")
    return path


def snap(n: int, img: Path, backing: str, *, hidden: bool) -> SnapshotRecord:
    return SnapshotRecord(
        id=f"snap-{n:024x}", name=f"s{n}", source_volume_id=f"vol-{1:024x}", image=img, backing=backing,
        size=MIB, created_at=1.0, state=SnapshotState.READY, hidden=hidden,
    )


def vol(n: int, img: Path, backing: str) -> VolumeRecord:
    return VolumeRecord(
        id=f"vol-{n:024x}", name=f"v{n}", capacity=MIB, params=VolumeParameters(), image=img,
        state=VolumeState.READY, created_at=1.0, backing=backing,
    )


async def test_reclaim_walks_down_hidden_layers_and_stops_at_a_visible_one(catalog: Catalog, tmp_path: Path) -> None:
    pool = FilePool(tmp_path)
    base, mid, top = image(tmp_path, "a.qcow2"), image(tmp_path, "b.qcow2"), image(tmp_path, "c.qcow2")
    visible = snap(1, base, "", hidden=False)
    hidden_mid = snap(2, mid, str(base), hidden=True)
    await catalog.put_snapshots([visible, hidden_mid])
    volume = vol(3, top, str(mid))
    await catalog.add_volume(volume)
    assert await chains.depth(catalog, volume) == 3
    assert await catalog.dependants(str(mid)) == 1

    await chains.reclaim(catalog, pool, str(mid))  # still needed by the volume
    assert mid.exists()

    await catalog.delete_volume(volume.id)
    top.unlink()
    await chains.reclaim(catalog, pool, str(mid))
    assert not mid.exists() and await catalog.snapshot(hidden_mid.id) is None
    assert base.exists() and await catalog.snapshot(visible.id) is not None, "a visible snapshot is never reclaimed"


async def test_reclaim_cascades_through_several_hidden_layers(catalog: Catalog, tmp_path: Path) -> None:
    pool = FilePool(tmp_path)
    images = [image(tmp_path, f"l{i}.qcow2") for i in range(4)]
    layers = [snap(i + 1, images[i], str(images[i - 1]) if i else "", hidden=True) for i in range(4)]
    await catalog.put_snapshots(layers)
    await chains.reclaim(catalog, pool, str(images[-1]))
    assert [p.exists() for p in images] == [False] * 4
    assert await catalog.snapshots() == []


async def test_depth_counts_the_whole_chain(catalog: Catalog, tmp_path: Path) -> None:
    images = [tmp_path / f"d{i}.qcow2" for i in range(3)]
    await catalog.put_snapshots([snap(1, images[0], "", hidden=False), snap(2, images[1], str(images[0]), hidden=True)])
    assert await chains.depth(catalog, vol(9, images[2], str(images[1]))) == 3
    assert await chains.depth(catalog, dataclasses.replace(vol(9, images[2], ""))) == 1
