"""What a killed test run leaves is swept by the next one: only its own, all of it, and nothing of a live run.

A child process plays the killed run: it makes a sandbox as the harness does, serves the driver from it
(a detached `csi-qsd serve`, its QSD), stages and publishes a volume (FUSE export, loop device, ext4
mount) and a VM volume, and is SIGKILLed. Its driver, its QSD, its mounts and its loop device stay, as
after a CI timeout; the sweep must remove every one of them, and leave this live run's sandbox alone.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd.sys import loop
from testing import owner, stale_runs
from testing.harness import Sandbox, force_cleanup, qsd_pids, until
from testing.helpers.parallel_io import _cgroup_hierarchy
from testing.leftovers import host_leftovers

REPO = Path(__file__).resolve().parents[2]

KILLED_RUN = """
import asyncio, sys
from csi_qsd.cli.client import CSIClient
from testing import owner
from testing.harness import Sandbox, DriverProcess

async def main() -> None:
    box = Sandbox(owner.make_base("cq"))
    driver = DriverProcess(box)
    await driver.start()
    async with CSIClient(box.endpoint, timeout=60) as csi:
        vid = (await csi.create_volume("stale", 64 << 20)).volume_id
        staging, target = box.staging("s"), box.target("s")
        await csi.stage(vid, str(staging))
        await csi.publish(vid, str(staging), str(target))
        (target / "data").write_text("written by the killed run")
    print(box.root, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.fixture
async def killed_run() -> AsyncIterator[Path]:
    """The base directory of a run SIGKILLed with a published volume; cleaned up if the sweep failed to."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_RUN, cwd=REPO, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 120)
    finally:
        child.kill()
        await child.wait()
    assert line, "the run to be killed did not get its volume published"
    base = Path(line.decode().strip())
    try:
        yield base
    finally:
        if base.exists():
            await asyncio.to_thread(force_cleanup, base)


async def test_a_killed_runs_driver_qsd_mounts_and_loop_device_are_swept(killed_run: Path, box: Sandbox) -> None:
    base = killed_run
    assert base in stale_runs.stale_bases() and box.root not in stale_runs.stale_bases()
    left = host_leftovers(base)
    assert any("(fuse" in item for item in left) and any(item.startswith("loop device") for item in left), left
    assert qsd_pids(base / "state") and stale_runs.processes_naming(base), "the killed run's QSD and driver live on"
    done = await asyncio.to_thread(stale_runs.sweep, base)
    assert not base.exists(), done
    assert host_leftovers(base) == [], done
    assert stale_runs.processes_naming(base) == [], done
    assert not [lp for lp in loop.loop_devices() if str(base) in str(lp.backing_file)]
    assert box.root.exists() and (box.root / owner.OWNER_FILE).exists()  # this live run's: untouched


def test_a_live_runs_directory_and_one_without_an_owner_are_never_stale(tmp_path: Path) -> None:
    live = owner.make_base("cq", tmp_path)
    unowned = tmp_path / "cqunowned"
    unowned.mkdir()
    dead = owner.make_base("cq", tmp_path)
    (dead / owner.OWNER_FILE).write_text(f"{_dead_token()}\n")
    assert stale_runs.stale_bases([tmp_path]) == [dead]
    assert live.exists() and unowned.exists()


def _dead_token() -> str:
    """The owner token of a process that has exited."""
    proc = subprocess.Popen(["sleep", "30"])
    token = owner.owner_token(proc.pid)
    proc.kill()
    proc.wait()
    assert not owner.alive(token)
    return token


async def test_a_killed_runs_writer_cgroup_is_swept_with_its_process() -> None:
    root = _cgroup_hierarchy()
    group = root / f"{owner.CGROUP_PREFIX}{_dead_token()}-0123abcd"
    child = group / "w0"
    child.mkdir(parents=True)
    writer = subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec sleep 600', str(child)])
    try:
        await until(lambda: str(writer.pid) in (child / "cgroup.procs").read_text().split(), "the writer in its cgroup")
        live = root / owner.cgroup_name()
        live.mkdir()
        try:
            assert list(stale_runs.stale_cgroups([root])) == [group]
            stale_runs.sweep_cgroup(group)
            assert not group.exists() and live.exists()
            assert writer.wait(10) == -9
        finally:
            live.rmdir()
    finally:
        if writer.poll() is None:
            writer.kill()
        for directory in (child, group):
            if directory.exists():
                directory.rmdir()
