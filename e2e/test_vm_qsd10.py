"""Growing a VM disk while its guest runs, on qemu-storage-daemon 10.

Two layers, each with a real TCG guest on a vhost-user-blk socket:

* QSD alone, its graph built as the driver builds it on QSD 10 (qcow2 node,
  export in QSD's main loop, ``writethrough=on``): the facts the driver
  relies on. The figures below were first measured with the exports in a
  shared iothread, which 10.0.13 turned out to abort on when clients come and
  go during graph changes (tests/integration/test_vhost_churn.py). Measured
  on QSD 10.0.13 with a guest reading ``/sys/block/vda/size`` in a loop:
  ``block_resize`` on the exported format node answers in 2-60 ms and the
  running guest sees 131072 -> 262144 sectors 15-100 ms after the command
  was sent, with no reconnect and no I/O error, while a second VM on another
  export in the same iothread keeps writing (largest gap between its 4 KiB
  O_DIRECT writes 20-300 ms, as without a resize on this loaded 2-core
  machine). ``block-export-del`` (mode hard) with the guest connected
  answers in ~1 ms and the export is gone: the guest is cut off (its QEMU
  logs the lost backend and retries), QSD and the other VM carry on. QSD
  7.2 did neither: its export kept its creation size and the hard delete
  never answered.
* The driver through CSI: NodeExpandVolume of a published VM volume grows
  the disk under the running guest without touching its export, and a retry
  with the size it already has changes nothing the guest can notice; the
  growth of a volume whose connected client set up no back-end channel
  (libblkio) is refused while a guest beside it, on the same QSD, grows.

Not pinned here because it is rare: on QSD 10.0.13 ``block_resize`` under
connected guests sometimes never answers. 7 of 74 first resizes hung where
another guest on the same iothread had just started its I/O (0 of 15 with
both guests long running, 0 of 25 with a single guest, 0 of ~30 later
resizes). QMP then stays silent for good, killing the guests does not
release it, only killing QSD does; the image was clean afterwards
(``qemu-img check``), at the old size or already the new one. A guest that
reconnects keeps the size it had; a ``block_resize`` to the size the image
already has then tells it (seen ~40 ms later).

Both layers need QSD >= 10; they are skipped on an older one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from qemu.qmp import EventListener

from csi_qsd.cli.client import CSIClient
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.qsd import features
from csi_qsd.sys.tools import bundled
from e2e.conftest import e2e_marks
from testing import owner, tiers
from testing.guest import (
    BLOCK_SIZE,
    GuestImage,
    RunningVM,
    StorageDaemon,
    VhostUserDisk,
    acknowledged_blocks,
    count_kernel_io_errors,
    guest_script,
    start_storage_daemon,
    start_vm,
    verify_pattern,
    verify_summaries,
    write_pattern,
    write_summaries,
)
from testing.harness import DriverProcess, qemu_io_session, qsd_pid
from testing.served import Served, provision, serving

pytestmark = e2e_marks()

MIB = 1 << 20
SIZE = 64 * MIB
SECTOR = 512
DEVICE = "/dev/vda"
VM_TIMEOUT_S = 120.0
# How long a running guest may take to see its disk grow, from the start of the call that grew it.
SEE_GROWTH_S = 5.0
# The longest pause in a guest's I/O loop that still counts as "no stall" (the loop turns every ~20-70 ms
# under TCG; a reconnect of the guest's QEMU alone takes at least its 1 s reconnect delay).
MAX_GAP_S = 1.0
QSD_VERSION_RE = re.compile(rb"version (\d+)\.(\d+)\.(\d+)")


def qsd_version(binary: str) -> tuple[int, int, int] | None:
    """The version the QSD binary reports (None if it cannot be run)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, check=True, timeout=30,
                             env=dict(os.environ, LC_ALL="C")).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = QSD_VERSION_RE.search(out)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


def driver_qsd_binary() -> str:
    return os.environ.get("CSI_QSD_QSD_BINARY", bundled("qemu-storage-daemon"))


DRIVER_QSD_VERSION = qsd_version(driver_qsd_binary())
# A QSD that does not run is a missing tool (testing.tiers); an older one lacks the feature, a skip by design.
pytestmark.append(tiers.needs("e2e", "" if DRIVER_QSD_VERSION else f"a QSD that runs at {driver_qsd_binary()}"))
needs_live_resize = pytest.mark.skipif(
    DRIVER_QSD_VERSION is not None and not features.live_resize_reaches_guest(DRIVER_QSD_VERSION),
    reason="QSD before 10 never tells a running guest that its vhost-user-blk disk grew",
)


# --- guests ----------------------------------------------------------------------


