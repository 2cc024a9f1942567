"""Snapshot benchmark: live snapshot, restore and clone latency of volumes holding data, beside a full copy.

Runs `csi-qsd serve` as a separate process and drives it over its UNIX socket.
For each size (1 GiB and 10 GiB by default) one qcow2 volume is staged and
published as a raw block volume (FUSE export + loop device), and most of it
(90%) is filled with incompressible non-zero data written through the
published device, so the data is really allocated in the qcow2 (checked with
`qemu-img map`). Then, with the volume still published:

    CreateSnapshot                       (live cut: new overlay + QMP blockdev-snapshot)
    CreateVolume from the first snapshot (restore: an overlay on the snapshot)
    CreateVolume from the volume         (clone of a volume in use: hidden cut + overlay)

each several times, round-robin over the sizes (so load from other processes
hits every size alike), beside these baselines measured in the same run on the
same filesystem:

    qemu-img create -b               a bare overlay: the floor of the O(1) approach
    cp --sparse=always + fsync       a full copy of the snapshot's image
    qemu-img convert -O qcow2 + fsync
    Probe                            one gRPC round trip

The repetitions are bounded by the driver's MAX_CHAIN_DEPTH: each snapshot and
each clone of the volume adds a layer to its chain, and a chain past that depth
is flattened (a full copy) in the background, which this benchmark must not
trigger. The issue's target is < 50 ms p50 for each call at every size, and
flat in size; it is printed as PASS or MISS.

Everything is undone through the driver, also on failure or Ctrl-C. Needs
root, /dev/fuse, and free space under /tmp for 90% of every size plus one more
copy of the largest (21 GiB for the default sizes). About 2 minutes. Usage:

    .venv/bin/python -m e2e.bench.snapshot_latency [--sizes 1,10] [--copies 1]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from csi_qsd.cli.client import CSIClient
from csi_qsd.controller.snapshots import MAX_CHAIN_DEPTH
from csi_qsd.sys.durable import fsync_path
from e2e.bench.latencies import Summary, timed
from e2e.bench.loop_devices import write_direct
from e2e.bench.report_tables import ms, progress, ratio, table, verdict
from e2e.bench.served_bench import ServedBench, bench_main, log_problems
from e2e.bench.shell import sh
from e2e.bench.sizes import GIB, MIB
from testing.harness import Sandbox

REQUIRED_TOOLS = ("qemu-storage-daemon", "qemu-img", "losetup", "cp")
PARAMETERS = {"format": "qcow2"}  # export "filesystem" (FUSE + loop device), published as a raw block volume
FILL_FRACTION = 0.9
WRITE_CHUNK = 8 * MIB
# Each snapshot and each clone adds one image to the source's chain; stay at or under the depth
# that starts a background flatten (a full copy) so the figures are those of the O(1) path.
SNAPSHOTS = 4
CLONES = MAX_CHAIN_DEPTH - 1 - SNAPSHOTS
RESTORES = 8
TARGET_MS = 50.0
FLAT_LIMIT = 2.0  # p50 at the largest size / p50 at the smallest: a copy would scale ~10x
SPACE_MARGIN = 2 * GIB

T = TypeVar("T")


def allocated_bytes(image: Path) -> int:
    """Bytes of guest data allocated in `image` itself (not its backing chain), per `qemu-img map`."""
    extents = json.loads(sh("qemu-img", "map", "-U", "--output=json", str(image)))
    return sum(e["length"] for e in extents if e.get("data") and e.get("depth", 0) == 0)


@dataclasses.dataclass
class SizeResults:
    """Every series (ms) measured on a volume of one size."""

    gib: int
    fill_bytes: int = 0
    fill_seconds: float = 0.0
    allocated: int = 0
    snapshot: list[float] = dataclasses.field(default_factory=list)
    snapshot_server: list[float] = dataclasses.field(default_factory=list)
    restore: list[float] = dataclasses.field(default_factory=list)
    restore_server: list[float] = dataclasses.field(default_factory=list)
    clone: list[float] = dataclasses.field(default_factory=list)
    clone_server: list[float] = dataclasses.field(default_factory=list)
    overlay: list[float] = dataclasses.field(default_factory=list)
    copy_cp: list[float] = dataclasses.field(default_factory=list)
    copy_convert: list[float] = dataclasses.field(default_factory=list)
    probe: list[float] = dataclasses.field(default_factory=list)


class Bench(ServedBench):
    """One run: a sandbox, a served driver, and per size the driver's figures and their baselines."""

    def __init__(self, box: Sandbox, sizes: Sequence[int], copies: int) -> None:
        super().__init__(box)
        self.sizes = sizes
        self.copies = copies
        self.results: list[SizeResults] = []
        self.header = describe(sizes)
        self.base = box.root / "baseline"
        self.base.mkdir()
        self.pool = box.state_dir / "pool"
        self.leftovers: list[str] = []

    async def phases(self, csi: CSIClient) -> None:
        """Fill one volume per size, then take the samples round-robin over the sizes.

        Interleaving puts the sizes side by side in time, so load from other
        processes on the machine hits all sizes alike and cannot fake (or hide)
        a growth with size.
        """
        sources = [await self._filled_volume(csi, SizeResults(gib)) for gib in self.sizes]
        first_images = [self.pool / f"{source}.qcow2" for source in sources]
        first_snapshots: list[str] = []
        progress(f"{SNAPSHOTS} snapshots per size ...")
        for i in range(SNAPSHOTS):
            for r, source, image in zip(self.results, sources, first_images):
                await self._baseline_overlay(r, image)
                with timed(r.probe):
                    await csi.probe()
                snapshot = await self._call(
                    "CreateSnapshot", r.snapshot, r.snapshot_server,
                    lambda: csi.create_snapshot(f"bench-snap-{r.gib}g-{i}", source),
                )
                self.snapshots.append(snapshot.snapshot_id)
                if i == 0:
                    first_snapshots.append(snapshot.snapshot_id)
        progress("full copies of the first snapshot's image ...")
        for r, image in zip(self.results, first_images):  # filled, and frozen since the first snapshot
            await self._full_copies(r, image)
        progress(f"{RESTORES} restores and {CLONES} clones per size ...")
        for i in range(RESTORES):
            for r, snapshot_id, image in zip(self.results, first_snapshots, first_images):
                await self._create_from(csi, r, r.restore, r.restore_server, f"bench-restore-{r.gib}g-{i}", image,
                                        from_snapshot=snapshot_id)
        for i in range(CLONES):
            for r, source, image in zip(self.results, sources, first_images):
                await self._create_from(csi, r, r.clone, r.clone_server, f"bench-clone-{r.gib}g-{i}", image,
                                        from_volume=source)

    async def _create_from(self, csi: CSIClient, r: SizeResults, samples: list[float], server: list[float],
                           name: str, image: Path, *, from_snapshot: str = "", from_volume: str = "") -> None:
        """A restore or a clone, timed beside a bare overlay on `image`."""
        await self._baseline_overlay(r, image)
        volume = await self._call("CreateVolume", samples, server, lambda: csi.create_volume(
            name, r.gib * GIB, PARAMETERS, block=True, from_snapshot=from_snapshot, from_volume=from_volume))
        self.volumes.append(volume.volume_id)

    async def _filled_volume(self, csi: CSIClient, r: SizeResults) -> str:
        """A volume of r.gib GiB, staged and published as a raw block device, 90% written; its ID."""
        self.results.append(r)
        size = r.gib * GIB
        progress(f"{r.gib} GiB: create, stage, publish, fill ...")
        volume = await self.stage(csi, f"bench-src-{r.gib}g", size, PARAMETERS, block=True)
        source, target = volume.id, volume.target
        r.fill_bytes = int(size * FILL_FRACTION) // WRITE_CHUNK * WRITE_CHUNK
        start = time.monotonic()
        await asyncio.to_thread(write_direct, target, range(0, r.fill_bytes, WRITE_CHUNK), WRITE_CHUNK)
        r.fill_seconds = time.monotonic() - start
        image = self.pool / f"{source}.qcow2"
        r.allocated = await asyncio.to_thread(allocated_bytes, image)
        if r.allocated < r.fill_bytes:
            raise RuntimeError(f"only {r.allocated} of {r.fill_bytes} written bytes are allocated in {image}")
        return source

    async def _call(self, method: str, samples: list[float], server: list[float],
                    call: Callable[[], Awaitable[T]]) -> T:
        """Time one CSI call from the client and, from the driver's log line, inside the driver."""
        offset = self.driver.log_path.stat().st_size
        with timed(samples):
            result = await call()
        with open(self.driver.log_path, "rb") as log:
            log.seek(offset)
            found = re.findall(rf"rpc={method} .*code=OK seconds=([0-9.]+)", log.read().decode(errors="replace"))
        if found:
            server.append(float(found[-1]) * 1000)
        return result

    async def _baseline_overlay(self, r: SizeResults, backing: Path) -> None:
        overlay = self.base / "overlay.qcow2"
        with timed(r.overlay):
            await asyncio.to_thread(sh, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=off",
                                    "-b", str(backing), "-F", "qcow2", str(overlay), str(r.gib * GIB))
        overlay.unlink()

    async def _full_copies(self, r: SizeResults, image: Path) -> None:
        copy = self.base / "copy.qcow2"
        for _ in range(self.copies):
            with timed(r.copy_cp):
                await asyncio.to_thread(sh, "cp", "--sparse=always", str(image), str(copy))
                await asyncio.to_thread(fsync_path, copy)
            copy.unlink()
            with timed(r.copy_convert):
                await asyncio.to_thread(sh, "qemu-img", "convert", "-U", "-f", "qcow2", "-O", "qcow2",
                                        str(image), str(copy))
                await asyncio.to_thread(fsync_path, copy)
            copy.unlink()

    async def undo(self, csi: CSIClient) -> None:
        await super().undo(csi)
        await self._check_pool_empty()

    async def _check_pool_empty(self, wait: float = 30.0) -> None:
        """DeleteVolume answers once the deletion is durable and frees the images in the background (with the
        hidden snapshots only the volume kept): give that `wait` seconds before calling what is left a leak."""
        deadline = time.monotonic() + wait
        while True:
            left = sorted(p.name for p in self.pool.iterdir()) if self.pool.exists() else []
            if not left:
                return
            if time.monotonic() > deadline:
                self.leftovers.append(f"{len(left)} image(s) left in the pool {wait:.0f} s after the last delete: "
                                      f"{', '.join(left[:4])}")
                return
            await asyncio.sleep(0.2)



