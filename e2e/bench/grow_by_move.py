"""A device-pool filesystem volume that must move to grow: how long it takes, and what a writing pod feels.

Run as ``.venv/bin/python -m e2e.bench.grow_by_move [--gib 1]`` (root). It prints
figures, never pass/fail.

The "NVMe" is a direct-I/O loop device over a sparse file. The driver
serves it as device pool ``bench``; an xfs volume of ``--gib`` GiB holds a
file filling most of it, a small volume right after it takes the space it
would grow into, and NodeExpandVolume to 1.25 times the size makes it move
(backups under the FUSE export, the last copy with the filesystem frozen,
`csi_qsd.node.moves`) and then grow. Meanwhile a writer writes synced 64 KiB
blocks round a file of the filesystem, timing each. Baselines from the same run:
``dd`` (O_DIRECT, 1 MiB) of the volume's bytes from the device into
another file of the same filesystem, and the writer's latencies for as
long before the move.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import threading
import time
from pathlib import Path

from csi_qsd.csi_pb import csi_pb2 as pb
from e2e.bench.device_pool import ServedPool, served_pool
from e2e.bench.latencies import Summary
from e2e.bench.report_tables import ratio, table
from e2e.bench.shell import sh
from e2e.bench.sizes import GIB, MIB
from e2e.bench.staged_volumes import stage

RING_BLOCKS = 1024
STALL = 0.05


class TimedWriter:
    """Writes synced 64 KiB blocks round a 64 MiB file from a thread, keeping each block's start and end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.latencies: list[tuple[float, float]] = []  # (when it started, when it ended)
        self.error: OSError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        block = b"w" * (64 << 10)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                os.pwrite(fd, block, (len(self.latencies) % RING_BLOCKS) * len(block))
                os.fsync(fd)
                self.latencies.append((started, time.monotonic()))
        except OSError as exc:
            self.error = exc
        finally:
            os.close(fd)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def between(self, start: float, end: float) -> list[float]:
        """Milliseconds of every block that was under way at some point in [start, end]."""
        return [(ended - began) * 1000 for began, ended in self.latencies if began <= end and ended >= start]


async def bench(gib: float) -> str:
    size = int(gib * GIB) // MIB * MIB
    async with served_pool(3 * size + 256 * MIB, timeout=3600) as pool:
        return await measure(pool, size)


async def measure(pool: ServedPool, size: int) -> str:
    csi, box, driver, node, scratch = pool.csi, pool.box, pool.driver, pool.node, pool.work / "copy.img"
    volume = await stage(csi, box, "pvc-fs", size, {"pool": "bench"}, fs_type="xfs")
    vid, target = volume.id, volume.target
    await csi.create_volume("pvc-next", 16 * MIB, {"pool": "bench"}, block=True)  # the space it would grow into
    sh("dd", "if=/dev/urandom", f"of={target / 'data'}", "bs=1M", f"count={size * 3 // 4 // MIB}", "oflag=direct",
       "status=none")
    start = pool.extent_start(vid)

    copy_started = time.monotonic()
    sh("dd", f"if={node}", f"of={scratch}", "bs=1M", f"skip={start // MIB}", f"count={size // MIB}",
       "iflag=direct", "oflag=direct", "status=none")
    copy_s = time.monotonic() - copy_started
    scratch.unlink()

    writer = TimedWriter(target / "log")
    writer.start()
    await asyncio.sleep(1)
    quiet_from = time.monotonic()
    await asyncio.sleep(min(max(copy_s, 2.0), 30.0))
    moved_from = time.monotonic()
    await csi.node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=vid, volume_path=str(target),
        capacity_range=pb.CapacityRange(required_bytes=size * 5 // 4)))
    moved_to = time.monotonic()
    await asyncio.sleep(1)
    writer.stop()
    if writer.error is not None:
        raise RuntimeError(f"the writer failed: {writer.error}")
    stalls = [f"+{began - moved_from:.2f} s: {(ended - began) * 1000:.0f} ms" for began, ended in writer.latencies
              if ended - began > STALL and began <= moved_to and ended >= moved_from]
    moved = pool.extent_start(vid) != start
    held = re.findall(r"event=move_switched volume_id=\S+ held_ms=(\d+)", driver.log())
    before = Summary.of(writer.between(quiet_from, moved_from))
    during = Summary.of(writer.between(moved_from, moved_to))
    move_s = moved_to - moved_from
    rows = [
        ["move and grow (NodeExpandVolume) vs dd of the volume's bytes", f"{copy_s:.2f} s", f"{move_s:.2f} s",
         ratio(move_s, copy_s)],
        ["writer p50 latency, during vs before", f"{before.p50:.1f} ms", f"{during.p50:.1f} ms",
         ratio(during.p50, before.p50)],
        ["writer p99 latency, during vs before", f"{before.p99:.1f} ms", f"{during.p99:.1f} ms",
         ratio(during.p99, before.p99)],
        ["writer longest wait, during vs before", f"{before.max:.1f} ms", f"{during.max:.1f} ms",
         ratio(during.max, before.max)],
    ]
    version = sh("uname", "-r").strip()
    return (f"an xfs volume of {size // MIB} MiB ({size * 3 // 4 // MIB} MiB of data) on a direct-I/O loop device, "
            f"kernel {version}; moved: {moved}; filesystem frozen for the last copy and switch: "
            f"{', '.join(held) or '?'} ms; writer blocks during the move: {during.count}\n\n"
            + table(["figure", "baseline", "measured", "ratio"], rows)
            + f"\n\nwriter blocks over {STALL * 1000:.0f} ms, from the start of the move: "
            f"{'; '.join(stalls) or 'none'}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0,
                        help="the volume's size in GiB (at least 1: at 0.5 its data and the writer's 64 MiB fill it)")
    args = parser.parse_args(argv)
    print(asyncio.run(bench(args.gib)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
