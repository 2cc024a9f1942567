"""What a QSD release can safely do, each rule with the releases it was measured on.

Every answer is decided from the version QSD reports over QMP, never from
hope, and each constant below names the first release that behaves:

* Which loop device a container volume gets over its FUSE export
  (`direct_io`, `LoopIO`). A direct-I/O loop device passes the kernel's
  parallel requests straight to QSD's FUSE export: 4.8x the random-read
  speed of a buffered one. But QSD's FUSE export before QEMU 10.0.8 corrupts
  parallel writes (nested polling overwrote the request buffer: 14-16 bad
  blocks in 16 parallel verified writers on 7.2.22 and 10.0.2, none on
  10.0.13), so older daemons get the buffered loop device, which serialises
  I/O and stays intact on every version.
* Whether a guest learns of a live resize under its vhost-user-blk export
  (`live_resize_reaches_guest`).
* Where vhost-user-blk exports run: in an iothread, and spread over several,
  or in QSD's main loop (`vhost_export_in_iothread`, `vhost_exports_spread`).
* Which iothreads serve a FUSE export on QEMU 11 and later
  (`fuse_iothreads`, `FuseThreads`).
* When a flatten carries the merged layers' changed-block records
  (`bitmaps_carried_before_stream`).
"""

from __future__ import annotations

import enum

# First release whose FUSE export copies a write's buffer before polling (10.0 stable, and every later series).
FUSE_PARALLEL_WRITES_SAFE = (10, 0, 8)


class LoopIO(enum.Enum):
    """The operator's setting: decide by QSD's version, or force one mode."""

    AUTO = "auto"
    DIRECT = "direct"
    BUFFERED = "buffered"


def fuse_safe_for_parallel_writes(version: tuple[int, int, int]) -> bool:
    return version >= FUSE_PARALLEL_WRITES_SAFE


def direct_io(setting: LoopIO, version: tuple[int, int, int]) -> bool:
    """True if new loop devices over FUSE exports should use direct I/O."""
    if setting is LoopIO.AUTO:
        return fuse_safe_for_parallel_writes(version)
    return setting is LoopIO.DIRECT


# First release seen to tell a running guest about block_resize under a vhost-user-blk export
# (10.0.13: 131072 -> 262144 sectors within 0.25 s, no reconnect); 7.2 never does and stalls the iothread.
VHOST_LIVE_RESIZE = (10, 0, 0)


def live_resize_reaches_guest(version: tuple[int, int, int]) -> bool:
    return version >= VHOST_LIVE_RESIZE


# From this version on, a vhost-user-blk export in an iothread aborts QSD
# (vhost_user_server_attach_aio_context: "Assertion `!co_ctx || co_ctx == ctx'
# failed") when a client connects or leaves while any graph change drains the
# iothread: measured on 10.0.13 within 1-43 connections with blockdev-add/del
# of other nodes running; 0 of 100 in the main loop, 0 of 100 on 7.2.
VHOST_IOTHREAD_ABORTS = (10, 0, 0)
# 11.1.3 (Debian trixie-backports) no longer aborts: 0 aborts in every run of the churn test with the
# exports in iothreads (500+ connections each). But it breaks another way: a later blockdev-add or
# block-export-add fails inside QSD with EBADF ("The device is not writable: Bad file descriptor",
# "Failed to bind socket ...: Bad file descriptor", "Could not refresh total sector count: Bad file
# descriptor"), so QSD closed a descriptor it did not own: exports spread over two iothreads, 8 of 26 runs;
# all in one iothread, 3 of 30; in the main loop 0 of 30 (10.0.13's main loop: 0 in every run). No release
# is known to be safe: every vhost-user-blk export of QSD >= 10 stays in the main loop (e2e.bench.vhost_churn
# measures the three placements).
VHOST_IOTHREAD_SAFE: tuple[int, int, int] | None = None


def vhost_export_in_iothread(version: tuple[int, int, int]) -> bool:
    """Whether vhost-user-blk exports may run in an iothread; elsewhere they run in QSD's main loop."""
    if version < VHOST_IOTHREAD_ABORTS:
        return True
    return VHOST_IOTHREAD_SAFE is not None and version >= VHOST_IOTHREAD_SAFE


# Whether exports in iothreads may go to different threads of the pool: not on any release measured
# (the EBADF above came most often with two threads).
VHOST_SPREAD_SAFE: tuple[int, int, int] | None = None


def vhost_exports_spread(version: tuple[int, int, int]) -> bool:
    """Whether vhost-user-blk exports may go to different iothreads of the pool (else all to the first)."""
    return VHOST_SPREAD_SAFE is not None and version >= VHOST_SPREAD_SAFE


# QEMU 11 rewrote the FUSE export: requests run in coroutines, one /dev/fuse queue per iothread of
# an `iothread` list, with parallel direct writes. Before it a FUSE export takes no list.
FUSE_IOTHREAD_LIST = (11, 0, 0)
# Below this many cores the list loses: on 2 cores (e2e.bench.scaling, one pod volume at 4k QD32) QSD 11.1.3
# over 2 iothreads gave 16-31k IOPS where its main loop gave more and 10.0.13's main loop 44-52k; its authors
# measured 61k -> 232k randwrite with four threads on a larger machine.
FUSE_IOTHREADS_MIN_CORES = 4


class FuseThreads(enum.Enum):
    """The operator's setting for FUSE exports on QEMU >= 11: by the node's cores, or forced."""

    AUTO = "auto"
    POOL = "pool"  # the pool's iothreads, one /dev/fuse queue each
    MAIN = "main"  # QSD's main loop, as before QEMU 11


def fuse_iothreads(
    version: tuple[int, int, int], pool: list[str], cores: int, setting: FuseThreads = FuseThreads.AUTO,
) -> list[str] | None:
    """The iothreads a new FUSE export is served by, or None for QSD's main loop (the only choice before 11)."""
    if version < FUSE_IOTHREAD_LIST or not pool or setting is FuseThreads.MAIN:
        return None
    if setting is FuseThreads.AUTO and cores < FUSE_IOTHREADS_MIN_CORES:
        return None
    return list(pool)


# From this version on QEMU refuses a persistent dirty bitmap on a read-only node ("Cannot add a persistent
# bitmap to read-only or inactive node"): a flatten carries the merged layers' records into the backing
# image once block-stream has reopened it read-write, before the job finalizes (10.0 took them before).
PERSISTENT_BITMAP_NEEDS_WRITABLE = (11, 0, 0)


def bitmaps_carried_before_stream(version: tuple[int, int, int]) -> bool:
    return version < PERSISTENT_BITMAP_NEEDS_WRITABLE


def describe(direct: bool) -> str:
    return "direct" if direct else "buffered"