def size_watch(new_sectors: int, turns_after: int = 10) -> str:
    """Guest loop: print the disk's size and read 4 KiB (O_DIRECT) per turn.

    ``SIZE <sectors> <turn> ok|ERR`` per turn; stops `turns_after` turns after
    the size reads `new_sectors` (the host bounds how long that may take).
    """
    return f"""
i=0; seen=-1
while :; do
    s=$(cat /sys/block/vda/size)
    if dd if={DEVICE} of=/dev/null bs=4k count=1 skip=$((i % 1000)) iflag=direct 2>/dev/null; then r=ok
    else r=ERR; failures=$((failures + 1)); fi
    echo "SIZE $s $i $r"
    if [ "$s" -eq {new_sectors} ] && [ "$seen" -lt 0 ]; then seen=$i; fi
    if [ "$seen" -ge 0 ] && [ "$i" -ge $((seen + {turns_after})) ]; then break; fi
    i=$((i + 1))
    sleep 0.05
done
"""


def write_ticks() -> str:
    """Guest loop, until the VM is stopped: 4 KiB O_DIRECT write + fsync, then ``TICK <n> ok|ERR``."""
    return f"""
dd if=/dev/zero of=/tmp/tick bs=4k count=1 2>/dev/null
i=0
while :; do
    if dd if=/tmp/tick of={DEVICE} bs=4k count=1 seek=$((i % 1000)) oflag=direct conv=notrunc,fsync \\
            2>/dev/null; then r=ok; else r=ERR; fi
    echo "TICK $i $r"
    i=$((i + 1))
done
"""


SIZE_LINE = re.compile(r"^SIZE (\d+) (\d+) (ok|ERR)$")
TICK_LINE = re.compile(r"^TICK (\d+) (ok|ERR)$")


class ConsoleClock:
    """When each console line of a running guest reached the host."""

    def __init__(self, vm: RunningVM) -> None:
        self.lines: list[tuple[float, str]] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._follow(vm))

    async def _follow(self, vm: RunningVM) -> None:
        try:
            async for line in vm.lines():
                self.lines.append((time.monotonic(), line))
                self._changed.set()
        finally:
            self._changed.set()

    async def first(self, pattern: re.Pattern[str], timeout: float, after: float = 0.0) -> tuple[float, re.Match[str]]:
        """The first line matching `pattern` that arrived at or after `after`, waiting up to `timeout`."""
        index = 0
        async with asyncio.timeout(timeout):
            while True:
                for stamp, line in self.lines[index:]:
                    if stamp >= after and (match := pattern.match(line)):
                        return stamp, match
                index = len(self.lines)
                if self._task.done():
                    raise AssertionError(f"the guest's console closed before a line matching {pattern.pattern!r}")
                self._changed.clear()
                await self._changed.wait()

    def matches(self, pattern: re.Pattern[str]) -> list[tuple[float, re.Match[str]]]:
        return [(stamp, m) for stamp, line in self.lines if (m := pattern.match(line))]

    def longest_gap(self, pattern: re.Pattern[str], start: float, end: float) -> float:
        """The longest time between consecutive matching lines over [start, end], its edges included."""
        stamps = [start, *(s for s, _ in self.matches(pattern) if start < s < end), end]
        return max(b - a for a, b in zip(stamps, stamps[1:]))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def clocked(vm: RunningVM) -> AsyncIterator[ConsoleClock]:
    clock = ConsoleClock(vm)
    try:
        yield clock
    finally:
        await clock.close()


async def wait_ticks(clock: ConsoleClock, count: int, after: float, timeout: float = 60.0) -> float:
    """Until the bystander has printed `count` ticks after `after`; returns when the last one arrived."""
    stamp = after
    for _ in range(count):
        stamp, _match = await clock.first(TICK_LINE, timeout, after=stamp + 1e-9)
    return stamp


def assert_no_reconnect(vm: RunningVM, who: str) -> None:
    # The guest's QEMU logs nothing while its backend stays; a lost one shows as end-of-file,
    # ring restore and reconnect errors on its stderr.
    assert not vm.qemu_stderr.strip(), f"{who}'s QEMU lost its vhost-user backend:\n{vm.qemu_stderr}"


def assert_ticks_clean(clock: ConsoleClock) -> None:
    bad = [m.group(0) for _, m in clock.matches(TICK_LINE) if m.group(2) != "ok"]
    assert not bad, f"the bystander VM saw write errors: {bad[:5]}"


# --- QSD alone -----------------------------------------------------------------------


