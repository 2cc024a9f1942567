"""Backups through the CLI: a full backup and five incrementals restore a block volume byte for byte.

At the default granularity and at 4 KiB: there the incrementals hold ranges
smaller than a plain qcow2 cluster, which must not hide the older backups'
data around them when the files are layered.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.server import Driver
from csi_qsd.sys.run import run
from testing.harness import Sandbox
from testing.helpers.written_blocks import BlockDevice

KIB, MIB = 1 << 10, 1 << 20
SIZE = 64 * MIB


async def cli(box: Sandbox, *args: str, check: bool = True) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "csi_qsd.cli", "volume", "--endpoint", box.endpoint, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert not check or proc.returncode == 0, err.decode()
    return proc.returncode or 0, out.decode(), err.decode()


def digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


@pytest.mark.parametrize("granularity", [64 * KIB, 4 * KIB])
async def test_full_plus_five_incrementals_restore_byte_for_byte(
    box: Sandbox, driver: tuple[Driver, CSIClient], granularity: int,
) -> None:
    drv, csi = driver
    parameters = {"changedBlockGranularity": str(granularity)}
    vid = (await csi.create_volume("pvc-bk", SIZE, parameters, block=True)).volume_id
    staging, target = box.staging("bk"), box.target("bk")
    await csi.stage(vid, str(staging), block=True)
    await csi.publish(vid, str(staging), str(target), block=True)
    dev = BlockDevice(target)
    out = box.root / "backups"
    out.mkdir()
    for i in range(16):
        dev.write(i * 3 * MIB + 12 * KIB, 200 * KIB, i)
    snaps, sums, files, reports = [], [], [], []
    for generation in range(6):
        if generation:
            dev.write(generation * 5 * MIB - 4 * KIB, 8 * KIB, 100 + generation)  # straddles a cluster boundary
            dev.write(SIZE - 64 * KIB * generation, 4 * KIB, 200 + generation)
            dev.discard(generation * 3 * MIB, 128 * KIB)
        sums.append(hashlib.sha256(target.read_bytes()).hexdigest())
        snaps.append((await csi.create_snapshot(f"bk-{generation}", vid)).snapshot_id)
        files.append(out / f"b{generation}.qcow2")
        since = ["--since", snaps[-2]] if generation else []
        _, text, _ = await cli(box, "backup", snaps[-1], *since, "-o", str(files[-1]), "--state-dir", str(box.state_dir))
        reports.append(json.loads(text))
        assert reports[-1]["snapshot_id"] == snaps[-1]

    for made in (*files, *(Path(f"{f}.json") for f in files)):  # each holds a volume, or says whose it is
        assert stat.S_IMODE(made.stat().st_mode) == 0o600, made
    for upto in (5, 3, 0):
        restored = box.root / f"restored{upto}.raw"
        await cli(box, "restore", *map(str, files[:upto + 1]), "-o", str(restored), "--format", "raw")
        assert restored.stat().st_size == SIZE
        assert stat.S_IMODE(restored.stat().st_mode) == 0o600
        assert digest(restored) == sums[upto], f"restore up to snapshot {upto} differs"
    # An incremental reads what changed (here a few clusters), not the volume.
    _, delta = await csi.metadata_delta(snaps[4], snaps[5])
    assert reports[5]["bytes_read"] == sum(length for _, length in delta) <= 6 * 64 * KIB
    if granularity == 4 * KIB:  # 8 KiB + 4 KiB written, and the whole 128 KiB cluster discarded
        assert reports[5]["bytes_read"] == 8 * KIB + 4 * KIB + 128 * KIB
    assert reports[0]["bytes_read"] >= 16 * 200 * KIB
    # A gap in the sequence is refused before anything is written.
    code, _, err = await cli(box, "restore", str(files[0]), str(files[2]), "-o", str(box.root / "x"), check=False)
    assert code == 1 and "INVALID_ARGUMENT" in err and snaps[1] in err
    assert not (box.root / "x").exists()
    await run(drv.config.qemu_img, "check", str(files[5]))
    os.sync()
