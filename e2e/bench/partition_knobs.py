"""Where a partition volume's time goes: one QSD graph knob at a time, each beside the device region, one run.

Run as ``.venv/bin/python -m e2e.bench.partition_knobs [--runtime 5] [--rounds 3]``
(root). It prints figures, never pass/fail.

The "NVMe" is a loop device (direct I/O) over a sparse file, as in
``e2e.bench.partitions``, and the volume a bare QSD (no driver) holding one
256 MiB extent in the shape the device pool gives it, exported over FUSE
with a direct-I/O loop device on the export. The jobs are
``e2e.bench.partitions``'; every figure is the median over the rounds.

Table 1: one QSD, the FUSE connection's background limit switched between
the kernel's default (12) and what the driver sets, run after run, so
nothing else changes. Table 2: one change at a time, a QSD each (the
throttle filter, the host_device's AIO engine or cache mode, the FUSE
export's thread, the loop device's mode; `null-co` for the FUSE export and
loop device with no storage at all; and, without QSD, a direct-I/O loop
device over the same range of the device, ``losetup --offset
--sizelimit``, since this kernel has no device-mapper), each beside the
same byte range of the device measured right after it in the same round,
with QSD's CPU use during the volume's job (a share of one CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import statistics
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient

from csi_qsd.sys import fusectl
from csi_qsd.sys.tools import bundled
from e2e.bench.fio import fio, lay_out
from e2e.bench.loop_devices import loop_device
from e2e.bench.partitions import JOBS, run_cli
from e2e.bench.process_usage import cpu_share
from e2e.bench.report_tables import ratio, table
from e2e.bench.sizes import MIB
from testing import owner
from testing.harness import terminate, until

REGION = 256 * MIB
OFFSET = 64 * MIB
BACKGROUND_LIMITS = (12, fusectl.MAX_BACKGROUND)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One change to the device pool's graph (or to the loop device over its export)."""

    name: str
    aio: str = "native"
    direct: bool = True
    throttle: bool = True
    iothread: bool = False  # the FUSE export in QSD's iothread rather than its main loop
    loop_direct: bool = True
    null: bool = False  # no storage: null-co, what FUSE and the loop device cost alone
    kernel: bool = False  # no QSD: a direct-I/O loop device over the extent itself, for reference

    def nodes(self, device: Path) -> list[dict[str, Any]]:
        """`blockdev-add` arguments, bottom up; the last is what the export stands on."""
        if self.null:
            return [{"driver": "null-co", "node-name": "top", "size": REGION, "read-zeroes": True}]
        host = {"driver": "host_device", "filename": str(device), "cache": {"direct": self.direct},
                "aio": self.aio, "discard": "unmap", "locking": "off"}
        nodes: list[dict[str, Any]] = [
            {"driver": "raw", "node-name": "file", "file": host, "offset": OFFSET, "size": REGION},
            {"driver": "raw", "node-name": "fmt", "file": "file"},
        ]
        if self.throttle:
            nodes.append({"driver": "throttle", "node-name": "thr", "throttle-group": "tg", "file": "fmt"})
        return nodes


VARIANTS = [
    Variant("as served: throttle > raw > raw window > host_device (native, O_DIRECT)"),
    Variant("no throttle filter", throttle=False),
    Variant("aio io_uring", aio="io_uring"),
    Variant("aio threads", aio="threads"),
    Variant("cache.direct off (host page cache)", aio="threads", direct=False),
    Variant("FUSE export in the iothread", iothread=True),
    Variant("buffered loop device", loop_direct=False),
    Variant("null-co (no storage: FUSE + loop alone)", null=True, throttle=False),
    Variant("no QSD: direct-I/O loop device over the extent", kernel=True),
]


