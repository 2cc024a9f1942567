"""The sweep of what a killed test run left behind, at the start of the next run.

Every base directory a test or bench makes (a sandbox under /tmp, a cluster's under /var/tmp) holds
`testing.owner.OWNER_FILE`, naming the process that made it by its pid and its start time. A directory whose owner no longer lives was left by a run killed before its
teardown (SIGKILL, a CI timeout). At the start of a run (the root conftest) those are swept, with
what provably stands on them:

- processes whose command line names a path inside (QSD's pidfile and QMP socket, `csi-qsd serve
  --state-dir`, a guest's QEMU);
- the cgroups a cluster node recorded inside, with every process in them (`testing.cluster.namespace`);
- loop devices over a file inside, or over a FUSE export mounted inside (by the mount's device
  number: once QSD is dead, sysfs reads "/"), a cluster node's exports included;
- mounts inside, FUSE ones included (stale once their QSD is dead).

The integrity tests' writer cgroups carry their owner in their name (`testing.owner.cgroup_name`) and
are swept the same way. A directory without an owner file, or whose owner lives (another session's run), is never
touched: nothing is found by a name alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from csi_qsd.sys import loop_ioctl, mounts
from testing.cluster import namespace
from testing.owner import CGROUP_PREFIX, CGROUP_RECORD, OWNER_FILE, alive

PARENTS = (Path("/tmp"), Path("/var/tmp"))
CGROUP_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/blkio"), Path("/sys/fs/cgroup/unified"))
_CGROUP_NAME = re.compile(rf"^{CGROUP_PREFIX}(\d+-\d+)-[0-9a-f]+$")


def stale_bases(parents: Iterable[Path] = PARENTS) -> list[Path]:
    """The base directories under `parents` whose owner no longer lives."""
    found = []
    for parent in parents:
        for marker in parent.glob(f"*/{OWNER_FILE}"):
            with contextlib.suppress(OSError):
                if not alive(marker.read_text().strip()):
                    found.append(marker.parent)
    return sorted(found)


def inside(path: str, base: Path) -> bool:
    return path == str(base) or path.startswith(f"{base}/")


def fuse_devices(mountinfo: str, base: Path) -> set[tuple[int, int]]:
    """Device numbers of the FUSE mounts in `mountinfo` (a /proc/PID/mountinfo's text) that belong to `base`:
    mounted inside it, or below a bind mount of a directory inside it (a cluster node's /var/lib/csi-qsd)."""
    entries = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        dash = fields.index("-")
        entries[fields[0]] = (fields[1], fields[2], _unescape(fields[3]), _unescape(fields[4]), fields[dash + 1])
    found = set()
    for mount_id, (parent, device, _, point, fs_type) in entries.items():
        if not fs_type.startswith("fuse"):
            continue
        ours, seen = inside(point, base), {mount_id}
        while not ours and parent in entries and parent not in seen:
            seen.add(parent)
            parent, _, root, _, _ = entries[parent]
            ours = f"/{base.name}/" in f"{root}/"  # the bind's source, as a path in its filesystem
        if ours:
            major, minor = device.split(":")
            found.add((int(major), int(minor)))
    return found


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def loop_devices_of(base: Path, fuse: set[tuple[int, int]]) -> list[Path]:
    """Loop devices over a file inside `base` (sysfs' path) or over one of the FUSE mounts `fuse`."""
    found = []
    for attribute in Path("/sys/block").glob("loop*/loop/backing_file"):
        device = Path("/dev") / attribute.parent.parent.name
        with contextlib.suppress(OSError):
            identity = loop_ioctl.backing_identity(device)
            if inside(attribute.read_text().strip(), base) or (identity is not None and identity[:2] in fuse):
                found.append(device)
    return found


def processes_naming(base: Path) -> list[int]:
    """Processes (not this one) with an argument that is a path inside `base`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if any(arg == str(base) or f"{base}/" in arg for arg in argv):
                found.append(int(entry.name))
    return found


def kill(pids: Iterable[int]) -> None:
    """SIGKILL `pids` and wait (bounded) until they are gone."""
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def recorded_cgroups(base: Path) -> list[str]:
    """The cgroups the cluster nodes of `base` recorded (`testing.owner.record_cgroup`, at most two levels down)."""
    records = [*base.glob(CGROUP_RECORD), *base.glob(f"*/{CGROUP_RECORD}"), *base.glob(f"*/*/{CGROUP_RECORD}")]
    return [record.read_text().strip() for record in records]


def sweep(base: Path) -> list[str]:
    """Remove a killed run's base directory and what stands on it (see the module's docstring); what was done."""
    done: list[str] = []
    cgroups = recorded_cgroups(base)
    fuse = fuse_devices(Path("/proc/self/mountinfo").read_text(), base)
    for pid in set().union(*(namespace.cgroup_pids(cgroup) for cgroup in cgroups)):
        with contextlib.suppress(OSError):  # the node's mount namespace: its QSD's FUSE exports
            fuse |= fuse_devices(Path(f"/proc/{pid}/mountinfo").read_text(), base)
    loops = loop_devices_of(base, fuse)
    for cgroup in cgroups:
        namespace.kill_cgroup(cgroup)
        done += [f"killed the processes of cgroup {cgroup}", *namespace.remove_cgroup(cgroup)]
    stray = processes_naming(base)
    kill(stray)
    done += [f"killed process {pid}" for pid in stray]
    for entry in sorted(mounts.mount_table(), key=lambda e: len(str(e.mount_point)), reverse=True):
        if inside(str(entry.mount_point), base):
            _quietly("umount", "-l", str(entry.mount_point))
            done.append(f"unmounted {entry.mount_point} ({entry.fs_type})")
    for device in loops:
        with contextlib.suppress(Exception):
            loop_ioctl.detach(device)
            done.append(f"detached {device}")
    shutil.rmtree(base, ignore_errors=True)
    done.append(f"removed {base}")
    return done


def stale_cgroups(roots: Iterable[Path] = CGROUP_ROOTS) -> Iterator[Path]:
    """The writer cgroups (`cgroup_name`) of runs that no longer live."""
    for root in roots:
        for group in root.glob(f"{CGROUP_PREFIX}*"):
            match = _CGROUP_NAME.match(group.name)
            if match and group.is_dir() and not alive(match[1]):
                yield group


def sweep_cgroup(group: Path) -> list[str]:
    """Kill what is left in a killed run's cgroup and below, and remove them."""
    children = sorted((d for d in group.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts))
    for directory in [*children, group]:
        with contextlib.suppress(OSError):
            kill(int(pid) for pid in (directory / "cgroup.procs").read_text().split())
        with contextlib.suppress(OSError):
            directory.rmdir()
    return [f"removed cgroup {group}"]


def sweep_all() -> list[str]:
    """Sweep every base directory and writer cgroup a killed run left; one line per thing done."""
    done = []
    for base in stale_bases():
        done += sweep(base)
    for group in stale_cgroups():
        done += sweep_cgroup(group)
    return done


def _quietly(*argv: str) -> None:
    subprocess.run(argv, capture_output=True, check=False, env=dict(os.environ, LC_ALL="C"))
