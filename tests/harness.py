"""Run csi-qsd for tests: in-process or as a separate `csi-qsd serve` process, and clean up after.

Every driver under test gets a short private directory under /tmp (UNIX
socket paths are limited to 107 bytes) holding its state dir and a fake
kubelet root. Cleanup is generic and forceful, so a failed test never leaves
mounts, loop devices or daemons behind for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from csi_qsd.config import Config
from csi_qsd.csi_client import CSIClient
from csi_qsd.qsd.daemon import running_pid
from csi_qsd.server import Driver, serving
from csi_qsd.sys import loop, mounts
from csi_qsd.tools import bundled


@dataclass
class Sandbox:
    """Directories of one driver under test."""

    root: Path
    state_dir: Path = field(init=False)
    kubelet: Path = field(init=False)

    def __post_init__(self) -> None:
        self.state_dir = self.root / "state"
        self.kubelet = self.root / "kubelet"
        self.kubelet.mkdir(parents=True, exist_ok=True)

    @property
    def endpoint(self) -> str:
        return f"unix://{self.state_dir / 'csi.sock'}"

    def config(self, **overrides: object) -> Config:
        values: dict[str, object] = dict(
            state_dir=self.state_dir, target_root=self.kubelet, node_id="node-a",
            qsd_binary=os.environ.get("CSI_QSD_QSD_BINARY", bundled("qemu-storage-daemon")),
            qemu_img=os.environ.get("CSI_QSD_QEMU_IMG", bundled("qemu-img")),
        )
        values.update(overrides)
        return Config(**values)  # type: ignore[arg-type]

    def staging(self, name: str) -> Path:
        path = self.kubelet / "plugins" / "staging" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def target(self, name: str) -> Path:
        """A pod's target path; like kubelet, create the parent only."""
        parent = self.kubelet / "pods" / name
        parent.mkdir(parents=True, exist_ok=True)
        return parent / "volume"


@contextlib.contextmanager
def sandbox() -> Iterator[Sandbox]:
    root = Path(tempfile.mkdtemp(prefix="cq", dir="/tmp"))
    try:
        yield Sandbox(root)
    finally:
        force_cleanup(root)


def force_cleanup(root: Path) -> None:
    """Unmount everything under `root`, detach its loop devices, kill its QSD, remove it."""
    state = root / "state"
    for entry in sorted(mounts.mount_table(), key=lambda e: len(str(e.mount_point)), reverse=True):
        if root in entry.mount_point.parents and entry.fs_type != "fuse":
            os.system(f"umount -l '{entry.mount_point}' 2>/dev/null")
    for lp in loop.loop_devices():
        if root in lp.backing_file.parents:
            os.system(f"losetup -d {lp.device} 2>/dev/null")
    pid = running_pid(Config(state_dir=state))
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break

            time.sleep(0.05)
    for entry in mounts.mount_table():
        if root in entry.mount_point.parents:
            os.system(f"umount -l '{entry.mount_point}' 2>/dev/null")
    shutil.rmtree(root, ignore_errors=True)


@contextlib.asynccontextmanager
async def in_process_driver(box: Sandbox, **overrides: object) -> AsyncIterator[tuple[Driver, CSIClient]]:
    """The driver served in this event loop, and a client connected to it."""
    config = box.config(**overrides)
    async with serving(config) as driver:
        async with CSIClient(config.endpoint, timeout=60) as client:
            yield driver, client
        # Stop QSD so FUSE exports go away with it; mounts are cleaned by the sandbox.
        await driver.daemon.shutdown()


class DriverProcess:
    """`csi-qsd serve` as a child process, killable with SIGKILL like a crashing pod."""

    def __init__(self, box: Sandbox, *extra: str) -> None:
        self.box = box
        self.extra = extra
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = box.root / "driver.log"

    async def start(self, timeout: float = 30.0, *, failpoints: str = "") -> None:
        """Start `csi-qsd serve` and wait until Probe says ready; `failpoints` arms crash points."""
        argv = [
            sys.executable, "-m", "csi_qsd.cli", "serve", "--state-dir", str(self.box.state_dir),
            "--target-root", str(self.box.kubelet), "--node-id", "node-a", "--log-level", "debug", *self.extra,
        ]
        log = open(self.log_path, "ab")
        env = dict(os.environ, CSI_QSD_FAILPOINTS=failpoints)
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdout=log, stderr=log, start_new_session=True, env=env
        )
        log.close()
        async with CSIClient(self.box.endpoint, timeout=5) as client:
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"driver exited {self.proc.returncode}: {self.log()[-4000:]}")
                try:
                    if await client.probe():
                        return
                except Exception:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"driver not ready in {timeout}s: {self.log()[-4000:]}")
                await asyncio.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def qsd_pid(box: Sandbox) -> int | None:
    return running_pid(Config(state_dir=box.state_dir))


def write_synced(path: Path, data: bytes) -> None:
    """Write a file the way an application that cares does: data, then fsync."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


async def wait_restored(csi: CSIClient, vid: str, path: Path, timeout: float = 30) -> None:
    """Until NodeGetVolumeStats reports the volume healthy again (after a QSD restart)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            stats = await csi.stats(vid, str(path))
            if not stats.volume_condition.abnormal:
                return
        except Exception:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"volume {vid} not restored within {timeout}s")
        await asyncio.sleep(0.2)
