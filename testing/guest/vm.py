"""Boots the guest in QEMU, streams its serial console and reports the script's result.

One VM is one ``qemu-system-x86_64`` child process driven with asyncio: the
serial console is QEMU's stdout, read by a task into a line buffer that any
number of consumers can follow (:meth:`RunningVM.lines`) or search
(:meth:`RunningVM.wait_for_line`). A watchdog task kills the VM at the
deadline, so a guest that hangs (for instance on a dead vhost-user backend)
fails the test instead of stalling it. The guest cannot hang QEMU's exit: it
powers off with ``poweroff -f``, and ``panic=-1`` + ``-no-reboot`` turn a
kernel panic into a QEMU exit too.

Acceleration defaults to TCG: the ``/dev/kvm`` on the project's machines is a
paravirtual KVM that hangs a stock kernel right after its first lines. Set
``CSI_QSD_E2E_ACCEL=kvm`` (or pass ``accel="kvm"``) where KVM works.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from testing import owner

from .disks import Disk, VhostUserDisk
from .image import GuestImage
from .initramfs import EXIT_MARKER, INIT_FAILED_MARKER, READY_MARKER, write_run_initrd

log = logging.getLogger(__name__)

DEFAULT_APPEND = "console=ttyS0 panic=-1 quiet"
_EXIT_RE = re.compile(re.escape(EXIT_MARKER) + r"(\d+)")
_READY_RE = re.compile(re.escape(READY_MARKER) + r" disks=(\d+) uptime=([\d.]+)")
_KILL_GRACE_S = 5.0
_ERROR_TAIL_LINES = 40


class GuestError(RuntimeError):
    """The guest did not run its script to completion; carries what it printed."""

    def __init__(self, message: str, output: str = "", qemu_stderr: str = "") -> None:
        tail = "\n".join(output.splitlines()[-_ERROR_TAIL_LINES:])
        details = message
        if tail:
            details += f"\n--- last console lines ---\n{tail}"
        if qemu_stderr.strip():
            details += f"\n--- qemu stderr ---\n{qemu_stderr.strip()}"
        super().__init__(details)
        self.output = output
        self.qemu_stderr = qemu_stderr


class GuestTimeout(GuestError):
    """A deadline passed: the whole VM's, or a :meth:`RunningVM.wait_for_line` one."""


@dataclass(frozen=True)
class GuestResult:
    """Outcome of a guest run whose script finished.

    ``boot_seconds`` is host wall time from spawning QEMU to the guest's
    ready marker (kernel up, modules loaded, disks present); ``guest_uptime``
    is the guest's own ``/proc/uptime`` at that point.
    """

    exit_code: int
    output: str
    qemu_returncode: int | None
    wall_seconds: float
    boot_seconds: float | None
    guest_uptime: float | None

    @property
    def lines(self) -> list[str]:
        return self.output.splitlines()


def default_accel() -> str:
    return os.environ.get("CSI_QSD_E2E_ACCEL", "").strip() or "tcg"


def qemu_binary() -> str:
    return os.environ.get("CSI_QSD_QEMU", "qemu-system-x86_64")


