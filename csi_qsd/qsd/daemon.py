"""Start, adopt and supervise the pool's qemu-storage-daemon.

The data plane outlives the control plane: QSD runs detached (its own session,
a pidfile and a QMP socket in the state dir), so a driver restart adopts it
instead of restarting it. When QSD dies, the supervisor starts a new one (or,
in external mode, waits for its container to) and calls back so the caller can
rebuild the graph from the catalog. This module never decides what the graph
should hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from csi_qsd import datapath
from csi_qsd.config import Config, QSDMode
from csi_qsd.errors import QSDError
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.graph import IOTHREAD_ID

log = logging.getLogger(__name__)

Rebuild = Callable[[QSDClient], Awaitable[None]]
RECONNECT_DELAY = 0.2
SHUTDOWN_TIMEOUT = 10.0


def qmp_socket(config: Config) -> Path:
    return config.qsd_dir / "qmp.sock"


def pidfile(config: Config) -> Path:
    return config.qsd_dir / "qsd.pid"


def daemon_argv(config: Config, *, daemonize: bool) -> list[str]:
    """The QSD command line: QMP monitor, one iothread, a locked pidfile."""
    argv = [
        config.qsd_binary,
        "--chardev", f"socket,id=qmp0,path={qmp_socket(config)},server=on,wait=off",
        "--monitor", "chardev=qmp0",
        "--object", f"iothread,id={IOTHREAD_ID}",
        "--pidfile", str(pidfile(config)),
    ]
    if daemonize:
        argv.append("--daemonize")
    return argv


def running_pid(config: Config) -> int | None:
    """The PID of a live QSD named by our pidfile, or None (stale pidfiles are ignored)."""
    try:
        pid = int(pidfile(config).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    if b"qemu-storage-daemon" not in cmdline.split(b"\0", 1)[0] and str(pidfile(config)).encode() not in cmdline:
        return None
    return pid


class QSDDaemon:
    """The supervised QSD of one pool and the QMP session to it."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._rebuild: Rebuild | None = None
        self.client = QSDClient(f"csi-qsd-{config.node_id}", config.qmp_timeout)
        self.restarts = 0
        self.version: tuple[int, int, int] = (0, 0, 0)
        self.loop_direct_io = False
        self._ready = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.client.connected

    async def start(self, rebuild: Rebuild) -> None:
        """Adopt the running QSD or start one, `rebuild` the graph, then supervise.

        `rebuild` runs again after every reconnect, so it must be idempotent.
        """
        self._rebuild = rebuild
        self._config.qsd_dir.mkdir(parents=True, exist_ok=True)
        await self._attach()
        self._supervisor = asyncio.create_task(self._supervise(), name="qsd-supervisor")

    async def close(self) -> None:
        """Stop supervising and drop the QMP session; QSD itself keeps running."""
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        self._ready.clear()
        await self.client.disconnect()

    async def shutdown(self) -> None:
        """Stop supervising and stop QSD: `quit`, wait, then SIGKILL."""
        await self.close()
        pid = running_pid(self._config)
        if pid is None:
            return
        with contextlib.suppress(QSDError):
            await self.client.connect(qmp_socket(self._config))
            await self.client.quit()
        await self.client.disconnect()
        if not await _wait_gone(pid, SHUTDOWN_TIMEOUT):
            log.warning("event=qsd_kill pid=%d reason=quit_timeout", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if not await _wait_gone(pid, SHUTDOWN_TIMEOUT):
                raise QSDError(f"qemu-storage-daemon pid {pid} survived SIGKILL")

    async def _attach(self) -> None:
        if self._config.qsd_mode is QSDMode.MANAGED and running_pid(self._config) is None:
            await self._spawn()
        else:
            log.info("event=qsd_adopt pid=%s socket=%s", running_pid(self._config), qmp_socket(self._config))
        await self._connect()
        self.version = await self.client.version()
        self.loop_direct_io = datapath.direct_io(self._config.loop_io, self.version)
        log.info("event=qsd_version version=%s loop_io=%s setting=%s", ".".join(map(str, self.version)),
                 datapath.describe(self.loop_direct_io), self._config.loop_io.value)
        if self._rebuild is not None:
            await self._rebuild(self.client)
        self._ready.set()

    async def _connect(self) -> None:
        """Connect to the QMP socket, waiting for it when QSD is another container's to start."""
        deadline = asyncio.get_running_loop().time() + self._config.qmp_timeout
        while True:
            try:
                await self.client.connect(qmp_socket(self._config))
                return
            except QSDError:
                if asyncio.get_running_loop().time() > deadline and self._config.qsd_mode is QSDMode.MANAGED:
                    raise
                await asyncio.sleep(RECONNECT_DELAY)

    async def _spawn(self) -> None:
        argv = daemon_argv(self._config, daemonize=True)
        log.info("event=qsd_start argv=%r", " ".join(argv))
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise QSDError(
                f"qemu-storage-daemon failed to start (exit {proc.returncode}): "
                f"{(err or out).decode(errors='replace').strip()}"
            )

    async def _supervise(self) -> None:
        """Eternal task: notice a lost daemon, bring it back, rebuild. Never exits silently."""
        while True:
            try:
                await self.client.wait_disconnected()
                self._ready.clear()
                log.warning("event=qsd_lost pid=%s", running_pid(self._config))
                self.restarts += 1
                await self._recover()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event=qsd_recover_failed; retrying")
                await self.client.disconnect()
                await asyncio.sleep(1.0)

    async def _recover(self) -> None:
        while True:
            try:
                await self._attach()
                log.info("event=qsd_recovered restarts=%d", self.restarts)
                return
            except QSDError as exc:
                log.warning("event=qsd_recover_retry error=%r", str(exc))
                await self.client.disconnect()
                await asyncio.sleep(1.0)


async def _wait_gone(pid: int, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").exists() and " Z " in Path(f"/proc/{pid}/stat").read_text():
            return True
        await asyncio.sleep(0.05)
    return False