@contextlib.asynccontextmanager
async def exported(variant: Variant, device: Path, work: Path) -> AsyncIterator[tuple[Path, int | None]]:
    """A bare QSD serving `variant` over FUSE, and a loop device on the export; yields it and QSD's PID."""
    if variant.kernel:
        async with loop_device(device, window=(OFFSET, REGION)) as carved:
            yield carved, None
        return
    qmp_path, export = work / "qmp.sock", work / "disk"
    export.touch()
    proc = await asyncio.create_subprocess_exec(
        bundled("qemu-storage-daemon"), "--chardev", f"socket,id=m,path={qmp_path},server=on,wait=off",
        "--monitor", "chardev=m", "--object", "iothread,id=io0", start_new_session=True)
    qmp = QMPClient("bench")
    try:
        async def connected() -> bool:
            with contextlib.suppress(Exception):  # the socket file appears just before QSD listens on it
                await qmp.connect(str(qmp_path))
                return True
            return False

        await until(connected, f"QSD's QMP socket {qmp_path}", 5)
        if variant.throttle:
            await qmp.execute("object-add", {"qom-type": "throttle-group", "id": "tg", "limits": {}})
        nodes = variant.nodes(device)
        for spec in nodes:
            await qmp.execute("blockdev-add", spec)
        args: dict[str, Any] = {"type": "fuse", "id": "e", "node-name": nodes[-1].get("node-name", "top"),
                                "mountpoint": str(export), "writable": True}
        if variant.iothread:
            args["iothread"] = "io0"
        await qmp.execute("block-export-add", args)
        await fusectl.raise_background(export)
        async with loop_device(export, direct=variant.loop_direct) as loopdev:
            yield loopdev, proc.pid
    finally:
        with contextlib.suppress(Exception):
            await qmp.execute("quit")
        with contextlib.suppress(Exception):
            await qmp.disconnect()
        await terminate(proc, 10)
        subprocess.run(["umount", "-l", str(export)], check=False, capture_output=True)
        export.unlink(missing_ok=True)
        qmp_path.unlink(missing_ok=True)  # left behind by a QSD that had to be killed


async def bench(runtime: float, rounds: int) -> str:
    work = owner.make_base("cqknobs")
    backing = work / "nvme.img"
    with open(backing, "wb") as f:
        f.truncate(OFFSET + REGION + 64 * MIB)
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        async with loop_device(backing) as device:
            await measure(device, work, runtime, rounds, samples)
    finally:
        backing.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            owner.remove_base(work)
    return render(samples, runtime, rounds)


async def measure(device: Path, work: Path, runtime: float, rounds: int,
                  samples: dict[tuple[str, str], list[float]]) -> None:
    """Every figure, into `samples` by (variant or limit, job)."""
    await lay_out(device, REGION, OFFSET)
    async with exported(VARIANTS[0], device, work) as (volume, _):
        for _ in range(rounds):  # one QSD, the limit switched back and forth: nothing else changes
            for limit in BACKGROUND_LIMITS:
                await fusectl.raise_background(work / "disk", limit)
                for job in JOBS:
                    samples.setdefault((f"max_background {limit}", job.name), []).append(
                        await fio(job, volume, runtime=runtime, size=REGION))
    for _ in range(rounds):
        for variant in VARIANTS:
            async with exported(variant, device, work) as (volume, qsd):
                for job in JOBS:
                    measured = fio(job, volume, runtime=runtime, size=REGION)
                    value, cpu = await cpu_share(qsd, measured, runtime) if qsd else (await measured, 0.0)
                    samples.setdefault((variant.name, job.name), []).append(value)
                    samples.setdefault((variant.name, job.name + " cpu"), []).append(cpu)
                    samples.setdefault((variant.name, job.name + " device"), []).append(
                        await fio(job, device, runtime=runtime, size=REGION, offset=OFFSET))


def render(samples: dict[tuple[str, str], list[float]], runtime: float, rounds: int) -> str:
    limits = table(["FUSE max_background", *(job.label for job in JOBS)],
                   [[f"{limit}{' (kernel default)' if limit == 12 else ' (as served)'}",
                     *(f"{statistics.median(samples[(f'max_background {limit}', job.name)]):,.0f}" for job in JOBS)]
                    for limit in BACKGROUND_LIMITS])
    rows = []
    for variant in VARIANTS:
        row = [variant.name]
        for job in JOBS:
            vol = statistics.median(samples[(variant.name, job.name)])
            dev = statistics.median(samples[(variant.name, job.name + " device")])
            cpu = statistics.median(samples[(variant.name, job.name + " cpu")])
            row += [f"{dev:,.0f}", f"{vol:,.0f}", ratio(vol, dev), f"{cpu:.0%}"]
        rows.append(row)
    headers = ["variant"]
    for job in JOBS:
        headers += [f"{job.label}: device", "volume", "ratio", "QSD CPU"]
    return (f"median of {rounds} rounds x {runtime:g} s per fio job\n\nthe as-served volume on one QSD, the FUSE "
            f"connection's background limit switched between runs:\n{limits}\n\none change at a time, a QSD each; "
            "the device region measured right after the volume, in the same round; QSD CPU: its share of one CPU "
            "during the volume's job\n" + table(headers, rows))


def main(argv: list[str] | None = None) -> int:
    return run_cli(__doc__ or "", bench, argv)


if __name__ == "__main__":
    raise SystemExit(main())
