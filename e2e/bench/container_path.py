"""Container path speed: a csi-qsd volume as a pod sees it, beside a loop device on a raw file, in one run.

Runs `csi-qsd serve` as a separate process and drives it over its UNIX socket
the way the external-provisioner and kubelet do (CreateVolume, NodeStage,
NodePublish). Two pairs, each measured in the same run:

  filesystem  fio inside the published target of a csi-qsd filesystem volume
              (ext4 on the driver's loop device over QSD's FUSE export) vs ext4
              made the same way on a direct-I/O loop device over a raw file in
              the same pool directory;
  block       fio on the published block device of a csi-qsd block volume vs a
              direct-I/O loop device over a raw file.

Jobs (fio, O_DIRECT, libaio, over a region written once beforehand, so the
figures are of overwrites and reads of allocated data, never of allocation):
4k random read and write at QD1 and QD32, 1 MiB sequential read and write at
QD8. Each job runs in rounds, the volume and its baseline back to back in
each, alternating which goes first (ABBA), so load from other processes hits
both alike; a figure is the mean over its rounds. The machines this runs on
are shared: read the ratios, and rerun before trusting a small change.

Prints QSD's version and the loop device mode the driver chose (and the
modes actually in effect, from sysfs). It prints figures, never pass/fail.
Needs root, /dev/fuse, loop devices and fio. About 5 minutes with the default
2 rounds of 5 s per job, 1.5 with --quick. Usage:

    .venv/bin/python -m e2e.bench.container_path [--runtime 5] [--rounds 2] [--quick]
        [--param format=raw --param preallocation=full] [--loop-io auto|direct|buffered] [--qsd 10|11]

Beside each ratio: QSD's CPU per thread during the volume's last run of the
job (/proc/PID/task/*/stat), so a single saturated thread shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from csi_qsd.sys.tools import bundled
from e2e.bench.fio import Job, fio, lay_out
from e2e.bench.loop_devices import ext4_on, loop_device, loop_mode_of, raw_file
from e2e.bench.report_tables import figure, progress, ratio, table
from e2e.bench.scaling import Row, compare, qsd_pids_of
from e2e.bench.served_bench import ServedBench, bench_main, logged
from e2e.bench.shell import sh
from e2e.bench.sizes import GIB, MIB
from testing.harness import Sandbox

VOLUME_SIZE = 1 * GIB
REGION = 512 * MIB  # what the jobs touch: half the volume, leaving ext4 its metadata
QUICK_RUNTIME = 3
QUICK_ROUNDS = 1
QUICK_REGION = 256 * MIB
REQUIRED_TOOLS = ("fio", "losetup", "mkfs.ext4", "qemu-storage-daemon")


JOBS = (
    Job("4k randread QD1", "randread", "4k", 1),
    Job("4k randread QD32", "randread", "4k", 32),
    Job("4k randwrite QD1", "randwrite", "4k", 1),
    Job("4k randwrite QD32", "randwrite", "4k", 32),
    Job("1M read QD8", "read", "1M", 8),
    Job("1M write QD8", "write", "1M", 8),
)


@dataclasses.dataclass
class Pair:
    """One kind of volume and its baseline: a row of figures (IOPS or MiB/s) per job, in JOBS' order."""

    title: str
    rows: list[Row] = dataclasses.field(default_factory=list)
    volume_loop: str = "?"
    baseline_loop: str = "?"


