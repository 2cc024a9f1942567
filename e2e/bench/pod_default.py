"""Pods on the default configuration: ext4 in a volume as `csi-qsd serve` makes it, beside ext4 on a loop device, one run.

Run as ``.venv/bin/python -m e2e.bench.pod_default`` (root). It prints
figures, never pass/fail.

Each configuration gets its own sandbox and a served driver (`csi-qsd
serve` with its defaults, over its UNIX socket as the external-provisioner
and kubelet drive it). It makes N filesystem volumes (CreateVolume with the
configuration's StorageClass parameters, NodeStage and NodePublish: ext4 on
the driver's loop device over QSD's FUSE export) and, as the baseline, N raw
files on the pool's filesystem (for ``host``, the node's: beside the pool
directory, which ``--serve=--managed-pool=xfs:SIZE`` makes the driver's own
XFS), each under a direct-I/O loop device with ext4 made as the driver
makes it. fio (O_DIRECT, libaio, 4k random, QD32
each) runs on a file in each filesystem, laid out once beforehand, on 1 and
then N at once; volumes and baselines alternate which goes first (ABBA) over
``--rounds``, and a figure is the mean.

Configurations (``--configs``, POOL:CLASS):

  POOL   host  the sandbox's own directory, on the node's filesystem (ext4
               here): where `csi-qsd serve --pool-dir` points by default;
         xfs / ext4  a fresh filesystem of that type on a direct-I/O loop
               device over a file in the sandbox (a machine with one disk
               has no other way to try one; the baseline pays that layer too)
  CLASS  default  no parameters: a thin qcow2 image, 64 KiB granularity, an
               enabled persistent dirty bitmap (what `csi-qsd volume create`
               makes)
         raw   format=raw, preallocation=full (the scaling bench's volumes)

A second anchor, run right after each comparison in the same run: fio
on a file in a plain directory on the pool's filesystem (what
csi-driver-host-path gives a filesystem volume: no loop device, no image),
`--rounds` times. The volumes' reads can hit the host's page cache (QSD
opens images buffered), the baselines' never do (O_DIRECT down to the
disk): each row says how much of the volumes' images the cache held just
before the row (fincore), and `--drop-caches` drops it before every run on
the volumes, so each starts cold. Each run on the volumes ends with a
sync: their writes left dirty in the host's page cache reach the disk on
their own turn (their CPU counted there), not during the baseline's.

Beside each row: the machine's CPU time per I/O on each side (all its
cores' busy time from /proc/stat during the runs, over the I/Os done: what
every layer of the path costs, fio's own share included) and how many cores
were busy; the FUSE requests in flight per volume (fusectl's
`waiting`, sampled every 10 ms), QSD's CPU per thread during the volumes'
last run (/proc/PID/task/*/stat), and for N volumes a projection for a node
with more cores: QSD 10 serves every FUSE export from its one main loop, so
N volumes on a node with a core per QSD shard (``--shards``) reach at most
the one-volume IOPS per CPU-second of the busiest QSD thread, times the
shards they use. That is an estimate from this run, and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import os
import shutil
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from csi_qsd.exports.fuse_loop import export_file
from csi_qsd.sys import mounts
from e2e.bench import scaling
from e2e.bench.fio import Job, fio, lay_out
from e2e.bench.loop_devices import ext4_on, loop_device, raw_file
from e2e.bench.report_tables import progress, ratio, table
from e2e.bench.served_bench import ServedBench, logged, missing, rerun_unshared, run_to_end
from e2e.bench.shell import output
from e2e.bench.sizes import GIB, MIB
from testing.harness import Sandbox, sandbox

VOLUME_SIZE = 1 * GIB
REGION = 512 * MIB  # the fio file in each filesystem: half the volume, leaving ext4 its metadata
CLASSES = {"default": {}, "raw": {"format": "raw", "preallocation": "full"}}
POOLS = ("host", "xfs", "ext4")
JOBS = ("randread", "randwrite")


@dataclasses.dataclass(frozen=True)
class Configuration:
    pool: str  # host, xfs or ext4
    klass: str  # default or raw

    @classmethod
    def parse(cls, text: str) -> "Configuration":
        pool, _, klass = text.partition(":")
        if pool not in POOLS or klass not in CLASSES:
            raise argparse.ArgumentTypeError(f"expected POOL:CLASS with POOL in {', '.join(POOLS)} and CLASS in "
                                             f"{', '.join(CLASSES)}, got {text!r}")
        return cls(pool, klass)

    @property
    def name(self) -> str:
        return f"{self.pool}:{self.klass}"


class Bench(ServedBench):
    def __init__(self, box: Sandbox, config: Configuration, pool: Path, counts: list[int], seconds: float,
                 rounds: int, shards: int, region: int = REGION, serve: tuple[str, ...] = ()) -> None:
        super().__init__(box, "--pool-dir", str(pool), "--qsd-shards", str(shards), *serve)
        self.config, self.pool, self.counts, self.params = config, pool, counts, CLASSES[config.klass]
        # Where the anchors live: the node's filesystem for `host` (beside the pool, never in it: with
        # `--serve=--managed-pool=…` the driver mounts its own XFS at the pool directory), else the pool's.
        self.anchors = box.root / "anchors" if config.pool == "host" else pool
        self.seconds, self.rounds, self.shards, self.region = seconds, rounds, shards, region
        self.rows: list[scaling.Row] = []
        self.directory: dict[tuple[str, int], list[float]] = {}  # (job, N): IOPS in plain directories, each round
        self.resident: dict[tuple[str, int], str] = {}  # (job, N): the volumes' images in the host's page cache
        self.drop_caches = False
        self.setting = "?"

    async def phases(self, csi: CSIClient) -> None:
        version, aio = logged(self.driver, "qsd_version"), logged(self.driver, "file_aio")
        self.setting = " ".join(f"{key}={version[key]}" for key in ("version", "loop_io") if key in version) or "?"
        self.setting += f" engine={aio['engine']}" if "engine" in aio else ""
        fuse = logged(self.driver, "fuse_paths")
        self.setting += f" async_dio={fuse.get('async_dio', '?')} growable={fuse.get('growable', '?')}"
        threads = logged(self.driver, "qsd_version").get("fuse_exports_in")
        self.setting += f" fuse_exports_in={threads}" if threads else ""
        count = max(self.counts)
        targets = []
        for index in range(count):
            namespace = {scaling.NAMESPACE_KEY: scaling.namespace_for(index, self.shards)}
            targets.append((await self.stage(csi, f"pod-{index}", VOLUME_SIZE, {**self.params, **namespace})).target)
        async with contextlib.AsyncExitStack() as stack:
            self.anchors.mkdir(exist_ok=True)
            baselines = []
            for index in range(count):
                raw = await stack.enter_async_context(raw_file(self.anchors / f"baseline-{index}.raw", VOLUME_SIZE))
                device = await stack.enter_async_context(loop_device(raw))
                baselines.append(await stack.enter_async_context(ext4_on(device, self.box.root / f"base-{index}")))
            volume_files = [t / "fio.dat" for t in targets]
            baseline_files = [b / "fio.dat" for b in baselines]
            directory_files = [stack.enter_context(plain_directory(self.anchors / f"directory-{index}")) / "fio.dat"
                               for index in range(count)]
            progress(f"{self.config.name}: laying out {self.region // MIB} MiB in each of {3 * count} files")
            for path in volume_files + baseline_files + directory_files:
                await lay_out(path, self.region)
            for rw in JOBS:
                for n in self.counts:
                    await self._compare(scaling.qd32(rw), n, volume_files[:n], baseline_files[:n],
                                        directory_files[:n])

    async def _compare(self, job: Job, n: int, volumes: list[Path], baselines: list[Path],
                       directories: list[Path]) -> None:
        exports = [export_file(self.box.state_dir / "exports", vid) for vid in list(self.staged)[:n]]
        progress(f"{self.config.name}: {job.name} x{n}, {self.rounds} x {self.seconds:g} s each side")
        self.rows.append(scaling.Row("pod", job.name, n))
        self.resident[(job.name, n)] = await resident(self.images(list(self.staged)[:n]))

        async def on_volumes() -> float:
            # QSD writes through the host's page cache: its writeback is the volumes' work, done (and its CPU
            # counted) on their turn, never left for the baseline's run to pay.
            await asyncio.to_thread(os.sync)
            if self.drop_caches:
                await drop_page_cache()
            iops = await fio(job, *volumes, runtime=self.seconds, size=self.region)
            await asyncio.to_thread(os.sync)
            return iops

        await scaling.compare(self.rows[-1], scaling.qsd_pids_of(self.box, self.shards), self.rounds, on_volumes,
                              functools.partial(fio, job, *baselines, runtime=self.seconds, size=self.region), exports)
        self.directory[(job.name, n)] = [await fio(job, *directories, runtime=self.seconds, size=self.region)
                                         for _ in range(self.rounds)]

    def images(self, volume_ids: list[str]) -> list[Path]:
        """The image files of `volume_ids` in the pool (each volume's newest file: its top image)."""
        found = []
        for vid in volume_ids:
            own = sorted(self.pool.glob(f"*{vid.removeprefix('vol-')}*"), key=lambda p: p.stat().st_mtime)
            found += own[-1:]
        return found

    def render(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items()) or \
            "no parameters (thin qcow2, 64 KiB granularity, persistent dirty bitmap)"
        head = (f"{self.config.name}: pool on {mounts.filesystem_of(self.pool) or '?'} ({self.config.pool}); class: "
                f"{params}; ext4 in each volume vs ext4 on a direct-I/O loop device on a raw file on "
                f"{mounts.filesystem_of(self.anchors) or '?'} ({self.anchors}); "
                f"{self.setting}; {self.shards} shard(s); {os.cpu_count()} cores; {self.rounds} x {self.seconds:g} s, "
                f"mean; load average {os.getloadavg()[0]:.2f}")
        rows = []
        for row in self.rows:
            vol, base = statistics.mean(row.volume), statistics.mean(row.baseline)
            spread = f"{min(row.volume) / 1000:.1f}-{max(row.volume) / 1000:.1f}k"
            volume_cost, baseline_cost = row.cpu_per_io()
            plain = statistics.mean(self.directory.get((row.job, row.count)) or [0.0])
            rows.append([row.job, str(row.count), f"{vol / 1000:.1f}k", spread, f"{base / 1000:.1f}k",
                         ratio(vol, base), f"{plain / 1000:.1f}k", ratio(vol, plain) if plain else "-",
                         self.resident.get((row.job, row.count), "?"), f"{volume_cost:.1f} / {baseline_cost:.1f}",
                         f"{statistics.mean(row.volume_cores):.2f} / {statistics.mean(row.baseline_cores):.2f}",
                         row.in_flight, row.threads[-1] if row.threads else "-"])
        ones = {row.job: row for row in self.rows if row.count == 1}
        projected = scaling.projection([(row.job, ones[row.job], row.count) for row in self.rows
                                        if row.count > 1 and row.job in ones], self.shards)
        headers = ["job", "N", "volumes", "spread", "baseline", "ratio", "plain dir", "ratio to dir", "images cached",
                   "CPU us/IO vol / base", "busy cores vol / base", "FUSE in flight/vol",
                   "QSD CPU per thread (volumes' last run)"]
        return "\n".join(part for part in (head, table(headers, rows), projected) if part)


@contextlib.contextmanager
def plain_directory(path: Path) -> Iterator[Path]:
    """A directory on the pool's filesystem, what csi-driver-host-path gives a filesystem volume; removed on exit."""
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def resident(files: list[Path]) -> str:
    """How much of `files` the host's page cache holds (fincore): a volume's reads there never reach the disk."""
    if not files or missing("fincore"):
        return "?"
    held = total = 0
    for path in files:
        res, size = (await output("fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(path))).split()
        held, total = held + int(res), total + int(size)
    return f"{held / MIB:.0f}/{total / MIB:.0f} MiB"


async def drop_page_cache() -> None:
    """Write back and drop the host's clean page cache, so the next run starts cold."""
    await asyncio.to_thread(os.sync)
    await asyncio.to_thread(Path("/proc/sys/vm/drop_caches").write_text, "3\n")


@contextlib.contextmanager
def pool_for(box: Sandbox, config: Configuration, count: int) -> Iterator[Path]:
    if config.pool == "host":
        yield box.state_dir / "pool"
        return
    # Room for every volume and baseline file, fully written, with ext4's and qcow2's metadata beside them.
    with scaling.new_filesystem(box.root, config.pool, size=2 * count * VOLUME_SIZE + 2 * GIB) as mountpoint:
        yield mountpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.pod_default", description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=lambda t: [Configuration.parse(p) for p in t.split(",")],
                        default=[Configuration("host", "default"), Configuration("host", "raw"),
                                 Configuration("xfs", "default"), Configuration("xfs", "raw")],
                        help="POOL:CLASS, comma-separated (default host:default,host:raw,xfs:default,xfs:raw)")
    parser.add_argument("--counts", type=lambda t: [int(p) for p in t.split(",")], default=[1, 4])
    parser.add_argument("--runtime", type=float, default=5, help="seconds per fio run (default 5)")
    parser.add_argument("--region-mib", type=int, default=REGION // MIB,
                        help="MiB of the fio file in each filesystem (default 512)")
    parser.add_argument("--rounds", type=int, default=2, help="runs on each side, alternating (default 2)")
    parser.add_argument("--shards", type=int, default=1, help="the driver's --qsd-shards (default 1)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the host's page cache before each run on the volumes (reads start cold)")
    parser.add_argument("--serve", action="append", default=[], metavar="ARG",
                        help="one more argument for `csi-qsd serve` (repeat it), e.g. --serve=--fuse-threads=main")
    args = parser.parse_args(argv)
    if missing("fio", "unshare"):
        return 2
    if args.runtime <= 0 or args.rounds < 1 or args.shards < 1 or min(args.counts) < 1 or \
            not 0 < args.region_mib * MIB < VOLUME_SIZE:
        parser.error("--runtime must be positive, --rounds, --shards and --counts at least 1, --region-mib under "
                     "the volume's 1024")
    if (rerun := rerun_unshared("e2e.bench.pod_default", argv)) is not None:
        return rerun
    status = 0
    for config in args.configs:
        with sandbox() as box, pool_for(box, config, max(args.counts)) as pool:
            bench = Bench(box, config, pool, args.counts, args.runtime, args.rounds, args.shards,
                          args.region_mib * MIB, tuple(args.serve))
            bench.drop_caches = args.drop_caches
            status = run_to_end(bench.run(), bench.driver, what=f"pod_default {config.name}") or status
            print(bench.render() + "\n", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
