"""Device-pool partitions: fio on a partition volume as a pod sees it vs the same region of the device, one run.

Run as ``.venv/bin/python -m e2e.bench.partitions [--runtime 5] [--rounds 3]``
(root). It prints figures, never pass/fail.

The "NVMe" is a loop device (direct I/O) over a sparse file. The driver
serves it as device pool ``bench`` and creates block volumes on it through
CSI (stage and publish with the block access type: QSD's FUSE export of the
extent, a loop device on it, the device file bind-mounted at the target).
Table 1: the same fio jobs (O_DIRECT, libaio) on a partition's target and,
right after, on the same byte range of the device directly (``--offset`` =
the extent's start), with QSD's CPU per thread during the partition's job. Table
2: 1, 2 and 4 partitions driven at once (4k random read QD32 on each),
aggregate IOPS beside one partition alone, and beside the device driven
directly over the same regions at once. Every figure is the median of the
rounds; each round measures a partition and its baseline back to back, so
load from elsewhere on the machine hits both alike.

A VM reaches a partition over vhost-user-blk: `partitions_vm` measures that
path (a guest under TCG would measure the emulated CPU, not the export).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from csi_qsd.sys.tools import bundled
from e2e.bench.device_pool import served_pool
from e2e.bench.fio import Job, fio, lay_out
from e2e.bench.process_usage import ThreadCPU
from e2e.bench.report_tables import ratio, table
from e2e.bench.shell import sh
from e2e.bench.sizes import MIB
from e2e.bench.staged_volumes import stage
from testing.harness import qsd_pid

REGION = 256 * MIB
JOBS = [
    Job("4k randread QD32", "randread", "4k", 32),
    Job("4k randwrite QD32", "randwrite", "4k", 32),
    Job("1M write QD8", "write", "1M", 8),
]
AT_ONCE = (1, 2, 4)


def figure(value: float) -> str:
    return f"{value:,.0f}"


async def bench(runtime: float, rounds: int) -> str:
    async with served_pool(4 * REGION + 64 * MIB) as pool:
        targets: list[tuple[Path, int]] = []
        for i in range(max(AT_ONCE)):
            volume = await stage(pool.csi, pool.box, f"pvc-part-{i}", REGION, {"pool": "bench"}, block=True)
            targets.append((volume.target, pool.extent_start(volume.id)))
        for target, start in targets:
            await lay_out(target, REGION)
        pid = qsd_pid(pool.box)
        assert pid is not None
        version = sh(bundled("qemu-storage-daemon"), "--version").splitlines()[0]
        return await measure(targets, pool.node, pid, runtime, rounds, version)


async def measure(targets: list[tuple[Path, int]], node: Path, pid: int, runtime: float, rounds: int,
                  version: str) -> str:
    samples: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
    threads: dict[str, str] = {}  # QSD's CPU per thread during the last round's run of each job

    for _ in range(rounds):
        target, start = targets[0]
        for job in JOBS:
            before = ThreadCPU.take(pid)
            samples[f"{job.name}/part"].append(await fio(job, target, runtime=runtime, size=REGION))
            threads[job.name] = ThreadCPU.take(pid).since(before)
            samples[f"{job.name}/device"].append(await fio(job, node, runtime=runtime, size=REGION, offset=start))
        read = JOBS[0]
        for count in AT_ONCE:
            parts = await asyncio.gather(*(fio(read, t, runtime=runtime, size=REGION) for t, _ in targets[:count]))
            samples[f"{count}/part"].append(sum(parts))
            directs = await asyncio.gather(*(fio(read, node, runtime=runtime, size=REGION, offset=s)
                                             for _, s in targets[:count]))
            samples[f"{count}/device"].append(sum(directs))
    med = {key: statistics.median(values) for key, values in samples.items()}
    rows = [[job.label, figure(med[f"{job.name}/device"]), figure(med[f"{job.name}/part"]),
             ratio(med[f"{job.name}/part"], med[f"{job.name}/device"]), threads[job.name]]
            for job in JOBS]
    first = table(["job", "device region (baseline)", "partition volume", "ratio", "QSD CPU per thread"], rows)
    one = med["1/part"]
    rows = [[str(count), figure(med[f"{count}/device"]), figure(med[f"{count}/part"]),
             ratio(med[f"{count}/part"], med[f"{count}/device"]), ratio(med[f"{count}/part"], one)]
            for count in AT_ONCE]
    second = table(["partitions at once", "device regions at once (baseline)", "aggregate IOPS", "ratio",
                    "vs one partition"], rows)
    return (f"{version}; block volumes (FUSE export > direct-I/O loop device); median of {rounds} rounds x "
            f"{runtime:g} s per job, each partition figure and its baseline back to back\n\n{first}\n\n"
            f"4k randread QD32 on each partition at once (IOPS):\n{second}\n")


def run_cli(doc: str, run: Callable[[float, int], Coroutine[Any, Any, str]], argv: list[str] | None) -> int:
    """Parse --runtime and --rounds, run the bench, print its tables (this one's and partition_knobs')."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--runtime", type=float, default=5, help="seconds per fio job")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every job (medians are printed)")
    args = parser.parse_args(argv)
    print(asyncio.run(run(args.runtime, args.rounds)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(__doc__ or "", bench, argv)


if __name__ == "__main__":
    raise SystemExit(main())
