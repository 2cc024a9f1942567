"""Backups through the CLI: a full backup and five incrementals restore a block volume byte for byte.

At the default granularity and at 4 KiB: there the incrementals hold ranges
smaller than a plain qcow2 cluster, which must not hide the older backups'
data around them when the files are layered.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import mmap
import os
import secrets
import stat
import sys
from pathlib import Path

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.server import Driver
from csi_qsd.sys.run import run
from testing.harness import Sandbox
from testing.helpers.ciphertext import holds, luks
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


def write_direct(device: Path, offset: int, data: bytes) -> None:
    """`data` at `offset` of the block device, O_DIRECT (from a page-aligned buffer), then fsync."""
    buf = mmap.mmap(-1, len(data))
    buf.write(data)
    fd = os.open(device, os.O_RDWR | os.O_DIRECT)
    try:
        assert os.pwrite(fd, buf, offset) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


async def test_an_encrypted_volume_s_backups_are_ciphertext_and_restore_with_its_key(
    box: Sandbox, driver: tuple[Driver, CSIClient],
) -> None:
    drv, csi = driver
    key = "k-" + secrets.token_urlsafe(24)
    key_file, wrong_file = box.root / "key", box.root / "wrong"
    key_file.write_text(key)
    wrong_file.write_text(key + "\n")
    vid = (await csi.create_volume("pvc-bk-enc", SIZE, {"encrypted": "true"}, block=True,
                                   secrets={"key": key})).volume_id
    staging, target = box.staging("bk-enc"), box.target("bk-enc")
    await csi.stage(vid, str(staging), block=True, secrets={"key": key})
    await csi.publish(vid, str(staging), str(target), block=True)
    marker = b"PLAINTEXT-" + secrets.token_hex(8).encode() + b"-"
    pattern = marker * (256 * KIB // len(marker)) + b"\0" * (256 * KIB % len(marker))
    write_direct(target, 3 * MIB, pattern)
    s0 = (await csi.create_snapshot("bk-enc-0", vid)).snapshot_id
    write_direct(target, 40 * MIB + 4 * KIB, pattern[:8 * KIB])
    write_direct(target, 3 * MIB, b"\xa5" * 64 * KIB)
    want = target.read_bytes()
    s1 = (await csi.create_snapshot("bk-enc-1", vid)).snapshot_id
    full, incremental = box.root / "full.qcow2", box.root / "incremental.qcow2"
    state = ["--state-dir", str(box.state_dir)]

    # Without the key, or with another (here the key and a newline), nothing is written.
    code, _, err = await cli(box, "backup", s0, "-o", str(full), *state, check=False)
    assert code == 1 and "INVALID_ARGUMENT" in err and "--key-file" in err and s0 in err
    code, _, err = await cli(box, "backup", s0, "-o", str(full), *state, "--key-file", str(wrong_file), check=False)
    assert code == 1 and "PERMISSION_DENIED" in err and "--key-file" in err
    assert not full.exists() and not Path(f"{full}.json").exists()
    assert key not in err

    _, text, _ = await cli(box, "backup", s0, "-o", str(full), *state, "--key-file", str(key_file))
    assert json.loads(text)["encrypted"] is True
    _, text, _ = await cli(box, "backup", s1, "--since", s0, "-o", str(incremental), *state, "--key-file", str(key_file))
    assert json.loads(text)["bytes_read"] == 2 * 64 * KIB  # the two clusters written after s0
    for made in (full, incremental):
        assert luks(made) and not holds(made, marker), made

    restored, raw = box.root / "restored.qcow2", box.root / "restored.raw"
    code, _, err = await cli(box, "restore", str(full), str(incremental), "-o", str(restored), check=False)
    assert code == 1 and "INVALID_ARGUMENT" in err and "--key-file" in err
    code, _, err = await cli(box, "restore", str(full), str(incremental), "-o", str(raw), "--format", "raw",
                             "--key-file", str(key_file), check=False)
    assert code == 1 and "INVALID_ARGUMENT" in err and not raw.exists()
    await cli(box, "restore", str(full), str(incremental), "-o", str(restored), "--key-file", str(key_file))
    assert luks(restored) and not holds(restored, marker)
    spec = {"driver": "qcow2", "encrypt.key-secret": "key", "file": {"driver": "file", "filename": str(restored)}}
    await run(drv.config.qemu_img, "convert", "--object", "secret,id=key,file=/dev/stdin", "-O", "raw",
              "json:" + json.dumps(spec), str(raw), stdin=key.encode())
    data = raw.read_bytes()
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(want).hexdigest()
    assert data[40 * MIB + 4 * KIB:40 * MIB + 12 * KIB] == pattern[:8 * KIB]
    assert data[3 * MIB + 64 * KIB:3 * MIB + 256 * KIB] == pattern[64 * KIB:]
