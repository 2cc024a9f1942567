"""VM volumes end to end: a real guest on the vhost-user-blk socket that csi-qsd publishes.

The driver runs as `csi-qsd serve` on its UNIX socket and is driven as the
external-provisioner and kubelet drive it (CreateVolume, NodeStage,
NodePublish with ``volume_mount_group``, ...). A busybox guest (TCG, ~2.5 s
to boot) opens ``<target>/vhost-user-blk.sock`` and writes 1 MiB blocks with
O_DIRECT, each followed by an fsync: a ``WROTE n`` line means block n was
acknowledged. What the guest saw acknowledged is then checked from the host
with ``qemu-img convert`` once the volume is unstaged, so neither QSD nor the
driver vouches for its own work.

Durability through crashes is the point of most tests here:

* SIGKILL of QSD under a default VM (QEMU's ``config-wce`` left on, so the
  guest believes the disk is write-through and never flushes): the default
  export has ``writethrough=on``, so no acknowledged block may be lost; the
  supervisor restarts QSD, re-adds the export at the same path and the guest
  (``reconnect=1``) carries on with zero I/O errors.
* the opt-in ``cache: writeback`` class is only safe with a VM that flushes
  (``config-wce=off``): same check.
* SIGKILL of the driver: QSD is detached, the guest never notices, and the
  restarted driver adopts the same QSD.

Queues (measured with QEMU/QSD 7.2): ``vhost-user-blk-pci`` asks for one
queue per vCPU unless ``num-queues`` is set, and refuses (retrying forever)
a backend offering fewer; the guest then uses min(device queues, vCPUs). The
export's queue count costs nothing while unused (4, 64 and 1024 queues all
cost ~4 KiB of QSD RSS per export), so the class's ``numQueues`` is an upper
bound only: VMs with more vCPUs than it must set ``num-queues=`` on the device.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from e2e.conftest import e2e_marks
from testing.guest import (
    BLOCK_SIZE,
    GuestImage,
    VhostUserDisk,
    acknowledged_blocks,
    count_kernel_io_errors,
    guest_script,
    run_guest,
    start_vm,
    verify_pattern,
    verify_summaries,
    write_pattern,
    write_summaries,
)
from testing.guest.writes import (
    DEVICE,
    RESTART_TIMEOUT_S,
    VM_TIMEOUT_S,
    assert_blocks,
    assert_clean_run,
    paced_writes,
    wait_for_block,
)
from testing.harness import DriverProcess, qsd_pid, until, wait_new_qsd
from testing.served import SIZE, SOCKET, Served, Volume, host_bytes, provision, release, serving

pytestmark = e2e_marks()

GROUP = "4321"


@pytest.fixture
async def served() -> AsyncIterator[Served[DriverProcess]]:
    async with serving() as value:
        yield value


# --- helpers -------------------------------------------------------------------


def write_cache_probe() -> str:
    return 'echo "WRITE_CACHE $(cat /sys/block/vda/queue/write_cache)"\n'


def mode_of(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


class AutoQueuesDisk(VhostUserDisk):
    """A vhost-user-blk device without ``num-queues=``: QEMU's default, one queue per vCPU."""

    def qemu_args(self, index: int) -> list[str]:
        args = super().qemu_args(index)
        args[-1] = args[-1].replace(f",num-queues={self.num_queues}", "")
        return args


async def crash_qsd_during_writes(
    served: Served[DriverProcess], guest_image: GuestImage, volume: Volume, disk: VhostUserDisk, seed: int
) -> tuple[list[int], str]:
    """SIGKILL QSD while the guest writes; returns the acked blocks and the guest's output."""
    blocks = 24
    script = guest_script(write_cache_probe(), *paced_writes(seed, blocks), verify_pattern(DEVICE, seed, blocks),
                          count_kernel_io_errors())
    vm = await start_vm(guest_image, [disk], script, timeout=VM_TIMEOUT_S)
    async with vm:
        await wait_for_block(vm, 5)
        old = qsd_pid(served.box)
        assert old is not None
        os.kill(old, signal.SIGKILL)
        killed_at = len(acknowledged_blocks(vm.output, DEVICE))
        await wait_new_qsd(served.box, old, RESTART_TIMEOUT_S)
        result = await vm.wait()
    assert result.exit_code == 0, result.output
    acked = assert_clean_run(result.output, blocks)
    assert killed_at < blocks, "the guest finished before QSD was killed: nothing was tested"
    return acked, result.output


# --- tests ---------------------------------------------------------------------