# the report ---------------------------------------------------------------

def _series(label: str, samples: list[float], p50: float | None = None) -> list[str]:
    """One row: n, p50, max and, if `p50` (the driver's) is given, driver p50 / this p50."""
    if not samples:
        return [label, "0", "-", "-", ""]
    s = Summary.of(samples)
    return [label, str(s.count), ms(s.p50), ms(s.max), "" if p50 is None else ratio(p50, s.p50)]


def report(results: list[SizeResults], header: str, leftovers: list[str], driver_log: str) -> str:
    out = [header, ""]
    for r in results:
        gib = f"{r.gib} GiB"
        if r.fill_seconds:
            rate = r.fill_bytes / r.fill_seconds / MIB
            out.append(f"{gib} volume: {r.fill_bytes / GIB:.2f} GiB written through the published device in "
                       f"{r.fill_seconds:.1f} s ({rate:.0f} MiB/s); {r.allocated / GIB:.2f} GiB allocated "
                       "in its qcow2 (qemu-img map)")
    out.append("")
    rows: list[list[str]] = []
    for r in results:
        gib = f"{r.gib} GiB"
        for title, samples, server in (
            (f"CreateSnapshot, {gib} (published, live cut)", r.snapshot, r.snapshot_server),
            (f"CreateVolume from snapshot (restore), {gib}", r.restore, r.restore_server),
            (f"CreateVolume from volume (clone in use), {gib}", r.clone, r.clone_server),
        ):
            if not samples:
                continue
            p50 = Summary.of(samples).p50
            rows.append(_series(title, samples))
            rows.append(_series("  part: inside the driver (its log)", server))
            rows.append(_series("  baseline: qemu-img create -b (bare overlay)", r.overlay, p50))
            rows.append(_series("  baseline: full copy, cp --sparse=always + fsync", r.copy_cp, p50))
            rows.append(_series("  baseline: full copy, qemu-img convert + fsync", r.copy_convert, p50))
            rows.append(_series("  baseline: Probe (gRPC round trip)", r.probe, p50))
    if rows:
        out.append(table(["latency, ms (ratio = driver p50 / baseline p50)", "n", "p50", "max", "ratio"], rows))
        out.append("")

    measured = [r for r in results if r.snapshot]
    if measured:
        small, large = measured[0], measured[-1]
        targets = []
        series: tuple[tuple[str, str], ...] = (
            ("CreateSnapshot", "snapshot"), ("restore", "restore"), ("clone in use", "clone"),
            ("full copy (cp), for scale", "copy_cp"),
        )
        for label, field in series:
            per_size: list[list[float]] = [getattr(r, field) for r in measured]
            p50s = [Summary.of(samples).p50 if samples else float("nan") for samples in per_size]
            worst_max = max((Summary.of(samples).max for samples in per_size if samples), default=float("nan"))
            growth = p50s[-1] / p50s[0] if p50s[0] > 0 else float("inf")

            def holds(per_size: list[list[float]] = per_size) -> bool:  # a size not measured raises: FAIL
                p50s = [Summary.of(samples).p50 for samples in per_size]
                return max(p50s) < TARGET_MS and (len(p50s) == 1 or p50s[-1] / p50s[0] < FLAT_LIMIT)

            targets.append([label, *(ms(p) for p in p50s), ms(worst_max),
                            f"{growth:.2f}x" if len(measured) > 1 else "-", "" if "copy" in label else verdict(holds)])
        headers = [f"target: p50 < {TARGET_MS:.0f} ms at every size, flat (p50 growth < {FLAT_LIMIT:.0f}x)",
                   *(f"{r.gib} GiB p50" for r in measured), "worst max",
                   f"{large.gib} GiB / {small.gib} GiB", "result"]
        out.append(table(headers, targets))
        out.append("")
    out.append("pool after deleting everything through the driver: " + ("; ".join(leftovers) or "empty"))
    out.append(driver_log)
    return "\n".join(out)


