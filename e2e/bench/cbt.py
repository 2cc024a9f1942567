"""Changed-block tracking benchmark: GetMetadataDelta beside comparing two snapshots block by block.

Runs `csi-qsd serve` as a separate process. One qcow2 volume (10 GiB by
default) is staged and published as a raw block volume; snapshot S0 is cut,
then 1% of its 4 KiB blocks are overwritten at random offsets scattered over
the whole volume (O_DIRECT through the published device, one fsync at the
end), and snapshot S1 is cut. Then, in the same run:

    GetMetadataDelta(S0, S1)          the driver: qcow2 allocation maps of the layers between them
    block-by-block comparison         both snapshots read whole (qemu-nbd, 4 MiB requests) and
                                      compared per 64 KiB: the answer a tool without CBT computes
    incremental backup                `csi_qsd.backup` of the delta: bytes read vs bytes written

The comparison must find no changed block the delta missed. Each scattered
4 KiB write allocates a 64 KiB qcow2 cluster, so the delta (and the
backup) is at cluster granularity: 1% of 4 KiB blocks is ~15% of clusters.
The target is < 1 s for the delta. Needs root and /dev/fuse; the sandbox and
driver are removed afterwards. Usage:

    .venv/bin/python -m e2e.bench.cbt [--size-gib 10] [--percent 1]
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import random
import tempfile
import time
from pathlib import Path

from csi_qsd import backup, extents
from csi_qsd.config import Config
from csi_qsd.csi_client import CSIClient
from csi_qsd.catalog import Catalog
from csi_qsd.tools import bundled
from e2e.bench.common import GIB, MIB, stop_driver_and_qsd
from tests.harness import DriverProcess, sandbox

KIB = 1 << 10
CLUSTER = 64 * KIB
TARGET_SECONDS = 1.0


def scatter(device: Path, size: int, count: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    offsets = sorted({rng.randrange(0, size // (4 * KIB)) * 4 * KIB for _ in range(count)})
    buf = mmap.mmap(-1, 4 * KIB)
    fd = os.open(device, os.O_RDWR | os.O_DIRECT)
    try:
        for i, offset in enumerate(offsets):
            buf[:8] = (i + 1).to_bytes(8, "little")
            os.pwrite(fd, buf, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return offsets


async def compare_block_by_block(image0: Path, image1: Path, size: int, qemu_nbd: str) -> set[int]:
    """Clusters whose content differs, reading both snapshots whole."""
    changed: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="cbt-bench-") as work:
        async with (
            backup.nbd_export(qemu_nbd, backup.qcow2_spec(image0, read_only=True), Path(work) / "a.sock",
                              read_only=True) as a,
            backup.nbd_export(qemu_nbd, backup.qcow2_spec(image1, read_only=True), Path(work) / "b.sock",
                              read_only=True) as b,
        ):
            for at in range(0, size, backup.CHUNK):
                length = min(backup.CHUNK, size - at)
                old, new = await a.read(at, length), await b.read(at, length)
                if old != new:
                    for i in range(0, length, CLUSTER):
                        if old[i:i + CLUSTER] != new[i:i + CLUSTER]:
                            changed.add((at + i) // CLUSTER)
    return changed


async def main(size: int, percent: float) -> None:
    with sandbox() as box:
        driver = DriverProcess(box, "--log-level", "info")
        await driver.start()
        try:
            async with CSIClient(box.endpoint, timeout=600) as csi:
                vid = (await csi.create_volume("pvc-cbt-bench", size, block=True)).volume_id
                staging, target = box.staging("cbt"), box.target("cbt")
                await csi.stage(vid, str(staging), block=True)
                await csi.publish(vid, str(staging), str(target), block=True)
                s0 = (await csi.create_snapshot("cbt-0", vid)).snapshot_id
                count = int(size // (4 * KIB) * percent / 100)
                started = time.monotonic()
                offsets = await asyncio.to_thread(scatter, target, size, count)
                print(f"wrote {len(offsets)} scattered 4 KiB blocks ({len(offsets) * 4 * KIB / MIB:.0f} MiB) "
                      f"in {time.monotonic() - started:.1f} s")
                s1 = (await csi.create_snapshot("cbt-1", vid)).snapshot_id

                delta_times = []
                for _ in range(3):
                    started = time.monotonic()
                    _, ranges = await csi.metadata_delta(s0, s1)
                    delta_times.append(time.monotonic() - started)
                delta = min(delta_times)
                async with Catalog(Config(state_dir=box.state_dir).catalog_path) as catalog:
                    rec0, rec1 = await catalog.snapshot(s0), await catalog.snapshot(s1)
                assert rec0 is not None and rec1 is not None
                qemu_nbd = bundled("qemu-nbd")
                started = time.monotonic()
                truth = await compare_block_by_block(rec0.image, rec1.image, size, qemu_nbd)
                comparison = time.monotonic() - started
                reported = extents.blocks(ranges, CLUSTER)
                written = extents.blocks([(o, 4 * KIB) for o in offsets], CLUSTER)
                assert truth <= reported, f"{len(truth - reported)} changed clusters missing from the delta"

                out = box.root / "inc.qcow2"
                started = time.monotonic()
                report = await backup.backup(rec1.image, ranges, size, out, snapshot_id=s1, base_snapshot_id=s0,
                                             qemu_img=bundled("qemu-img"), qemu_nbd=qemu_nbd)
                backup_seconds = time.monotonic() - started
                print(f"volume {size / GIB:.0f} GiB, {percent}% of 4 KiB blocks changed: {len(written)} clusters "
                      f"touched, {len(truth)} differ, {len(reported)} reported in {len(ranges)} ranges "
                      f"(exact: {reported == written})")
                verdict = "PASS" if delta < TARGET_SECONDS else "MISS"
                print(f"GetMetadataDelta      {delta:8.3f} s  (best of 3: {', '.join(f'{t:.3f}' for t in delta_times)}) "
                      f"target < {TARGET_SECONDS:.0f} s: {verdict}")
                print(f"block-by-block        {comparison:8.3f} s  (both snapshots read whole)")
                print(f"ratio                 {comparison / delta:8.0f}x faster with the delta")
                print(f"incremental backup    {backup_seconds:8.3f} s  read {report.bytes_read / MIB:.1f} MiB "
                      f"for {len(offsets) * 4 * KIB / MIB:.1f} MiB written in 4 KiB blocks "
                      f"({len(truth) * CLUSTER / MIB:.1f} MiB of 64 KiB clusters differ; "
                      f"{report.bytes_read / (len(truth) * CLUSTER):.2f}x of that); the volume is {size / MIB:.0f} MiB")
                await csi.unpublish(vid, str(target))
                await csi.unstage(vid, str(staging))
        finally:
            await stop_driver_and_qsd(driver)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=10)
    parser.add_argument("--percent", type=float, default=1.0)
    args = parser.parse_args()
    asyncio.run(main(int(args.size_gib * GIB), args.percent))
