"""The catalog's `extents` table: reached by migration from older catalogs, taken and grown atomically."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from csi_qsd.catalog import SCHEMA_VERSION, Catalog, ExtentRecord, ExtentState, _MIGRATIONS
from csi_qsd.pools import extents
from csi_qsd.pools.extents import Extent, Layout

V1_SCHEMA = Path(__file__).parent.parent / "data" / "catalog_v1.sql"
MIB = 1 << 20


async def test_an_old_catalog_gains_the_extents_table(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(V1_SCHEMA.read_text())
    db.execute("PRAGMA user_version=1")
    db.close()
    assert any("extents" in s for statements in _MIGRATIONS.values() for s in statements)
    async with Catalog(path) as catalog:
        assert await catalog.extents("fast") == []
        taken = await catalog.take_extent("fast", "vol-1", lambda rows: (MIB, 4 * MIB))
        assert taken == ExtentRecord("fast", MIB, 4 * MIB, "vol-1", ExtentState.USED)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()


async def test_concurrent_takes_never_overlap(tmp_path: Path) -> None:
    async with Catalog(tmp_path / "catalog.db") as catalog:
        def first_free(rows: list[ExtentRecord]) -> tuple[int, int]:
            end = max((r.start + r.length for r in rows), default=MIB)
            return end, MIB

        results = await asyncio.gather(*(catalog.take_extent("p", f"vol-{i}", first_free) for i in range(20)))
        starts = [r.start for r in results if r is not None]
        assert len(set(starts)) == 20
        again = await catalog.take_extent("p", "vol-3", first_free)  # a retry gets what it holds
        assert again is not None and again.start == results[3].start if results[3] else False
        await catalog.release_extents("p", "vol-3")
        rows = {r.volume_id: r for r in await catalog.extents("p")}
        assert rows["vol-3"].state is ExtentState.SCRUBBING
        await catalog.drop_extent("p", rows["vol-3"].start)
        assert "vol-3" not in {r.volume_id for r in await catalog.extents("p")}


async def test_growth_and_takes_racing_never_overlap(tmp_path: Path) -> None:
    """A grow and creates for the same free space at once: each is checked against the rows it commits with."""
    layout = Layout(16 * MIB, MIB)

    def taken(rows: list[ExtentRecord]) -> list[Extent]:
        return [Extent(r.start, r.length) for r in rows]

    def best_fit(rows: list[ExtentRecord]) -> tuple[int, int] | None:
        picked = extents.choose(layout, taken(rows), 2 * MIB)
        return (picked.start, picked.length) if picked is not None else None

    async with Catalog(tmp_path / "catalog.db") as catalog:
        first = await catalog.take_extent("p", "vol-a", best_fit)
        assert first is not None
        own = Extent(first.start, first.length)

        def fits(rows: list[ExtentRecord]) -> bool:
            return extents.grows_in_place(layout, taken(rows), own, 8 * MIB)

        results = await asyncio.gather(
            catalog.resize_extent("p", first.start, 8 * MIB, fits),
            *(catalog.take_extent("p", f"vol-{i}", best_fit) for i in range(6)),
        )
        rows = sorted(taken(await catalog.extents("p")))
        for left, right in zip(rows, rows[1:]):
            assert left.end <= right.start, f"{left} and {right} overlap"
        grown = next(r for r in await catalog.extents("p") if r.volume_id == "vol-a")
        assert (grown.length == 8 * MIB) == results[0]
        assert all(r.end <= layout.data_end for r in rows)
