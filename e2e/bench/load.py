"""Load bench: many clients cycling whole volume lifecycles while QSD and the driver are SIGKILLed.

Serves `csi-qsd serve` as a separate process (as in a pod) and runs N clients
at once, each looping, for the given time:

    CreateVolume -> NodeStageVolume -> NodePublishVolume -> write, sync, read back
      -> NodeUnpublishVolume -> NodeUnstageVolume -> DeleteVolume

over filesystem, block and vhost-user-blk (VM) volumes in turn (qcow2, 64 MiB).
At 1/4 and 1/2 of the run QSD is SIGKILLed (the driver's supervisor starts a
new one and rebuilds every volume; `--qsd-kills` spreads more or fewer over
the first 3/4); at 3/4 the driver is SIGKILLed and started again, as kubelet
restarts a crashed plugin container.

Clients behave like kubelet and the external-provisioner: a call that fails is
retried with a short backoff until it succeeds, for at most `--bound` seconds.
The write step writes 1 MiB of random bytes and syncs it (a file and fsync on
a filesystem volume; pwrite and fsync on the block device), holds the volume
`--dwell` seconds, then reads it back (the file's pages dropped first, the
device with O_DIRECT). An I/O error, or a read while QSD went away, waits
until the driver has logged its rebuild and reports the volume healthy, then
is done again; bytes that differ from a read while QSD stayed up are lost
data. A VM volume has no guest here: its socket must answer a vhost-user
greeting.

Checked, and printed as PASS or FAIL (the exit status is 1 on any FAIL; a
check that could not be made, such as the leak check cut short, is a FAIL):

    every call answered a code the spec allows for its RPC (the fuzz test's
        table, `testing.helpers.fuzz_codes`, plus UNAVAILABLE while QSD or
        the driver is down)
    every step succeeded within the bound, retries included
    no synced data was lost, across the QSD kills too
    nothing leaked: no volume listed, no catalog row, no mount or loop device
        of the sandbox, no image in the pool, no export or node in QSD
    the kills happened and the driver recovered from each
    QSD went away only when the bench killed it (the driver's event=qsd_lost)

Printed: per RPC the OK calls, p50/p99/max latency of the answers, retries,
the slowest step (retries included) and the non-OK codes seen. Not run in CI.

    .venv/bin/python -m e2e.bench.load [--clients 16] [--seconds 300] [--dwell 1] [--bound 60]
        [--qsd-kills 2] [--kind filesystem|block|vhost-user-blk ...] [--driver-log FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import logging
import mmap
import os
import shutil
import signal
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc

from csi_qsd.cli.client import CSIClient
from csi_qsd.publish.vhost_user import SOCKET_NAME
from csi_qsd.qsd.vhost_greeting import greet
from csi_qsd.sys import loop, mounts
from e2e.bench.control_plane import REQUIRED_TOOLS
from e2e.bench.latencies import Summary
from e2e.bench.report_tables import ms, table, verdict
from e2e.bench.restart import KINDS, SIZE, Kind
from e2e.bench.served_bench import ServedBench, bench_main, retrying
from e2e.bench.sizes import MIB
from testing.harness import Sandbox, qsd_pid, until, wait_new_qsd, wait_restored, write_synced
from testing.helpers.fuzz_codes import ALLOWED
from testing.leftovers import qsd_leftovers

T = TypeVar("T")
Code = grpc.StatusCode
# QSD and the driver are each down for a moment during the run, so every RPC may also answer
# UNAVAILABLE (kubelet and the provisioner retry it); everything else must be in the fuzz test's table.
RETRYABLE = {Code.UNAVAILABLE}
PAYLOAD = MIB
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 2.0
LIFECYCLE = ("CreateVolume", "NodeStageVolume", "NodePublishVolume", "NodeUnpublishVolume", "NodeUnstageVolume",
             "DeleteVolume")
DRIVER_KILL_AT = 0.75  # of the run; the QSD kills are spread evenly before it


def schedule(qsd_kills: int) -> list[tuple[float, str]]:
    """When each kill comes, as a fraction of the run: 2 QSD kills come at 1/4 and 1/2, the driver's at 3/4."""
    step = DRIVER_KILL_AT / (qsd_kills + 1)
    return [(step * (i + 1), "QSD") for i in range(qsd_kills)] + [(DRIVER_KILL_AT, "driver")]


