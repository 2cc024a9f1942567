"""A guest writing paced, acknowledged 1 MiB blocks to its disk, and the checks of what it acknowledged.

Each block is written with O_DIRECT and followed by an fsync: a ``WROTE n``
line on the console means block n was acknowledged. Writes are paced
(CHUNK blocks, then PAUSE_S) so that even a fast (KVM) guest is still
writing when a test kills something; TCG is slower than that anyway.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from testing.guest import (
    BLOCK_SIZE,
    RunningVM,
    acknowledged_blocks,
    pattern_block,
    verify_summaries,
    write_pattern,
    write_summaries,
)

DEVICE = "/dev/vda"
VM_TIMEOUT_S = 90.0
RESTART_TIMEOUT_S = 30.0
CHUNK, PAUSE_S = 2, 0.1


def paced_writes(seed: int, blocks: int, pause: float = PAUSE_S) -> list[str]:
    """Guest script parts writing blocks 0..`blocks`-1 of `seed`'s pattern to DEVICE, CHUNK at a time."""
    return [
        write_pattern(DEVICE, seed, min(CHUNK, blocks - first), start=first) + f"sleep {pause}\n"
        for first in range(0, blocks, CHUNK)
    ]


async def wait_for_block(vm: RunningVM, index: int, timeout: float = VM_TIMEOUT_S) -> None:
    """Until the guest has acknowledged block `index`; GuestError if it ends first."""
    pattern = re.compile(rf"^WROTE (\d+) dev={re.escape(DEVICE)}")
    async with asyncio.timeout(timeout):
        while max(acknowledged_blocks(vm.output, DEVICE), default=-1) < index:
            await vm.wait_for_line(pattern)


def assert_clean_run(output: str, blocks: int) -> list[int]:
    """The guest wrote every block in order with no error and read them all back; returns the acked list."""
    acked = acknowledged_blocks(output, DEVICE)
    assert acked == list(range(blocks)), f"acknowledged {acked}"
    assert sum(s.errors for s in write_summaries(output)) == 0, "the guest saw write errors"
    (verify,) = verify_summaries(output)
    assert (verify.ok, verify.mismatch, verify.ioerrors) == (blocks, 0, 0), verify
    assert "KERNEL_IO_ERRORS 0" in output.splitlines(), "the guest kernel logged I/O errors"
    return acked


def assert_blocks(data: bytes, seed: int, blocks: Sequence[int], what: str) -> None:
    """Each of `blocks` in `data` (a disk's bytes read from the host) holds `seed`'s pattern."""
    assert blocks, f"{what}: no block to check"
    bad = [i for i in blocks if data[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE] != pattern_block(seed, i)]
    assert not bad, f"{what}: acknowledged blocks {bad} do not hold what the guest wrote"
