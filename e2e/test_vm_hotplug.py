"""Disk hotplug into a running VM, the way KubeVirt does it, with a real guest.

Kubernetes cannot add a volume to a running pod. KubeVirt therefore mounts a
new claim in a small *attachment pod* on the VM's node, and its node agent
bind-mounts what that pod received into the VM's pod, where the VMM hot-adds
the device. Here, with the driver served as `csi-qsd serve` and driven as
kubelet drives it:

* the VM (QEMU running as uid/gid 107, as KubeVirt's QEMU does) boots from
  one csi-qsd disk and exposes its QMP monitor and a PCIe root port;
* a second VM volume, of a class naming the VMM's group (`vmmGroup: 107`), is
  staged and published to an attachment pod's target with that pod's own
  fsGroup (2000); the test, as the node agent, bind-mounts the target into
  the VM's directory and, as the VMM, hot-adds it over QMP (`chardev-add`
  with reconnect, `device_add vhost-user-blk-pci`): QEMU opens the socket as
  uid 107 after dropping root;
* the guest sees /dev/vdb and writes paced 1 MiB blocks (O_DIRECT + fsync);
  meanwhile QSD is SIGKILLed (the guest stalls, then resumes), a snapshot is
  cut live, NodeUnpublishVolume of the attachment target is refused with
  FAILED_PRECONDITION (a VM is connected), and the volume grows (the guest
  sees the new size and writes at its end);
* then the VMM hot-removes it (`device_del`, `chardev-remove`), the agent
  unmounts its bind, and the unpublish retried (as kubelet retries) and the
  unstage succeed: no mount, socket or export of the volume is left, and the
  boot disk, written before and after, never noticed.

Every block the guest acknowledged is checked from the host with qemu-img, and
the snapshot through a volume restored from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from qemu.qmp import EventListener, QMPClient

from csi_qsd.sys import mounts, unix_peers
from e2e.conftest import e2e_marks
from testing import owner
from testing.guest import (
    BLOCK_SIZE,
    GuestImage,
    RunningVM,
    VhostUserDisk,
    acknowledged_blocks,
    count_kernel_io_errors,
    guest_script,
    start_vm,
    verify_pattern,
    verify_summaries,
    write_pattern,
    write_summaries,
)
from testing.guest.writes import RESTART_TIMEOUT_S, assert_blocks
from testing.harness import DriverProcess, qsd_pid, wait_new_qsd
from testing.served import SIZE, SOCKET, Served, read_image, run, serving

pytestmark = e2e_marks()

VMM_ID = "107"  # KubeVirt's qemu user and group
ATTACHMENT_GROUP = "2000"  # the attachment pod's fsGroup: not the VM's
VM_CLASS = {"export": "vhost-user-blk", "vmmGroup": VMM_ID}
BOOT, HOT = "/dev/vda", "/dev/vdb"
BOOT_SEED, HOT_SEED = 1811, 1822
HOT_BLOCKS = 32
CHUNK, PAUSE_S = 2, 0.1
SECTOR = 512
VM_TIMEOUT_S = 240.0
QMP_TIMEOUT_S = 30.0
UNPLUG_TIMEOUT_S = 60.0
GROWN = 2 * SIZE
FAR = GROWN // BLOCK_SIZE - 1  # the last block of the grown disk


def wait_for(condition: str, what: str, tenths: int = 1800) -> str:
    """Guest text: wait (bounded, `tenths` x 0.1 s) until the shell `condition` holds, counting a failure if not."""
    return f"""
_w=0
while ! {condition}; do
    _w=$((_w + 1))
    if [ "$_w" -gt {tenths} ]; then echo "TIMEOUT {what}"; failures=$((failures + 1)); break; fi
    sleep 0.1
done
"""


def guest() -> str:
    hot_writes = [
        write_pattern(HOT, HOT_SEED, min(CHUNK, HOT_BLOCKS - first), start=first) + f"sleep {PAUSE_S}\n"
        for first in range(0, HOT_BLOCKS, CHUNK)
    ]
    return guest_script(
        write_pattern(BOOT, BOOT_SEED, 2), verify_pattern(BOOT, BOOT_SEED, 2), 'echo "BOOT_DISK_OK"',
        wait_for("[ -e /sys/block/vdb ]", "hotplug"),
        'echo "HOTPLUGGED $(cat /sys/block/vdb/size)"',
        *hot_writes,
        verify_pattern(HOT, HOT_SEED, HOT_BLOCKS),
        wait_for(f'[ "$(cat /sys/block/vdb/size)" -eq {GROWN // SECTOR} ]', "growth"),
        'echo "GREW $(cat /sys/block/vdb/size)"',
        write_pattern(HOT, HOT_SEED, 1, start=FAR), verify_pattern(HOT, HOT_SEED, 1, start=FAR),
        'echo "HOT_DONE"',
        wait_for("[ ! -e /sys/block/vdb ]", "unplug"),
        'echo "UNPLUGGED"',
        write_pattern(BOOT, BOOT_SEED, 2, start=2), verify_pattern(BOOT, BOOT_SEED, 4),
        count_kernel_io_errors(),
    )


@contextlib.contextmanager
def vm_pod_dir() -> Iterator[Path]:
    """The VM pod's volumes as its QEMU sees them: a short path that uid 107 may traverse."""
    root = owner.make_base("cqhp")
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        for mount_point in (root / "hotplug", root / "disk0"):
            if mounts.mounted_at(mount_point) is not None:  # left by a failed test
                subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