async def test_guest_writes_through_the_published_socket_and_the_host_reads_the_same_bytes(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    volume = await provision(served, "vm-roundtrip")
    seed, blocks = 101, 8
    script = guest_script(
        'echo "SECTORS $(cat /sys/block/vda/size)"',
        write_pattern(DEVICE, seed, blocks),
        verify_pattern(DEVICE, seed, blocks),
        count_kernel_io_errors(),
    )
    result = await run_guest(guest_image, [VhostUserDisk(volume.socket)], script, timeout=VM_TIMEOUT_S)

    assert result.exit_code == 0, result.output
    assert f"SECTORS {SIZE // 512}" in result.lines
    acked = assert_clean_run(result.output, blocks)
    stats = await served.csi.stats(volume.id, str(volume.target))
    assert not stats.volume_condition.abnormal, stats.volume_condition.message
    await release(served, volume)
    assert not volume.target.exists(), "unpublish must remove the target directory"
    assert_blocks(await host_bytes(served, volume), seed, acked, "host view after unstage")


async def test_qsd_sigkill_under_a_default_vm_loses_no_acknowledged_write(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    """Default class (export writethrough=on) and default VM (config-wce on: the guest never flushes)."""
    volume = await provision(served, "vm-qsd-crash", group=GROUP)
    seed = 202
    acked, output = await crash_qsd_during_writes(served, guest_image, volume, VhostUserDisk(volume.socket), seed)

    assert "WRITE_CACHE write through" in output.splitlines(), "expected a guest that never sends flushes"
    # The export came back at the same path, with the pod's group and no access for others.
    assert mode_of(volume.socket) == (0o660, 0, int(GROUP))
    stats = await served.csi.stats(volume.id, str(volume.target))
    assert not stats.volume_condition.abnormal, stats.volume_condition.message
    await release(served, volume)
    assert_blocks(await host_bytes(served, volume), seed, acked, "after QSD SIGKILL")


async def test_writeback_class_with_a_flushing_vm_survives_qsd_sigkill(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    """`cache: writeback` is only offered for VMs with config-wce=off, which flush; nothing acked is lost."""
    volume = await provision(served, "vm-writeback", {"cache": "writeback"})
    seed = 303
    disk = VhostUserDisk(volume.socket, config_wce=False)
    acked, output = await crash_qsd_during_writes(served, guest_image, volume, disk, seed)

    assert "WRITE_CACHE write back" in output.splitlines(), "config-wce=off must make the guest flush"
    await release(served, volume)
    assert_blocks(await host_bytes(served, volume), seed, acked, "writeback class after QSD SIGKILL")


async def test_driver_sigkill_and_restart_do_not_interrupt_the_guest(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    volume = await provision(served, "vm-driver-crash")
    seed, blocks = 404, 30
    # Slower pacing: the guest must still be writing when the restarted driver is back (~1.5 s).
    script = guest_script(*paced_writes(seed, blocks, pause=0.3), verify_pattern(DEVICE, seed, blocks),
                          count_kernel_io_errors())
    qsd_before = qsd_pid(served.box)
    vm = await start_vm(guest_image, [VhostUserDisk(volume.socket)], script, timeout=VM_TIMEOUT_S)
    async with vm:
        await wait_for_block(vm, 3)
        await served.driver.kill9()
        down_at = max(acknowledged_blocks(vm.output, DEVICE))
        # The data plane does not need the control plane: writes go on while it is down.
        await wait_for_block(vm, down_at + 4, timeout=30)
        assert served.driver.proc is not None and served.driver.proc.returncode is not None
        assert qsd_pid(served.box) == qsd_before
        await served.driver.start()
        restarted_at = max(acknowledged_blocks(vm.output, DEVICE))
        result = await vm.wait()

    assert result.exit_code == 0, result.output
    acked = assert_clean_run(result.output, blocks)
    assert restarted_at < blocks - 1, "the guest finished before the driver came back: restart not covered"
    assert qsd_pid(served.box) == qsd_before, "the restarted driver must adopt QSD, not replace it"
    assert "event=qsd_adopt" in served.driver.log_path.read_text(errors="replace")
    await release(served, volume)  # the adopted driver still manages the volume
    assert_blocks(await host_bytes(served, volume), seed, acked, "after driver restart")


async def test_two_vms_on_one_qsd_each_see_only_their_own_volume(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    volumes = [await provision(served, f"vm-pair-{i}") for i in range(2)]
    seeds, blocks = (505, 606), 8

    def script(seed: int) -> str:
        # Each guest checks its disk starts empty (nothing of the other's), then writes and reads back.
        return guest_script(
            'if [ "$(dd if=/dev/vda bs=1M count=1 iflag=direct 2>/dev/null | tr -d "\\000" | wc -c)" -ne 0 ]; '
            'then echo "NOT_EMPTY"; failures=$((failures + 1)); fi',
            *paced_writes(seed, blocks), verify_pattern(DEVICE, seed, blocks), count_kernel_io_errors(),
        )

    spans: list[tuple[float, float]] = []

    async def guest(volume: Volume, seed: int) -> str:
        vm = await start_vm(guest_image, [VhostUserDisk(volume.socket)], script(seed), timeout=VM_TIMEOUT_S)
        async with vm:
            await wait_for_block(vm, 0)
            first = time.monotonic()
            result = await vm.wait()
        spans.append((first, time.monotonic()))
        assert result.exit_code == 0, result.output
        return result.output

    qsd_before = qsd_pid(served.box)
    outputs = await asyncio.gather(*(guest(v, s) for v, s in zip(volumes, seeds)))
    for output in outputs:
        assert_clean_run(output, blocks)
    (a_start, a_end), (b_start, b_end) = spans
    assert a_start < b_end and b_start < a_end, f"the guests did not do I/O at the same time: {spans}"
    assert qsd_pid(served.box) == qsd_before
    for volume in volumes:
        await release(served, volume)
    for volume, seed, other in ((volumes[0], seeds[0], seeds[1]), (volumes[1], seeds[1], seeds[0])):
        data = await host_bytes(served, volume)
        assert_blocks(data, seed, range(blocks), f"volume {volume.id}")
        assert f"seed={other} ".encode() not in data, f"volume {volume.id} holds the other VM's data"


async def test_multi_queue_vm_on_the_default_export_and_the_refusal_below_it(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    """Default numQueues (64) serves a 2-vCPU VM with QEMU's default device (2 queues).

    A class offering fewer queues than the device asks for (numQueues=1, 2
    vCPUs) is refused by QEMU, which retries forever: the VM never boots.
    Setting num-queues on the device to at most the class's is the remedy.
    """
    probe = 'echo "MQ $(ls /sys/block/vda/mq | wc -l)"'
    seed, blocks = 707, 4
    wide = await provision(served, "vm-mq")
    result = await run_guest(
        guest_image, [AutoQueuesDisk(wide.socket)],
        guest_script(probe, write_pattern(DEVICE, seed, blocks), verify_pattern(DEVICE, seed, blocks)),
        cpus=2, timeout=VM_TIMEOUT_S,
    )
    assert result.exit_code == 0, result.output
    assert "MQ 2" in result.lines

    narrow = await provision(served, "vm-mq-narrow", {"numQueues": "1"})
    vm = await start_vm(guest_image, [AutoQueuesDisk(narrow.socket)], guest_script(probe), cpus=2,
                        timeout=VM_TIMEOUT_S)
    async with vm:
        refusal = "The maximum number of queues supported by the backend is 1"
        await until(lambda: refusal in vm.qemu_stderr or vm.returncode is not None,
                    lambda: f"QEMU to refuse the queues; its stderr:\n{vm.qemu_stderr}", 30)
        assert refusal in vm.qemu_stderr, vm.qemu_stderr
        assert "MQ" not in vm.output, "the guest must not have come up"
    result = await run_guest(guest_image, [VhostUserDisk(narrow.socket, num_queues=1)], guest_script(probe),
                             cpus=2, timeout=VM_TIMEOUT_S)
    assert result.exit_code == 0 and "MQ 1" in result.lines, result.output


async def test_socket_directory_follows_volume_mount_group(served: Served[DriverProcess]) -> None:
    grouped = await provision(served, "vm-group", group=GROUP)
    assert mode_of(grouped.target) == (0o750, 0, int(GROUP))
    assert mode_of(grouped.socket) == (0o660, 0, int(GROUP))
    assert stat.S_ISSOCK(os.stat(grouped.socket).st_mode)

    private = await provision(served, "vm-root")
    assert mode_of(private.target) == (0o700, 0, 0)
    assert mode_of(private.socket) == (0o600, 0, 0)
    # The pod sees the directory, not a bind of the socket file: a re-created socket shows through.
    assert sorted(os.listdir(private.target)) == [SOCKET]


async def test_readonly_publish_gives_the_vm_a_readonly_disk_and_one_vm_per_socket(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    volume = await provision(served, "vm-ro-src")
    seed, blocks = 808, 2
    result = await run_guest(guest_image, [VhostUserDisk(volume.socket)],
                             guest_script(write_pattern(DEVICE, seed, blocks)), timeout=VM_TIMEOUT_S)
    assert result.exit_code == 0, result.output
    await served.csi.unpublish(volume.id, str(volume.target))

    ro_target = served.box.target("vm-ro-reader")
    await served.csi.publish(volume.id, str(volume.staging), str(ro_target), readonly=True)
    # A vhost-user-blk socket serves one VM: a second publish is refused, naming where it is in use.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served.csi.publish(volume.id, str(volume.staging), str(volume.target))
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert volume.id in (info.value.details() or "") and str(ro_target) in (info.value.details() or "")

    script = guest_script(
        'echo "RO $(cat /sys/block/vda/ro)"',
        verify_pattern(DEVICE, seed, blocks),
        write_pattern(DEVICE, seed + 1, 1, start=blocks),
    )
    result = await run_guest(guest_image, [VhostUserDisk(ro_target / SOCKET)], script, timeout=VM_TIMEOUT_S)
    assert result.exit_code == 1 and "RO 1" in result.lines, result.output
    (verify,) = verify_summaries(result.output)
    assert verify.ok == blocks
    (attempt,) = write_summaries(result.output)
    assert (attempt.wrote, attempt.errors) == (0, 1), "a readonly publish must not let the guest write"

    # Unpublished and published writable again: the export is writable again.
    await served.csi.unpublish(volume.id, str(ro_target))
    await served.csi.publish(volume.id, str(volume.staging), str(volume.target))
    result = await run_guest(guest_image, [VhostUserDisk(volume.socket)],
                             guest_script('echo "RO $(cat /sys/block/vda/ro)"', write_pattern(DEVICE, seed, 1)),
                             timeout=VM_TIMEOUT_S)
    assert result.exit_code == 0 and "RO 0" in result.lines, result.output


async def test_offline_expansion_is_seen_by_the_next_vm_and_stalls_no_other(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    """NodeExpandVolume on an unused VM volume (OFFLINE, as kubelet calls it after staging).

    No guest has ever opened the grown volume's export (on QSD 10.0.13 a
    block_resize under such an export killed QSD, and every VM's disk with it,
    until the driver greeted each new export once). On QSD >= 10 the image
    grows under the export, on 7.2 the export is re-added around the resize;
    either way the next VM sees the new size and a VM writing to another
    volume meanwhile carries on untouched.
    """
    busy = await provision(served, "vm-busy")
    grown = await provision(served, "vm-grown")
    await served.csi.unpublish(grown.id, str(grown.target))
    seed, blocks = 909, 24
    script = guest_script(*paced_writes(seed, blocks, pause=0.2), verify_pattern(DEVICE, seed, blocks),
                          count_kernel_io_errors())
    vm = await start_vm(guest_image, [VhostUserDisk(busy.socket)], script, timeout=VM_TIMEOUT_S)
    async with vm:
        await wait_for_block(vm, 3)
        assert await served.csi.expand(grown.id, str(grown.staging), 2 * SIZE) == 2 * SIZE
        at_expand = len(acknowledged_blocks(vm.output, DEVICE))
        await wait_for_block(vm, at_expand + 2, timeout=20)  # still writing: nothing stalled
        result = await vm.wait()
    assert result.exit_code == 0, result.output
    assert_clean_run(result.output, blocks)

    await served.csi.publish(grown.id, str(grown.staging), str(grown.target))
    far = (2 * SIZE) // BLOCK_SIZE - 1
    script = guest_script('echo "SECTORS $(cat /sys/block/vda/size)"', write_pattern(DEVICE, seed, 1, start=far),
                          verify_pattern(DEVICE, seed, 1, start=far))
    result = await run_guest(guest_image, [VhostUserDisk(grown.socket)], script, timeout=VM_TIMEOUT_S)
    assert result.exit_code == 0, result.output
    assert f"SECTORS {2 * SIZE // 512}" in result.lines


async def test_own_iothread_with_polling_budget(served: Served[DriverProcess], guest_image: GuestImage) -> None:
    """`iothreadPollMaxNs` gives the volume its own QSD iothread with that polling budget (QSD < 10).

    On QSD 10.0 the export runs in QSD's main loop instead (an iothread export
    aborts QSD there when clients come and go): the volume still works.
    """
    volume = await provision(served, "vm-poll", {"iothreadPollMaxNs": "0"})
    seed, blocks = 1001, 4
    result = await run_guest(guest_image, [VhostUserDisk(volume.socket)],
                             guest_script(write_pattern(DEVICE, seed, blocks), verify_pattern(DEVICE, seed, blocks)),
                             timeout=VM_TIMEOUT_S)
    assert result.exit_code == 0, result.output
    await release(served, volume)
    again = await provision(served, "vm-poll-2", {"iothreadPollMaxNs": "0"})  # a fresh iothread for a new volume
    await release(served, again)
    assert_blocks(await host_bytes(served, volume), seed, list(range(blocks)), "own iothread")
