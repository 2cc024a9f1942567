"""The FUSE path probe against the bundled QSDs: what each one's export offers, as the kernel shows it.

QSD 10.0's FUSE export (libfuse) asks for FUSE_ASYNC_DIO, so a direct-I/O
loop device over it has several requests waiting at once; QEMU 11.1.3's
rewritten export asks for it only when the export is `growable`, so the
probe finds it there and the driver adds growable exports. Neither takes the `io-uring`
option yet: the schema walk must still find the FUSE export's options
(`mountpoint`), or the probe would miss the option the day it comes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from csi_qsd.qsd import fuse_paths
from csi_qsd.sys import loop
from csi_qsd.sys.tools import bundled
from testing import tiers
from testing.harness import Sandbox, in_process_driver

EXPECTED_ASYNC_DIO = {"10": True, "11": True}
EXPECTED_GROWABLE = {"10": False, "11": True}


@pytest.mark.parametrize("version", sorted(EXPECTED_ASYNC_DIO))
async def test_probe_answers_for_the_bundled_qsd(box: Sandbox, version: str) -> None:
    binary = bundled(f"qemu-storage-daemon-{version}")
    tiers.require("integration", "" if os.path.exists(binary) else binary)
    async with in_process_driver(box, qsd_binary=binary) as (driver, _csi):
        client = driver.daemon.client
        members = await fuse_paths.offered(client)
        assert {"mountpoint", "growable"} <= members, members
        workdir = box.root / "fuse-probe"
        paths = await fuse_paths.probe(client, workdir, measure_async_dio=True)
        print(f"QSD {'.'.join(map(str, driver.daemon.version))}: {paths.describe()}")
        assert paths.async_dio is EXPECTED_ASYNC_DIO[version]
        assert paths.growable is EXPECTED_GROWABLE[version]
        plain = await fuse_paths.async_dio(client, workdir)
        assert plain is (version == "10"), "QSD 11 asks for FUSE_ASYNC_DIO on a growable export only"
        assert paths.io_uring_option is (fuse_paths.IO_URING_OPTION in members)
        assert paths.kernel == fuse_paths.kernel_uring()
        assert paths.io_uring is (paths.io_uring_option and paths.kernel == "on")
        # The driver's own answer at start-up is the same, and new exports follow it.
        assert driver.daemon.fuse_paths.io_uring is paths.io_uring
        assert driver.daemon.fuse_paths.growable is paths.growable
        # Nothing of the probe is left: node, export, loop device, mount.
        assert fuse_paths.PROBE_NODE not in await client.node_names()
        assert not loop.find_loop(workdir / "disk")
        assert not os.path.ismount(workdir / "disk") and Path(workdir / "disk").stat().st_size == 0
