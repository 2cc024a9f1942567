"""Proves the guest harness against a bare qemu-storage-daemon.

Each test boots the busybox guest (TCG by default, a few seconds), has it do
O_DIRECT I/O on vhost-user-blk disks served by a QSD the test starts itself,
and then checks the bytes from the host with ``qemu-img convert`` once QSD
has released the image, so every layer between guest and image file is
covered by an independent check.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from e2e.conftest import e2e_marks
from testing.guest import (
    BLOCK_SIZE,
    FileDisk,
    GuestError,
    GuestImage,
    StorageDaemon,
    VhostUserDisk,
    VhostUserExport,
    acknowledged_blocks,
    count_kernel_io_errors,
    device_stat_samples,
    device_stats,
    guest_script,
    pattern_block,
    run_guest,
    start_storage_daemon,
    start_vm,
    verify_pattern,
    verify_summaries,
    write_pattern,
)

pytestmark = e2e_marks()

IMAGE_SIZE = 64 * 1024 * 1024
VM_TIMEOUT_S = 50.0



async def _run(*cmd: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, f"{' '.join(cmd)} failed: {out.decode(errors='replace')}"


async def _create_qcow2(path: Path) -> Path:
    await _run("qemu-img", "create", "-q", "-f", "qcow2", str(path), str(IMAGE_SIZE))
    return path


async def _read_image(image: Path, scratch: Path) -> bytes:
    """The guest-visible contents of a qcow2 image, via qemu-img (not via QSD)."""
    raw = scratch / f"{image.stem}.raw"
    await _run("qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(image), str(raw))
    return raw.read_bytes()


def _assert_pattern(data: bytes, seed: int, blocks: Sequence[int]) -> None:
    for index in blocks:
        got = data[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
        expected = pattern_block(seed, index)
        assert got == expected, f"block {index} differs; starts with {got[:48]!r}"


@pytest_asyncio.fixture
async def qsd_factory(tmp_path: Path) -> AsyncIterator[list[StorageDaemon]]:
    """Collects daemons a test starts and stops any left running on the way out."""
    started: list[StorageDaemon] = []
    yield started
    for daemon in started:
        await daemon.stop()


async def _start_qsd(
    tmp_path: Path, started: list[StorageDaemon], images: Sequence[Path], num_queues: int
) -> tuple[StorageDaemon, list[Path]]:
    sockets = [tmp_path / f"vhost{i}.sock" for i in range(len(images))]
    exports = [VhostUserExport(img, sock, num_queues=num_queues) for img, sock in zip(images, sockets)]
    daemon = await start_storage_daemon(exports, tmp_path / "qmp.sock")
    started.append(daemon)
    return daemon, sockets


async def test_direct_io_pattern_roundtrip_over_two_queues(
    guest_image: GuestImage, tmp_path: Path, qsd_factory: list[StorageDaemon]
) -> None:
    image = await _create_qcow2(tmp_path / "disk0.qcow2")
    daemon, (sock,) = await _start_qsd(tmp_path, qsd_factory, [image], num_queues=2)
    seed, blocks = 1234, 8
    script = guest_script(
        "ls /sys/block/vda/mq | wc -l | sed 's/^/MQ_QUEUES /'",
        "echo \"WRITE_CACHE $(cat /sys/block/vda/queue/write_cache)\"",
        write_pattern("/dev/vda", seed, blocks),
        verify_pattern("/dev/vda", seed, blocks),
        # Two O_DIRECT reads of one block must both reach the device: a
        # silent fallback to buffered I/O would serve the second from cache.
        device_stats("/dev/vda"),
        "dd if=/dev/vda of=/dev/null bs=1M count=1 iflag=direct 2>/dev/null",
        "dd if=/dev/vda of=/dev/null bs=1M count=1 iflag=direct 2>/dev/null",
        device_stats("/dev/vda"),
        count_kernel_io_errors(),
    )
    # cpus=2: the guest's virtio-blk uses min(num-queues, vCPUs) queues.
    result = await run_guest(
        guest_image,
        [VhostUserDisk(sock, num_queues=2, config_wce=False)],
        script,
        cpus=2,
        timeout=VM_TIMEOUT_S,
    )

    assert result.exit_code == 0, result.output
    assert "MQ_QUEUES 2" in result.lines
    assert "WRITE_CACHE write back" in result.lines  # config-wce=off: guest sends flushes
    assert acknowledged_blocks(result.output, "/dev/vda") == list(range(blocks))
    (summary,) = verify_summaries(result.output)
    assert (summary.ok, summary.mismatch, summary.ioerrors) == (blocks, 0, 0)
    (before, after) = device_stat_samples(result.output, "/dev/vda")
    assert after[0] - before[0] == 2 * BLOCK_SIZE // 512
    assert "KERNEL_IO_ERRORS 0" in result.lines

    assert await daemon.stop() == 0
    _assert_pattern(await _read_image(image, tmp_path), seed, range(blocks))


async def test_two_disks_on_one_daemon_keep_their_own_data(
    guest_image: GuestImage, tmp_path: Path, qsd_factory: list[StorageDaemon]
) -> None:
    images = [await _create_qcow2(tmp_path / f"disk{i}.qcow2") for i in range(2)]
    daemon, sockets = await _start_qsd(tmp_path, qsd_factory, images, num_queues=1)
    seeds, blocks = (11, 22), 4
    script = guest_script(
        write_pattern("/dev/vda", seeds[0], blocks),
        write_pattern("/dev/vdb", seeds[1], blocks),
        verify_pattern("/dev/vda", seeds[0], blocks),
        verify_pattern("/dev/vdb", seeds[1], blocks),
    )
    result = await run_guest(
        guest_image,
        [VhostUserDisk(sock, config_wce=False) for sock in sockets],
        script,
        timeout=VM_TIMEOUT_S,
    )

    assert result.exit_code == 0, result.output
    assert {s.device: s.ok for s in verify_summaries(result.output)} == {"/dev/vda": blocks, "/dev/vdb": blocks}
    assert await daemon.stop() == 0
    for image, seed in zip(images, seeds):
        _assert_pattern(await _read_image(image, tmp_path), seed, range(blocks))


async def test_flushed_writes_survive_daemon_kill(
    guest_image: GuestImage, tmp_path: Path, qsd_factory: list[StorageDaemon]
) -> None:
    """Writes the guest saw acknowledged (O_DIRECT + fsync) survive SIGKILL of QSD.

    Needs ``config_wce=False``: QSD 7.2 reports wce=0, so with QEMU's default
    the guest thinks the disk is write-through, never flushes, and a QSD
    crash loses the unflushed qcow2 metadata, i.e. all of those writes.
    """
    image = await _create_qcow2(tmp_path / "disk0.qcow2")
    daemon, (sock,) = await _start_qsd(tmp_path, qsd_factory, [image], num_queues=1)
    seed, blocks = 77, 4
    result = await run_guest(
        guest_image,
        [VhostUserDisk(sock, config_wce=False)],
        guest_script(write_pattern("/dev/vda", seed, blocks)),
        timeout=VM_TIMEOUT_S,
    )
    assert result.exit_code == 0, result.output
    acked = acknowledged_blocks(result.output, "/dev/vda")
    assert acked == list(range(blocks))

    await daemon.kill()
    _assert_pattern(await _read_image(image, tmp_path), seed, acked)


async def test_file_disk_console_streaming_and_exit_code(guest_image: GuestImage, tmp_path: Path) -> None:
    """QEMU's in-process virtio-blk path, the console API, and a non-zero exit status."""
    image = tmp_path / "plain.raw"
    with image.open("wb") as f:
        f.truncate(IMAGE_SIZE)
    script = guest_script(write_pattern("/dev/vda", 5, 2), verify_pattern("/dev/vda", 5, 2), "echo done-marker") + "exit 3\n"
    vm = await start_vm(guest_image, [FileDisk(image, format="raw")], script, timeout=VM_TIMEOUT_S)
    async with vm:
        ready = await vm.wait_for_line(r"CSI_QSD_GUEST_READY disks=(\d+)", timeout=VM_TIMEOUT_S)
        assert ready.group(1) == "1"
        # The cursor moves forward: block 1 is found after block 0.
        assert (await vm.wait_for_line(r"^WROTE (\d+)")).group(1) == "0"
        assert (await vm.wait_for_line(r"^WROTE (\d+)")).group(1) == "1"
        streamed = [line async for line in vm.lines()]
        result = await vm.wait()

    assert result.exit_code == 3
    assert "done-marker" in streamed and streamed == result.lines
    assert result.boot_seconds is not None and result.boot_seconds < result.wall_seconds
    _assert_pattern(image.read_bytes(), 5, range(2))


async def test_kill_stops_a_hung_guest(guest_image: GuestImage) -> None:
    vm = await start_vm(guest_image, [], "echo sleeping; sleep 600", timeout=VM_TIMEOUT_S)
    async with vm:
        await vm.wait_for_line("^sleeping$", timeout=VM_TIMEOUT_S)
        await vm.kill()
        assert vm.returncode is not None
        with pytest.raises(GuestError, match="killed"):
            await vm.wait()
