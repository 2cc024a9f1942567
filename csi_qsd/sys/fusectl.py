"""How many requests the kernel lets a FUSE export have in flight (fusectl's max_background).

A direct-I/O loop device sends all its I/O to QSD's FUSE file as
asynchronous ("background") FUSE requests, and the kernel allows a FUSE
connection 12 of those by default: a pod's queue depth of 32 reached QSD as
12. QSD 10.0 serves several FUSE requests at once (nested polling), so the
limit cost a third of the random-read speed: measured on QSD 10.0.13, 4k
random reads QD32 through a partition's loop device, 22-29k IOPS at 12
against 34-50k at 64 to 256 (the same QSD, alternating). The driver raises
the limit to the loop device's own queue depth on every export it adds.

fusectl (`/sys/fs/fuse/connections`) is where the kernel exposes the limit;
the driver mounts it when the host has not. Without it the export still
works, at the kernel's default, and a warning says so.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from csi_qsd.sys import mounts
from csi_qsd.sys.run import run

log = logging.getLogger(__name__)

CONNECTIONS = Path("/sys/fs/fuse/connections")
# A loop device queues up to 128 requests (its nr_requests); more could never arrive.
MAX_BACKGROUND = 128


async def raise_background(export_file: Path, limit: int = MAX_BACKGROUND) -> bool:
    """Let the FUSE connection serving `export_file` have `limit` background requests; False if it cannot."""
    if not mounts.is_mounted(CONNECTIONS):
        code, _ = await run("mount", "-t", "fusectl", "fusectl", str(CONNECTIONS), check=False)
        if code != 0:
            log.warning("event=fusectl_unavailable path=%s effect=fuse_max_background_kept", CONNECTIONS)
            return False
    try:
        minor = os.minor(os.stat(export_file).st_dev)
        # fusectl's files are kernel attributes held in memory: reading and writing them never waits for a disk.
        _write_limits(CONNECTIONS / str(minor), limit)
    except OSError as exc:
        log.warning("event=fuse_max_background_failed export=%s error=%r", export_file, exc.strerror)
        return False
    return True


def _write_limits(connection: Path, limit: int) -> None:
    # QEMU 11's FUSE export sets a far larger limit itself (65535): never lower one.
    if int((connection / "max_background").read_text()) >= limit:
        return
    # The kernel throttles writers once the congestion threshold is reached: keep it below the limit, as its default.
    (connection / "max_background").write_text(str(limit))
    (connection / "congestion_threshold").write_text(str(limit * 3 // 4))
