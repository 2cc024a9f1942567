"""Start, adopt and supervise one qemu-storage-daemon: a node runs one per shard (`shards`).

The data plane outlives the control plane: QSD runs detached (its own session,
a pidfile and a QMP socket in the state dir), so a driver restart adopts it
instead of restarting it. When QSD dies, the supervisor starts a new one (or,
in external mode, waits for its container to) and calls back so the caller can
rebuild the graph from the catalog. This module never decides what the graph
should hold.

A QSD that stops answering is treated as a dead one. A wedged QSD is worse
than a crashed one: its exports hang every consumer and nothing restarts it
(seen on 7.2: `block-export-del` unanswered, the monitor silent for 12
minutes). So a command left unanswered for `qmp_timeout`, or a liveness ping
(`query-version`, sent while the session is idle) left unanswered, makes the
supervisor log what a bug report needs, SIGKILL QSD and take the crash path.
The daemon's runstate (`QSDState`) says where in that cycle it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from csi_qsd.errors import NoAnswer, QSDError, QSDNoAnswer
from csi_qsd.qsd import features, fuse_paths, iothreads
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.settings import QSDMode, QSDSettings
from csi_qsd.sys.processes import wait_gone
from csi_qsd.sys.run import tool_env

log = logging.getLogger(__name__)

# The rebuild brings the graph in line with the caller's records; what it returns (if anything) is
# the rest of the work, which may run after the daemon is ready (an adopted QSD that kept its graph).
Rebuild = Callable[[QSDClient], Awaitable[Callable[[], Awaitable[None]] | None]]
RECONNECT_DELAY = 0.2
SHUTDOWN_TIMEOUT = 10.0
# The liveness ping goes out once the session has been idle for a ping interval, checked every
# interval: a silent monitor is noticed within qmp_timeout + 2 intervals (2 x qmp_timeout up to
# 10 s, then qmp_timeout + 10 s), and an idle QSD gets one cheap query every few seconds at most.
PING_MIN = 0.2
PING_MAX = 5.0
KERNEL_STACK_LINES = 64


class QSDState(enum.Enum):
    """Where the supervised QSD is, like qemu.qmp's Runstate for a session. Only RUNNING serves calls."""

    STOPPED = "stopped"  # not supervised: before start, after close or shutdown
    STARTING = "starting"  # first bring-up: adopt or spawn, connect, rebuild the graph
    RUNNING = "running"  # answering over QMP with the graph rebuilt
    WEDGED = "wedged"  # stopped answering: being diagnosed and killed
    RESTARTING = "restarting"  # lost (crashed or killed): a new QSD is coming up and being rebuilt


def ping_interval(qmp_timeout: float) -> float:
    """Seconds between liveness pings of an idle session, for a given QMP timeout."""
    return max(PING_MIN, min(qmp_timeout / 2, PING_MAX))


def qmp_socket(config: QSDSettings) -> Path:
    return config.qsd_dir / "qmp.sock"


def pidfile(config: QSDSettings) -> Path:
    return config.qsd_dir / "qsd.pid"


def daemon_argv(config: QSDSettings, *, daemonize: bool) -> list[str]:
    """The QSD command line: QMP monitor, the pool of iothreads, a locked pidfile."""
    argv = [
        config.qsd_binary,
        "--chardev", f"socket,id=qmp0,path={qmp_socket(config)},server=on,wait=off",
        "--monitor", "chardev=qmp0",
        *iothreads.command_line(config.iothreads, config.poll_max_ns),
        "--pidfile", str(pidfile(config)),
    ]
    if daemonize:
        argv.append("--daemonize")
    return argv


