"""Control-plane benchmark: CSI call latencies and QSD memory for many volumes, against baselines.

Runs `csi-qsd serve` as a separate process and drives it over its UNIX socket
as the external-provisioner and kubelet would, for N filesystem volumes
(qcow2, 1 GiB, ext4):

    CreateVolume                     vs bare `qemu-img create`, the same made durable,
                                        mkdir and `fallocate -l 1G` (csi-driver-host-path)
    NodeStageVolume+NodePublish      vs losetup on a raw file + mkfs.ext4 + mount + bind mount
    NodeUnpublish+NodeUnstage        vs umount bind + umount + losetup -d
    DeleteVolume                     vs unlink of the image
    QSD RSS with N staged            vs QSD with no volume

Every baseline sample is taken right before the driver's sample it is compared
with, so load from other processes on the machine hits both alike. At the end
the figures are checked against the issue's targets (CreateVolume p99 < 100 ms,
< 2 MiB of QSD memory per volume) and printed as PASS or MISS.

Everything is undone through the driver, also on failure or Ctrl-C. Usage:

    .venv/bin/python -m e2e.bench.control_plane [--volumes 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from csi_qsd.sys import loop, mounts
from csi_qsd.sys.durable import fsync_path
from e2e.bench.latencies import Summary, measured, timed
from e2e.bench.process_usage import open_fds, status_field_kib
from e2e.bench.report_tables import ms, ratio, table, verdict
from e2e.bench.served_bench import ServedBench, bench_main, log_problems
from e2e.bench.shell import sh
from e2e.bench.sizes import GIB, KIB
from e2e.bench.staged_volumes import Staged, release
from testing.harness import Sandbox, qsd_pid

REQUIRED_TOOLS = ("qemu-storage-daemon", "qemu-img", "losetup", "mkfs.ext4", "mount", "umount", "fallocate")
SIZE = GIB
FS_TYPE = "ext4"
PARAMETERS = {"format": "qcow2", "export": "filesystem"}
# The options csi_qsd.sys.filesystems.make passes, so the baseline formats the same way.
MKFS_EXT4 = ("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard")

TARGET_CREATE_P99_MS = 100.0
TARGET_RSS_PER_VOLUME_KIB = 2 * 1024


@dataclasses.dataclass
class Memory:
    """One snapshot of the processes' memory and descriptors."""

    key: str  # empty, created, staged, unstaged, deleted
    label: str
    qsd_rss_kib: int
    qsd_fds: int
    driver_rss_kib: int
    loops: int
    mounts: int


@dataclasses.dataclass
class Results:
    """Every series of samples (ms) and memory snapshot, filled in as the phases run."""

    probe: list[float] = dataclasses.field(default_factory=list)
    create: list[float] = dataclasses.field(default_factory=list)
    qemu_img: list[float] = dataclasses.field(default_factory=list)
    qemu_img_durable: list[float] = dataclasses.field(default_factory=list)
    mkdir: list[float] = dataclasses.field(default_factory=list)
    fallocate: list[float] = dataclasses.field(default_factory=list)
    stage: list[float] = dataclasses.field(default_factory=list)
    stage_only: list[float] = dataclasses.field(default_factory=list)
    publish_only: list[float] = dataclasses.field(default_factory=list)
    host_up: list[float] = dataclasses.field(default_factory=list)
    host_mkfs: list[float] = dataclasses.field(default_factory=list)
    unstage: list[float] = dataclasses.field(default_factory=list)
    host_down: list[float] = dataclasses.field(default_factory=list)
    delete: list[float] = dataclasses.field(default_factory=list)
    unlink: list[float] = dataclasses.field(default_factory=list)
    unlink_durable: list[float] = dataclasses.field(default_factory=list)
    memory: list[Memory] = dataclasses.field(default_factory=list)
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    peak_free_loop: str = ""
    driver_log: str = ""  # its warnings and errors