class Bench(ServedBench):
    """A sandbox, a served driver, the volumes it made, and the two pairs' figures."""

    def __init__(self, box: Sandbox, parameters: dict[str, str], loop_io: str, runtime: float, rounds: int,
                 region: int, qsd: str = "") -> None:
        extra = (["--loop-io", loop_io] if loop_io else [])
        extra += ["--qsd-binary", bundled(f"qemu-storage-daemon-{qsd}")] if qsd else []
        super().__init__(box, *extra)
        self.parameters = parameters
        self.runtime = runtime
        self.rounds = rounds
        self.region = region
        self.pool = box.state_dir / "pool"
        self.pairs: list[Pair] = []
        self.qsd: str = "?"

    async def phases(self, csi: CSIClient) -> None:
        f = logged(self.driver, "qsd_version")
        self.qsd = (f"QSD {f['version']}, loop devices {f['loop_io']} (--loop-io {f['setting']}), FUSE exports in "
                    f"{f['fuse_exports_in']} ({f['iothreads']} iothreads)" if f else "? (the driver logged no version)")
        await self._filesystem(csi)
        await self._block(csi)

    async def _compare(self, pair: Pair, volume: Path, baseline: Path) -> None:
        progress(f"{pair.title}: laying out {self.region // MIB} MiB on each")
        await lay_out(volume, self.region)
        await lay_out(baseline, self.region)
        self.pairs.append(pair)
        for index, job in enumerate(JOBS):  # the turns go on from job to job
            progress(f"{pair.title}: {job.name}, {self.rounds} x {self.runtime} s each")
            pair.rows.append(Row(pair.title, job.name, 1))
            await compare(pair.rows[-1], qsd_pids_of(self.box, 1), self.rounds,
                          functools.partial(fio, job, volume, runtime=self.runtime, size=self.region),
                          functools.partial(fio, job, baseline, runtime=self.runtime, size=self.region),
                          first=index * self.rounds)

    async def _filesystem(self, csi: CSIClient) -> None:
        pair = Pair("filesystem")
        target = (await self.stage(csi, "bench-fs", VOLUME_SIZE, self.parameters)).target
        pair.volume_loop = loop_mode_of(target)
        async with raw_file(self.pool / "bench-fs.raw", VOLUME_SIZE) as raw, loop_device(raw) as device, \
                ext4_on(device, self.box.root / "ext4-raw") as mountpoint:
            pair.baseline_loop = loop_mode_of(mountpoint)
            await self._compare(pair, target / "fio.dat", mountpoint / "fio.dat")

    async def _block(self, csi: CSIClient) -> None:
        pair = Pair("block")
        target = (await self.stage(csi, "bench-blk", VOLUME_SIZE, self.parameters, block=True)).target
        pair.volume_loop = loop_mode_of(target)
        async with raw_file(self.pool / "bench-blk.raw", VOLUME_SIZE) as raw, loop_device(raw) as device:
            pair.baseline_loop = loop_mode_of(device)
            await self._compare(pair, target, device)


def report(bench: Bench) -> str:
    params = ", ".join(f"{k}={v}" for k, v in sorted(bench.parameters.items())) or \
        "defaults (qcow2, preallocation=off)"
    lines = [
        f"{bench.qsd}; volume class: {params}",
        f"fio O_DIRECT libaio, {bench.rounds} x {bench.runtime:g} s per job, {bench.region // MIB} MiB region "
        "written beforehand; "
        f"{VOLUME_SIZE // GIB} GiB volumes; load average {os.getloadavg()[0]:.2f} at the end",
    ]
    for pair in bench.pairs:
        rows = []
        for job, row in zip(JOBS, pair.rows):
            if row.volume and row.baseline:
                volume, baseline = statistics.mean(row.volume), statistics.mean(row.baseline)
                rows.append([job.label, figure(volume), f"{figure(min(row.volume))}-{figure(max(row.volume))}",
                             figure(baseline), ratio(volume, baseline), row.threads[-1]])
        what = "ext4 in the published volume" if pair.title == "filesystem" else "the published block device"
        base = "ext4 on a loop device on a raw file" if pair.title == "filesystem" else "a loop device on a raw file"
        lines += [
            "",
            f"{pair.title}: {what} (loop {pair.volume_loop}) vs {base} (loop {pair.baseline_loop})",
            table(["job", "csi-qsd", "spread", "baseline", "ratio", "QSD CPU per thread"], rows),
        ]
    return "\n".join(lines)


def key_value(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"--param takes KEY=VALUE, not {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.container_path", description=__doc__.split("\n")[0])
    parser.add_argument("--runtime", type=float, default=5, help="seconds per fio run (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each job on each side (default 2)")
    parser.add_argument("--region-mib", type=int, default=REGION // MIB, help="MiB the jobs touch (default 512)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_ROUNDS} x {QUICK_RUNTIME} s per job over {QUICK_REGION // MIB} MiB")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                        help="StorageClass parameter of the volumes (repeatable), e.g. format=raw")
    parser.add_argument("--loop-io", default="", choices=["", "auto", "direct", "buffered"],
                        help="passed to `csi-qsd serve` (default: the driver's own default)")
    parser.add_argument("--qsd", default="", choices=["", "10", "11"],
                        help="the install's qemu-storage-daemon-10 or -11 (default: the default runtime)")
    args = parser.parse_args(argv)
    parameters = dict(args.param)
    if args.runtime <= 0 or args.rounds < 1 or not 0 < args.region_mib * MIB < VOLUME_SIZE:
        parser.error("--runtime must be positive, --rounds at least 1, --region-mib under the volume's 1024")
    runtime, rounds, region = (
        (QUICK_RUNTIME, QUICK_ROUNDS, QUICK_REGION) if args.quick
        else (args.runtime, args.rounds, args.region_mib * MIB)
    )
    def made(box: Sandbox) -> Bench:
        qsd = bundled(f"qemu-storage-daemon-{args.qsd}") if args.qsd else "qemu-storage-daemon"
        progress(sh(qsd, "--version").splitlines()[0])
        return Bench(box, parameters, args.loop_io, runtime, rounds, region, args.qsd)

    return bench_main(made, report, tools=REQUIRED_TOOLS)


if __name__ == "__main__":
    sys.exit(main())
