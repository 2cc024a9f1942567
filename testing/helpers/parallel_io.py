"""Parallel verified I/O on a published volume from several cgroups: how data corruption under load shows.

The loop driver gives each block cgroup its own worker, so writers in
several cgroups reach a FUSE export concurrently, where one process's
threads would be serialised. `cgroups` makes private child cgroups (and
removes them with whatever is left in them), `in_cgroup` starts a command
inside one, `run_fio` runs a verified fio job in each at once. `published`
is a volume staged and published for the load, `loop_dio` tells which
loop device mode the driver chose under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from csi_qsd.cli.client import CSIClient
from testing import owner
from testing.harness import Sandbox

MIB = 1 << 20
VOLUME_SIZE = 256 * MIB
GROUPS = 4  # writer processes, one per cgroup
THREADS = 4  # writers per process: 16 in all


def _cgroup_hierarchy() -> Path:
    """The hierarchy that carries the block I/O controller: cgroup v2, else v1 `blkio`, else bare v2."""
    for candidate in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/blkio"), Path("/sys/fs/cgroup/unified")):
        if (candidate / "cgroup.procs").exists() and os.access(candidate, os.W_OK):
            if candidate == Path("/sys/fs/cgroup") and not (candidate / "cgroup.controllers").exists():
                continue  # a tmpfs holding v1 hierarchies, not a cgroup itself
            return candidate
    pytest.fail("no writable cgroup hierarchy: integrity tests place their writers in several cgroups")


@contextlib.contextmanager
def cgroups(count: int = GROUPS) -> Iterator[list[Path]]:
    """`count` private child cgroups under a parent of our own; removed afterwards with anything left in them."""
    parent = _cgroup_hierarchy() / owner.cgroup_name()  # its run in the name: swept if the run is killed
    parent.mkdir()
    children = [parent / f"w{i}" for i in range(count)]
    try:
        with contextlib.suppress(OSError):  # give the children the io controller where v2 offers it
            if "io" in (parent / "cgroup.controllers").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+io")
        for child in children:
            child.mkdir()
        yield children
    finally:
        for child in children:
            _remove_cgroup(child)
        _remove_cgroup(parent)


def _remove_cgroup(group: Path) -> None:
    """rmdir a cgroup of ours; the only processes that can be in it are writers the test started there."""
    if not group.exists():
        return
    for _ in range(100):
        try:
            group.rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.05)  # bounded: the kernel empties the group once the killed writers are reaped
    group.rmdir()


def in_cgroup(group: Path, *argv: str) -> list[str]:
    """argv run inside `group`: the shell joins it, then execs, so every thread and child starts there.

    If joining fails the command never runs (and the test fails), so no writer
    escapes into the test's own cgroup unnoticed.
    """
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *argv]


@dataclasses.dataclass
class Published:
    """A volume staged and published in the sandbox (`block`: as a block device)."""

    vid: str
    staging: Path
    target: Path
    block: bool


@contextlib.asynccontextmanager
async def published(box: Sandbox, csi: CSIClient, name: str, *, block: bool,
                    from_snapshot: str = "") -> AsyncIterator[Published]:
    """A new volume staged and published in the sandbox; unpublished, unstaged and deleted afterwards."""
    vid = (await csi.create_volume(name, VOLUME_SIZE, block=block, from_snapshot=from_snapshot)).volume_id
    volume = Published(vid, box.staging(name), box.target(name), block)
    await csi.stage(vid, str(volume.staging), block=block)
    await csi.publish(vid, str(volume.staging), str(volume.target), block=block)
    yield volume
    await csi.unpublish(vid, str(volume.target))
    await csi.unstage(vid, str(volume.staging))
    await csi.delete_volume(vid)


def loop_dio(volume: Published) -> bool:
    """Whether the loop device under the published target runs with direct I/O (read from sysfs)."""
    st = os.stat(volume.target)
    device = st.st_rdev if volume.block else st.st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    assert (sysfs / "loop").is_dir(), f"{volume.target} is not on a loop device ({sysfs.resolve().name})"
    return (sysfs / "loop" / "dio").read_text().strip() == "1"


def fio_job(group: int, target: Path, *, block: bool) -> str:
    """One cgroup's fio job: THREADS jobs x iodepth 4 of verified 4k random writes, then of 1 MiB writes.

    On a block device every job gets its own region (jobs that overlap would
    overwrite each other's verified blocks); on a filesystem its own files.
    """
    where = (f"filename={target}\noffset={group * 64}m\noffset_increment=16m\n" if block
             else f"directory={target}\nunlink=1\n")
    return f"""[global]
ioengine=libaio
direct=1
iodepth=4
numjobs={THREADS}
verify=crc32c
continue_on_error=verify
verify_state_save=0
{where}
[g{group}-4k]
rw=randwrite
bs=4k
size=2m

[g{group}-1m]
stonewall
rw=write
bs=1m
size=8m
"""


async def run_fio(box: Sandbox, groups: list[Path], target: Path, *, block: bool,
                  timeout: float = 120) -> FioResult:
    """fio in every cgroup at once, bounded; what its JSON reports say."""
    procs = []
    for g, group in enumerate(groups):
        job = box.root / f"fio-{g}.ini"
        job.write_text(fio_job(g, target, block=block))
        procs.append(await asyncio.create_subprocess_exec(
            *in_cgroup(group, "fio", "--output-format=json", f"--output={box.root / f'fio-{g}.json'}", str(job)),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        ))
    try:
        results = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), timeout)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    result = FioResult()
    for g, (proc, (_, err)) in enumerate(zip(procs, results)):
        text = (box.root / f"fio-{g}.json").read_text()
        assert "{" in text, f"fio exited {proc.returncode} without a report: {err.decode(errors='replace')}"
        report = json.loads(text[text.index("{"):])  # fio puts its warning about shared files first
        for job in report["jobs"]:
            result.jobs += 1
            # continue_on_error=verify: fio counts every block that fails verification and goes on.
            result.bad_blocks += job.get("total_err", 0)
            if job["error"] not in (0, errno.EILSEQ):  # EILSEQ is how fio reports a verify failure
                result.failures.append(f"{job['jobname']}: {os.strerror(job['error'])}")
            result.written += job["write"]["io_bytes"]
            result.verified += job["read"]["io_bytes"]
    return result


@dataclasses.dataclass
class FioResult:
    """What the fio reports of one `run_fio` add up to: bytes written and verified, bad blocks, failed jobs."""

    jobs: int = 0
    bad_blocks: int = 0
    written: int = 0
    verified: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
