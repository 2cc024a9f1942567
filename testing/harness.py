"""Run csi-qsd for tests: in-process or as a separate `csi-qsd serve` process, and clean up after.

Every driver under test gets a short private directory under /tmp (UNIX
socket paths are limited to 107 bytes) holding its state dir and a fake
kubelet root. Cleanup is generic and forceful, so a failed test never leaves
mounts, loop devices or daemons behind for the next one.

Tests wait for what they can observe (a pid, a mount, a log line, Probe, a
counter) with `until`, never with a fixed sleep that hopes it happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, overload

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.config import Config
from csi_qsd.node.cut_off import REBUILT
from csi_qsd.qsd.daemon import running_pid
from csi_qsd.qsd.shards import MAX_SHARDS, ShardSettings
from csi_qsd.server import Driver, serving
from csi_qsd.sys import loop, mounts
from csi_qsd.sys.tools import bundled
from testing import owner

T = TypeVar("T")
POLL_INTERVAL = 0.05


@overload
async def until(
    predicate: Callable[[], Awaitable[T]], what: str | Callable[[], str], timeout: float = ..., interval: float = ...
) -> T: ...


@overload
async def until(
    predicate: Callable[[], T], what: str | Callable[[], str], timeout: float = ..., interval: float = ...
) -> T: ...


async def until(
    predicate: Callable[[], object], what: str | Callable[[], str], timeout: float = 60.0,
    interval: float = POLL_INTERVAL,
) -> object:
    """Poll `predicate` (sync or async) until it returns something truthy, and return that.

    For events that nothing notifies (a pid file, a mount, a log line): a short
    poll inside a bound. Raises AssertionError naming `what` (a string, or a
    callable for a message built at the deadline, e.g. with the last log lines)
    after `timeout` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            message = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")
        await asyncio.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def http_get(port: int, path: str, timeout: float = 30.0) -> tuple[int, bytes] | None:
    """GET http://127.0.0.1:`port``path`: (status, body), or None while nothing listens there."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return None
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


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
    def runtime_dir(self) -> Path:
        """The driver's own runtime directory (`--runtime-dir`), beside its state, not the host's /run."""
        return self.root / "run"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.state_dir / 'csi.sock'}"

    def config(self, **overrides: object) -> Config:
        values: dict[str, object] = dict(
            state_dir=self.state_dir, target_root=self.kubelet, node_id="node-a", runtime_dir=self.runtime_dir,
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
    root = owner.make_base("cq")  # swept by the next run if this one is killed (testing.stale_runs)
    try:
        yield Sandbox(root)
    finally:
        force_cleanup(root)


def _quietly(*argv: str) -> None:
    """Run a cleanup tool whose failure is expected (the object may be gone already); output is captured."""
    subprocess.run(argv, capture_output=True, check=False, env=dict(os.environ, LC_ALL="C"))


def _kill_and_wait(pid: int, timeout: float = 5.0) -> None:
    """SIGKILL `pid` and wait (bounded) until it has exited, so its FUSE exports are gone."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        select.select([pidfd], [], [], timeout)  # readable once the process has exited
    finally:
        os.close(pidfd)


def release_host_state(root: Path) -> None:
    """Unmount the filesystems under `root` and detach the loop devices over its files.

    Must come before its QSD stops: once a FUSE export is gone, a loop
    device over it no longer shows its backing path and cannot be found.
    """
    for entry in sorted(mounts.mount_table(), key=lambda e: len(str(e.mount_point)), reverse=True):
        if root in entry.mount_point.parents and entry.fs_type != "fuse":
            _quietly("umount", "-l", str(entry.mount_point))
    for lp in loop.loop_devices():
        if root in lp.backing_file.parents:
            _quietly("losetup", "-d", str(lp.device))


def force_cleanup(root: Path) -> None:
    """Unmount everything under `root`, detach its loop devices, kill its QSD, remove it."""
    state = root / "state"
    release_host_state(root)
    for pid in qsd_pids(state):
        _kill_and_wait(pid)
    for entry in mounts.mount_table():
        if root in entry.mount_point.parents:
            _quietly("umount", "-l", str(entry.mount_point))
    shutil.rmtree(root, ignore_errors=True)


async def crash_qsd(box: Sandbox, csi: CSIClient, vid: str, path: Path) -> None:
    """SIGKILL the sandbox's QSD, then wait until its successor serves volume `vid` at `path` again."""
    old = qsd_pid(box)
    assert old is not None, "no QSD runs for the sandbox"
    os.kill(old, signal.SIGKILL)
    await wait_new_qsd(box, old)
    await wait_restored(csi, vid, path)