async def bind(source: Path, target: Path) -> None:
    """What KubeVirt's node agent does with the attachment pod's volume: a bind mount into the VM's pod."""
    target.mkdir(exist_ok=True)
    await run("mount", "--bind", str(source), str(target))


@contextlib.asynccontextmanager
async def monitor(path: Path) -> AsyncIterator[QMPClient]:
    qmp = QMPClient("vm")
    await asyncio.wait_for(qmp.connect(str(path)), QMP_TIMEOUT_S)
    try:
        yield qmp
    finally:
        await qmp.disconnect()


async def qmp_call(qmp: QMPClient, command: str, arguments: dict[str, Any] | None = None) -> Any:
    return await asyncio.wait_for(qmp.execute(command, arguments), QMP_TIMEOUT_S)


async def hot_add(qmp: QMPClient, socket: Path) -> None:
    """As the VMM: a reconnecting chardev on the socket, and a vhost-user-blk-pci device in the free root port."""
    await qmp_call(qmp, "chardev-add", {"id": "hp-char", "backend": {"type": "socket", "data": {
        "addr": {"type": "unix", "data": {"path": str(socket)}}, "server": False, "reconnect": 1}}})
    await qmp_call(qmp, "device_add", {"driver": "vhost-user-blk-pci", "id": "hp-disk", "chardev": "hp-char",
                                       "num-queues": 1, "bus": "hp-port"})


async def hot_remove(qmp: QMPClient) -> None:
    """As the VMM: unplug the device (the guest lets go of it first), then close the chardev."""
    listener = EventListener(("DEVICE_DELETED",))
    with qmp.listen(listener):
        await qmp_call(qmp, "device_del", {"id": "hp-disk"})
        async with asyncio.timeout(UNPLUG_TIMEOUT_S):
            while True:
                data = cast(dict[str, Any], (await listener.get())["data"])
                if data.get("device") == "hp-disk":
                    break
    await qmp_call(qmp, "chardev-remove", {"id": "hp-char"})


def acked(vm: RunningVM, device: str) -> list[int]:
    return acknowledged_blocks(vm.output, device)


async def wait_block(vm: RunningVM, device: str, index: int, timeout: float = VM_TIMEOUT_S) -> int:
    """Until the guest acknowledged block `index` of `device`; how many blocks it has by then."""
    pattern = re.compile(rf"^WROTE (\d+) dev={re.escape(device)}")
    async with asyncio.timeout(timeout):
        while max(acked(vm, device), default=-1) < index:
            await vm.wait_for_line(pattern)
    return len(acked(vm, device))


async def image_bytes(served: Served[DriverProcess], image: Path) -> bytes:
    return await read_image(image, served.box.root)


def top_image(pool: Path, volume_id: str) -> Path:
    tops = sorted(pool.glob(f"{volume_id}.*.qcow2"), key=lambda p: int(p.name.split(".")[1]))
    return tops[-1] if tops else pool / f"{volume_id}.qcow2"


@pytest.fixture
async def served() -> AsyncIterator[Served[DriverProcess]]:
    async with serving() as value:
        yield value