# entry point --------------------------------------------------------------

def missing_space(sizes: Sequence[int]) -> bool:
    """Whether /tmp lacks room for every filled image and one copy (then said on stderr)."""
    st = os.statvfs("/tmp")
    free = st.f_bavail * st.f_frsize
    needed = int(FILL_FRACTION * (sum(sizes) + max(sizes)) * GIB) + SPACE_MARGIN
    if free < needed:
        print(f"needs {needed / GIB:.1f} GiB free under /tmp, has {free / GIB:.1f} GiB; try --sizes 1", file=sys.stderr)
    return free < needed


def describe(sizes: Sequence[int]) -> str:
    version = sh("qemu-storage-daemon", "--version").splitlines()[0]
    return (f"csi-qsd snapshots: qcow2 volumes of {', '.join(f'{g} GiB' for g in sizes)}, "
            f"{FILL_FRACTION:.0%} filled, staged and published as raw block volumes; "
            f"{SNAPSHOTS} snapshots, {RESTORES} restores and {CLONES} clones per size "
            f"(MAX_CHAIN_DEPTH {MAX_CHAIN_DEPTH}); {version}; kernel {platform.release()}; {os.cpu_count()} CPUs; "
            f"load average {os.getloadavg()[0]:.2f} at start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.snapshot_latency", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,10", help="volume sizes in GiB, comma-separated (default 1,10)")
    parser.add_argument("--copies", type=int, default=1, help="full-copy baseline samples per size (default 1)")
    args = parser.parse_args(argv)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        parser.error("--sizes takes whole GiB, e.g. 1,10")
    if not sizes or sizes[0] < 1 or args.copies < 1:
        parser.error("--sizes must be at least 1 GiB and --copies at least 1")
    if missing_space(sizes):
        return 2
    return bench_main(lambda box: Bench(box, sizes, args.copies), lambda bench: report(
        bench.results, bench.header, bench.leftovers, log_problems(bench.driver)), tools=REQUIRED_TOOLS)


if __name__ == "__main__":
    sys.exit(main())
