"""Scaling over cores: 1, 2 and 4 volumes at QD32 at once vs as many regions of raw files, pods and VMs, one run.

Run as ``.venv/bin/python -m e2e.bench.scaling`` (root). It prints figures,
never pass/fail.

For each QSD runtime asked for (``--qsd 10,11``: the install's
``qemu-storage-daemon-10`` and ``-11``; ``11:4:pool`` also sets ``--iothreads 4
--fuse-threads pool``)
it serves the driver with that QSD and makes 4 raw, fully allocated volumes
of each kind:

  pod  a block volume as a pod gets it (QSD's FUSE export, a direct-I/O loop
       device on it); N of them driven at once by one fio (libaio, O_DIRECT,
       4k random, QD32 each), against N direct-I/O loop devices over N raw
       files in the same pool directory, driven the same way;
  vm   a vhost-user-blk volume; N polling libblkio clients at once
       (`e2e.bench.blkio_client`: registered memory, a poll queue, 4k random,
       QD32 each), against the same client with libblkio's io_uring driver
       on N raw files (O_DIRECT). Not qemu-img bench, which copies every
       request through a bounce buffer in one thread and understates the export.

Volume and baseline alternate which goes first (ABBA) over ``--rounds``; a
figure is the mean. Pod rows also print how many FUSE requests the kernel had
in flight to QSD (fusectl's ``waiting``, sampled every 10 ms during the
volumes' runs, max and mean per volume): QSD 10.0 takes a loop device's
queue as a stack of nested requests, while QSD 11.1.3 answers FUSE_INIT
without FUSE_ASYNC_DIO, so the kernel sends each direct-I/O request of a
loop device synchronously, one at a time, whatever its iothreads. Beside
each it prints the aggregate's scaling over one volume and QSD's CPU per
thread (/proc/PID/task/*/stat) during the volumes' runs: a single saturated
thread (QSD 10.0's main loop serving every export) shows there. On QEMU 11
the driver spreads VM exports over its iothreads (one per core by default)
and gives each FUSE export all of them, so on a machine with more cores the
same command shows how far that carries.

``--pool-dir`` and ``--pool-fs`` put the file pool and the baseline's raw files
elsewhere (``--pool-fs``: a fresh xfs or ext4 on a direct-I/O loop device, a
layer the baseline's direct writes pay and QSD's buffered ones only at
writeback). The pool's filesystem decides how QSD's buffered writes go:
io_uring completes one to XFS in QSD's own thread; ext4 (in this kernel) has
no asynchronous buffered writes, so io_uring hands each to a worker thread
(the ``iou-wrk`` in the CPU column) and QSD waits for its wake-up.

``--shards 1,2`` repeats each runtime with the driver's ``--qsd-shards``,
volume i placed on shard i mod S, so N volumes use min(N, S) QSD processes,
each serving its VM disks from its own main loop (the CPU column shows each
shard's threads: s0, s1, ...); beside the VM rows, a projection for a node
with a core per shard, an estimate from this run and printed as one.
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
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from csi_qsd.exports.fuse_loop import export_file
from csi_qsd.qsd.shards import place
from csi_qsd.sys import filesystems, fusectl, mounts
from csi_qsd.sys.tools import bundled
from e2e.bench import blkio_client
from e2e.bench.fio import Job, fio
from e2e.bench.loop_devices import loop_device, raw_file
from e2e.bench.process_usage import MachineCPU, ThreadCPU
from e2e.bench.report_tables import progress, ratio, table
from e2e.bench.served_bench import ServedBench, logged, missing, run_to_end
from e2e.bench.shell import output, sh
from e2e.bench.sizes import MIB
from testing.harness import Sandbox, qsd_pid, sandbox

SIZE = 256 * MIB
POOL_FS_BYTES = 8 * 4 * SIZE  # --pool-fs: 4 volumes and 4 baseline files of each kind, with room to spare
PARAMS = {"format": "raw", "preallocation": "full"}


@dataclasses.dataclass(frozen=True)
class Runtime:
    version: str  # "10" or "11": the install's qemu-storage-daemon-<version>
    iothreads: int | None  # --iothreads, None for the driver's default (one per core)
    fuse: str = ""  # --fuse-threads, "" for the driver's default
    shards: int = 1  # --qsd-shards

    @classmethod
    def parse(cls, text: str) -> "Runtime":
        version, _, rest = text.partition(":")
        threads, _, fuse = rest.partition(":")
        if version not in ("10", "11") or (threads and not threads.isdigit()) or fuse not in ("", "pool", "main"):
            raise argparse.ArgumentTypeError(f"expected VERSION[:IOTHREADS[:pool|main]], got {text!r}")
        return cls(version, int(threads) if threads else None, fuse)

    @property
    def binary(self) -> str:
        return bundled(f"qemu-storage-daemon-{self.version}")

    def flags(self) -> list[str]:
        return ["--qsd-binary", self.binary, *(["--iothreads", str(self.iothreads)] if self.iothreads else []),
                *(["--fuse-threads", self.fuse] if self.fuse else []), "--qsd-shards", str(self.shards)]


NAMESPACE_KEY = "csi.storage.k8s.io/pvc/namespace"


def namespace_for(index: int, shards: int) -> str:
    """A claim namespace that places volume `index` on shard index mod `shards` (the driver's own rule)."""
    wanted = index % shards
    return next(f"bench-{index}-{n}" for n in range(10_000) if place(f"namespace:bench-{index}-{n}", shards) == wanted)


@dataclasses.dataclass
class Row:
    kind: str
    job: str
    count: int
    volume: list[float] = dataclasses.field(default_factory=list)
    baseline: list[float] = dataclasses.field(default_factory=list)
    threads: list[str] = dataclasses.field(default_factory=list)
    busiest: list[float] = dataclasses.field(default_factory=list)  # CPU share of the busiest QSD thread
    in_flight: str = "-"  # FUSE requests in flight per volume (pods), "max M, mean A"
    volume_cores: list[float] = dataclasses.field(default_factory=list)  # the machine's busy cores, each run
    baseline_cores: list[float] = dataclasses.field(default_factory=list)

    def cpu_per_io(self) -> tuple[float, float]:
        """The machine's CPU microseconds per I/O on the volumes' side and on the baseline's (0 if not measured)."""
        def per_io(cores: list[float], iops: list[float]) -> float:
            return statistics.mean(cores) / statistics.mean(iops) * 1e6 if cores and iops and min(iops) > 0 else 0.0
        return per_io(self.volume_cores, self.volume), per_io(self.baseline_cores, self.baseline)


class InFlight:
    """Samples fusectl's `waiting` (FUSE requests queued or being served) of some FUSE connections."""

    def __init__(self, export_files: list[Path]) -> None:
        self.files = [fusectl.CONNECTIONS / str(os.minor(os.stat(f).st_dev)) / "waiting" for f in export_files]
        self.samples: list[int] = []

    async def sample(self, until: asyncio.Event) -> None:
        while not until.is_set():
            self.samples += [int(f.read_text()) for f in self.files]
            await asyncio.sleep(0.01)

    def summary(self) -> str:
        if not self.samples:
            return "-"
        return f"max {max(self.samples)}, mean {statistics.mean(self.samples):.1f}"


def qd32(rw: str) -> Job:
    return Job(f"4k {rw} QD32", rw, "4k", 32)


async def blkio_iops(driver: str, paths: list[Path], write: bool, seconds: float) -> float:
    """Aggregate IOPS of one polling libblkio client per path, all at once (4k random, QD32 each)."""
    runs = [blkio_client.iops(driver, path, write=write, seconds=seconds, size=SIZE) for path in paths]
    return sum(await asyncio.gather(*runs))


async def compare(row: Row, pids: list[int], rounds: int, volume: Callable[[], Awaitable[float]],
                  baseline: Callable[[], Awaitable[float]], fuse_exports: list[Path] | None = None,
                  first: int = 0) -> None:
    """`rounds` of `volume` and `baseline` alternating which goes first (ABBA; the volume first in even turns,
    counted from `first`), with QSD's CPU per thread and the FUSE requests in flight during the volumes' runs,
    and the machine's busy cores during each side's runs."""
    for turn in range(first, first + rounds):
        async def on_volume() -> None:
            sampler = InFlight(fuse_exports) if fuse_exports else None
            done = asyncio.Event()
            sampling = asyncio.create_task(sampler.sample(done)) if sampler else None
            before = [ThreadCPU.take(pid) for pid in pids]
            machine = MachineCPU.take()
            try:
                row.volume.append(await volume())
                row.volume_cores.append(MachineCPU.take().busy_cores_since(machine))
            finally:
                done.set()
                if sampling is not None:
                    await sampling
            after = [ThreadCPU.take(pid) for pid in pids]
            if sampler is not None:
                row.in_flight = sampler.summary()
            shares = [a.since(b) for a, b in zip(after, before)]
            row.threads.append(shares[0] if len(shares) == 1 else
                               "; ".join(f"s{i}: {share}" for i, share in enumerate(shares)))
            row.busiest.append(max(a.busiest_since(b) for a, b in zip(after, before)))

        async def on_baseline() -> None:
            machine = MachineCPU.take()
            row.baseline.append(await baseline())
            row.baseline_cores.append(MachineCPU.take().busy_cores_since(machine))

        for step in ((on_volume, on_baseline) if turn % 2 == 0 else (on_baseline, on_volume)):
            await step()


def projection(cases: list[tuple[str, Row, int]], shards: int) -> str:
    """For each (job, its one-volume row, N): N volumes on a node with a core per QSD shard, estimated from the row's
    IOPS per CPU-second of its busiest QSD thread, times the shards N volumes use; '' if there is none to project."""
    lines = []
    for job, one, n in cases:
        if one.busiest:
            per_cpu = statistics.mean(one.volume) / max(statistics.mean(one.busiest), 0.05)
            used = min(n, shards)
            lines.append([job, str(n), str(used), f"{per_cpu / 1000:.1f}k", f"{used * per_cpu / 1000:.1f}k"])
    return ("projection (an estimate, not measured here): a core per QSD shard; one volume's IOPS per CPU-second "
            "of the busiest QSD thread, times the shards N volumes use\n"
            + table(["job", "N", "shards used", "IOPS per thread-CPU", "projected ceiling"], lines)) if lines else ""


def qsd_pids_of(box: Sandbox, shards: int) -> list[int]:
    pids = [qsd_pid(box, shard) for shard in range(shards)]
    if None in pids:
        raise RuntimeError(f"a QSD shard is not running: {pids}")
    return [pid for pid in pids if pid is not None]


class Bench(ServedBench):
    def __init__(self, box: Sandbox, runtime: Runtime, counts: list[int], kinds: list[str], seconds: float,
                 rounds: int, pool: Path) -> None:
        super().__init__(box, "--pool-dir", str(pool), *runtime.flags())
        self.runtime, self.counts, self.kinds = runtime, counts, kinds
        self.seconds, self.rounds, self.pool = seconds, rounds, pool
        self.rows: list[Row] = []
        self.version = "?"
        self.placement = "?"

    async def phases(self, csi: CSIClient) -> None:
        if f := logged(self.driver, "qsd_version"):
            self.version = f"QSD {f['version']}"
            self.placement = (f"{f['iothreads']} iothreads; VM exports in {f['vhost_exports_in']}, FUSE exports in "
                              f"{f['fuse_exports_in']}")
        async with contextlib.AsyncExitStack() as stack:
            raws = [await stack.enter_async_context(raw_file(self.pool / f"baseline-{i}.raw", SIZE))
                    for i in range(max(self.counts))]
            for raw in raws:  # written once, as the volumes are (preallocation=full)
                await output("dd", "if=/dev/zero", f"of={raw}", "bs=1M", f"count={SIZE // MIB}", "oflag=direct",
                             "conv=notrunc", "status=none")
            if "pod" in self.kinds:
                await self._pods(csi, raws)
            if "vm" in self.kinds:
                await self._vms(csi, raws)

    async def _volume(self, csi: CSIClient, name: str, params: dict[str, str], *, block: bool, index: int) -> Path:
        params = {**params, NAMESPACE_KEY: namespace_for(index, self.runtime.shards)}
        return (await self.stage(csi, name, SIZE, params, block=block)).target

    async def _pods(self, csi: CSIClient, raws: list[Path]) -> None:
        volumes = [await self._volume(csi, f"pod-{i}", PARAMS, block=True, index=i) for i in range(max(self.counts))]
        pod_volumes = list(self.staged)
        async with contextlib.AsyncExitStack() as stack:
            loops = [await stack.enter_async_context(loop_device(raw)) for raw in raws]
            for rw in ("randwrite", "randread"):
                for n in self.counts:
                    exports = [export_file(self.box.state_dir / "exports", vid) for vid in pod_volumes[:n]]
                    await self._compare(Row("pod", f"4k {rw} QD32", n),
                                        functools.partial(fio, qd32(rw), *volumes[:n], runtime=self.seconds, size=SIZE),
                                        functools.partial(fio, qd32(rw), *loops[:n], runtime=self.seconds, size=SIZE),
                                        exports)

    async def _vms(self, csi: CSIClient, raws: list[Path]) -> None:
        # writeback: a VM that flushes (the default writethrough adds a flush to every write, measured apart
        # by e2e.bench.partitions_vm)
        params = {**PARAMS, "export": "vhost-user-blk", "cache": "writeback"}
        targets = [await self._volume(csi, f"vm-{i}", params, block=False, index=i) for i in range(max(self.counts))]
        sockets = [t / "vhost-user-blk.sock" for t in targets]
        for write in (True, False):
            for n in self.counts:
                job = f"4k rand{'write' if write else 'read'} QD32"
                await self._compare(
                    Row("vm", job, n),
                    functools.partial(blkio_iops, "virtio-blk-vhost-user", sockets[:n], write, self.seconds),
                    functools.partial(blkio_iops, "io_uring", raws[:n], write, self.seconds))

    async def _compare(self, row: Row, volume: Callable[[], Awaitable[float]],
                       baseline: Callable[[], Awaitable[float]], fuse_exports: list[Path] | None = None) -> None:
        progress(f"{row.kind} {row.job} x{row.count}")
        await compare(row, qsd_pids_of(self.box, self.runtime.shards), self.rounds, volume, baseline, fuse_exports)
        self.rows.append(row)

    def render(self) -> str:
        rows = []
        ones: dict[tuple[str, str], tuple[float, float]] = {}
        for row in self.rows:
            vol, base = statistics.mean(row.volume), statistics.mean(row.baseline)
            if row.count == 1:
                ones[(row.kind, row.job)] = (vol, base)
            one_vol, one_base = ones.get((row.kind, row.job), (0.0, 0.0))
            spread = f"{min(row.volume) / 1000:.1f}-{max(row.volume) / 1000:.1f}k"
            rows.append([f"{row.kind} {row.job}", str(row.count), f"{vol / 1000:.1f}k", spread,
                         f"{base / 1000:.1f}k", ratio(vol, base), ratio(vol, one_vol), ratio(base, one_base),
                         row.in_flight, row.threads[-1] if row.threads else "-"])
        head = [f"{self.version} ({self.placement}); {self.runtime.shards} QSD shard(s); {os.cpu_count()} cores; "
                f"pool on {mounts.filesystem_of(self.pool) or '?'}; {self.rounds} rounds, mean"]
        return "\n".join(head) + "\n" + table(
            ["job", "N", "volumes", "spread", "regions", "ratio", "vol xN/x1", "reg xN/x1",
             "FUSE in flight/vol", "QSD CPU per thread (volumes' last run)"], rows) + "\n" + projection(
            [(f"vm {r.job}", r, n) for r in self.rows if r.kind == "vm" and r.count == 1 for n in self.counts],
            self.runtime.shards)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qsd", type=lambda t: [Runtime.parse(p) for p in t.split(",")],
                        default=[Runtime("10", None), Runtime("11", None)],
                        help="QSD runtimes, comma-separated: VERSION[:IOTHREADS[:pool|main]], e.g. 10,11,11:4:pool "
                             "(the driver's --iothreads and --fuse-threads; default 10,11)")
    parser.add_argument("--shards", type=lambda t: [int(p) for p in t.split(",")], default=[1],
                        help="the driver's --qsd-shards, comma-separated: each runtime once per count (default 1)")
    parser.add_argument("--counts", type=lambda t: [int(p) for p in t.split(",")], default=[1, 2, 4])
    parser.add_argument("--kinds", type=lambda t: t.split(","), default=["pod", "vm"])
    parser.add_argument("--runtime", type=float, default=5, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pool-dir", type=Path, default=None,
                        help="make the file pool and the baseline's files in a new directory under this one "
                             "(default: the sandbox's state dir)")
    parser.add_argument("--pool-fs", choices=["xfs", "ext4"], default=None,
                        help="make the file pool and the baseline's files on a new filesystem of this type, "
                             "on a direct-I/O loop device over a file in the sandbox")
    args = parser.parse_args(argv)
    if args.pool_dir is not None and args.pool_fs is not None:
        parser.error("--pool-dir and --pool-fs exclude each other")
    return args