class StepFailed(Exception):
    """A step that did not succeed within the bound; the client stops."""


@dataclasses.dataclass
class Series:
    """One RPC's (or data step's) answers: latencies of the successes, retries and the failures' codes."""

    latencies: list[float] = dataclasses.field(default_factory=list)  # ms, successful attempts
    retries: int = 0
    codes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    worst_step: float = 0.0  # s, from the first attempt to the success


@dataclasses.dataclass
class Kill:
    what: str
    at: float  # s into the run
    back: float = 0.0  # s until the new QSD runs / the new driver answers Probe
    recovered: float = 0.0  # s until the driver logged the rebuild (QSD kills)
    problem: str = ""


@dataclasses.dataclass
class QSDEvents:
    """QSD losses and rebuilds as the driver logs them, read on demand from where the last read stopped."""

    log: Path
    offset: int = 0
    lost: int = 0  # event=qsd_lost: the driver saw QSD go away (killed here, or died on its own)
    rebuilt: int = 0  # event=qsd_recovered: a new QSD runs and every volume is rebuilt

    def poll(self) -> "QSDEvents":
        with contextlib.suppress(FileNotFoundError), open(self.log, "rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
            chunk = chunk[:chunk.rfind(b"\n") + 1]  # whole lines only
            self.offset += len(chunk)
            self.lost += chunk.count(b"event=qsd_lost")
            self.rebuilt += chunk.count(b"event=qsd_recovered")
        return self

    def restarted(self) -> None:
        """The driver was started again and answers Probe: a rebuild the old one was cut off in is the new one's."""
        self.poll()
        self.rebuilt = max(self.rebuilt, self.lost)

    @property
    def steady(self) -> bool:
        return self.poll().rebuilt >= self.lost


class Load(ServedBench):
    """One run: the sandbox, the served driver, the clients, the kills and what they saw."""

    def __init__(self, box: Sandbox, clients: int, seconds: float, dwell: float, bound: float,
                 kinds: tuple[Kind, ...] = KINDS, qsd_kills: int = 2) -> None:
        super().__init__(box)
        self.client_timeout = bound
        self.qsd_kills = qsd_kills
        self.kinds = kinds
        self.clients = clients
        self.seconds = seconds
        self.dwell = dwell
        self.bound = bound
        self.series: dict[str, Series] = collections.defaultdict(Series)
        self.failures: dict[str, list[str]] = collections.defaultdict(list)  # by check: spec, step, data, kill
        self.leaks: list[str] = []
        self.leak_check: BaseException | str | None = "it did not run"  # None once it ran to the end
        self.kills: list[Kill] = []
        self.lifecycles: collections.Counter[str] = collections.Counter()
        self.checked: collections.Counter[str] = collections.Counter()  # data checks by kind
        self.across_qsd = 0  # data checks with a QSD restart between the sync and the read
        self.across_driver = 0
        self.written: dict[str, bytes] = {}  # volume ID -> the bytes synced to it and not yet read back
        self.events = QSDEvents(self.driver.log_path)
        self.driver_kills = 0
        self.loops_seen: set[Path] = set()
        self.started = 0.0
        self.elapsed = 0.0
        self.io = concurrent.futures.ThreadPoolExecutor(clients + 2, thread_name_prefix="load-io")

    # the run --------------------------------------------------------------

    async def phases(self, csi: CSIClient) -> None:
        self.started = time.monotonic()
        await asyncio.gather(self._kills(), *(self._client(csi, i) for i in range(self.clients)))
        self.elapsed = time.monotonic() - self.started
        try:
            await self._check_leaks(csi)
            self.leak_check = None
        except BaseException as exc:
            self.leak_check = exc
            raise

    async def undo(self, csi: CSIClient) -> None:
        """Each client undid what it made, and the leak check says what is left."""
        self.io.shutdown(wait=False, cancel_futures=True)

    async def _client(self, csi: CSIClient, index: int) -> None:
        n = 0
        while time.monotonic() - self.started < self.seconds:
            kind, params, block = self.kinds[(index + n) % len(self.kinds)]
            try:
                await self._lifecycle(csi, f"pvc-load-{index:02d}-{n:05d}", kind, params, block, n)
            except StepFailed:
                return
            self.lifecycles[kind] += 1
            n += 1

    async def _lifecycle(self, csi: CSIClient, name: str, kind: str, params: dict[str, str], block: bool,
                         n: int) -> None:
        staging, target = self.box.staging(name), self.box.target(name)
        vid = ""
        done = False
        try:
            vid = (await self._step(csi, "CreateVolume", name,
                                    lambda: csi.create_volume(name, SIZE, params, block=block))).volume_id
            await self._step(csi, "NodeStageVolume", vid, lambda: csi.stage(vid, str(staging), block=block))
            await self._step(csi, "NodePublishVolume", vid,
                             lambda: csi.publish(vid, str(staging), str(target), block=block))
            if kind == "vhost-user-blk":
                await self._greet(vid, target)
            else:
                await self._write_and_verify(csi, vid, target, block, n)
            await self._step(csi, "NodeUnpublishVolume", vid, lambda: csi.unpublish(vid, str(target)))
            await self._step(csi, "NodeUnstageVolume", vid, lambda: csi.unstage(vid, str(staging)))
            await self._step(csi, "DeleteVolume", vid, lambda: csi.delete_volume(vid))
            done = True
        finally:
            if not done and vid:  # a failed step, or Ctrl-C: undo what is left, as the CO would
                await retrying(f"unpublish {vid}", lambda: csi.unpublish(vid, str(target)))
                await retrying(f"unstage {vid}", lambda: csi.unstage(vid, str(staging)))
                await retrying(f"delete {vid}", lambda: csi.delete_volume(vid))
            self.written.pop(vid, None)
            for empty in (staging, target.parent):
                with contextlib.suppress(OSError):
                    empty.rmdir()

    async def _step(self, csi: CSIClient, method: str, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """An RPC until it succeeds (bounded); a code outside the spec's table for it is a failure."""

        def code(exc: Exception) -> str:
            assert isinstance(exc, grpc.aio.AioRpcError)
            if exc.code() not in ALLOWED[method] | RETRYABLE:
                self._fail("spec", f"{method} {what}: {exc.code().name} is not a code the spec allows: "
                                   f"{exc.details()}")
            return str(exc.code().name)

        return await self._retried(method, what, call, grpc.aio.AioRpcError, code)

    async def _retried(self, label: str, what: str, call: Callable[[], Awaitable[T]], errors: type[Exception],
                       code: Callable[[Exception], str],
                       before_retry: Callable[[], Awaitable[None]] | None = None) -> T:
        """`call` until it succeeds, with a growing pause (then `before_retry`) between attempts, within the bound.

        Records the latency of the success, each failed attempt by `code(exc)`
        and the retries under `label`. Raises StepFailed after the bound.
        """
        series = self.series[label]
        first = time.monotonic()
        delay = BACKOFF_FIRST
        while True:
            attempt = time.perf_counter()
            try:
                result = await call()
            except errors as exc:
                name = code(exc)
                series.codes[name] += 1
                if time.monotonic() - first + delay > self.bound:
                    self._fail("step", f"{label} {what}: still {name} after {self.bound:g} s: {exc}")
                    raise StepFailed(label) from exc
                series.retries += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, BACKOFF_MAX)
                if before_retry is not None:
                    await before_retry()
                continue
            series.latencies.append((time.perf_counter() - attempt) * 1000)
            series.worst_step = max(series.worst_step, time.monotonic() - first)
            return result

    def _fail(self, check: str, message: str) -> None:
        line = f"{time.monotonic() - self.started:6.1f}s {message}"
        self.failures[check].append(line)
        print(f"FAIL {line}", file=sys.stderr, flush=True)

    # the data path --------------------------------------------------------

    async def _write_and_verify(self, csi: CSIClient, vid: str, target: Path, block: bool, n: int) -> None:
        payload = os.urandom(PAYLOAD)
        offset = (n % (SIZE // PAYLOAD - 1)) * PAYLOAD  # somewhere in the volume, never the same twice in a row
        if block:
            await self._io(csi, "write+fsync", vid, target, _write_device, target, payload, offset)
        else:
            await self._io(csi, "write+fsync", vid, target, _write_file, target / "data", payload)
        lost, driver_kills = self.events.poll().lost, self.driver_kills
        self.written[vid] = payload
        self._note_loops()
        await asyncio.sleep(self.dwell)  # the pod runs; a kill may come now
        kind = "block" if block else "filesystem"
        read: Callable[[], bytes] = (functools.partial(_read_device, target, offset, PAYLOAD) if block
                                     else (target / "data").read_bytes)
        first = time.monotonic()
        while True:
            await self._steady(csi, vid, target)
            before, pid = self.events.lost, qsd_pid(self.box)
            data = await self._io(csi, "read back", vid, target, read)
            if data == payload:
                break
            what = self._what_was_read(vid, data)
            if what.startswith("another volume"):
                self._fail("data", f"{kind} {vid} read {what}")
            await asyncio.sleep(1.0)  # let the driver log a QSD that died under the read
            if self.events.poll().lost == before and qsd_pid(self.box) == pid:
                self._fail("data", f"synced data lost on {kind} {vid}: read back {what} "
                                   f"({self.events.lost - lost} QSD restarts since the sync)")
                break
            # Read while QSD went away: read again once rebuilt.
            self.series["read back"].codes[f"stale: {what.split(' (')[0]}"] += 1
            if time.monotonic() - first > self.bound:
                self._fail("step", f"read back {vid}: QSD kept going away for {self.bound:g} s")
                raise StepFailed("read back")
        del self.written[vid]
        self.checked[kind] += 1
        self.across_qsd += self.events.lost != lost
        self.across_driver += self.driver_kills != driver_kills

    def _what_was_read(self, vid: str, data: bytes) -> str:
        """What a read that did not return the synced bytes returned instead, in a few words."""
        payload = self.written[vid]
        if len(data) < len(payload):
            return f"a short read ({len(data)} of {len(payload)} bytes)"
        if not data.strip(b"\0"):
            return "zeros"
        for other, theirs in self.written.items():
            blocks = {theirs[i:i + 4096] for i in range(0, len(theirs), 4096)}
            shared = sum(data[i:i + 4096] in blocks for i in range(0, len(data), 4096))
            if other != vid and shared:
                return f"another volume's data ({shared} of {len(data) // 4096} 4 KiB blocks from {other})"
        same = sum(1 for a, b in zip(data, payload) if a == b)
        return f"other bytes ({same} of {len(data)} equal to the synced ones)"

    async def _io(self, csi: CSIClient, label: str, vid: str, target: Path, fn: Callable[..., T], *args: object) -> T:
        """Blocking I/O off the loop; after an I/O error (QSD died under it) wait for the rebuild and redo it."""

        def run() -> Awaitable[T]:
            return asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

        try:
            return await self._retried(label, vid, run, OSError, _errno_name, lambda: self._steady(csi, vid, target))
        except StepFailed:
            self.failures["step"][-1] += f"; at the end {_describe_mount(target)}"
            raise

    async def _steady(self, csi: CSIClient, vid: str, target: Path) -> None:
        """Until the driver has rebuilt after every QSD loss it logged and reports the volume healthy."""
        try:
            await until(lambda: self.events.steady, "the driver's rebuild after QSD went away", self.bound)
            await wait_restored(csi, vid, target, self.bound)
        except AssertionError as exc:
            self._fail("step", f"{vid}: {exc}")
            raise StepFailed("recovery") from exc

    async def _greet(self, vid: str, target: Path) -> None:
        """A VM volume: the published socket answers a vhost-user greeting (retried over a QSD restart)."""
        socket = target / SOCKET_NAME

        async def answered() -> None:
            if not await greet(socket, timeout=5):
                raise OSError(errno.ECONNREFUSED, f"no vhost-user answer on {socket}")

        await self._retried("vhost-user greeting", vid, answered, OSError, lambda exc: "no answer")
        self.checked["vhost-user-blk"] += 1

    def _note_loops(self) -> None:
        """Remember the loop devices of our volumes: one left attached over a dead export shows no backing file."""
        self.loops_seen |= {lp.device for lp in loop.loop_devices() if self.box.root in lp.backing_file.parents}

    # the kills ------------------------------------------------------------

    async def _kills(self) -> None:
        for fraction, what in schedule(self.qsd_kills):
            await asyncio.sleep(max(0.0, self.started + fraction * self.seconds - time.monotonic()))
            kill = Kill(what, time.monotonic() - self.started)
            self.kills.append(kill)
            print(f"{kill.at:6.1f}s SIGKILL {what}", file=sys.stderr, flush=True)
            try:
                if what == "QSD":
                    await self._kill_qsd(kill)
                else:
                    await self._kill_driver(kill)
            except (AssertionError, RuntimeError) as exc:
                kill.problem = str(exc)[:300]
                self._fail("kill", f"SIGKILL {what}: {kill.problem}")

    async def _kill_qsd(self, kill: Kill) -> None:
        self._note_loops()
        self._driver_alive()
        pid = qsd_pid(self.box)
        if pid is None:
            raise RuntimeError("no QSD runs")
        rebuilt = self.events.poll().rebuilt
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        await wait_new_qsd(self.box, pid, self.bound)
        kill.back = time.monotonic() - t0
        await until(lambda: self.events.poll().rebuilt > rebuilt, "event=qsd_recovered in the driver log",
                    self.bound)
        kill.recovered = time.monotonic() - t0

    async def _kill_driver(self, kill: Kill) -> None:
        self._driver_alive()
        pid = qsd_pid(self.box)
        self.driver_kills += 1
        await self.driver.kill9()
        t0 = time.monotonic()
        await self.driver.start(timeout=self.bound)
        kill.back = time.monotonic() - t0
        self.events.restarted()
        if qsd_pid(self.box) != pid:
            raise RuntimeError(f"the restarted driver replaced QSD {pid} instead of adopting it")

    def _driver_alive(self) -> None:
        proc = self.driver.proc
        if proc is None or proc.returncode is not None:
            raise RuntimeError(f"the driver exited on its own: {self.driver.log()[-2000:]}")

    # leaks ----------------------------------------------------------------

    async def _check_leaks(self, csi: CSIClient) -> None:
        """After every client is done: nothing the run made may be left anywhere."""
        volumes = await self._step(csi, "ListVolumes", "(all)", csi.list_volumes)
        self.leaks += [f"volume listed: {v.volume_id}" for v in volumes]
        self._driver_alive()
        await self.driver.stop()
        root, state = self.box.root, self.box.state_dir
        self.leaks += [f"mount: {e.mount_point} ({e.fs_type})" for e in mounts.mount_table()
                       if root in e.mount_point.parents]
        self._note_loops()
        attached = {lp.device: lp.backing_file for lp in loop.loop_devices()}
        self.leaks += [f"loop device: {device} over {attached[device]}" for device in sorted(self.loops_seen)
                       if device in attached and (root in attached[device].parents or attached[device] == Path("/"))]
        self.leaks += [f"image in the pool: {p.name}" for p in (state / "pool").iterdir()
                       if p.name.startswith(("vol-", "snap-"))]
        with sqlite3.connect(f"file:{state / 'catalog.db'}?mode=ro", uri=True) as db:
            for name in ("volumes", "stages", "publishes"):
                count = db.execute(f"SELECT COUNT(*) FROM {name}").fetchone()[0]  # noqa: S608 - fixed names
                self.leaks += [f"{count} rows in catalog table {name}"] if count else []
        if qsd_pid(self.box) is None:
            self.leaks.append("QSD is not running at the end (the driver should leave it serving)")
            return
        exports, nodes = await qsd_leftovers(state)
        self.leaks += [f"QSD export: {e}" for e in sorted(exports)] + [f"QSD node: {n}" for n in sorted(nodes)]


# I/O, run in threads ---------------------------------------------------------------


def _write_file(path: Path, data: bytes) -> None:
    """Write and fsync, then drop the file's clean pages so the read back comes from the volume."""
    write_synced(path, data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_device(device: Path, data: bytes, offset: int) -> None:
    with open(device, "r+b", buffering=0) as f:
        os.pwrite(f.fileno(), data, offset)
        os.fsync(f.fileno())


def _describe_mount(path: Path) -> str:
    """What is mounted at `path` and what is inside, for the report of a failed data step."""
    entry = mounts.mounted_at(path)
    if entry is None:
        return f"{path} is not a mount point"
    try:
        inside = sorted(p.name for p in path.iterdir())[:10] if path.is_dir() else ["(device)"]
    except OSError as exc:
        inside = [repr(exc)]
    return f"{path} has {entry.fs_type} from {entry.source} (root {entry.root}) holding {inside}"


def _errno_name(exc: Exception) -> str:
    return errno.errorcode.get(getattr(exc, "errno", None) or 0, type(exc).__name__)


def _read_device(device: Path, offset: int, length: int) -> bytes:
    """Read with O_DIRECT (into a page-aligned buffer), so the bytes come from QSD, not the page cache."""
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
    try:
        with mmap.mmap(-1, length) as buffer:
            got = os.preadv(fd, [buffer], offset)
            return bytes(buffer[:got])
    finally:
        os.close(fd)


# the report -------------------------------------------------------------------------


def report(load: Load) -> tuple[str, bool]:
    """The figures and the checks, and whether every check passed."""
    out = [f"csi-qsd load: {load.clients} clients for {load.seconds:g} s ({load.elapsed:.0f} s with the last "
           f"lifecycles), {', '.join(k for k, _, _ in load.kinds)} volumes in turn (qcow2, {SIZE // MIB} MiB), "
           f"dwell {load.dwell:g} s; {os.cpu_count()} CPUs", ""]
    rows = []
    order = [*LIFECYCLE, "ListVolumes", "write+fsync", "read back", "vhost-user greeting"]
    for name in [n for n in order if n in load.series]:
        s = load.series[name]
        codes = ", ".join(f"{code} {count}" for code, count in s.codes.most_common()) or "-"
        if s.latencies:
            summary = Summary.of(s.latencies)
            rows.append([name, str(summary.count), ms(summary.p50), ms(summary.p99), ms(summary.max),
                         str(s.retries), f"{s.worst_step:.1f}", codes])
        else:
            rows.append([name, "0", "-", "-", "-", str(s.retries), "-", codes])
    out.append(table(["RPC / data step", "OK", "p50 ms", "p99 ms", "max ms", "retries", "slowest step s",
                      "failed attempts by code"], rows))
    out.append("")
    if load.kills:
        out.append(table(["kill", "at s", "back s", "rebuilt s", "problem"], [
            [f"SIGKILL {k.what}", f"{k.at:.1f}", f"{k.back:.1f}", f"{k.recovered:.1f}" if k.what == "QSD" else "-",
             k.problem or "-"] for k in load.kills]))
        out.append("(back: a new QSD runs / the new driver answers Probe; rebuilt: the driver logged qsd_recovered)")
        out.append("")
    calls = sum(len(load.series[m].latencies) + sum(load.series[m].codes.values()) for m in LIFECYCLE)
    retries = sum(s.retries for s in load.series.values())
    out.append(f"lifecycles completed: {sum(load.lifecycles.values())} "
               f"({', '.join(f'{k} {n}' for k, n in sorted(load.lifecycles.items())) or 'none'}); "
               f"{calls} lifecycle calls, {retries} retries in all")
    out.append(f"data checks: {', '.join(f'{k} {n}' for k, n in sorted(load.checked.items())) or 'none'}; "
               f"{load.across_qsd} across a QSD restart, {load.across_driver} across a driver restart")
    out.append("")
    failed = load.failures
    qsd_kills = sum(1 for k in load.kills if k.what == "QSD")
    unbidden = load.events.poll().lost - qsd_kills

    def nothing_leaked() -> bool:
        if load.leak_check is not None:
            raise RuntimeError(f"the leak check did not finish: {load.leak_check!r}")
        return not load.leaks

    checks: list[tuple[str, Callable[[], bool], str]] = [
        ("every call answered a code the spec allows", lambda: not failed["spec"],
         f"{calls} lifecycle calls, {len(failed['spec'])} answers outside"),
        ("every step succeeded within the bound (retries included)", lambda: not failed["step"],
         f"{retries} retries, {len(failed['step'])} steps failed"),
        ("no synced data lost", lambda: not failed["data"],
         f"{sum(load.checked.values())} checks, {load.across_qsd} across a QSD restart, {len(failed['data'])} lost"),
        ("nothing leaked", nothing_leaked, "; ".join(load.leaks[:10]) or "volumes, catalog, mounts, loops, pool, "
         "QSD exports and nodes all empty"),
        ("kills done and recovered", lambda: len(load.kills) == len(schedule(load.qsd_kills)) and not failed["kill"],
         ", ".join(f"{k.what} at {k.at:.0f} s" for k in load.kills) or "none"),
        ("QSD went away only when killed", lambda: unbidden == 0,
         f"{load.events.lost} QSD restarts seen by the driver, {qsd_kills} of them SIGKILLs from the bench"),
    ]
    verdicts = [verdict(test, "FAIL") for _, test, _ in checks]
    for (label, _, detail), said in zip(checks, verdicts):
        out.append(f"{said}  {label}: {detail}")
    for check, lines in failed.items():
        out += [f"  {check}: {line[:400]}" for line in lines[:10]]
    return "\n".join(out), all(said == "PASS" for said in verdicts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.load", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=300.0, help="how long clients start new lifecycles")
    parser.add_argument("--dwell", type=float, default=1.0, help="seconds between the sync and the read back")
    parser.add_argument("--bound", type=float, default=60.0, help="seconds a step may take, retries included")
    parser.add_argument("--qsd-kills", type=int, default=2, help="SIGKILL QSD this many times before the driver")
    parser.add_argument("--kind", choices=[k for k, _, _ in KINDS], action="append",
                        help="only volumes of this kind (repeatable; default: all three in turn)")
    parser.add_argument("--driver-log", type=Path, help="keep a copy of the driver's log here")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0 or args.qsd_kills < 0:
        parser.error("--clients and --seconds must be positive, --qsd-kills at least 0")
    # The greeting helper warns of each refused connection; here they are counted instead.
    logging.getLogger("csi_qsd.qsd.vhost_greeting").setLevel(logging.ERROR)
    kinds = tuple(k for k in KINDS if not args.kind or k[0] in args.kind)
    passed: list[bool] = []

    def summary(load: Load) -> str:
        if args.driver_log is not None and load.driver.log_path.exists():
            shutil.copyfile(load.driver.log_path, args.driver_log)
        text, ok = report(load)
        passed.append(ok)
        return text

    status = bench_main(lambda box: Load(box, args.clients, args.seconds, args.dwell, args.bound, kinds,
                                         args.qsd_kills), summary, tools=REQUIRED_TOOLS, what="load bench")
    return status or (0 if passed[0] else 1)


if __name__ == "__main__":
    sys.exit(main())
