"""A QSD frozen (SIGSTOP) under a writing guest: the driver kills and replaces it, the guest carries on.

The driver runs as `csi-qsd serve --qmp-timeout 2`, as in its pod with a
short bound. The guest writes paced 1 MiB blocks (O_DIRECT + fsync) to its
vhost-user-blk disk; QSD is frozen mid-run. Its monitor stops answering,
the watchdog logs the wedge, SIGKILLs QSD and the supervisor brings a new
one up with the export at the same socket; the guest (``reconnect=1``)
stalls for the outage, then finishes with no I/O error and no acknowledged
block lost (the default class exports with ``writethrough=on``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

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
from testing.served import Served, host_bytes, provision, release, serving

pytestmark = e2e_marks()

QMP_TIMEOUT_S = "2"


@pytest.fixture
async def served() -> AsyncIterator[Served[DriverProcess]]:
    async with serving("--qmp-timeout", QMP_TIMEOUT_S) as value:
        yield value


async def test_qsd_frozen_under_a_writing_guest_is_replaced_and_loses_no_acknowledged_write(
    served: Served[DriverProcess], guest_image: GuestImage
) -> None:
    volume = await provision(served, "vm-frozen")
    seed, blocks = 303, 24
    script = guest_script(*paced_writes(seed, blocks), verify_pattern(DEVICE, seed, blocks), count_kernel_io_errors())
    vm = await start_vm(guest_image, [VhostUserDisk(volume.socket)], script, timeout=VM_TIMEOUT_S)
    async with vm:
        await wait_for_block(vm, 5)
        old = qsd_pid(served.box)
        assert old is not None
        os.kill(old, signal.SIGSTOP)
        try:
            frozen_at = len(acknowledged_blocks(vm.output, DEVICE))
            await wait_new_qsd(served.box, old, RESTART_TIMEOUT_S)
        finally:
            # Leave no stopped QSD of ours behind, whatever happened.
            with contextlib.suppress(OSError):
                if str(served.box.state_dir).encode() in Path(f"/proc/{old}/cmdline").read_bytes():
                    os.kill(old, signal.SIGKILL)
        result = await vm.wait()
    assert result.exit_code == 0, result.output
    acked = assert_clean_run(result.output, blocks)
    assert frozen_at < blocks, "the guest finished before QSD was frozen: nothing was tested"
    log = served.driver.log()
    assert "event=qsd_wedged" in log and "proc_state='T (stopped)'" in log and "event=qsd_recovered" in log
    assert await served.csi.probe()
    await release(served, volume)
    assert_blocks(await host_bytes(served, volume), seed, acked, "after a frozen QSD was replaced")
