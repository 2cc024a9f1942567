"""How QSD reads and writes a file pool's images: io_uring where QSD can, else its thread pool.

With the thread pool every request is handed to a worker thread and back;
with io_uring QSD's own loop submits it and reaps it, and a read the page
cache holds completes at once. Measured on QSD 10.0.13 (a qcow2 image in
the page cache, its FUSE export under a direct-I/O loop device, fio 4k
QD32, two runs, alternating): random reads 34.6-37.2k IOPS with the thread
pool against 58.3-60.4k with io_uring, random writes 29.3-34.5k against
32.4-37.0k. io_uring can be missing (a QSD built without it, a kernel or a
seccomp profile that refuses it), so QSD is asked: a throwaway read-only
node opened with it. QSD before 10 keeps the thread pool, as it always had.

io_uring completes a buffered write in QSD's own thread only where the
filesystem can take one without blocking (XFS, btrfs); on ext4 it hands each
write to a worker thread and QSD waits for its wake-up. Pods' random writes
on QSD 10.0.13, same machine and layering (`e2e.bench.scaling --pool-fs`):
60.9k IOPS with the pool on XFS against 37.7k on ext4. The pool's
filesystem is the operator's choice, so the driver only says so at start-up.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from pathlib import Path

from csi_qsd.errors import QSDError
from csi_qsd.qsd.client import QSDClient
from csi_qsd.sys import mounts

log = logging.getLogger(__name__)

IO_URING_FROM = (10, 0, 0)
# Filesystems whose buffered writes io_uring completes without a worker thread (FOP_BUFFER_WASYNC in Linux).
ASYNC_BUFFERED_WRITES = frozenset({"xfs", "btrfs"})
THREADS = "threads"
IO_URING = "io_uring"
NATIVE = "native"
PROBE_NODE = "csi-qsd-aio-probe"


class FileIO(enum.Enum):
    """The operator's setting for image files: QSD's best engine through the page cache, or a forced one."""

    AUTO = "auto"  # io_uring where QSD has it, else the thread pool; the page cache
    THREADS = "threads"  # the thread pool; the page cache
    DIRECT = "direct"  # the engine `auto` picks, with O_DIRECT (no page cache)
    NATIVE = "native"  # Linux AIO, O_DIRECT (QEMU's aio=native needs it)


@dataclasses.dataclass(frozen=True)
class Engine:
    """What a file protocol node is opened with."""

    aio: str
    direct: bool


async def resolve(setting: FileIO, client: QSDClient, probe_file: Path) -> Engine:
    """The engine `setting` asks for on this QSD (only `auto` and `direct` ask QSD about io_uring)."""
    if setting is FileIO.THREADS:
        return Engine(THREADS, direct=False)
    if setting is FileIO.NATIVE:
        return Engine(NATIVE, direct=True)
    return Engine(await choose(client, probe_file), direct=setting is FileIO.DIRECT)


def note_filesystem(pool_id: str, directory: Path, engine: Engine) -> None:
    """Log the pool's filesystem, and where io_uring's writes to it will take a worker thread."""
    fs_type = mounts.filesystem_of(directory)
    if engine.aio == IO_URING and not engine.direct and fs_type not in ASYNC_BUFFERED_WRITES:
        log.warning("event=pool_filesystem pool=%s fs=%s buffered_writes=worker_thread "
                    "hint=%r", pool_id, fs_type or "unknown",
                    "io_uring completes buffered writes in QSD's own thread on xfs or btrfs only: "
                    "a file pool there takes pods' random writes about 1.6x faster")
    else:
        log.info("event=pool_filesystem pool=%s fs=%s aio=%s direct=%s", pool_id, fs_type or "unknown",
                 engine.aio, "yes" if engine.direct else "no")


async def choose(client: QSDClient, probe_file: Path) -> str:
    """`io_uring` if this QSD opens `probe_file` (a regular file, created if missing) with it, else `threads`."""
    if await client.version() < IO_URING_FROM:
        return THREADS
    probe_file.touch(mode=0o600, exist_ok=True)
    if PROBE_NODE in await client.node_names():  # a probe a crash cut off
        await client.blockdev_del(PROBE_NODE)
    try:
        await client.blockdev_add({"driver": "file", "node-name": PROBE_NODE, "filename": str(probe_file),
                                   "aio": IO_URING, "read-only": True})
    except QSDError as exc:
        log.warning("event=file_aio engine=%s reason=%r", THREADS, str(exc))
        return THREADS
    await client.blockdev_del(PROBE_NODE)
    log.info("event=file_aio engine=%s", IO_URING)
    return IO_URING
