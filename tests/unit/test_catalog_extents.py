"""The catalog's `extents` table: reached by migration from older catalogs, taken and grown atomically."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path

from csi_qsd.catalog import SCHEMA_VERSION, Catalog, ExtentChoice, ExtentRecord, ExtentState
from csi_qsd.catalog.schema import MIGRATIONS
from csi_qsd.pools import regions
from csi_qsd.pools.regions import Layout, Region
from tests.fakes.sample_records import volume

V1_SCHEMA = Path(__file__).parent.parent / "data" / "catalog_v1.sql"
MIB = 1 << 20


async def test_an_old_catalog_gains_the_extents_table(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(V1_SCHEMA.read_text())
    db.execute("PRAGMA user_version=1")
    db.close()
    assert any("extents" in s for statements in MIGRATIONS.values() for s in statements)
    async with Catalog(path) as catalog:
        assert await catalog.extents("fast") == []
        taken = await catalog.take_extent("fast", "vol-1", lambda rows: ExtentChoice(MIB, 4 * MIB))
        assert taken == ExtentRecord("fast", MIB, 4 * MIB, "vol-1", ExtentState.USED)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()


async def test_concurrent_takes_never_overlap(tmp_path: Path) -> None:
    async with Catalog(tmp_path / "catalog.db") as catalog:
        def first_free(rows: list[ExtentRecord]) -> ExtentChoice:
            end = max((r.start + r.length for r in rows), default=MIB)
            return ExtentChoice(end, MIB)

        results = await asyncio.gather(*(catalog.take_extent("p", f"vol-{i}", first_free) for i in range(20)))
        starts = [r.start for r in results if r is not None]
        assert len(set(starts)) == 20
        again = await catalog.take_extent("p", "vol-3", first_free)  # a retry gets what it holds
        assert again is not None and again.start == results[3].start if results[3] else False
        await catalog.set_extents_scrubbing("p", "vol-3")
        rows = {r.volume_id: r for r in await catalog.extents("p")}
        assert rows["vol-3"].state is ExtentState.SCRUBBING
        await catalog.delete_extent("p", rows["vol-3"].start)
        assert "vol-3" not in {r.volume_id for r in await catalog.extents("p")}


async def test_growth_and_takes_racing_never_overlap(tmp_path: Path) -> None:
    """A grow and creates for the same free space at once: each is checked against the rows it commits with."""
    layout = Layout(16 * MIB, MIB)

    def taken(rows: list[ExtentRecord]) -> list[Region]:
        return [Region(r.start, r.length) for r in rows]

    def best_fit(rows: list[ExtentRecord]) -> ExtentChoice | None:
        picked = regions.choose(layout, taken(rows), 2 * MIB)
        return ExtentChoice(picked.start, picked.length) if picked is not None else None

    async with Catalog(tmp_path / "catalog.db") as catalog:
        first = await catalog.take_extent("p", "vol-a", best_fit)
        assert first is not None
        own = Region(first.start, first.length)

        def fits(rows: list[ExtentRecord]) -> bool:
            return regions.grows_in_place(layout, taken(rows), own, 8 * MIB)

        results = await asyncio.gather(
            catalog.set_extent_length("p", first.start, 8 * MIB, fits),
            *(catalog.take_extent("p", f"vol-{i}", best_fit) for i in range(6)),
        )
        rows = sorted(taken(await catalog.extents("p")))
        for left, right in zip(rows, rows[1:]):
            assert left.end <= right.start, f"{left} and {right} overlap"
        grown = next(r for r in await catalog.extents("p") if r.volume_id == "vol-a")
        assert (grown.length == 8 * MIB) == results[0]
        assert all(r.end <= layout.data_end for r in rows)


async def test_a_move_keeps_both_homes_until_its_commit_and_never_hands_either_out(tmp_path: Path) -> None:
    """MOVING and RETIRING extents are taken; the commit swaps them with the volume's generation in one step."""
    layout = Layout(16 * MIB, MIB)

    def best_fit(size: int) -> Callable[[list[ExtentRecord]], ExtentChoice | None]:
        def choose(rows: list[ExtentRecord]) -> ExtentChoice | None:
            picked = regions.choose(layout, [Region(r.start, r.length) for r in rows], size)
            return ExtentChoice(picked.start, picked.length) if picked is not None else None
        return choose

    async with Catalog(tmp_path / "catalog.db") as catalog:
        record = volume(1)
        await catalog.add_volume(record)
        await catalog.take_extent("p", record.id, best_fit(2 * MIB))
        assert not await catalog.set_move_committed("p", record.id, 1)  # nothing to commit yet
        moving = await catalog.take_move_extent("p", record.id, best_fit(4 * MIB))
        assert moving == ExtentRecord("p", 3 * MIB, 4 * MIB, record.id, ExtentState.MOVING)
        assert await catalog.take_move_extent("p", record.id, best_fit(8 * MIB)) == moving  # a retry: the same
        other = await catalog.take_extent("p", "vol-2", best_fit(4 * MIB))
        assert other is not None and other.start == 7 * MIB  # neither home is free space

        assert await catalog.set_move_committed("p", record.id, 1)
        states = {r.start: r.state for r in await catalog.extents("p") if r.volume_id == record.id}
        assert states == {MIB: ExtentState.RETIRING, 3 * MIB: ExtentState.USED}
        moved = await catalog.volume(record.id)
        assert moved is not None and moved.generation == 1
        assert await catalog.take_extent("p", record.id, best_fit(MIB)) == ExtentRecord(
            "p", 3 * MIB, 4 * MIB, record.id, ExtentState.USED)  # the volume's own extent is the new one

        await catalog.set_extents_scrubbing("p", record.id, ExtentState.RETIRING)
        states = {r.start: r.state for r in await catalog.extents("p") if r.volume_id == record.id}
        assert states == {MIB: ExtentState.SCRUBBING, 3 * MIB: ExtentState.USED}
        await catalog.delete_extent("p", MIB)
        assert [r.start for r in await catalog.extents("p")] == [3 * MIB, 7 * MIB]

        undone = await catalog.take_move_extent("p", record.id, best_fit(5 * MIB))
        assert undone is not None and undone.state is ExtentState.MOVING
        await catalog.set_extents_scrubbing("p", record.id, ExtentState.MOVING)  # an undone move
        rows = {r.start: r for r in await catalog.extents("p")}
        assert rows[undone.start].state is ExtentState.SCRUBBING and rows[3 * MIB].state is ExtentState.USED
