"""Device-pool partitions as a VM sees them: qemu-img bench over vhost-user-blk vs the same region directly, one run.

Run as ``.venv/bin/python -m e2e.bench.partitions_vm [--rounds 3]`` (root).
It prints figures, never pass/fail.

The "NVMe" is a loop device (direct I/O) over a file filled with data. The
driver serves it as device pool ``bench``, creates two VM volumes on it
through CSI (the default ``cache: writethrough`` and ``cache: writeback``,
for VMs that flush) and stages and publishes each (a `raw` window on the device under
the volume's throttle filter, exported over vhost-user-blk). The client is
``qemu-img bench`` with libblkio's ``virtio-blk-vhost-user`` driver on the
published socket: the vhost-user-blk protocol a guest's QEMU speaks, with
no guest kernel or CPU emulation to measure instead. The baseline is the
same ``qemu-img bench`` on the same byte range of the device (a `raw`
window on `host_device`, O_DIRECT, native AIO), right after, so both sides
use one tool and one I/O path in the client. qemu-img bench issues
sequential requests only; the figure is the median over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import re
import statistics
from pathlib import Path

from csi_qsd.sys.tools import bundled
from e2e.bench.device_pool import served_pool
from e2e.bench.process_usage import ThreadCPU
from e2e.bench.report_tables import ratio, table
from e2e.bench.shell import output, sh
from e2e.bench.sizes import MIB
from e2e.bench.staged_volumes import stage
from testing.harness import qsd_pid

REGION = 256 * MIB


@dataclasses.dataclass(frozen=True)
class BenchJob:
    label: str
    size: int
    depth: int
    count: int
    write: bool = False

    @property
    def sequential(self) -> bool:
        return self.size >= MIB

    def scaled(self, share: float) -> BenchJob:
        """The same job with `share` of its requests (at least the queue depth)."""
        return dataclasses.replace(self, count=max(self.depth, round(self.count * share)))

    def args(self) -> list[str]:
        return ["-s", str(self.size), "-d", str(self.depth), "-c", str(self.count), "-n",
                *(["-w"] if self.write else [])]

    def figure(self, seconds: float) -> float:
        """MiB/s for large requests, IOPS for small ones."""
        return self.count * self.size / MIB / seconds if self.sequential else self.count / seconds


JOBS = [
    BenchJob("4k read QD32 (IOPS)", 4096, 32, 100_000),
    BenchJob("4k read QD1 (IOPS)", 4096, 1, 20_000),
    BenchJob("4k write QD32 (IOPS)", 4096, 32, 100_000, write=True),
    BenchJob("1M write QD8 (MiB/s)", MIB, 8, 1_000, write=True),
]
CACHES = ("writeback", "writethrough")
_DONE = re.compile(r"Run completed in ([0-9.]+) seconds")


async def qemu_img_bench(image_opts: str, job: BenchJob, *, flush: bool = False) -> float:
    """`job`'s figure through `image_opts`; `flush`: a flush after every `depth` requests (the most qemu-img allows).

    A writethrough disk flushes after every write, but QEMU shares one
    flush among the writes in flight when it starts, so with `depth`
    requests in flight that is about one flush per `depth` writes.
    """
    text = await output(bundled("qemu-img"), "bench", "--image-opts", image_opts, *job.args(),
                        *([f"--flush-interval={job.depth}"] if flush else []))
    found = _DONE.search(text)
    if found is None:
        raise RuntimeError(f"qemu-img bench printed no time: {text.strip()}")
    return job.figure(float(found.group(1)))


def through_socket(socket: Path) -> str:
    return f"driver=virtio-blk-vhost-user,path={socket},cache.direct=on"


def device_region(node: Path, start: int) -> str:
    return (f"driver=raw,offset={start},size={REGION},file.driver=host_device,file.filename={node},"
            "file.aio=native,file.locking=off,file.cache.direct=on")


def blkio_missing() -> str:
    """Why qemu-img cannot be a vhost-user-blk client here ('' if it can)."""
    if "virtio-blk-vhost-user" not in sh(bundled("qemu-img"), "--help"):
        return ("this qemu-img has no virtio-blk-vhost-user driver (libblkio, Debian's qemu-block-extra): "
                "scripts/install-qemu.sh installs it with the bundled QEMU")
    return ""


async def bench(rounds: int, share: float) -> str:
    missing = blkio_missing()
    if missing:
        return missing
    async with served_pool(2 * REGION + 64 * MIB, random_data=True) as pool:
        published: dict[str, tuple[Path, int]] = {}
        for cache in CACHES:
            params = {"pool": "bench", "export": "vhost-user-blk", "cache": cache}
            volume = await stage(pool.csi, pool.box, f"pvc-{cache}", REGION, params)
            published[cache] = (volume.target / "vhost-user-blk.sock", pool.extent_start(volume.id))
        pid = qsd_pid(pool.box)
        assert pid is not None
        version = sh(bundled("qemu-storage-daemon"), "--version").splitlines()[0]
        return await measure(published, pool.node, pid, rounds, version, [job.scaled(share) for job in JOBS])


async def measure(published: dict[str, tuple[Path, int]], node: Path, pid: int, rounds: int, version: str,
                  jobs: list[BenchJob]) -> str:
    samples: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
    threads: dict[str, str] = {}  # QSD's CPU per thread during the last round's run
    for _ in range(rounds):
        for job in jobs:
            for cache, (socket, start) in published.items():
                before = ThreadCPU.take(pid)
                samples[f"{job.label}/{cache}"].append(await qemu_img_bench(through_socket(socket), job))
                threads[f"{job.label}/{cache}"] = ThreadCPU.take(pid).since(before)
                samples[f"{job.label}/device"].append(await qemu_img_bench(device_region(node, start), job))
                if job.write:
                    flushed = await qemu_img_bench(device_region(node, start), job, flush=True)
                    samples[f"{job.label}/device+flush"].append(flushed)
    med = {key: statistics.median(values) for key, values in samples.items()}

    def cell(key: str) -> str:
        return f"{med[key]:,.0f}" if key in med else "-"

    rows = []
    for job in jobs:
        flushed = med.get(f"{job.label}/device+flush", med[f"{job.label}/device"])
        rows.append([
            job.label, cell(f"{job.label}/device"), cell(f"{job.label}/writeback"),
            ratio(med[f"{job.label}/writeback"], med[f"{job.label}/device"]),
            cell(f"{job.label}/device+flush"), cell(f"{job.label}/writethrough"),
            ratio(med[f"{job.label}/writethrough"], flushed),
            threads.get(f"{job.label}/writeback", "-"),
        ])
    headers = ["job", "device region", "volume, cache: writeback", "ratio", "device region, flushing",
               "volume, writethrough (default)", "ratio",
               "QSD CPU per thread (writeback)"]
    return (f"{version}; VM volumes (vhost-user-blk export > raw window > direct-I/O loop device), "
            f"qemu-img bench with libblkio's virtio-blk-vhost-user driver; median of {rounds} rounds. A "
            "writethrough volume acknowledges a write once it is on the device (QSD flushes after it): its "
            "baseline flushes once per queue depth of writes (the most qemu-img bench allows).\n\n"
            + table(headers, rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every job (medians are printed)")
    parser.add_argument("--share", type=float, default=1.0, help="this share of each job's requests (default 1)")
    args = parser.parse_args(argv)
    print(asyncio.run(bench(args.rounds, args.share)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
