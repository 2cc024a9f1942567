-- The catalog schema (user_version 2) of the release before I/O limits, verbatim: catalogs it wrote must still open.
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
    pool        TEXT NOT NULL DEFAULT 'default'
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
    loop_device  TEXT NOT NULL DEFAULT ''
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