async def test_hotplug_through_an_attachment_pod_into_a_running_vm(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    csi, box = served.csi, served.box
    pool = box.state_dir / "pool"
    boot = (await csi.create_volume("vm-boot", SIZE, VM_CLASS)).volume_id
    boot_staging, boot_target = box.staging("vm-boot"), box.target("virt-launcher")
    await csi.stage(boot, str(boot_staging), mount_group=VMM_ID)
    await csi.publish(boot, str(boot_staging), str(boot_target), mount_group=VMM_ID)

    hot = (await csi.create_volume("vm-hot", SIZE, VM_CLASS)).volume_id
    staging, target = box.staging("vm-hot"), box.target("hp-volume-attach")
    await csi.stage(hot, str(staging), mount_group=ATTACHMENT_GROUP)
    await csi.publish(hot, str(staging), str(target), mount_group=ATTACHMENT_GROUP)
    st = os.stat(target / SOCKET)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, int(VMM_ID), 0o660), "the socket is the VMM's group's"

    with vm_pod_dir() as pod:
        await bind(boot_target, pod / "disk0")
        qmp_socket = pod / "qmp.sock"
        vm = await start_vm(
            guest_image, [VhostUserDisk(pod / "disk0" / SOCKET)], guest(), timeout=VM_TIMEOUT_S,
            extra_args=["-qmp", f"unix:{qmp_socket},server=on,wait=off",
                        "-device", "pcie-root-port,id=hp-port,chassis=1,slot=1",
                        "-runas", f"{VMM_ID}:{VMM_ID}"],
        )
        async with vm:
            await vm.wait_for_line(r"^BOOT_DISK_OK$", VM_TIMEOUT_S)
            await bind(target, pod / "hotplug")  # the node agent
            async with monitor(qmp_socket) as qmp:
                await hot_add(qmp, pod / "hotplug" / SOCKET)
                seen = await vm.wait_for_line(r"^HOTPLUGGED (\d+)$", VM_TIMEOUT_S)
                assert int(seen.group(1)) == SIZE // SECTOR

                # QSD dies under the writing guest; the supervisor brings it back, the guest carries on.
                await wait_block(vm, HOT, 5)
                old = qsd_pid(box)
                assert old is not None
                os.kill(old, 9)
                killed_at = len(acked(vm, HOT))
                await wait_new_qsd(box, old, RESTART_TIMEOUT_S)
                resumed = await wait_block(vm, HOT, killed_at + 1)

                # A live snapshot while it writes.
                before = len(acked(vm, HOT))
                snapshot = await csi.create_snapshot("vm-hot-snap", hot)
                assert snapshot.ready_to_use

                # The attachment pod goes while the VM holds the disk: refused, naming the volume.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await csi.unpublish(hot, str(target))
                assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert hot in (refused.value.details() or "")
                assert (target / SOCKET).exists(), "a refused unpublish must leave the target as it was"
                at_refusal = len(acked(vm, HOT))

                await vm.wait_for_line(rf"^VERIFY_SUMMARY dev={re.escape(HOT)} ", VM_TIMEOUT_S)
                assert await csi.expand(hot, str(target), GROWN) == GROWN
                await vm.wait_for_line(rf"^GREW {GROWN // SECTOR}$", 30)
                await vm.wait_for_line(r"^HOT_DONE$", VM_TIMEOUT_S)
                await hot_remove(qmp)
            await vm.wait_for_line(r"^UNPLUGGED$", UNPLUG_TIMEOUT_S)

            # The VM let go: the agent drops its bind, kubelet's retry of the unpublish succeeds.
            await run("umount", str(pod / "hotplug"))
            await csi.unpublish(hot, str(target))
            await csi.unstage(hot, str(staging))
            result = await vm.wait()
        await run("umount", str(pod / "disk0"))

    assert result.exit_code == 0, result.output
    assert killed_at < HOT_BLOCKS and resumed > killed_at, "QSD was not killed while the guest wrote"
    assert before < HOT_BLOCKS and at_refusal < HOT_BLOCKS, "the snapshot and the refusal came after the writes"
    hot_acked = acknowledged_blocks(result.output, HOT)
    assert hot_acked == [*range(HOT_BLOCKS), FAR], f"acknowledged on {HOT}: {hot_acked}"
    assert acknowledged_blocks(result.output, BOOT) == [0, 1, 2, 3]
    assert sum(s.errors for s in write_summaries(result.output)) == 0, "the guest saw write errors"
    verified = {(v.device, v.ok, v.mismatch, v.ioerrors) for v in verify_summaries(result.output)}
    assert verified == {(BOOT, 2, 0, 0), (HOT, HOT_BLOCKS, 0, 0), (HOT, 1, 0, 0), (BOOT, 4, 0, 0)}, verified
    assert "KERNEL_IO_ERRORS 0" in result.lines

    # Nothing of the hot volume is left on the node: no mount, no socket, no listening export.
    socket_dir = box.state_dir / "exports" / hot
    table = mounts.mount_table()
    assert not [m for m in table if hot in m.root or m.mount_point == target], "a mount of the volume is left"
    assert not target.exists() and not socket_dir.exists()
    assert not unix_peers.peers(socket_dir / "vhost" / SOCKET).listening, "QSD still exports the volume"

    # Every acknowledged block is in the volume; the snapshot holds every block acknowledged before it.
    data = await image_bytes(served, top_image(pool, hot))
    assert len(data) == GROWN
    assert_blocks(data, HOT_SEED, hot_acked, "hot-plugged volume after QSD SIGKILL, snapshot and growth")
    restored = (await csi.create_volume("vm-hot-restored", SIZE, VM_CLASS,
                                        from_snapshot=snapshot.snapshot_id)).volume_id
    assert_blocks(await image_bytes(served, pool / f"{restored}.qcow2"), HOT_SEED, range(before), "the snapshot")

    await csi.unpublish(boot, str(boot_target))
    await csi.unstage(boot, str(boot_staging))
    assert_blocks(await image_bytes(served, pool / f"{boot}.qcow2"), BOOT_SEED, range(4), "the boot disk")
