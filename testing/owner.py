"""Who made a test's base directory or cgroup: a process, named by its pid and start time.

A run marks each base directory it makes (`make_base`) and names its writer cgroups after itself
(`cgroup_name`); a cluster node records its cgroup in its directory (`record_cgroup`). What a run that
is no longer `alive` made is what `testing.stale_runs` sweeps; the start time keeps a recycled pid from
passing for the run that died.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

OWNER_FILE = ".csi-qsd-test-owner"
CGROUP_RECORD = ".csi-qsd-test-cgroup"
CGROUP_PREFIX = "csi-qsd-test-"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def owner_token(pid: int | None = None) -> str:
    """"PID-START": the process a base directory or cgroup belongs to (this one by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{start_time(pid)}"


def alive(token: str) -> bool:
    """True while the process `token` names runs (same pid, same start time); a token not ours counts as alive."""
    try:
        pid, started = (int(part) for part in token.strip().split("-"))
    except ValueError:
        return True
    return start_time(pid) == started


def make_base(prefix: str, parent: Path = Path("/tmp")) -> Path:
    """A new private directory under `parent`, marked as this process's."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    (base / OWNER_FILE).write_text(owner_token() + "\n")
    return base


def remove_base(base: Path) -> None:
    """Remove a base `make_base` made, once everything else in it is gone (OSError if something is left)."""
    (base / OWNER_FILE).unlink(missing_ok=True)
    base.rmdir()


def cgroup_name() -> str:
    """A name for a cgroup of this run's, its owner in it: `csi-qsd-test-PID-START-RANDOM`."""
    return f"{CGROUP_PREFIX}{owner_token()}-{secrets.token_hex(4)}"


def record_cgroup(directory: Path, cgroup: str) -> None:
    """Record in `directory` (inside a base) the cgroup path (from a hierarchy's root) a node of it runs in."""
    (directory / CGROUP_RECORD).write_text(cgroup + "\n")
