"""QEMU 11's FUSE export over the pool's iothreads: parallel verified writers intact, every thread serving.

QSD 11 takes a list of iothreads for a FUSE export, one /dev/fuse queue each,
with parallel direct writes: a new request path, so the parallel verified
writers of test_integrity run through it (forced with `--fuse-threads pool`:
on fewer than 4 cores the driver keeps the main loop), and each pool thread
must have done work (QEMU 11 names its threads "IO <id>"). QEMU 11 sets the
connection's background limit itself (65535), which the driver must not lower.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from csi_qsd.exports import fuse_loop
from csi_qsd.qsd import features
from csi_qsd.sys import fusectl
from csi_qsd.sys.tools import bundled
from testing import tiers
from testing.harness import Sandbox, in_process_driver, qsd_pid
from testing.helpers.parallel_io import GROUPS, MIB, THREADS, cgroups, loop_dio, published, run_fio

pytestmark = tiers.needs("integration", "" if shutil.which("fio") else "fio")


def iothread_cpu(pid: int) -> dict[str, int]:
    """CPU ticks of each of QSD's named iothreads ("IO iothread0": ticks)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        name = (task / "comm").read_text().strip()
        if name.startswith("IO iothread"):
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            found[name.removeprefix("IO ")] = int(fields[11]) + int(fields[12])
    return found


async def test_parallel_writers_verify_over_the_fuse_iothread_list(box: Sandbox) -> None:
    async with in_process_driver(box, qsd_binary=bundled("qemu-storage-daemon-11"), iothreads=2,
                                 fuse_threads=features.FuseThreads.POOL) as (driver, csi):
        assert driver.daemon.version >= features.FUSE_IOTHREAD_LIST, "the install provides QEMU 11"
        assert driver.daemon.fuse_iothreads() == ["iothread0", "iothread1"]
        pid = qsd_pid(box)
        assert pid is not None
        async with published(box, csi, "fio", block=True) as volume:
            assert loop_dio(volume), "QEMU 11 keeps parallel writes intact: a direct-I/O loop device"
            export = fuse_loop.export_file(box.state_dir / "exports", volume.vid)
            connection = fusectl.CONNECTIONS / str(os.minor(os.stat(export).st_dev))
            background = int((connection / "max_background").read_text())
            assert background > fusectl.MAX_BACKGROUND, "the driver must not lower the limit QEMU 11 sets itself"
            before = iothread_cpu(pid)
            with cgroups() as groups:
                fio = await run_fio(box, groups, volume.target, block=True)
            after = iothread_cpu(pid)
        assert not fio.failures, f"fio jobs failed: {fio.failures}"
        assert fio.written == fio.verified == GROUPS * THREADS * (2 + 8) * MIB, f"fio verified less: {fio}"
        assert fio.bad_blocks == 0, f"{fio.bad_blocks} blocks failed verification over the FUSE iothread list"
        busy = {name for name in ("iothread0", "iothread1") if after.get(name, 0) > before.get(name, 0)}
        assert busy == {"iothread0", "iothread1"}, f"not every pool thread served the export: {before} -> {after}"
        assert os.path.exists(f"/proc/{pid}"), "QSD lived through it"