def qemu_command(
    image: GuestImage,
    initrd: Path,
    disks: Sequence[Disk],
    *,
    accel: str,
    memory_mib: int,
    cpus: int,
    append: str = "",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The full QEMU command line; public so benchmarks can log or tweak it.

    Guest RAM is a shared memfd because vhost-user backends map it to do I/O
    straight into guest buffers; it costs nothing for in-process disks.
    """
    cmd = [
        qemu_binary(),
        "-machine", "q35,memory-backend=mem",
        "-accel", accel,
        "-smp", str(cpus),
        "-m", f"{memory_mib}M",
        "-object", f"memory-backend-memfd,id=mem,size={memory_mib}M,share=on",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-serial", "stdio",
        "-no-reboot",
        "-kernel", str(image.kernel),
        "-initrd", str(initrd),
        "-append", f"{DEFAULT_APPEND} {append}".strip(),
    ]  # fmt: skip
    if accel == "kvm":
        cmd += ["-cpu", "host"]
    for index, disk in enumerate(disks):
        cmd += disk.qemu_args(index)
    return cmd + list(extra_args)


class RunningVM:
    """A booted (or booting) guest. Use :func:`start_vm` to create one.

    Also an async context manager that kills the VM on exit if it is still
    running, so a failing test never leaks a QEMU process.
    """

    def __init__(self, proc: asyncio.subprocess.Process, workdir: Path, timeout: float) -> None:
        self._proc = proc
        self._workdir = workdir
        self._started = time.monotonic()
        self._lines: list[str] = []
        self._stderr: list[str] = []
        self._eof = False
        self._cond = asyncio.Condition()
        self._cursor = 0
        self._timed_out = False
        self._killed = False
        self._ready_at: float | None = None
        self._ended_at: float | None = None
        self._stdout_task = asyncio.create_task(self._pump_stdout())
        self._stderr_task = asyncio.create_task(self._pump_stderr())
        self._watchdog = asyncio.create_task(self._enforce_deadline(timeout))

    # -- background tasks ------------------------------------------------

    async def _pump_stdout(self) -> None:
        assert self._proc.stdout is not None
        pending = b""
        while chunk := await self._proc.stdout.read(65536):
            pending += chunk
            *complete, pending = pending.split(b"\n")
            if complete:
                await self._append([_decode(raw) for raw in complete])
        if pending:
            await self._append([_decode(pending)])
        async with self._cond:
            self._eof = True
            self._cond.notify_all()

    async def _append(self, lines: list[str]) -> None:
        if self._ready_at is None and any(READY_MARKER in line for line in lines):
            self._ready_at = time.monotonic()
        for line in lines:
            log.debug("guest[%d]: %s", self._proc.pid, line)
        async with self._cond:
            self._lines.extend(lines)
            self._cond.notify_all()

    async def _pump_stderr(self) -> None:
        assert self._proc.stderr is not None
        while line := await self._proc.stderr.readline():
            self._stderr.append(_decode(line))

    async def _enforce_deadline(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._proc.wait(), timeout)
        except TimeoutError:
            self._timed_out = True
            log.warning("guest %d passed its %.0fs deadline; killing it", self._proc.pid, timeout)
            await self._terminate()

    async def _terminate(self) -> None:
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        await self._proc.wait()

    async def _finish(self) -> None:
        """Waits for QEMU and its pipes to close, then drops the per-run files."""
        await self._proc.wait()
        await asyncio.gather(self._stdout_task, self._stderr_task)
        if not self._watchdog.done():
            self._watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watchdog
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        shutil.rmtree(self._workdir, ignore_errors=True)

    # -- public API ------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """QEMU's exit status, or None while it runs."""
        return self._proc.returncode

    @property
    def output(self) -> str:
        """Console output so far (complete lines only)."""
        return "\n".join(self._lines)

    @property
    def qemu_stderr(self) -> str:
        return "\n".join(self._stderr)

    async def lines(self) -> AsyncIterator[str]:
        """Yields every console line from the start of the boot, then new ones as they come.

        Independent of :meth:`wait_for_line`'s cursor; ends when QEMU closes
        the console.
        """
        index = 0
        while True:
            async with self._cond:
                await self._cond.wait_for(lambda: index < len(self._lines) or self._eof)
                batch = self._lines[index:]
                eof = self._eof
            for line in batch:
                yield line
            index += len(batch)
            if eof and index >= len(self._lines):
                return

    async def wait_for_line(self, pattern: str | re.Pattern[str], timeout: float | None = None) -> re.Match[str]:
        """Waits for a console line matching ``pattern`` (``re.search``) and returns the match.

        Works like an expect-style cursor: the search starts after the line
        matched by the previous call (from the start of the boot for the
        first), so a line printed before the call is never missed and
        successive calls walk forward through the output.
        """
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        try:
            async with asyncio.timeout(timeout):
                while True:
                    async with self._cond:
                        await self._cond.wait_for(lambda: self._cursor < len(self._lines) or self._eof)
                        batch = self._lines[self._cursor :]
                        eof = self._eof
                    for offset, line in enumerate(batch):
                        match = regex.search(line)
                        if match:
                            self._cursor += offset + 1
                            return match
                    self._cursor += len(batch)
                    if eof:
                        raise GuestError(
                            f"guest console closed without a line matching {regex.pattern!r}",
                            self.output,
                            self.qemu_stderr,
                        )
        except TimeoutError:
            raise GuestTimeout(
                f"no console line matching {regex.pattern!r} within {timeout}s", self.output, self.qemu_stderr
            ) from None

    async def wait(self) -> GuestResult:
        """Waits for the guest to power off and returns its script's exit code.

        Raises :class:`GuestTimeout` if the VM's deadline killed it, and
        :class:`GuestError` if it was killed, failed in ``/init`` or ended
        without reporting the script's status (crash, panic, QEMU error).
        """
        await self._finish()
        output, stderr = self.output, self.qemu_stderr
        if self._timed_out:
            raise GuestTimeout("guest did not finish before its deadline", output, stderr)
        if self._killed:
            raise GuestError("guest was killed", output, stderr)
        failed = [line for line in self._lines if INIT_FAILED_MARKER in line]
        if failed:
            raise GuestError(f"guest init failed: {failed[0]}", output, stderr)
        exits = [m for line in self._lines if (m := _EXIT_RE.search(line))]
        if not exits:
            raise GuestError(f"guest ended without an exit marker (qemu rc={self.returncode})", output, stderr)
        ready = next((m for line in self._lines if (m := _READY_RE.search(line))), None)
        assert self._ended_at is not None
        return GuestResult(
            exit_code=int(exits[-1].group(1)),
            output=output,
            qemu_returncode=self.returncode,
            wall_seconds=self._ended_at - self._started,
            boot_seconds=None if self._ready_at is None else self._ready_at - self._started,
            guest_uptime=None if ready is None else float(ready.group(2)),
        )

    async def kill(self) -> None:
        """Kills QEMU at once (SIGKILL), as a host crash would; idempotent.

        The guest gets no chance to flush anything, which is the point when a
        test checks what an abrupt VM death leaves on the volume.
        """
        if self._proc.returncode is None:
            self._killed = True
        await self._terminate()
        await self._finish()

    async def __aenter__(self) -> RunningVM:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.kill()


def _check_backends(disks: Sequence[Disk]) -> None:
    """Fails fast on a missing vhost-user socket.

    With ``reconnect`` set QEMU does not fail on an absent socket: it retries
    forever with the guest frozen, which would surface only as a timeout.
    """
    for disk in disks:
        if isinstance(disk, VhostUserDisk):
            try:
                is_socket = stat.S_ISSOCK(os.stat(disk.socket_path).st_mode)
            except FileNotFoundError:
                is_socket = False
            if not is_socket:
                raise FileNotFoundError(f"no vhost-user socket at {disk.socket_path}")


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r\n")


async def start_vm(
    image: GuestImage,
    disks: Sequence[Disk],
    script: str,
    *,
    accel: str | None = None,
    memory_mib: int = 256,
    cpus: int = 1,
    timeout: float = 120.0,
    files: Mapping[str, bytes] | None = None,
    append: str = "",
    extra_args: Sequence[str] = (),
    disk_wait_s: float = 30.0,
) -> RunningVM:
    """Boots ``image`` with ``disks`` and runs ``script`` as ``/run.sh`` in the guest.

    ``disks[i]`` is ``/dev/vd{a+i}`` in the guest (also listed in the
    script's ``$CSI_QSD_DISKS``); ``/init`` waits up to ``disk_wait_s`` for
    all of them before running the script. ``files`` (guest path -> bytes)
    are added to the guest's rootfs. ``timeout`` bounds the VM's whole life.
    """
    _check_backends(disks)
    workdir = owner.make_base("csi-qsd-vm-", Path(tempfile.gettempdir()))
    try:
        initrd = workdir / "initrd.img"
        write_run_initrd(
            initrd, image.initrd, script, expected_disks=len(disks), disk_wait_s=disk_wait_s, files=files
        )
        cmd = qemu_command(
            image,
            initrd,
            disks,
            accel=accel or default_accel(),
            memory_mib=memory_mib,
            cpus=cpus,
            append=append,
            extra_args=extra_args,
        )
        log.info("starting guest: %s", " ".join(cmd))
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return RunningVM(proc, workdir, timeout)


async def run_guest(
    image: GuestImage,
    disks: Sequence[Disk],
    script: str,
    *,
    accel: str | None = None,
    memory_mib: int = 256,
    cpus: int = 1,
    timeout: float = 120.0,
    files: Mapping[str, bytes] | None = None,
    append: str = "",
    extra_args: Sequence[str] = (),
    disk_wait_s: float = 30.0,
) -> GuestResult:
    """:func:`start_vm` then :meth:`RunningVM.wait`; the VM is killed if the wait is cancelled."""
    vm = await start_vm(
        image,
        disks,
        script,
        accel=accel,
        memory_mib=memory_mib,
        cpus=cpus,
        timeout=timeout,
        files=files,
        append=append,
        extra_args=extra_args,
        disk_wait_s=disk_wait_s,
    )
    async with vm:
        return await vm.wait()
