"""Two QSD shards under one guest: the shard that dies takes only its own disk with it.

The driver runs as `csi-qsd serve --qsd-shards 2`. A guest has two
vhost-user-blk disks, one on each shard (placed through their claim
namespaces); it writes paced 1 MiB blocks (O_DIRECT + fsync) to the disk on
shard 1 while shard 0's QSD is SIGKILLed. Shard 1 is never touched: the
guest finishes with no I/O error and every acknowledged block on the host,
while shard 0 is replaced and its disk served again.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

import pytest

from csi_qsd.params import NAMESPACE_KEY
from csi_qsd.qsd import vhost_greeting
from e2e.conftest import e2e_marks
from testing.guest import (
    GuestImage,
    VhostUserDisk,
    acknowledged_blocks,
    count_kernel_io_errors,
    guest_script,
    start_vm,
    verify_pattern,
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
from testing.harness import DriverProcess, qsd_pid, wait_new_qsd
from testing.helpers.shard_placement import namespace_on
from testing.served import Served, host_bytes, provision, release, serving

pytestmark = e2e_marks()


@pytest.fixture
async def served() -> AsyncIterator[Served[DriverProcess]]:
    async with serving("--qsd-shards", "2") as value:
        yield value


async def test_a_lost_shard_leaves_the_guest_disk_on_the_other_shard_writing(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    on_one = await provision(served, "vm-shard1", {NAMESPACE_KEY: namespace_on(1, 2)})
    on_zero = await provision(served, "vm-shard0", {NAMESPACE_KEY: namespace_on(0, 2)})
    pids = qsd_pid(served.box, 0), qsd_pid(served.box, 1)
    assert None not in pids and pids[0] != pids[1]
    seed, blocks = 404, 24
    script = guest_script(*paced_writes(seed, blocks), verify_pattern(DEVICE, seed, blocks), count_kernel_io_errors())
    disks = [VhostUserDisk(on_one.socket), VhostUserDisk(on_zero.socket)]  # the guest writes to the first (vda)
    vm = await start_vm(guest_image, disks, script, timeout=VM_TIMEOUT_S)
    async with vm:
        await wait_for_block(vm, 5)
        os.kill(pids[0] or 0, signal.SIGKILL)
        killed_at = len(acknowledged_blocks(vm.output, DEVICE))
        await wait_new_qsd(served.box, pids[0] or 0, RESTART_TIMEOUT_S)
        result = await vm.wait()
    assert result.exit_code == 0, result.output
    acked = assert_clean_run(result.output, blocks)
    assert killed_at < blocks, "the guest finished before shard 0 was killed: nothing was tested"
    assert qsd_pid(served.box, 1) == pids[1], "shard 1 was not touched"
    assert await vhost_greeting.greet(on_zero.socket), "shard 0's disk is served again by the new QSD"
    assert "event=qsd_recovered" in served.driver.log()
    await release(served, on_zero)
    await release(served, on_one)
    assert_blocks(await host_bytes(served, on_one), seed, acked, "on the shard that stayed up")