@contextlib.contextmanager
def short_dir() -> Iterator[Path]:
    """A private directory with a short path (UNIX socket paths are limited to 107 bytes)."""
    root = owner.make_base("cq10")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def qmp(daemon: StorageDaemon, command: str, arguments: dict[str, Any] | None = None) -> Any:
    return await asyncio.wait_for(daemon.qmp.execute(command, arguments), 10)


@contextlib.asynccontextmanager
async def storage_daemon(root: Path, names: tuple[str, ...]) -> AsyncIterator[StorageDaemon]:
    """QSD with, per name, a qcow2 volume exported as the driver exports it on QSD 10 (main loop)."""
    for name in names:
        subprocess.run([bundled("qemu-img"), "create", "-q", "-f", "qcow2", str(root / f"{name}.qcow2"), str(SIZE)],
                       check=True)
    daemon = await start_storage_daemon([], root / "qmp.sock")
    try:
        version = (await qmp(daemon, "query-version"))["qemu"]
        if not features.live_resize_reaches_guest((version["major"], version["minor"], version["micro"])):
            pytest.skip(f"QSD {version} never tells a running guest that its disk grew")
        for name in names:
            await qmp(daemon, "blockdev-add", {
                "driver": "file", "node-name": f"{name}-f", "filename": str(root / f"{name}.qcow2"),
                "aio": "threads", "cache": {"direct": False, "no-flush": False},
            })
            await qmp(daemon, "blockdev-add", {
                "driver": "qcow2", "node-name": f"{name}-q", "file": f"{name}-f", "l2-cache-size": MIB,
            })
            await qmp(daemon, "block-export-add", {
                "type": "vhost-user-blk", "id": f"{name}-vhost", "node-name": f"{name}-q",
                "addr": {"type": "unix", "path": str(root / f"{name}.sock")}, "writable": True,
                "writethrough": True, "num-queues": 1, "logical-block-size": SECTOR,
            })
        yield daemon
    finally:
        await daemon.kill()


