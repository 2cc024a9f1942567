"""Live snapshot and clone of a VM volume while its guest writes, checked byte for byte from the host.

The driver runs as `csi-qsd serve` on its UNIX socket. One vhost-user-blk
volume is staged and published as kubelet would; a busybox guest opens the
published socket and writes a pattern sequentially (1 MiB blocks, O_DIRECT,
fsync after each: a ``WROTE n`` line means block n was acknowledged). While it
writes, the test takes a CSI snapshot and then a clone of the volume in use.
The export must stay connected through both cuts: same QSD, same socket, the
guest reports no I/O error, keeps writing, and reads every block back at the
end through the new chain.

Then, from the host and without QSD (``qemu-img convert`` of the new volumes'
images, read through their backing chains), each copy must be a consistent
prefix of the write sequence: every block acknowledged before the call started
holds its pattern, the blocks after the cut are zero, and at most the one block
that was in flight at the cut is torn (each of its sectors either the pattern
or zero). Nothing acknowledged after the call returned may be in it.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.conftest import e2e_marks
from testing.guest import (
    BLOCK_SIZE,
    GuestImage,
    RunningVM,
    VhostUserDisk,
    acknowledged_blocks,
    count_kernel_io_errors,
    guest_script,
    pattern_block,
    start_vm,
    verify_pattern,
    verify_summaries,
    write_summaries,
)
from testing.guest.writes import paced_writes
from testing.harness import DriverProcess, qsd_pid, until
from testing.served import Served, read_image, serving

pytestmark = e2e_marks()

MIB = 1 << 20
SECTOR = 512
SEED = 8128
BLOCKS = 36  # the guest writes blocks 0..35: long enough to cut twice mid-write
# Paced writes (`paced_writes`: 2 blocks, then 0.1 s) cap the guest at ~20 blocks/s, so
# a fast guest (KVM) cannot finish before both cuts; TCG is slower than that anyway.
SIZE = 64 * MIB
VM_PARAMETERS = {"format": "qcow2", "export": "vhost-user-blk"}
VM_TIMEOUT_S = 55.0
DEVICE = "/dev/vda"
WROTE = re.compile(rf"^WROTE (\d+) dev={re.escape(DEVICE)}")


@pytest.fixture
async def served() -> AsyncIterator[Served[DriverProcess]]:
    async with serving(fuse=True) as value:
        yield value


@dataclass(frozen=True)
class Cut:
    """One live cut (snapshot or clone) and how far the guest was around it."""

    what: str
    acked_before: int  # blocks 0..n-1 were acknowledged when the call started
    acked_after: int  # the most blocks the copy may hold: acknowledged just after the call returned, + 1 in flight
    seconds: float
    image: Path  # the new volume's image, read through its chain from the host


def acked(vm: RunningVM) -> int:
    blocks = acknowledged_blocks(vm.output, DEVICE)
    assert blocks == list(range(len(blocks))), f"the guest must write in order: {blocks}"
    return len(blocks)


async def wait_for_block(vm: RunningVM, index: int) -> None:
    """Until the guest has acknowledged block `index`; fails if it ends first."""
    while acked(vm) <= index:
        await vm.wait_for_line(WROTE, timeout=VM_TIMEOUT_S)


async def acked_after_return(vm: RunningVM, what: str) -> int:
    """How far the guest got by the time a call returned, as a bound for what the copy may hold.

    The console lags the guest a little: a block acknowledged just before the
    return may still be on its way. Lines come in order and far apart (each
    is a fsynced 1 MiB write), so the next WROTE line to arrive after the
    return brings any such line with it; counting then, not at once and not
    after a fixed pause, can only loosen the bound by that one block.
    """
    seen = acked(vm)
    assert seen < BLOCKS, f"the guest finished before the {what} returned: raise BLOCKS"
    await wait_for_block(vm, seen)
    return acked(vm)


def classify(data: bytes, index: int) -> str:
    """'pattern', 'zero', 'torn' (every sector the pattern or zero) or 'garbage' for block `index`."""
    got = data[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE]
    expected = pattern_block(SEED, index)
    if got == expected:
        return "pattern"
    if not any(got):
        return "zero"
    zero = bytes(SECTOR)
    for offset in range(0, BLOCK_SIZE, SECTOR):
        sector = got[offset:offset + SECTOR]
        if sector != zero and sector != expected[offset:offset + SECTOR]:
            return "garbage"
    return "torn"


def assert_consistent_prefix(data: bytes, cut: Cut) -> int:
    """The image holds blocks 0..m-1, then at most one torn block, then zeros; returns m."""
    assert len(data) == SIZE, f"{cut.what}: image is {len(data)} bytes, expected {SIZE}"
    kinds = [classify(data, i) for i in range(SIZE // BLOCK_SIZE)]
    assert "garbage" not in kinds, f"{cut.what}: block {kinds.index('garbage')} holds bytes nobody wrote"
    m = kinds.index("zero") if "zero" in kinds else len(kinds)
    m = min(m, kinds.index("torn") if "torn" in kinds else m)
    assert m >= cut.acked_before, (
        f"{cut.what}: blocks {m}..{cut.acked_before - 1} were acknowledged before the call started "
        f"but are missing (image holds {kinds[:cut.acked_before + 1]})"
    )
    tail = kinds[m + 1:]
    assert all(k == "zero" for k in tail), f"{cut.what}: not a prefix: blocks after {m} are {tail}"
    assert m <= cut.acked_after, (
        f"{cut.what}: holds {m} blocks, but the guest had acknowledged at most {cut.acked_after} "
        "by the time the call returned"
    )
    return m


async def test_live_snapshot_and_clone_of_a_vm_volume_under_writes(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    box, csi = served.box, served.csi
    pool = box.state_dir / "pool"
    vid = (await csi.create_volume("pvc-vm-live", SIZE, VM_PARAMETERS)).volume_id
    staging, target = box.staging("vm"), box.target("vm")
    await csi.stage(vid, str(staging))
    await csi.publish(vid, str(staging), str(target))
    socket = target / "vhost-user-blk.sock"
    qsd_before, socket_inode = qsd_pid(box), socket.stat().st_ino

    script = guest_script(*paced_writes(SEED, BLOCKS), verify_pattern(DEVICE, SEED, BLOCKS), count_kernel_io_errors())
    # config_wce=False as in the harness tests: the guest sees a write-back cache and flushes.
    vm = await start_vm(guest_image, [VhostUserDisk(socket, config_wce=False)], script, timeout=VM_TIMEOUT_S)
    cuts: list[Cut] = []
    async with vm:
        await wait_for_block(vm, 2)

        before, start = acked(vm), time.monotonic()
        snapshot = await csi.create_snapshot("snap-vm-live", vid)
        seconds = time.monotonic() - start
        after = await acked_after_return(vm, "snapshot")
        assert snapshot.ready_to_use and snapshot.size_bytes == SIZE and snapshot.source_volume_id == vid
        restored = await csi.create_volume("pvc-vm-restore", SIZE, VM_PARAMETERS, from_snapshot=snapshot.snapshot_id)
        assert restored.content_source.snapshot.snapshot_id == snapshot.snapshot_id
        cuts.append(Cut("restore of the snapshot", before, after + 1, seconds, pool / f"{restored.volume_id}.qcow2"))

        await wait_for_block(vm, after + 2)  # the guest keeps writing after the cut
        before, start = acked(vm), time.monotonic()
        clone = await csi.create_volume("pvc-vm-clone", SIZE, VM_PARAMETERS, from_volume=vid)
        seconds = time.monotonic() - start
        after = await acked_after_return(vm, "clone")
        assert clone.content_source.volume.volume_id == vid
        cuts.append(Cut("clone of the volume in use", before, after + 1, seconds, pool / f"{clone.volume_id}.qcow2"))

        await wait_for_block(vm, after + 2)
        result = await vm.wait()

    # The guest: every write acknowledged, none failed, all read back through the new chain.
    assert result.exit_code == 0, result.output
    summaries = write_summaries(result.output)
    assert sum(w.wrote for w in summaries) == BLOCKS, result.output
    assert sum(w.errors for w in summaries) == 0, result.output
    (verified,) = verify_summaries(result.output)
    assert (verified.ok, verified.mismatch, verified.ioerrors) == (BLOCKS, 0, 0), result.output
    assert "KERNEL_IO_ERRORS 0" in result.lines, result.output
    # The export stayed up: the same daemon and the same socket served the guest throughout.
    assert qsd_pid(box) == qsd_before and socket.stat().st_ino == socket_inode
    for cut in cuts:
        assert cut.seconds < 5, f"{cut.what} took {cut.seconds:.2f}s"

    # From the host, with the live volume still staged: each copy is the guest's writes up to its cut.
    for cut in cuts:
        assert_consistent_prefix(await read_image(cut.image, box.root), cut)

    # The live volume after two cuts holds every block, in the files on disk.
    await csi.unpublish(vid, str(target))
    await csi.unstage(vid, str(staging))
    tops = sorted(pool.glob(f"{vid}.*.qcow2"), key=lambda p: int(p.name.split(".")[1]))
    assert tops, f"no overlay of {vid} in {sorted(p.name for p in pool.iterdir())}"
    live = await read_image(tops[-1], box.root)
    for index in range(BLOCKS):
        assert classify(live, index) == "pattern", f"live volume: block {index} is {classify(live, index)}"

    for volume_id in (restored.volume_id, clone.volume_id, vid):
        await csi.delete_volume(volume_id)
    await csi.delete_snapshot(snapshot.snapshot_id)
    await until(lambda: sorted(p.name for p in pool.iterdir()) == [], "every image to go with the last user of the chain", 10)