def running_pid(config: QSDSettings) -> int | None:
    """The PID of a live QSD named by our pidfile, or None (stale pidfiles are ignored).

    In external mode the pidfile holds the PID as QSD's container sees it; it
    names the same process here only when the pod shares one PID namespace.
    Otherwise the command-line check finds another process (or none) under
    that number and this returns None, so nothing else is ever signalled.
    """
    try:
        pid = int(pidfile(config).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    if b"qemu-storage-daemon" not in cmdline.split(b"\0", 1)[0] and str(pidfile(config)).encode() not in cmdline:
        return None
    return pid


@dataclasses.dataclass(frozen=True)
class ThreadDiagnostics:
    """What the kernel says one QSD thread is doing."""

    tid: int
    name: str
    wchan: str
    stack: tuple[str, ...] | None  # None where /proc/PID/task/TID/stack is not readable


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def process_state(pid: int) -> str:
    """The State line of /proc/PID/status ('T (stopped)', 'D (disk sleep)', ...), or '' if gone."""
    for line in (_read(Path(f"/proc/{pid}/status")) or "").splitlines():
        if line.startswith("State:"):
            return line.partition(":")[2].strip()
    return ""


def thread_diagnostics(pid: int) -> list[ThreadDiagnostics]:
    """Every thread's name, wait channel and kernel stack (root only), read from /proc. Blocking: run in a thread."""
    found = []
    try:
        tasks = sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name))
    except (OSError, ValueError):
        return []
    for task in tasks:
        stack = _read(task / "stack")
        found.append(ThreadDiagnostics(
            tid=int(task.name),
            name=(_read(task / "comm") or "").strip(),
            wchan=(_read(task / "wchan") or "").strip(),
            stack=tuple(stack.splitlines()[:KERNEL_STACK_LINES]) if stack is not None else None,
        ))
    return found


