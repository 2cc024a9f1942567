"""Changed-block tracking benchmark: GetMetadataDelta beside comparing two snapshots block by block.

Runs `csi-qsd serve` as a separate process. For each changed-block
granularity (the default 64 KiB and `changedBlockGranularity: 4Ki`) one
qcow2 volume (10 GiB by default) is staged and published as a raw block
volume; snapshot S0 is cut, then 1% of its 4 KiB blocks are overwritten at
random offsets scattered over the whole volume (O_DIRECT through the
published device, one fsync at the end; the same offsets on both volumes),
and snapshot S1 is cut. Then, in the same run:

    GetMetadataDelta(S0, S1)          the driver: qcow2 allocation maps of the layers between them
    block-by-block comparison         both snapshots read whole (qemu-nbd, 4 MiB requests) and
                                      compared per 4 KiB: the answer a tool without CBT computes
    incremental backup                `csi_qsd.backup.incremental` of the delta: bytes read vs bytes changed

The comparison must find no changed block the delta missed. At 64 KiB each
scattered 4 KiB write allocates a whole cluster, so the delta and the
backup are ~15× the changed bytes; at 4 KiB (extended L2 subclusters) they
are the changed bytes. Targets: the delta < 1 s and ≥ 100× faster than the
comparison; the backup reads ≤ 1.1× the changed bytes.

Then the write cost of the finer layout: fio 4 KiB random writes (QD16,
O_DIRECT, through the published block device) on a fresh volume of each
granularity, and again after a snapshot (every write then lands in a new
overlay). Needs root, /dev/fuse and fio; the sandbox and driver are removed
afterwards. Usage:

    .venv/bin/python -m e2e.bench.cbt [--size-gib 10] [--percent 1] [--fio-seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from csi_qsd.backup import incremental
from csi_qsd.catalog import Catalog
from csi_qsd.cli.client import CSIClient
from csi_qsd.config import Config
from csi_qsd.qcow2 import extents, imagemap
from csi_qsd.sys.tools import bundled
from e2e.bench.fio import Job, fio
from e2e.bench.loop_devices import write_direct
from e2e.bench.report_tables import table, verdict
from e2e.bench.served_bench import ServedBench, bench_main
from e2e.bench.sizes import GIB, KIB, MIB
from e2e.bench.staged_volumes import release
from testing.harness import Sandbox

BLOCK = 4 * KIB
DELTA_TARGET_SECONDS = 1.0
SPEEDUP_TARGET = 100
BACKUP_READ_TARGET = 1.1
FIO_SIZE = 2 * GIB
GRANULARITIES = {"64 KiB (default)": 64 * KIB, "4 KiB": 4 * KIB}


@dataclasses.dataclass(frozen=True)
class Result:
    granularity: int
    changed: int  # 4 KiB blocks whose content differs between S0 and S1
    reported_bytes: int
    ranges: int
    delta_seconds: list[float]
    comparison_seconds: float
    backup_seconds: float
    backup_read: int

    @property
    def delta(self) -> float:
        return min(self.delta_seconds)


def differing_blocks(at: int, old: bytes, new: bytes, out: set[int]) -> None:
    """4 KiB blocks that differ, found through 64 KiB slices first (most are equal)."""
    coarse = 64 * KIB
    for i in range(0, len(new), coarse):
        if old[i:i + coarse] != new[i:i + coarse]:
            for j in range(i, min(i + coarse, len(new)), BLOCK):
                if old[j:j + BLOCK] != new[j:j + BLOCK]:
                    out.add((at + j) // BLOCK)


async def compare_block_by_block(image0: Path, image1: Path, size: int, qemu_nbd: str) -> set[int]:
    """4 KiB blocks whose content differs, reading both snapshots whole."""
    changed: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="cbt-bench-") as work:
        async with (
            incremental.nbd_export(qemu_nbd, imagemap.qcow2_spec(image0, read_only=True), Path(work) / "a.sock",
                              read_only=True) as a,
            incremental.nbd_export(qemu_nbd, imagemap.qcow2_spec(image1, read_only=True), Path(work) / "b.sock",
                              read_only=True) as b,
        ):
            for at in range(0, size, incremental.CHUNK):
                length = min(incremental.CHUNK, size - at)
                old, new = await a.read(at, length), await b.read(at, length)
                if old != new:
                    differing_blocks(at, old, new, changed)
    return changed


async def measure(bench: Bench, csi: CSIClient, size: int, granularity: int, offsets: list[int]) -> Result:
    name, box = f"cbt-{granularity // KIB}k", bench.box
    volume = await bench.stage(csi, name, size, {"changedBlockGranularity": str(granularity)}, block=True)
    vid, device = volume.id, volume.target
    s0 = (await csi.create_snapshot(f"{name}-0", vid)).snapshot_id
    await asyncio.to_thread(write_direct, device, offsets, BLOCK)
    s1 = (await csi.create_snapshot(f"{name}-1", vid)).snapshot_id

    delta_times = []
    for _ in range(3):
        started = time.monotonic()
        _, ranges = await csi.metadata_delta(s0, s1)
        delta_times.append(time.monotonic() - started)
    async with Catalog(Config(state_dir=box.state_dir).catalog_path) as catalog:
        rec0, rec1 = await catalog.snapshot(s0), await catalog.snapshot(s1)
    assert rec0 is not None and rec1 is not None
    qemu_nbd = bundled("qemu-nbd")
    started = time.monotonic()
    truth = await compare_block_by_block(rec0.image, rec1.image, size, qemu_nbd)
    comparison = time.monotonic() - started
    reported = extents.blocks(ranges, BLOCK)
    assert truth <= reported, f"{len(truth - reported)} changed blocks missing from the delta"
    assert all(o % granularity == 0 and n % granularity == 0 for o, n in ranges), "a range off the granularity"

    out = box.root / f"{name}.qcow2"
    started = time.monotonic()
    report = await incremental.backup(rec1.image, ranges, size, out, snapshot_id=s1, base_snapshot_id=s0,
                                 qemu_img=bundled("qemu-img"), qemu_nbd=qemu_nbd)
    backup_seconds = time.monotonic() - started
    out.unlink()
    await release(csi, volume, delete=False)
    return Result(granularity, len(truth), extents.total(ranges), len(ranges), delta_times, comparison,
                  backup_seconds, report.bytes_read)


RANDWRITE = Job("4k randwrite QD16", "randwrite", "4k", 16)


async def write_cost(bench: Bench, csi: CSIClient, granularity: int, seconds: float) -> tuple[float, float]:
    """(IOPS on a fresh volume, IOPS after a snapshot) of 4 KiB random writes, QD16, O_DIRECT, the whole device."""
    name = f"fio-{granularity // KIB}k"
    volume = await bench.stage(csi, name, FIO_SIZE, {"changedBlockGranularity": str(granularity)}, block=True)
    fresh = await fio(RANDWRITE, volume.target, runtime=seconds)
    await csi.create_snapshot(f"{name}-0", volume.id)
    after = await fio(RANDWRITE, volume.target, runtime=seconds)
    await release(csi, volume, delete=False)
    return fresh, after


def report(size: int, percent: float, written: int, results: dict[str, Result]) -> None:
    changed = next(iter(results.values())).changed * BLOCK
    print(f"\nvolume {size / GIB:.0f} GiB, {percent}% of its 4 KiB blocks rewritten at random: {written} writes, "
          f"{changed / MIB:.1f} MiB changed (block-by-block truth at 4 KiB)")
    rows = []
    for label, r in results.items():
        rows.append([
            label, f"{r.reported_bytes / MIB:.1f} MiB in {r.ranges}",
            f"{r.delta:.3f} s ({', '.join(f'{t:.3f}' for t in r.delta_seconds)})",
            f"{r.comparison_seconds:.1f} s", f"{r.comparison_seconds / r.delta:.0f}x",
            f"{r.backup_read / MIB:.1f} MiB in {r.backup_seconds:.1f} s", f"{r.backup_read / changed:.2f}x",
        ])
    print(table(["granularity", "delta reports (ranges)", "GetMetadataDelta (3 runs)", "block by block",
                 "speed-up", "incremental backup read", "read / changed"], rows))
    checks: dict[str, Callable[[Result], bool]] = {
        f"4 KiB: GetMetadataDelta < {DELTA_TARGET_SECONDS:.0f} s": lambda fine: fine.delta < DELTA_TARGET_SECONDS,
        f"4 KiB: ≥ {SPEEDUP_TARGET}x faster than block by block":
            lambda fine: fine.comparison_seconds / fine.delta >= SPEEDUP_TARGET,
        f"4 KiB: backup reads ≤ {BACKUP_READ_TARGET}x the changed bytes":
            lambda fine: fine.backup_read <= BACKUP_READ_TARGET * changed,
    }
    for what, check in checks.items():
        print(f"  {verdict(lambda: check(results['4 KiB']))}  {what}")


class Bench(ServedBench):
    def __init__(self, box: Sandbox, size: int, percent: float, fio_seconds: float) -> None:
        super().__init__(box)
        self.size, self.percent, self.fio_seconds = size, percent, fio_seconds

    async def phases(self, csi: CSIClient) -> None:
        size, percent, fio_seconds = self.size, self.percent, self.fio_seconds
        rng = random.Random(1)
        count = int(size // BLOCK * percent / 100)
        offsets = sorted({rng.randrange(0, size // BLOCK) * BLOCK for _ in range(count)})
        results: dict[str, Result] = {}
        for label, granularity in GRANULARITIES.items():
            results[label] = await measure(self, csi, size, granularity, offsets)
            print(f"measured {label}", file=sys.stderr)
        report(size, percent, len(offsets), results)
        if fio_seconds:
            rows = []
            for label, granularity in GRANULARITIES.items():
                fresh, after = await write_cost(self, csi, granularity, fio_seconds)
                rows.append([label, f"{fresh:.0f}", f"{after:.0f}"])
            print(f"\nfio 4 KiB random writes, QD16, O_DIRECT, {fio_seconds:g} s each, "
                  f"{FIO_SIZE / GIB:.0f} GiB block volume (IOPS):")
            print(table(["granularity", "fresh volume", "after a snapshot"], rows), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=10)
    parser.add_argument("--percent", type=float, default=1.0)
    parser.add_argument("--fio-seconds", type=float, default=15, help="0: skip the write-cost runs")
    args = parser.parse_args(argv)
    return bench_main(lambda box: Bench(box, int(args.size_gib * GIB), args.percent, args.fio_seconds),
                      lambda bench: "", tools=("fio",))


if __name__ == "__main__":
    sys.exit(main())
