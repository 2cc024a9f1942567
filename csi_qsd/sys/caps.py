"""Which Linux capabilities this process holds, read from /proc (decide by state, not by a tool's message)."""

from __future__ import annotations

from pathlib import Path

CAP_SYS_RESOURCE = 24  # ext4 online growth (EXT4_IOC_RESIZE_FS) checks it; root without it gets EPERM


def effective(status: str) -> int:
    """The effective capability mask from the text of /proc/<pid>/status."""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def has(capability: int) -> bool:
    return bool(effective(Path("/proc/self/status").read_text()) >> capability & 1)
