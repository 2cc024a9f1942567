"""The catalog's tables: the schema this release creates, and the steps that bring an older catalog to it.

A new catalog is created at SCHEMA_VERSION in one script. An older one (its
version in `PRAGMA user_version`) is brought forward one schema at a time:
each step's statements and its version bump commit in one transaction, so a
failure or crash leaves the catalog at the last schema it reached and the
next open goes on from there. A catalog newer than this release is refused.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from csi_qsd.errors import StartupError

SCHEMA_VERSION = 8
# The whole schema as this release creates it; older catalogs reach it through MIGRATIONS.
SCHEMA = """
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
    image_pending INTEGER NOT NULL DEFAULT 0,
    key_version TEXT NOT NULL DEFAULT ''
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
MIGRATIONS: dict[int, tuple[str, ...]] = {
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
    8: (
        # Key rotation: the version (the Secret's 'keyVersion') of the key an encrypted volume's images open
        # with; volumes of earlier releases were made with an unversioned key ('').
        "ALTER TABLE volumes ADD COLUMN key_version TEXT NOT NULL DEFAULT ''",
    ),
}


def prepare(db: sqlite3.Connection, path: Path) -> None:
    """Bring the database `db` (the catalog at `path`) to SCHEMA_VERSION: create it, or migrate it step by step.

    Raises StartupError for a catalog of a newer schema, sqlite3.Error when a
    step fails (that step is rolled back; the steps before it stay).
    """
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StartupError(f"catalog {path} has schema {version}, newer than this driver's {SCHEMA_VERSION}")
    if version == 0:
        db.executescript(SCHEMA)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    for target in range(version + 1, SCHEMA_VERSION + 1) if version else ():
        _migrate(db, target)


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """The block's statements in one transaction (taking the write lock at once): committed, or rolled back if it
    raises."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _migrate(db: sqlite3.Connection, target: int) -> None:
    """Bring the catalog from schema `target`-1 to `target`, atomically: all of it or none."""
    with transaction(db):
        for statement in MIGRATIONS[target]:
            db.execute(statement)
        db.execute(f"PRAGMA user_version={target}")
