"""One standalone QSD serving one image graph, over vhost-user-blk or FUSE, for benches that compare node graphs.

The exports are set up as the driver sets up a VM volume's (its own
iothread, one queue, write-back cache) and a pod volume's on QSD 11 (a
growable FUSE export with a /dev/fuse queue per core) but from the command
line, so a bench can put any graph under them: the layouts and ciphers an
encrypted volume could use. `ceiling` says what a run's IOPS would be with
a core for each QSD thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from e2e.bench import blkio_client
from e2e.bench.fio import Job, fio
from e2e.bench.process_usage import ThreadCPU

QCOW2_MAX_THREADS = 4  # block/qcow2.h: encrypted clusters ciphered by at most this many pool workers per image
WORKER = "worker"  # QEMU's name for its thread-pool threads
IO_WQ = "iou-wrk"  # the kernel's io_uring workers, as many as the work needs: no bound of their own


@dataclass(frozen=True)
class Run:
    iops: float
    threads: dict[str, float]  # QSD thread (pool and io_uring workers summed by kind) -> share of one CPU in the run

    def ceiling(self) -> float:
        """IOPS with a core per QSD thread (and the client's own): bounded by the busiest thread, or by the pool
        workers spread over the QCOW2_MAX_THREADS a qcow2 image may use at once (never by the kernel's io_uring
        workers)."""
        workers = self.threads.get(WORKER, 0.0) / QCOW2_MAX_THREADS
        busiest = max([share for name, share in self.threads.items() if name not in (WORKER, IO_WQ)]
                      + [workers, 0.05])
        return self.iops / busiest


def vhost_export(socket: Path) -> str:
    return (f"type=vhost-user-blk,id=vm,node-name=top,addr.type=unix,addr.path={socket},writable=on,iothread=io0,"
            "num-queues=1,writethrough=off")


def fuse_export(mountpoint: Path) -> str:
    queues = ",".join(f"iothread.{index}=io{index}" for index in range(os.cpu_count() or 1))
    return f"type=fuse,id=pod,node-name=top,mountpoint={mountpoint},writable=on,growable=on,allow-other=off,{queues}"


def _ready(path: Path, fuse: bool) -> bool:
    return os.path.ismount(path) if fuse else path.exists()


@contextlib.asynccontextmanager
async def serving(qsd: str, spec: str, export: str, at: Path, objects: list[str]) -> AsyncIterator[int]:
    """QSD exporting the node `spec` (a --blockdev, dotted keys) with `export` (at the socket or FUSE file `at`);
    yields its pid."""
    fuse = export.startswith("type=fuse")
    if fuse:
        at.touch()
    else:
        at.unlink(missing_ok=True)
    threads = [f"iothread,id=io{index}" for index in range(os.cpu_count() or 1)]
    argv = [qsd, *[arg for obj in [*objects, *threads] for arg in ("--object", obj)],
            "--blockdev", f"{spec},node-name=top", "--export", export]
    log = at.with_name(at.name + ".log")
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not _ready(at, fuse):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(f"qemu-storage-daemon did not export {spec}: {log.read_text().strip()}")
            await asyncio.sleep(0.05)
        yield process.pid
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if fuse and os.path.ismount(at):  # a QSD killed leaves its mount behind
            subprocess.run(["umount", "-l", str(at)], check=False)
        if not fuse:
            at.unlink(missing_ok=True)


async def measure(pid: int, at: Path, *, fuse: bool, write: bool, seconds: float, size: int) -> Run:
    """A 4k QD32 random run, with QSD's CPU per thread meanwhile: on a vhost-user-blk socket the polling libblkio
    client, on a FUSE file fio (O_DIRECT, libaio)."""
    before = ThreadCPU.take(pid)
    if fuse:
        job = Job("4k QD32", "randwrite" if write else "randread", "4k", 32)
        iops = await fio(job, at, runtime=seconds, size=size)
    else:
        iops = await blkio_client.iops("virtio-blk-vhost-user", at, write=write, seconds=seconds, size=size)
    shares = ThreadCPU.take(pid).shares_since(
        before, lambda name: next((pool for pool in (WORKER, IO_WQ) if name.startswith(pool)), name))
    return Run(iops, shares)