async def test_qsd_block_resize_reaches_the_running_guest_and_stalls_no_other_vm(guest_image: GuestImage) -> None:
    with short_dir() as root:
        async with storage_daemon(root, ("grown", "busy")) as daemon:
            watcher = await start_vm(guest_image, [VhostUserDisk(root / "grown.sock")],
                                     guest_script(size_watch(2 * SIZE // SECTOR)), timeout=VM_TIMEOUT_S)
            bystander = await start_vm(guest_image, [VhostUserDisk(root / "busy.sock")], guest_script(write_ticks()),
                                       timeout=VM_TIMEOUT_S)
            async with watcher, bystander, clocked(watcher) as watched, clocked(bystander) as busy:
                await watched.first(SIZE_LINE, VM_TIMEOUT_S)
                await wait_ticks(busy, 20, after=0.0, timeout=VM_TIMEOUT_S)
                started = time.monotonic()
                await qmp(daemon, "block_resize", {"node-name": "grown-q", "size": 2 * SIZE})
                seen, _ = await watched.first(re.compile(rf"^SIZE {2 * SIZE // SECTOR} "), SEE_GROWTH_S)
                settled = await wait_ticks(busy, 10, after=seen)
                result = await watcher.wait()
                gap = busy.longest_gap(TICK_LINE, started, settled)
                assert_ticks_clean(busy)
                assert_no_reconnect(bystander, "the bystander")
            assert result.exit_code == 0, result.output
            sizes = {int(m.group(1)) for _, m in watched.matches(SIZE_LINE)}
            assert sizes == {SIZE // SECTOR, 2 * SIZE // SECTOR}, sizes
            assert_no_reconnect(watcher, "the growing guest")
            assert gap < MAX_GAP_S, f"the other VM's writes stalled {gap:.2f}s during the resize"


async def test_qsd_hard_export_del_with_a_guest_connected_answers_at_once(guest_image: GuestImage) -> None:
    with short_dir() as root:
        async with storage_daemon(root, ("cut", "busy")) as daemon:
            cut = await start_vm(guest_image, [VhostUserDisk(root / "cut.sock")], guest_script(write_ticks()),
                                 timeout=VM_TIMEOUT_S)
            bystander = await start_vm(guest_image, [VhostUserDisk(root / "busy.sock")], guest_script(write_ticks()),
                                       timeout=VM_TIMEOUT_S)
            async with cut, bystander, clocked(cut) as victim, clocked(bystander) as busy:
                await wait_ticks(victim, 5, after=0.0, timeout=VM_TIMEOUT_S)
                await wait_ticks(busy, 5, after=0.0, timeout=VM_TIMEOUT_S)
                listener = EventListener(("BLOCK_EXPORT_DELETED",))
                with daemon.qmp.listen(listener):
                    started = time.monotonic()
                    await qmp(daemon, "block-export-del", {"id": "cut-vhost", "mode": "hard"})
                    event = await asyncio.wait_for(listener.get(), 10)
                    took = time.monotonic() - started
                data = cast(dict[str, Any], event["data"])
                assert data["id"] == "cut-vhost"
                exports = {e["id"] for e in await qmp(daemon, "query-block-exports")}
                assert exports == {"busy-vhost"}
                settled = await wait_ticks(busy, 20, after=time.monotonic())
                gap = busy.longest_gap(TICK_LINE, started, settled)
                assert_ticks_clean(busy)
                assert_no_reconnect(bystander, "the bystander")
            assert took < 2.0, f"block-export-del took {took:.2f}s"
            assert gap < MAX_GAP_S, f"the other VM's writes stalled {gap:.2f}s while an export was cut"


# --- the driver ----------------------------------------------------------------------


@pytest.fixture
async def served() -> AsyncIterator[Served[DriverProcess]]:
    async with serving() as value:
        yield value


async def expansion_mode(csi: CSIClient) -> int:
    response: Any = await csi.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), timeout=csi.timeout)
    modes = [c.volume_expansion.type for c in response.capabilities if c.HasField("volume_expansion")]
    assert len(modes) == 1, response
    return int(modes[0])


@needs_live_resize
async def test_online_expansion_seen_by_running_guest(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    """NodeExpandVolume of a published VM volume while its guest runs: the guest sees the new size at once.

    No reconnect (the export stays), no I/O error, and the grown space is
    usable at once; a VM on another volume of the same driver (same QSD,
    same iothread) keeps writing without a stall.
    """
    assert await expansion_mode(served.csi) == pb.PluginCapability.VolumeExpansion.ONLINE, (
        "a driver that grows running VMs' disks must advertise ONLINE expansion")
    grown = await provision(served, "vm-online-grown")
    busy = await provision(served, "vm-online-busy")
    qsd_before = qsd_pid(served.box)
    far, seed = 2 * SIZE // BLOCK_SIZE - 1, 4242
    watch = guest_script(
        size_watch(2 * SIZE // SECTOR),
        write_pattern(DEVICE, seed, 1, start=far),
        verify_pattern(DEVICE, seed, 1, start=far),
        count_kernel_io_errors(),
    )
    watcher = await start_vm(guest_image, [VhostUserDisk(grown.socket)], watch, timeout=VM_TIMEOUT_S)
    bystander = await start_vm(guest_image, [VhostUserDisk(busy.socket)], guest_script(write_ticks()),
                               timeout=VM_TIMEOUT_S)
    async with watcher, bystander, clocked(watcher) as watched, clocked(bystander) as ticks:
        await watched.first(SIZE_LINE, VM_TIMEOUT_S)
        await wait_ticks(ticks, 20, after=0.0, timeout=VM_TIMEOUT_S)
        started = time.monotonic()
        assert await served.csi.expand(grown.id, str(grown.target), 2 * SIZE) == 2 * SIZE
        returned = time.monotonic()
        seen, _ = await watched.first(re.compile(rf"^SIZE {2 * SIZE // SECTOR} "),
                                      max(0.0, started + SEE_GROWTH_S - time.monotonic()))
        settled = await wait_ticks(ticks, 10, after=max(seen, returned))
        result = await watcher.wait()
        busy_gap = ticks.longest_gap(TICK_LINE, started, settled)
        assert_ticks_clean(ticks)
        assert_no_reconnect(bystander, "the bystander")

    assert result.exit_code == 0, result.output
    sizes = [int(m.group(1)) for _, m in watched.matches(SIZE_LINE)]
    assert set(sizes) == {SIZE // SECTOR, 2 * SIZE // SECTOR} and sizes == sorted(sizes), sizes
    assert not [m.group(0) for _, m in watched.matches(SIZE_LINE) if m.group(3) != "ok"], "the guest saw read errors"
    assert_no_reconnect(watcher, "the growing guest")
    watch_gap = watched.longest_gap(SIZE_LINE, started, seen)
    assert watch_gap < MAX_GAP_S, f"the growing guest's I/O stalled {watch_gap:.2f}s"
    (wrote,) = write_summaries(result.output)
    (verify,) = verify_summaries(result.output)
    assert (wrote.wrote, wrote.errors, verify.ok) == (1, 0, 1), "the grown space must be usable at once"
    assert "KERNEL_IO_ERRORS 0" in result.lines
    assert busy_gap < MAX_GAP_S, f"the other VM's writes stalled {busy_gap:.2f}s during the expansion"
    assert qsd_pid(served.box) == qsd_before


def libblkio_client(socket: Path) -> contextlib.AbstractAsyncContextManager[None]:
    """qemu-io on `socket` through libblkio's virtio-blk-vhost-user driver, connected until the block ends."""
    return qemu_io_session(
        [bundled("qemu-io"), "--image-opts", f"driver=virtio-blk-vhost-user,path={socket},cache.direct=on"], "read 0 1M")


@needs_live_resize
async def test_growth_under_a_libblkio_client_is_refused_while_a_guest_beside_it_grows_live(
    served: Served[DriverProcess], guest_image: GuestImage,
) -> None:
    """Two volumes of one QSD: libblkio (no back-end channel) on one, a guest's QEMU on the other.

    The first's NodeExpandVolume is FAILED_PRECONDITION and QSD lives (before
    the check it died, SIGSEGV, taking the guest's disk too); the guest's
    grows under it as before, seen live with no reconnect.
    """
    grown = await provision(served, "vm-beside-grown")
    held = await provision(served, "vm-beside-blkio")
    qsd_before = qsd_pid(served.box)
    watcher = await start_vm(guest_image, [VhostUserDisk(grown.socket)], guest_script(size_watch(2 * SIZE // SECTOR)),
                             timeout=VM_TIMEOUT_S)
    async with watcher, clocked(watcher) as watched, libblkio_client(held.socket):
        await watched.first(SIZE_LINE, VM_TIMEOUT_S)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.csi.expand(held.id, str(held.target), 2 * SIZE)
        details = info.value.details() or ""
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION, details
        assert held.id in details and "back-end channel" in details, details
        assert qsd_pid(served.box) == qsd_before, "qemu-storage-daemon died"
        started = time.monotonic()
        assert await served.csi.expand(grown.id, str(grown.target), 2 * SIZE) == 2 * SIZE
        await watched.first(re.compile(rf"^SIZE {2 * SIZE // SECTOR} "),
                            max(0.0, started + SEE_GROWTH_S - time.monotonic()))
        result = await watcher.wait()
    assert result.exit_code == 0, result.output
    assert not [m.group(0) for _, m in watched.matches(SIZE_LINE) if m.group(3) != "ok"], "the guest saw read errors"
    assert_no_reconnect(watcher, "the growing guest")
    assert qsd_pid(served.box) == qsd_before
    assert await served.csi.expand(held.id, str(held.target), 2 * SIZE) == 2 * SIZE  # the client gone: it grows


@needs_live_resize
async def test_expand_retry_without_growth_keeps_guest_connected(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    """A NodeExpandVolume retry asking for the size the volume has: nothing the guest can notice."""
    volume = await provision(served, "vm-expand-retry")
    qsd_before = qsd_pid(served.box)
    seed, blocks = 4343, 24
    writes = [write_pattern(DEVICE, seed, 2, start=first) + "sleep 0.1\n" for first in range(0, blocks, 2)]
    script = guest_script(*writes, verify_pattern(DEVICE, seed, blocks), count_kernel_io_errors(),
                          'echo "SECTORS $(cat /sys/block/vda/size)"')
    vm = await start_vm(guest_image, [VhostUserDisk(volume.socket)], script, timeout=VM_TIMEOUT_S)
    async with vm:
        wrote = re.compile(rf"^WROTE (\d+) dev={re.escape(DEVICE)}")
        async with asyncio.timeout(VM_TIMEOUT_S):
            while len(acknowledged_blocks(vm.output, DEVICE)) < 4:
                await vm.wait_for_line(wrote)
        for path in (volume.target, volume.staging):
            assert await served.csi.expand(volume.id, str(path), SIZE) == SIZE
        at_retry = len(acknowledged_blocks(vm.output, DEVICE))
        async with asyncio.timeout(30):
            while len(acknowledged_blocks(vm.output, DEVICE)) < min(blocks, at_retry + 3):
                await vm.wait_for_line(wrote)
        result = await vm.wait()

    assert result.exit_code == 0, result.output
    assert at_retry < blocks, "the guest finished before the retry: nothing was tested"
    assert acknowledged_blocks(result.output, DEVICE) == list(range(blocks))
    assert sum(s.errors for s in write_summaries(result.output)) == 0
    (verify,) = verify_summaries(result.output)
    assert (verify.ok, verify.mismatch, verify.ioerrors) == (blocks, 0, 0), verify
    assert "KERNEL_IO_ERRORS 0" in result.lines
    assert f"SECTORS {SIZE // SECTOR}" in result.lines
    assert_no_reconnect(vm, "the guest")
    assert qsd_pid(served.box) == qsd_before
