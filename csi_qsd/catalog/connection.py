"""The catalog's one SQLite connection: opened and laid out, one transaction per write, and when I/O leaves the loop.

WAL with synchronous=FULL, so a committed row survives a crash. An intent
may be committed without its own fsync (`durable=False`, 0.3-0.8 ms saved
per call): it survives the driver's crash (the WAL is in the page cache),
the final commit's fsync makes it durable with itself, and what a power
loss can leave without it is an image no row names that holds no data of
its own, which the reconcile removes.

Not all I/O runs in a worker thread. Writes do, and so do opening and
closing; a read runs on the event loop when the connection is free (tens of
microseconds, less than the hop), in a worker thread when a transaction
holds it. `usable()`, which Probe calls synchronously, always queries on the
event loop, and while a transaction holds the connection it waits there for
it (a commit's fsync included). The rows themselves are `Catalog`'s
(`csi_qsd.catalog.store`), which runs every read and write through here.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self, TypeVar

from csi_qsd.catalog import schema
from csi_qsd.errors import Unavailable

T = TypeVar("T")

_CLOSED = "the catalog is closed: the driver is stopping"
# Commits between two checkpoints of the WAL into the database (SQLite's own default is 1000 pages).
CHECKPOINT_EVERY = 200
# A durable commit that took longer than this (seconds) sends the next ones off the event loop (`Catalog._run`).
LOOP_COMMIT_MAX = 0.002
# The WAL's length laid out when the catalog opens (`_lay_out_wal`): more than the frames of CHECKPOINT_EVERY
# commits (3-4 pages of 4 KiB each), so that commits overwrite the file and never lengthen it.
WAL_ROOM = 4 << 20


class CatalogConnection:
    """The connection under `Catalog`: open, close, `usable`, and `_run` (a write) and `_read` for its verbs."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._commits = 0  # since the last checkpoint
        self._fast_disk = False  # the last durable commit took under LOOP_COMMIT_MAX (`_run`)

    async def open(self) -> None:
        """Open the database (made, with its directory, if missing) and bring it to `schema.SCHEMA_VERSION`.

        Raises StartupError for a catalog of a newer schema, sqlite3.Error
        when a migration step fails (`schema.prepare`); the database is
        closed again either way.
        """
        await asyncio.to_thread(self._open)

    async def close(self) -> None:
        """Close the database once any transaction under way has committed; closing twice is no error."""
        await asyncio.to_thread(self._close)

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def usable(self) -> bool:
        """True while the database answers a trivial query (used by Probe).

        Runs on the caller's thread, the event loop: it waits there for a
        transaction that holds the connection.
        """
        try:
            self._call(lambda db: db.execute("SELECT 1").fetchone())
            return True
        except (sqlite3.Error, Unavailable):
            return False

    def _open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA wal_autocheckpoint=0")  # durable commits checkpoint, off the event loop (`_run`)
            db.execute("PRAGMA foreign_keys=ON")
            schema.prepare(db, self._path)
            _lay_out_wal(db, self._path.with_name(self._path.name + "-wal"))
        except BaseException:
            db.close()
            raise
        self._db = db

    def _close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            if self._db is None:
                raise Unavailable(_CLOSED)
            return fn(self._db)

    async def _run(self, fn: Callable[[sqlite3.Connection], T], *, durable: bool = True) -> T:
        """`fn` in one transaction, and what it returns; `durable=False` commits an intent without waiting for its
        fsync.

        An intent writes the WAL without syncing it and never checkpoints, so
        it cannot wait for the disk: it runs on the event loop whenever the
        connection is free, saving the hop to a worker thread (0.15-0.35 ms
        measured). A durable commit runs there too while the disk answers
        fast (the last one took under LOOP_COMMIT_MAX: an fsync of a few WAL
        pages takes 0.1-0.3 ms on an SSD, less than the hop); one that took
        longer sends the next ones to a worker thread, until one there is
        fast again, so a slow or stalled disk holds a worker, not the loop.
        Checkpoints always run in a worker thread.
        """
        def transaction(db: sqlite3.Connection) -> T:
            started = time.monotonic()
            if not durable:
                db.execute("PRAGMA synchronous=NORMAL")
            try:
                with schema.transaction(db):
                    result = fn(db)
            finally:
                if not durable:
                    db.execute("PRAGMA synchronous=FULL")
            self._commits += 1
            if durable:
                self._fast_disk = time.monotonic() - started < LOOP_COMMIT_MAX
                if self._commits >= CHECKPOINT_EVERY:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                    self._commits = 0
            return result
        on_loop = not durable or (self._fast_disk and self._commits + 1 < CHECKPOINT_EVERY)
        return await self._dispatch(transaction, on_loop=on_loop)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """What `fn` reads; on the event loop when the connection is free, else in a worker thread.

        A read by key from the WAL's cached pages takes tens of microseconds,
        less than the hop to a worker thread (0.15-0.35 ms measured), and a
        node call makes several. A connection busy with a transaction (whose
        commit may wait for the disk) is never waited for on the loop.
        """
        return await self._dispatch(fn, on_loop=True)

    async def _dispatch(self, fn: Callable[[sqlite3.Connection], T], *, on_loop: bool) -> T:
        """`fn` on the event loop if `on_loop` and the connection is free, else in a worker thread."""
        if on_loop and self._lock.acquire(blocking=False):
            try:
                if self._db is None:
                    raise Unavailable(_CLOSED)
                result = fn(self._db)
            finally:
                self._lock.release()
            await asyncio.sleep(0)  # still a point where other tasks run, as the hop was: no caller starves them
            return result
        return await asyncio.to_thread(self._call, fn)


def _lay_out_wal(db: sqlite3.Connection, wal: Path) -> None:
    """Lengthen the WAL to WAL_ROOM bytes with frames of a transaction that is rolled back.

    A commit's fdatasync of a WAL that grows must write the file's new
    length too (a journal commit of the filesystem's): 0.2-0.45 ms on these
    machines, against 0.12-0.18 ms for frames written over ones already
    there. SQLite writes the frames of a transaction larger than its page
    cache to the WAL before the commit ("spills" them); rolled back, they
    stay in the file, past the last commit frame, where recovery never reads
    (only frames up to a commit frame count), and the next commits overwrite
    them. SQLite removes the WAL when the catalog closes; after a checkpoint
    it starts again from the file's beginning and keeps its length, so every
    open lays it out once. Nothing is committed here, and a WAL already laid
    out (another process has the catalog open) or one another writer holds
    (busy) is left as it is: only a commit's cost depends on it.
    """
    try:
        if wal.stat().st_size >= WAL_ROOM:
            return
    except FileNotFoundError:
        pass
    cache_size = db.execute("PRAGMA cache_size").fetchone()[0]
    db.execute("PRAGMA cache_size=10")  # a few pages: the blob's spill to the WAL
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("CREATE TABLE wal_room(filler BLOB)")
            db.execute("INSERT INTO wal_room VALUES (zeroblob(?))", (WAL_ROOM,))
        finally:
            db.execute("ROLLBACK")
    except sqlite3.OperationalError:  # another writer holds the database: its commits keep the WAL as it is
        pass
    finally:
        db.execute(f"PRAGMA cache_size={cache_size}")