@contextlib.contextmanager
def pool_dir(box: Sandbox, under: Path | None, fs_type: str | None) -> Iterator[Path]:
    """The pool directory for one runtime's run: the sandbox's, a new one under `under` or on a new `fs_type`."""
    if fs_type is not None:
        with new_filesystem(box.root, fs_type) as mountpoint:
            yield mountpoint
        return
    if under is None:
        yield box.state_dir / "pool"
        return
    made = Path(tempfile.mkdtemp(prefix="csi-qsd-bench-pool-", dir=under))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


@contextlib.contextmanager
def new_filesystem(root: Path, fs_type: str, size: int = POOL_FS_BYTES) -> Iterator[Path]:
    """A fresh `fs_type` filesystem of `size` bytes, mounted under `root`, on a direct-I/O loop device over a file in `root`."""
    image, mountpoint = root / f"pool-{fs_type}.img", root / f"pool-{fs_type}"
    image.touch()
    os.truncate(image, size)
    mountpoint.mkdir()
    device = sh("losetup", "--find", "--show", "--direct-io=on", str(image)).strip()
    try:
        asyncio.run(filesystems.make(Path(device), fs_type))  # as the driver makes them: no lazy init left running
        sh("mount", device, str(mountpoint))
        try:
            yield mountpoint
        finally:
            sh("umount", str(mountpoint))
    finally:
        sh("losetup", "--detach", device)
        image.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if missing("fio"):
        return 2
    for runtime in (dataclasses.replace(r, shards=n) for r in args.qsd for n in args.shards):
        with sandbox() as box, pool_dir(box, args.pool_dir, args.pool_fs) as pool:
            bench = Bench(box, runtime, args.counts, args.kinds, args.runtime, args.rounds, pool)
            code = run_to_end(bench.run(), bench.driver, what=f"scaling on QSD {runtime.version}")
            if code:
                return code
            print(bench.render(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