class Bench(ServedBench):
    """One run: a sandbox, a served driver, the host baselines, and what they measured."""

    client_timeout = 120.0

    def __init__(self, box: Sandbox, volumes: int) -> None:
        super().__init__(box)
        self.n = volumes
        self.results = Results()
        self.base = box.root / "baseline"
        self.base.mkdir()
        self.used_loops: set[str] = set()  # loop devices seen under our staging mounts

    # the run --------------------------------------------------------------

    async def phases(self, csi: CSIClient) -> None:
        r = self.results
        await self._phase("probe", self._probe, csi)
        self._snapshot("empty", "QSD started, no volume (baseline)")
        await self._phase("create", self._create, csi)
        self._snapshot("created", f"{self.n} created, none staged")
        await self._phase("stage", self._stage, csi)
        self._snapshot("staged", f"{self.n} staged + published")
        r.peak_free_loop = sh("losetup", "--find").strip()
        await self._phase("unstage", self._unstage, csi)
        self._snapshot("unstaged", "all unpublished + unstaged")
        await self._phase("delete", self._delete, csi)
        self._snapshot("deleted", "all deleted")

    async def _phase(self, name: str, body: Callable[[CSIClient], Awaitable[None]], csi: CSIClient) -> None:
        start = time.monotonic()
        print(f"phase {name} ...", file=sys.stderr, flush=True)
        try:
            await body(csi)
        finally:
            self.results.phase_seconds[name] = time.monotonic() - start

    async def _probe(self, csi: CSIClient) -> None:
        for _ in range(self.n):
            with timed(self.results.probe):
                await csi.probe()

    async def _create(self, csi: CSIClient) -> None:
        r = self.results
        for i in range(self.n):
            hostpath_dir = self.base / f"hp{i:04d}"
            with timed(r.mkdir):
                os.makedirs(hostpath_dir)
            image = self.base / f"img{i:04d}.qcow2"
            with timed(r.qemu_img):
                sh("qemu-img", "create", "-q", "-f", "qcow2", str(image), str(SIZE))
            durable_tmp, durable = self.base / "durable.tmp", self.base / "durable.qcow2"
            with timed(r.qemu_img_durable):
                sh("qemu-img", "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=off", str(durable_tmp), str(SIZE))
                fsync_path(durable_tmp)
                os.rename(durable_tmp, durable)
                fsync_path(self.base)
            durable.unlink()
            block_file = self.base / "falloc.img"
            with timed(r.fallocate):
                sh("fallocate", "--length", str(SIZE), str(block_file))
            block_file.unlink()
            with timed(r.create):
                volume = await csi.create_volume(f"pvc-bench-{i:04d}", SIZE, PARAMETERS, fs_type=FS_TYPE)
            self.volumes.append(volume.volume_id)

    async def _stage(self, csi: CSIClient) -> None:
        r = self.results
        for i, volume_id in enumerate(self.volumes):
            self._host_stage_and_unstage()
            # kubelet creates the staging dir and the target's parent
            v = Staged(volume_id, self.box.staging(f"v{i:04d}"), self.box.target(f"pod{i:04d}"))
            self.staged[volume_id] = v
            with timed(r.stage):
                with timed(r.stage_only):
                    await csi.stage(volume_id, str(v.staging), fs_type=FS_TYPE)
                with timed(r.publish_only):
                    await csi.publish(volume_id, str(v.staging), str(v.target), fs_type=FS_TYPE)

    def _host_stage_and_unstage(self) -> None:
        """The raw host steps a filesystem volume needs, with no driver: the stage baselines."""
        r = self.results
        raw = self.base / "raw.img"
        staging, target = self.base / "staging", self.base / "target"
        with open(raw, "wb") as handle:
            handle.truncate(SIZE)
        with timed(r.host_up):
            device = sh("losetup", "--find", "--show", "--direct-io=off", str(raw)).strip()
            with timed(r.host_mkfs):
                sh(*MKFS_EXT4, device)
            staging.mkdir()
            sh("mount", "-t", FS_TYPE, device, str(staging))
            target.mkdir()
            sh("mount", "--bind", str(staging), str(target))
        with timed(r.host_down):
            sh("umount", str(target))
            target.rmdir()
            sh("umount", str(staging))
            sh("losetup", "--detach", device)
        staging.rmdir()
        raw.unlink()

    async def _unstage(self, csi: CSIClient) -> None:
        for volume_id, v in list(self.staged.items()):
            with timed(self.results.unstage):
                await release(csi, v, delete=False)
            del self.staged[volume_id]

    async def _delete(self, csi: CSIClient) -> None:
        r = self.results
        for i, volume_id in enumerate(list(self.volumes)):
            with timed(r.unlink):
                (self.base / f"img{i:04d}.qcow2").unlink()
                os.rmdir(self.base / f"hp{i:04d}")
            durable = self.base / "durable.qcow2"
            sh("qemu-img", "create", "-q", "-f", "qcow2", str(durable), str(SIZE))
            with timed(r.unlink_durable):
                durable.unlink()
                fsync_path(self.base)
            with timed(r.delete):
                await csi.delete_volume(volume_id)
            self.volumes.remove(volume_id)

    # memory ---------------------------------------------------------------

    def _snapshot(self, key: str, label: str) -> None:
        pid = qsd_pid(self.box)
        if pid is None:
            raise RuntimeError(f"QSD is not running at '{label}': {self.driver.log()}")
        assert self.driver.proc is not None
        in_box = [m for m in mounts.mount_table() if self.box.root in m.mount_point.parents]
        self.used_loops |= {m.source for m in in_box if m.source.startswith("/dev/loop")}
        self.results.memory.append(Memory(
            key=key, label=label, qsd_rss_kib=status_field_kib(pid), qsd_fds=open_fds(pid),
            driver_rss_kib=status_field_kib(self.driver.proc.pid), loops=len(self._our_loops()), mounts=len(in_box),
        ))

    def _our_loops(self) -> list[str]:
        """Loop devices backed by our files, including those the driver used whose FUSE export went away.

        A loop device left attached after its FUSE export was unmounted lazily
        shows "/" as its backing file, so it is recognised by name and size.
        """
        found = []
        for lp in loop.loop_devices():
            if self.box.root in lp.backing_file.parents:
                found.append(str(lp.device))
            elif str(lp.device) in self.used_loops and lp.backing_file == Path("/") \
                    and loop.device_size(lp.device) == SIZE:
                found.append(str(lp.device))
        return found