class QSDDaemon:
    """The supervised QSD of one shard, the QMP session to it and its runstate."""

    def __init__(self, config: QSDSettings) -> None:
        self._config = config
        self._rebuild: Rebuild | None = None
        self._verifier: asyncio.Task[None] | None = None
        self.client = QSDClient(f"csi-qsd-{config.node_id}", config.qmp_timeout)
        self.client.on_no_answer = self._no_answer
        self.restarts = 0
        self.wedges = 0
        self.version: tuple[int, int, int] = (0, 0, 0)
        self.loop_direct_io = False
        self.fuse_paths = fuse_paths.FusePaths(io_uring_option=False, kernel="absent", async_dio=None)
        self.iothreads = iothreads.IOThreadPool(config.iothreads, config.poll_max_ns)
        self._state = QSDState.STOPPED
        self._state_changed = asyncio.Event()
        self._wedge: NoAnswer | None = None
        self._wedge_reported = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def runstate(self) -> QSDState:
        return self._state

    @property
    def pid(self) -> int | None:
        """QSD's PID as this PID namespace sees it; None where it is not visible (or QSD is not running)."""
        return running_pid(self._config)

    @property
    def ready(self) -> bool:
        """True only while RUNNING with a live session: the one state in which calls are served."""
        return self._state is QSDState.RUNNING and self.client.connected

    async def runstate_changed(self) -> QSDState:
        """Wait for the next runstate change and return the new state (as qemu.qmp's runstate_changed)."""
        await self._state_changed.wait()
        return self._state

    def _set_state(self, state: QSDState, reason: str = "") -> None:
        if state is self._state:
            return
        previous, self._state = self._state, state
        level = logging.WARNING if state in (QSDState.WEDGED, QSDState.RESTARTING) else logging.INFO
        log.log(level, "event=qsd_state from=%s to=%s%s", previous.value, state.value,
                f" reason={reason}" if reason else "")
        self._state_changed.set()
        self._state_changed = asyncio.Event()

    async def start(self, rebuild: Rebuild) -> None:
        """Adopt the running QSD or start one, `rebuild` the graph, then supervise.

        `rebuild` runs again after every reconnect, so it must be idempotent.
        An adopted QSD that does not answer is killed and replaced once.
        Raises QSDError if no QSD can be brought up.
        """
        self._rebuild = rebuild
        self._config.qsd_dir.mkdir(parents=True, exist_ok=True)
        self._set_state(QSDState.STARTING)
        try:
            try:
                await self._attach()
            except QSDNoAnswer as exc:
                await self._put_down(exc.report)
                self._set_state(QSDState.STARTING, "wedged")
                await self._attach()
        except BaseException:
            self._set_state(QSDState.STOPPED, "start_failed")
            await self.client.disconnect()
            raise
        self._set_state(QSDState.RUNNING)
        self._supervisor = asyncio.create_task(self._supervise(), name="qsd-supervisor")
        self._watchdog = asyncio.create_task(self._watch(), name="qsd-watchdog")

    def _verify_later(self, rest: Callable[[], Awaitable[None]]) -> None:
        """Run the rest of a rebuild in the background; logged, never silently lost."""
        async def verify() -> None:
            started = asyncio.get_running_loop().time()
            try:
                await rest()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event=qsd_verify_failed")
                return
            log.info("event=qsd_verified seconds=%.3f", asyncio.get_running_loop().time() - started)

        if self._verifier is not None:
            self._verifier.cancel()
        self._verifier = asyncio.create_task(verify(), name="qsd-verify")

    async def close(self) -> None:
        """Stop supervising and drop the QMP session; QSD itself keeps running."""
        for task in (self._verifier, self._watchdog, self._supervisor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._supervisor = self._watchdog = self._verifier = None
        self._set_state(QSDState.STOPPED)
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
        if not await wait_gone(pid, SHUTDOWN_TIMEOUT):
            log.warning("event=qsd_kill pid=%d reason=quit_timeout", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if not await wait_gone(pid, SHUTDOWN_TIMEOUT):
                raise QSDError(f"qemu-storage-daemon pid {pid} survived SIGKILL")

    async def _attach(self) -> None:
        if self._config.qsd_mode is QSDMode.MANAGED and running_pid(self._config) is None:
            await self._spawn()
        else:
            log.info("event=qsd_adopt pid=%s socket=%s", running_pid(self._config), qmp_socket(self._config))
        await self._connect()
        self.version = await self.client.version()
        self.loop_direct_io = features.direct_io(self._config.loop_io, self.version)
        self.iothreads.spread = features.vhost_exports_spread(self.version)
        await self._ensure_iothreads()
        # QEMU's export before 11 is libfuse's, which always asks for FUSE_ASYNC_DIO: measured where it may not.
        self.fuse_paths = await fuse_paths.probe(self.client, self._config.qsd_dir / "fuse-probe",
                                                 measure_async_dio=self.version >= features.FUSE_IOTHREAD_LIST)
        log.info("event=qsd_version version=%s loop_io=%s setting=%s iothreads=%d vhost_exports_in=%s "
                 "fuse_exports_in=%s", ".".join(map(str, self.version)), features.describe(self.loop_direct_io),
                 self._config.loop_io.value, len(self.iothreads.ids),
                 "iothreads" if self.vhost_iothreads() else "main_loop",
                 "iothreads" if self.fuse_iothreads() else "main_loop")
        if self._rebuild is not None:
            rest = await self._rebuild(self.client)
            if rest is not None:
                self._verify_later(rest)

    def vhost_iothreads(self) -> iothreads.IOThreadPool | None:
        """The pool a new vhost-user-blk export is placed in, or None where this QSD must run it in its main loop."""
        return self.iothreads if features.vhost_export_in_iothread(self.version) else None

    def fuse_iothreads(self) -> list[str] | None:
        """The iothreads a new FUSE export is served by, or None for the main loop (QEMU < 11)."""
        return features.fuse_iothreads(self.version, self.iothreads.ids, iothreads.node_cores(),
                                       self._config.fuse_threads)

    async def _ensure_iothreads(self) -> None:
        """Add the pool's threads an adopted QSD lacks (one started by an older driver had only the first)."""
        present = await self.client.iothreads()
        for thread_id in self.iothreads.ids:
            if thread_id not in present:
                await self.client.execute("object-add", iothreads.object_args(thread_id, self.iothreads.poll_max_ns))
            elif self.iothreads.poll_max_ns is not None:
                await self.client.execute("qom-set", {"path": f"/objects/{thread_id}", "property": "poll-max-ns",
                                                      "value": self.iothreads.poll_max_ns})

    async def _connect(self) -> None:
        """Connect to the QMP socket, waiting for it when QSD is another container's to start.

        A QSD that takes the connection but never greets is not waited for:
        QSDNoAnswer goes up, and the caller puts it down.
        """
        deadline = asyncio.get_running_loop().time() + self._config.qmp_timeout
        while True:
            try:
                await self.client.connect(qmp_socket(self._config))
                return
            except QSDNoAnswer:
                raise
            except QSDError:
                if asyncio.get_running_loop().time() > deadline and self._config.qsd_mode is QSDMode.MANAGED:
                    raise
                await asyncio.sleep(RECONNECT_DELAY)

    async def _spawn(self) -> None:
        argv = daemon_argv(self._config, daemonize=True)
        log.info("event=qsd_start argv=%r", " ".join(argv))
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=tool_env(),
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise QSDError(
                f"qemu-storage-daemon failed to start (exit {proc.returncode}): "
                f"{(err or out).decode(errors='replace').strip()}"
            )

    # watchdog -----------------------------------------------------------

    def _no_answer(self, report: NoAnswer) -> None:
        """The client's hook: a command went unanswered. Acted on by the supervisor, only for the live session.

        While starting or restarting, the supervisor gets the same news as a
        QSDNoAnswer from its own call and acts on that instead.
        """
        if self._state is not QSDState.RUNNING or report.session != self.client.session or self._wedge is not None:
            return
        self._wedge = report
        self._wedge_reported.set()

    async def _watch(self) -> None:
        """Eternal task: ping an idle session, so a QSD that stops answering is noticed with nobody calling."""
        interval = ping_interval(self._config.qmp_timeout)
        while True:
            await asyncio.sleep(interval)
            if not self.ready or self.client.idle_for() < interval:
                continue
            try:
                await self.client.ping()
            except QSDError as exc:
                # No answer reaches the supervisor through the hook; a lost session it sees itself.
                log.debug("event=qsd_ping_failed error=%r", str(exc))

    async def _until_lost_or_wedged(self) -> NoAnswer | None:
        """Wait until the session ends (None) or a command goes unanswered (its report)."""
        lost = asyncio.create_task(self.client.wait_disconnected(), name="qsd-session")
        wedged = asyncio.create_task(self._wedge_reported.wait(), name="qsd-wedge")
        try:
            await asyncio.wait((lost, wedged), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (lost, wedged):
                task.cancel()
            await asyncio.gather(lost, wedged, return_exceptions=True)
        return self._wedge

    async def _put_down(self, report: NoAnswer) -> None:
        """Log what a bug report needs about a QSD that stopped answering, then SIGKILL it.

        The session is dropped afterwards, so the crash path (restart,
        rebuild) follows. Never raises for a QSD that is already gone.
        """
        self._set_state(QSDState.WEDGED, f"no_answer command={report.command}")
        self.wedges += 1
        pid = running_pid(self._config)
        now = asyncio.get_running_loop().time()
        in_flight = [f"{item.command}:{now - item.started:.1f}s" for item in self.client.in_flight()]
        if pid is not None:
            state = process_state(pid)
            threads = await asyncio.to_thread(thread_diagnostics, pid)
        else:
            state, threads = "", []
        log.error(
            "event=qsd_wedged pid=%s command=%s waited_s=%.1f timeout_s=%s in_flight=%s proc_state=%r "
            "mode=%s threads=%s", pid, report.command, report.waited, self._config.qmp_timeout,
            ",".join(in_flight) or "-", state, self._config.qsd_mode.value,
            json.dumps([dataclasses.asdict(t) for t in threads]),
        )
        if pid is None:
            log.error("event=qsd_kill_impossible reason=pid_not_visible pidfile=%s mode=%s: restart the "
                      "qemu-storage-daemon by hand (in external mode its PID is only visible to this "
                      "container when the pod shares one PID namespace)", pidfile(self._config),
                      self._config.qsd_mode.value)
        else:
            log.warning("event=qsd_kill pid=%d reason=wedged", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if not await wait_gone(pid, SHUTDOWN_TIMEOUT):
                log.error("event=qsd_kill_failed pid=%d proc_state=%r", pid, process_state(pid))
        await self.client.disconnect()
        self._wedge = None
        self._wedge_reported.clear()

    # supervisor ---------------------------------------------------------

    async def _supervise(self) -> None:
        """Eternal task: notice a lost or wedged daemon, bring it back, rebuild. Never exits silently."""
        while True:
            try:
                wedge = await self._until_lost_or_wedged()
                if wedge is not None:
                    await self._put_down(wedge)
                reason = "wedged" if wedge is not None else "session_lost"
                self._set_state(QSDState.RESTARTING, reason)
                log.warning("event=qsd_lost pid=%s reason=%s", running_pid(self._config), reason)
                self.restarts += 1
                await self._recover()
                self._set_state(QSDState.RUNNING)
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
            except QSDNoAnswer as exc:
                await self._put_down(exc.report)
                self._set_state(QSDState.RESTARTING, "wedged")
            except QSDError as exc:
                log.warning("event=qsd_recover_retry error=%r", str(exc))
                await self.client.disconnect()
                await asyncio.sleep(1.0)
