"""Loop devices, files and filesystems for the baselines a bench measures the driver beside, and direct writes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from csi_qsd.sys import filesystems
from csi_qsd.sys.run import run
from e2e.bench.shell import output


def write_direct(device: Path, offsets: Iterable[int], size: int) -> None:
    """`size` bytes of random data at each of `offsets` of `device` (O_DIRECT, no two alike), then one fsync."""
    with mmap.mmap(-1, size) as buffer:  # page-aligned, as O_DIRECT needs
        buffer.write(os.urandom(size))
        fd = os.open(device, os.O_WRONLY | os.O_DIRECT)
        try:
            for i, offset in enumerate(offsets):
                buffer[:8] = i.to_bytes(8, "little")
                os.pwrite(fd, buffer, offset)
            os.fsync(fd)
        finally:
            os.close(fd)



@contextlib.asynccontextmanager
async def loop_device(backing: Path, *, direct: bool = True, window: tuple[int, int] | None = None,
                      ) -> AsyncIterator[Path]:
    """A loop device over `backing` (its (offset, length) `window`), direct I/O or buffered; detached on exit."""
    carve = [f"--offset={window[0]}", f"--sizelimit={window[1]}"] if window else []
    device = Path((await output("losetup", "--find", "--show", f"--direct-io={'on' if direct else 'off'}",
                                *carve, str(backing))).strip())
    try:
        yield device
    finally:
        await run("losetup", "--detach", str(device), check=False)



@contextlib.asynccontextmanager
async def raw_file(path: Path, size: int) -> AsyncIterator[Path]:
    """A file of `size` bytes allocated at `path` (fallocate), as a baseline's backing; removed on exit."""
    await output("fallocate", "-l", str(size), str(path))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)



@contextlib.asynccontextmanager
async def ext4_on(device: Path, mountpoint: Path) -> AsyncIterator[Path]:
    """ext4 made as the driver makes it, mounted at `mountpoint`, unmounted on exit."""
    await filesystems.make(device, "ext4")
    mountpoint.mkdir(parents=True, exist_ok=True)
    await output("mount", str(device), str(mountpoint))
    try:
        yield mountpoint
    finally:
        await output("umount", str(mountpoint))



def loop_mode_of(path: Path) -> str:
    """'direct (loopN)' or 'buffered (loopN)': the loop device a block device file or a mounted directory sits on."""
    st = os.stat(path)
    dev = st.st_rdev if path.is_block_device() or not path.is_dir() else st.st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    try:
        dio = (sysfs / "loop" / "dio").read_text().strip()
        name = sysfs.resolve().name
    except OSError:
        return "not a loop device"
    return f"{'direct' if dio == '1' else 'buffered'} ({name})"