# the report ---------------------------------------------------------------

RATIO_NOTE = "ratio = driver figure / baseline"


def _rows(figure: str, samples: list[float], parts: list[tuple[str, list[float]]],
          baselines: list[tuple[str, list[float]]]) -> list[list[str]]:
    if not samples:
        return []
    s = Summary.of(samples)
    rows = [[figure, str(s.count), ms(s.p50), ms(s.p99), ms(s.max), "", "", ""]]
    for label, part in parts:
        if part:
            p = Summary.of(part)
            rows.append([f"  part: {label}", str(p.count), ms(p.p50), ms(p.p99), ms(p.max), "", "", ""])
    for label, base in baselines:
        if base:
            b = Summary.of(base)
            rows.append([f"  baseline: {label}", str(b.count), ms(b.p50), ms(b.p99), ms(b.max),
                         ratio(s.p50, b.p50), ratio(s.p99, b.p99), ratio(s.max, b.max)])
    return rows


def report(r: Results, n: int, header: str) -> str:
    out = [header, ""]
    latency: list[list[str]] = []
    latency += _rows("CreateVolume (qcow2, 1 GiB, filesystem)", r.create, [], [
        ("qemu-img create -f qcow2 1G (bare)", r.qemu_img),
        ("same + fsync, rename, fsync dir", r.qemu_img_durable),
        ("mkdir (host-path, filesystem)", r.mkdir),
        ("fallocate -l 1G (host-path, block)", r.fallocate),
        ("Probe RPC (gRPC round trip)", r.probe),
    ])
    latency += _rows("NodeStage + NodePublish (ext4)", r.stage, [
        ("NodeStageVolume", r.stage_only), ("NodePublishVolume", r.publish_only),
    ], [
        ("losetup raw file + mkfs.ext4 + mount + bind", r.host_up),
        ("mkfs.ext4 alone (same options)", r.host_mkfs),
    ])
    latency += _rows("NodeUnpublish + NodeUnstage", r.unstage, [], [
        ("umount bind + umount + losetup -d", r.host_down),
        ("Probe RPC (gRPC round trip)", r.probe),
    ])
    latency += _rows("DeleteVolume", r.delete, [], [
        ("unlink image + rmdir (host-path)", r.unlink),
        ("unlink image + fsync dir", r.unlink_durable),
        ("Probe RPC (gRPC round trip)", r.probe),
    ])
    if latency:
        out.append(table(["latency, ms (" + RATIO_NOTE + ")", "n", "p50", "p99", "max",
                          "p50 ratio", "p99 ratio", "max ratio"], latency))
        out.append("")

    snapshots = {m.key: m for m in r.memory}
    base = snapshots.get("empty")
    if base is not None:
        rows = [[m.label, f"{m.qsd_rss_kib / KIB:.1f}", ratio(m.qsd_rss_kib, base.qsd_rss_kib), str(m.qsd_fds),
                 f"{m.driver_rss_kib / KIB:.1f}", str(m.loops), str(m.mounts)] for m in r.memory]
        out.append(table(["memory (baseline: QSD with no volume)", "QSD RSS MiB", "ratio", "QSD fds",
                          "driver RSS MiB", "loop devs", "mounts"], rows))
    staged, created = snapshots.get("staged"), snapshots.get("created")
    per_volume = None
    if base is not None and staged is not None:
        per_volume = (staged.qsd_rss_kib - base.qsd_rss_kib) / n
        out.append(f"QSD RSS per staged volume: {per_volume:.0f} KiB "
                   f"(({staged.qsd_rss_kib} - {base.qsd_rss_kib}) KiB / {n})")
        if created is not None:
            out.append(f"  of which staging alone: {(staged.qsd_rss_kib - created.qsd_rss_kib) / n:.0f} KiB; "
                       f"QSD with no volume: {base.qsd_rss_kib / KIB:.1f} MiB")
        out.append("")

    # Each check reads its figure itself: one not measured fails rather than vanish.
    targets = [
        ["CreateVolume p99 < 100 ms", f"{Summary.of(r.create).p99:.1f} ms" if r.create else "-",
         verdict(lambda: Summary.of(r.create).p99 < TARGET_CREATE_P99_MS)],
        ["QSD memory per volume < 2 MiB", "-" if per_volume is None else f"{per_volume:.0f} KiB",
         verdict(lambda: measured(per_volume, "QSD memory per volume") < TARGET_RSS_PER_VOLUME_KIB)],
    ]
    out.append(table(["target (from the issue)", "measured", "result"], targets))
    out.append("")

    scaling = []
    for label, samples, present in (
        ("CreateVolume", r.create, "volumes"), ("NodeStage + NodePublish", r.stage, "staged"),
        ("NodeUnpublish + NodeUnstage", r.unstage, "staged"), ("DeleteVolume", r.delete, "volumes"),
    ):
        tenth = len(samples) // 10
        if tenth >= 2:
            first, last = Summary.of(samples[:tenth]).p50, Summary.of(samples[-tenth:]).p50
            scaling.append([label, present, ms(first), ms(last), ratio(last, first)])
    if scaling:
        out.append(table(["scaling: p50 of the first vs the last 10% of calls, ms", "others present",
                          "first 10%", "last 10%", "ratio"], scaling))
        out.append("")

    slowest = []
    for label, samples in (("CreateVolume", r.create), ("NodeStage", r.stage_only),
                           ("NodePublish", r.publish_only), ("NodeUnpublish+Unstage", r.unstage),
                           ("DeleteVolume", r.delete)):
        if samples:
            s = Summary.of(samples)
            slowest.append(f"{label} #{s.slowest} {ms(s.max)} ms")
    if slowest:
        out.append("slowest samples (volume index): " + "; ".join(slowest))
    if r.phase_seconds:
        out.append("phase wall time, s (baselines included): "
                   + ", ".join(f"{k} {v:.1f}" for k, v in r.phase_seconds.items()))
    if r.peak_free_loop:
        out.append(f"next free loop device with all volumes staged: {r.peak_free_loop}")
    out.append(r.driver_log)
    return "\n".join(out)


# entry point --------------------------------------------------------------

def describe(n: int) -> str:
    version = sh("qemu-storage-daemon", "--version").splitlines()[0]
    block_devices = len(os.listdir("/sys/class/block"))
    return (f"csi-qsd control plane: {n} volumes, qcow2 {SIZE // GIB} GiB, filesystem export, {FS_TYPE}; "
            f"{version}; kernel {platform.release()}; {os.cpu_count()} CPUs; "
            f"{block_devices} block devices on the host at start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.control_plane", description=__doc__.split("\n")[0])
    parser.add_argument("--volumes", type=int, default=200, help="how many volumes to create and stage (default 200)")
    args = parser.parse_args(argv)
    if args.volumes < 1:
        parser.error("--volumes must be at least 1")
    header: list[str] = []

    def made(box: Sandbox) -> Bench:
        header.append(describe(args.volumes))  # once the tools are known to be there
        return Bench(box, args.volumes)

    def summary(bench: Bench) -> str:
        bench.results.driver_log = log_problems(bench.driver)
        return report(bench.results, args.volumes, header[0])

    return bench_main(made, summary, tools=REQUIRED_TOOLS, log_tail=None)


if __name__ == "__main__":
    sys.exit(main())
