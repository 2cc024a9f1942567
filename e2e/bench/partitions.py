"""Device-pool partitions: fio on a partition volume as a pod sees it vs the same region of the device, one run.

Run as ``.venv/bin/python -m e2e.bench.partitions [--runtime 5]`` (root). It
prints figures, never pass/fail.

The "NVMe" is a loop device (direct I/O) over a sparse file. The driver
serves it as device pool ``bench`` and creates block volumes on it through
CSI (stage and publish with the block access type: QSD's FUSE export of the
extent, a loop device on it, the device file bind-mounted at the target).
Table 1: the same fio jobs (O_DIRECT, libaio) on a partition's target and on
the same byte range of the device directly (``--offset`` = the extent's
start). Table 2: 1, 2 and 4 partitions driven at once (4k random read QD32
on each), aggregate IOPS beside one partition alone, and the device
directly over the same regions at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import subprocess
import tempfile
from pathlib import Path

from csi_qsd.csi_client import CSIClient
from e2e.bench.common import ratio, table
from tests.harness import DriverProcess, sandbox

MIB = 1 << 20
REGION = 256 * MIB
JOBS = {
    "4k randread QD32": ("randread", "4k", 32),
    "4k randwrite QD32": ("randwrite", "4k", 32),
    "1M write QD8": ("write", "1M", 8),
}


async def fio(filename: Path, rw: str, bs: str, depth: int, runtime: int, offset: int = 0) -> float:
    """IOPS of one fio job on [offset, offset+REGION) of `filename`."""
    proc = await asyncio.create_subprocess_exec(
        "fio", "--name=j", f"--filename={filename}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={depth}",
        "--ioengine=libaio", "--direct=1", f"--offset={offset}", f"--size={REGION}", "--time_based",
        f"--runtime={runtime}", "--output-format=json", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"fio failed: {err.decode()}")
    job = json.loads(out)["jobs"][0]
    return float(job["read"]["iops"] + job["write"]["iops"])


async def fill(filename: Path, offset: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        "fio", "--name=fill", f"--filename={filename}", "--rw=write", "--bs=1M", "--iodepth=8",
        "--ioengine=libaio", "--direct=1", f"--offset={offset}", f"--size={REGION}",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    await proc.wait()


async def bench(runtime: int) -> str:
    work = Path(tempfile.mkdtemp(prefix="cqbench", dir="/tmp"))
    backing = work / "nvme.img"
    with open(backing, "wb") as f:
        f.truncate(4 * REGION + 64 * MIB)
    node = Path(subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(backing)], check=True,
                               capture_output=True, text=True).stdout.strip())
    try:
        with sandbox() as box:
            driver = DriverProcess(box, "--device-pool", f"bench={node}")
            await driver.start()
            try:
                async with CSIClient(box.endpoint, timeout=120) as csi:
                    targets: list[tuple[Path, int]] = []
                    for i in range(4):
                        vol = await csi.create_volume(f"pvc-part-{i}", REGION, {"pool": "bench"}, block=True)
                        staging, target = box.staging(f"p{i}"), box.target(f"p{i}")
                        await csi.stage(vol.volume_id, str(staging), block=True)
                        await csi.publish(vol.volume_id, str(staging), str(target), block=True)
                        db = sqlite3.connect(box.state_dir / "catalog.db")
                        (start,) = db.execute("SELECT start FROM extents WHERE volume_id=?",
                                              (vol.volume_id,)).fetchone()
                        db.close()
                        targets.append((target, start))
                    for target, start in targets:
                        await fill(target, 0)
                    rows = []
                    target, start = targets[0]
                    for name, (rw, bs, depth) in JOBS.items():
                        part = await fio(target, rw, bs, depth, runtime)
                        direct = await fio(node, rw, bs, depth, runtime, start)
                        rows.append([name, f"{part:,.0f}", f"{direct:,.0f}", ratio(part, direct)])
                    first = table(["job (IOPS)", "partition volume", "device region", "ratio"], rows)
                    rows = []
                    one = 0.0
                    for count in (1, 2, 4):
                        parts = await asyncio.gather(*(fio(t, "randread", "4k", 32, runtime)
                                                       for t, _ in targets[:count]))
                        directs = await asyncio.gather(*(fio(node, "randread", "4k", 32, runtime, s)
                                                         for _, s in targets[:count]))
                        one = one or sum(parts)
                        rows.append([str(count), f"{sum(parts):,.0f}", ratio(sum(parts), one),
                                     f"{sum(directs):,.0f}", ratio(sum(parts), sum(directs))])
                    second = table(["partitions at once", "aggregate IOPS", "vs one", "device regions at once",
                                    "ratio"], rows)
                    return f"{first}\n\n4k randread QD32 on each partition:\n{second}\n"
            finally:
                await driver.stop()  # the sandbox's cleanup takes down its QSD, mounts and loop devices
    finally:
        subprocess.run(["losetup", "-d", str(node)], check=False)
        backing.unlink(missing_ok=True)
        work.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", type=int, default=5, help="seconds per fio job")
    args = parser.parse_args(argv)
    print(asyncio.run(bench(args.runtime)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
