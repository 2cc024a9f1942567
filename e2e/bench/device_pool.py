"""The device pool the benches measure: a direct-I/O loop device over a file, served as pool ``bench``.

`csi-qsd serve` runs as a process in a sandbox of its own; everything (the
driver, its QSD, the sandbox's mounts, the loop device, the files) is gone
when the context ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from e2e.bench.loop_devices import loop_device
from e2e.bench.shell import sh
from e2e.bench.sizes import MIB
from testing import owner
from testing.harness import DriverProcess, Sandbox, sandbox


@dataclasses.dataclass(frozen=True)
class ServedPool:
    box: Sandbox
    driver: DriverProcess
    csi: CSIClient
    node: Path  # the loop device standing for the NVMe
    work: Path  # a scratch directory beside the device's file, removed with it

    def extent_start(self, volume_id: str) -> int:
        """Where the volume's extent starts on the device, as the catalog records it."""
        db = sqlite3.connect(self.box.state_dir / "catalog.db")
        try:
            (start,) = db.execute("SELECT start FROM extents WHERE volume_id=? AND state='used'",
                                  (volume_id,)).fetchone()
            return int(start)
        finally:
            db.close()


@contextlib.asynccontextmanager
async def served_pool(size: int, *, random_data: bool = False, timeout: float = 120) -> AsyncIterator[ServedPool]:
    """A device of `size` bytes: sparse, or filled with random bytes (then the pool is forced onto it)."""
    work = owner.make_base("cqbench")
    backing = work / "nvme.img"
    if random_data:
        sh("dd", "if=/dev/urandom", f"of={backing}", "bs=1M", f"count={size // MIB}", "status=none")
    else:
        with open(backing, "wb") as f:
            f.truncate(size)
    try:
        async with loop_device(backing) as node:
            with sandbox() as box:
                driver = DriverProcess(box, "--device-pool", f"bench={node}{',force' if random_data else ''}")
                await driver.start()
                try:
                    async with CSIClient(box.endpoint, timeout=timeout) as csi:
                        yield ServedPool(box, driver, csi, node, work)
                finally:
                    await driver.stop()  # the sandbox's cleanup takes down its QSD, mounts and loop devices
    finally:
        shutil.rmtree(work, ignore_errors=True)
