"""Restart benchmark: how long a node is deaf after a driver crash, and QSD's memory per idle volume.

Serves `csi-qsd serve` as a separate process, stages and publishes N volumes
of mixed kinds (filesystem, block, vhost-user-blk, in turn; qcow2, 64 MiB),
then SIGKILLs the driver and starts it again, as a crashing plugin container
would be restarted, and measures:

    Probe ready          from the new process's start until Probe answers ready
    first call           NodeGetVolumeStats on the last volume, right after Probe
    background checks    until the log says the adopted graph was verified (event=qsd_verified)
    QSD RSS per volume   (RSS with N staged - RSS with none) / N

The baseline is the same restart measured in the same run with no volume
staged, and the time the full checks took (what a start that verifies every
volume before serving would have cost). Targets: Probe ready and the first
call in < 5 s with 1000 volumes; < 512 KiB of QSD memory per idle volume.
Figures only; nothing here decides pass or fail for CI.

    .venv/bin/python -m e2e.bench.restart [--volumes 1000] [--parallel 4]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from e2e.bench.process_usage import status_field_kib
from e2e.bench.report_tables import ms, ratio, table, verdict
from e2e.bench.served_bench import ServedBench, bench_main
from e2e.bench.sizes import KIB, MIB
from testing.harness import DriverProcess, Sandbox, qsd_pid, until

SIZE = 64 * MIB
Kind = tuple[str, dict[str, str], bool]
KINDS: tuple[Kind, ...] = (
    ("filesystem", {"export": "filesystem"}, False),
    ("block", {"export": "filesystem"}, True),
    ("vhost-user-blk", {"export": "vhost-user-blk"}, False),
)
TARGET_READY_S = 5.0
VERIFIED = re.compile(r"event=qsd_verified seconds=([0-9.]+)")
TARGET_RSS_PER_VOLUME_KIB = 512


async def restart(driver: DriverProcess, box: Sandbox, probe_vid: str, probe_path: str) -> tuple[float, float, float]:
    """SIGKILL and restart the driver: (seconds to Probe ready, to the first call answered, checks took)."""
    verified_before = len(VERIFIED.findall(driver.log()))
    await driver.kill9()
    started = time.perf_counter()
    await driver.start(timeout=600)
    ready = time.perf_counter() - started
    if not probe_vid:
        return ready, ready, 0.0
    async with CSIClient(box.endpoint, timeout=60) as csi:
        await csi.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id=probe_vid, volume_path=probe_path))
    first = time.perf_counter() - started
    await until(lambda: len(VERIFIED.findall(driver.log())) > verified_before,
                "the background checks (event=qsd_verified in the driver log)", 600)
    return ready, first, float(VERIFIED.findall(driver.log())[-1])


class Bench(ServedBench):
    def __init__(self, box: Sandbox, volumes: int, parallel: int, kinds: tuple[Kind, ...]) -> None:
        super().__init__(box)
        self.n, self.parallel, self.kinds = volumes, parallel, kinds
        self.rows: list[list[str]] = []
        self.header = self.footer = ""

    async def phases(self, csi: CSIClient) -> None:
        box, driver, volumes = self.box, self.driver, self.n
        try:
            pid = qsd_pid(box)
            assert pid is not None
            empty_ready, _, _ = await restart(driver, box, "", "")
            rss_empty = status_field_kib(pid)
            t0 = time.perf_counter()
            gate = asyncio.Semaphore(self.parallel)

            async def one(index: int) -> None:
                kind, params, block = self.kinds[index % len(self.kinds)]
                async with gate:
                    await self.stage(csi, f"pvc-restart-{index:04d}", SIZE, params, block=block)

            await asyncio.gather(*(one(i) for i in range(volumes)))
            setup = time.perf_counter() - t0
            rss_full = status_field_kib(pid)
            last = self.staged[self.volumes[-1]]
            ready, first, verified = await restart(driver, box, last.id, str(last.target))
            assert qsd_pid(box) == pid, "the restarted driver must adopt the same QSD"
        except BaseException:
            events = [line for line in driver.log().splitlines() if "event=qsd" in line or "level=ERROR" in line]
            print("driver log, QSD events and errors:", *events[-30:], sep="\n", file=sys.stderr)
            raise
        per_volume = (rss_full - rss_empty) / volumes
        self.header = (f"csi-qsd restart bench: {volumes} volumes staged and published "
                       f"({', '.join(k for k, _, _ in self.kinds)} in turn) in {setup:.0f} s; {sys.platform}")
        self.rows = [
            ["Probe ready after SIGKILL, s", f"{ready:.2f}", f"{empty_ready:.2f}", ratio(ready, empty_ready),
             f"< {TARGET_READY_S:.0f} {verdict(lambda: ready < TARGET_READY_S)}"],
            ["first call on an old volume, s", f"{first:.2f}", "-", "-",
             f"< {TARGET_READY_S:.0f} {verdict(lambda: first < TARGET_READY_S)}"],
            ["background checks, s", f"{verified:.2f}", "-", ratio(verified, ready), "after Probe"],
            ["QSD RSS per idle volume, KiB", f"{per_volume:.0f}", f"{rss_empty} (QSD alone)", "-",
             f"< {TARGET_RSS_PER_VOLUME_KIB} {verdict(lambda: per_volume < TARGET_RSS_PER_VOLUME_KIB)}"],
        ]
        self.footer = (f"(QSD RSS {rss_empty} KiB empty, {rss_full} KiB with {volumes}; "
                       f"{ms(per_volume * KIB / 1024)} KiB per volume)")

    def report(self) -> str:
        if not self.rows:
            return "FAIL: the restarts were not measured"
        return "\n".join([self.header, table(["figure", f"{self.n} volumes", "no volume (baseline)", "ratio",
                                                "target"], self.rows), self.footer])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.restart", description=__doc__.split("\n")[0])
    parser.add_argument("--volumes", type=int, default=1000)
    parser.add_argument("--parallel", type=int, default=4, help="stage this many volumes at a time")
    parser.add_argument("--kind", choices=[k for k, _, _ in KINDS], action="append",
                        help="only volumes of this kind (repeatable; default: all three in turn)")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in KINDS if not args.kind or k[0] in args.kind)
    return bench_main(lambda box: Bench(box, args.volumes, args.parallel, kinds), Bench.report)


if __name__ == "__main__":
    sys.exit(main())