@contextlib.asynccontextmanager
async def in_process_driver(box: Sandbox, **overrides: object) -> AsyncIterator[tuple[Driver, CSIClient]]:
    """The driver served in this event loop, and a client connected to it."""
    config = box.config(**overrides)
    async with serving(config) as driver:
        async with CSIClient(config.endpoint, timeout=60) as client:
            yield driver, client
        # Stop QSD so FUSE exports go away with it, after what stands on them.
        await asyncio.to_thread(release_host_state, box.root)
        await driver.qsd.shutdown()


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
            "--target-root", str(self.box.kubelet), "--runtime-dir", str(self.box.runtime_dir), "--node-id", "node-a",
            "--log-level", "debug", *self.extra,
        ]
        log = open(self.log_path, "ab")
        env = dict(os.environ, CSI_QSD_FAILPOINTS=failpoints)
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdout=log, stderr=log, start_new_session=True, env=env
        )
        log.close()
        proc = self.proc
        async with CSIClient(self.box.endpoint, timeout=5) as client:

            async def ready() -> bool:
                if proc.returncode is not None:
                    raise RuntimeError(f"driver exited {proc.returncode}: {self.log()[-4000:]}")
                try:
                    return bool(await client.probe())
                except Exception:  # no socket yet, or not serving yet
                    return False

            await until(ready, lambda: f"Probe ready; driver log:\n{self.log()[-4000:]}", timeout)

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
        await terminate(self.proc)


async def terminate(proc: asyncio.subprocess.Process | None, timeout: float = 15.0) -> None:
    """SIGTERM a child that still runs, SIGKILL it if it has not exited within `timeout`, and reap it."""
    if proc is not None and proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def running_driver(box: Sandbox, *extra: str) -> AsyncIterator[DriverProcess]:
    """`csi-qsd serve` for `box` (with `extra` flags), ready; stopped on the way out."""
    driver = DriverProcess(box, *extra)
    try:
        await driver.start()
        yield driver
    finally:
        await driver.stop()


def qsd_pid(box: Sandbox, shard: int = 0) -> int | None:
    return running_pid(ShardSettings(Config(state_dir=box.state_dir), shard))


def qsd_pids(state_dir: Path) -> list[int]:
    """The live QSDs of every shard a driver on `state_dir` may have started."""
    config = Config(state_dir=state_dir)
    found = (running_pid(ShardSettings(config, shard)) for shard in range(MAX_SHARDS))
    return [pid for pid in found if pid is not None]


async def wait_new_qsd(box: Sandbox, old: int, timeout: float = 60.0) -> int:
    """Until a QSD other than `old` runs for `box` (the supervisor restarted it); its pid."""

    def new_pid() -> int | None:
        pid = qsd_pid(box)
        return pid if pid != old else None

    pid = await until(new_pid, f"a new QSD to replace pid {old}", timeout)
    assert pid is not None
    return pid


def write_synced(path: Path, data: bytes) -> None:
    """Write a file the way an application that cares does: data, then fsync."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


async def wait_restored(csi: CSIClient, vid: str, path: Path, timeout: float = 60) -> None:
    """Until NodeGetVolumeStats reports the volume served again at `path` (after a QSD restart).

    Served again is healthy, or, at a target published before the crash, abnormal only because a container
    that took the target before would still hold the dead mount (`csi_qsd.node.cut_off`): this process
    reads the target itself and sees the new one.
    """

    async def healthy() -> bool:
        try:
            stats = await csi.stats(vid, str(path))
        except Exception:  # UNAVAILABLE while QSD is down
            return False
        return not stats.volume_condition.abnormal or REBUILT in stats.volume_condition.message

    await until(healthy, f"volume {vid} healthy again at {path}", timeout, interval=0.2)


@contextlib.asynccontextmanager
async def qemu_io_session(argv: list[str], first: str, cwd: Path | None = None,
                          timeout: float = 60.0) -> AsyncIterator[None]:
    """qemu-io (`argv`, reading commands) kept open until the block ends; its `first` command must read 1 MiB,
    so the block starts once it is connected and did I/O."""
    proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(first.encode() + b"\n")
        await proc.stdin.drain()
        async with asyncio.timeout(timeout):
            while b"read 1048576/1048576 bytes" not in (line := await proc.stdout.readline()):
                assert line, "qemu-io ended before it read 1 MiB"
        yield
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.write(b"quit\n")
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def refused(call: Awaitable[object], code: grpc.StatusCode, *names: str) -> str:
    """Await a CSI call that must fail with `code` and a message naming each of `names`; the message."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    for name in names:
        assert name in (info.value.details() or "")
    return info.value.details() or ""
