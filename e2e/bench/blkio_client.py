"""A polling vhost-user-blk client for the benches: blkio_bench.c, built against Debian 13's libblkio.

`qemu-img bench` over libblkio copies every request through a bounce buffer
(its buffers are not registered) and runs in one thread beside QSD: it
understates a vhost-user-blk export. blkio_bench registers its memory with
libblkio and polls its queue, as a VM's virtio-blk with polling would, and
measures random I/O for a given time. The same program with libblkio's
io_uring driver measures the baseline (a file or device, O_DIRECT).

Built once into .runtime/blkio-bench/ with gcc from a Debian 13 root made by
mmdebstrap (.runtime/blkio-build, ~30 s, kept), and run with the loader and
libraries of the QEMU 11 root the install made (.runtime/qemu11, which has
libblkio). Only the benches use it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from e2e.bench.shell import output

REPO = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).with_name("blkio_bench.c")
RUNTIME = REPO / ".runtime"
BUILD_ROOT = RUNTIME / "blkio-build"
QEMU11_ROOT = RUNTIME / "qemu11"
_IOPS = re.compile(r"^iops=([0-9.]+)$", re.M)


def _binary() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return RUNTIME / "blkio-bench" / f"blkio_bench-{digest}"


def ensure_built() -> Path:
    """The client for this source, built if missing. Raises RuntimeError saying what is missing."""
    binary = _binary()
    if binary.exists():
        return binary
    if not (QEMU11_ROOT / "usr/lib/x86_64-linux-gnu").is_dir():
        raise RuntimeError(f"{QEMU11_ROOT} is missing: run scripts/install.sh")
    if not (BUILD_ROOT / "usr/include/blkio.h").exists():
        partial = BUILD_ROOT.with_name(BUILD_ROOT.name + ".tmp")
        shutil.rmtree(partial, ignore_errors=True)
        mirror = subprocess.run(["bash", str(REPO / "scripts/debian-mirror.sh")], check=True, capture_output=True,
                                text=True).stdout.strip()
        subprocess.run(["mmdebstrap", "--quiet", "--variant=apt", "--include=gcc,libc6-dev,libblkio-dev", "trixie",
                        str(partial), f"deb {mirror} trixie main"], check=True)
        partial.rename(BUILD_ROOT)
    work = BUILD_ROOT / "build"
    work.mkdir(exist_ok=True)
    shutil.copy(SOURCE, work / SOURCE.name)
    subprocess.run(["chroot", str(BUILD_ROOT), "gcc", "-O2", "-Wall", "-o", "/build/blkio_bench",
                    f"/build/{SOURCE.name}", "-lblkio"], check=True)
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(work / "blkio_bench", binary.with_suffix(".tmp"))
    os.replace(binary.with_suffix(".tmp"), binary)
    return binary


def argv(driver: str, path: Path, *, write: bool, block_size: int, depth: int, seconds: float,
         size: int) -> list[str]:
    """The command line that runs the client with the QEMU 11 root's libraries."""
    libs = f"{QEMU11_ROOT}/usr/lib/x86_64-linux-gnu:{QEMU11_ROOT}/lib/x86_64-linux-gnu"
    return [str(QEMU11_ROOT / "lib64/ld-linux-x86-64.so.2"), "--library-path", libs, str(ensure_built()),
            driver, str(path), "write" if write else "read", str(block_size), str(depth), str(seconds), str(size)]


async def iops(driver: str, path: Path, *, write: bool, block_size: int = 4096, depth: int = 32,
               seconds: float = 5, size: int) -> float:
    """One run's IOPS. Raises HostCommandError with the client's message if it fails."""
    out = await output(*argv(driver, path, write=write, block_size=block_size, depth=depth, seconds=seconds, size=size))
    found = _IOPS.search(out)
    if found is None:
        raise RuntimeError(f"blkio_bench {driver} {path} printed no iops: {out.strip()}")
    return float(found.group(1))
