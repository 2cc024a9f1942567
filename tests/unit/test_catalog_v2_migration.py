"""A catalog of schema 2 (before I/O limits) migrates to the current schema and keeps every row.

The old catalog is made from its own DDL (tests/data/catalog_v2.sql) with
positional inserts, as that release wrote it; after opening, its volumes have
no limits, and limits can be stored and read back.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from pathlib import Path

import pytest

from csi_qsd.catalog import SCHEMA_VERSION, Catalog
from csi_qsd.catalog.schema import MIGRATIONS
from csi_qsd.params import QoS, VolumeParameters

V2_SCHEMA = Path(__file__).parent.parent / "data" / "catalog_v2.sql"
VOLUME_ID = "vol-" + "ab" * 12


def write_v2_catalog(path: Path) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(V2_SCHEMA.read_text())
    db.execute("PRAGMA user_version=2")
    db.execute("INSERT INTO volumes VALUES (?,?,?,?,?,?,?,?,?,?,?)",
               (VOLUME_ID, "pvc-old", 1 << 30, VolumeParameters().to_json(), f"/pool/{VOLUME_ID}.qcow2", "ready",
                time.time(), "", 2, "", "default"))
    db.execute("INSERT INTO stages VALUES (?,?,?,?,?,?,?,?)",
               (VOLUME_ID, "/kubelet/staging/x", "mount", "ext4", "[]", "", "staged", "/dev/loop7"))
    db.close()


async def test_schema_2_catalog_migrates_and_keeps_its_rows(tmp_path: Path) -> None:
    assert SCHEMA_VERSION >= 3 and 3 in MIGRATIONS
    path = tmp_path / "catalog.db"
    write_v2_catalog(path)
    async with Catalog(path) as catalog:
        volume = await catalog.volume(VOLUME_ID)
        assert volume is not None
        assert (volume.name, volume.capacity, volume.generation, volume.pool) == ("pvc-old", 1 << 30, 2, "default")
        assert volume.qos == QoS()
        stage = await catalog.stage(VOLUME_ID)
        assert stage is not None and stage.loop_device == "/dev/loop7"
        limited = dataclasses.replace(volume, qos=QoS(iops_total=200, bps_read=1 << 20))
        await catalog.set_volume(limited)
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        db.close()
    async with Catalog(path) as catalog:  # reopened: no second migration, the limits are there
        assert await catalog.volume(VOLUME_ID) == limited


async def test_a_failed_migration_leaves_schema_2_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "catalog.db"
    write_v2_catalog(path)
    monkeypatch.setitem(MIGRATIONS, 3, (*MIGRATIONS[3], "ALTER TABLE nowhere ADD COLUMN x TEXT"))
    with pytest.raises(sqlite3.OperationalError):
        await Catalog(path).open()
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        columns = {row[1] for row in db.execute("PRAGMA table_info(volumes)")}
        assert "qos" not in columns
    finally:
        db.close()


async def test_a_migrated_volume_has_no_key_version_and_keeps_the_one_set(tmp_path: Path) -> None:
    """Schema 8: the version of an encrypted volume's key; rows from before read as '' (an unversioned key)."""
    path = tmp_path / "catalog.db"
    write_v2_catalog(path)
    async with Catalog(path) as catalog:
        volume = await catalog.volume(VOLUME_ID)
        assert volume is not None and volume.key_version == ""
        await catalog.set_volume(dataclasses.replace(volume, key_version="2026-11"))
    async with Catalog(path) as catalog:
        volume = await catalog.volume(VOLUME_ID)
        assert volume is not None and volume.key_version == "2026-11"
