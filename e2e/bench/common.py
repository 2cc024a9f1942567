"""Shared by the benchmarks: timing, percentiles, process memory, plain tables, fio, and the served-driver skeleton.

Benchmarks print every figure beside a baseline measured in the same run.
The measuring and formatting helpers never decide pass or fail; `verdict`
turns a check into PASS, MISS or, when the check itself raised, FAIL.
`ServedBench` is the skeleton of a bench against `csi-qsd serve`: start it,
open a client, run the phases, undo what they left, stop it and its QSDs;
`bench_main` runs one in a sandbox and prints its report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from csi_qsd.cli.client import CSIClient
from csi_qsd.sys import filesystems
from csi_qsd.sys.run import run
from tests.harness import DriverProcess, Sandbox, qsd_pids, sandbox

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between ranks like numpy's default.

    Raises ValueError for no samples or q outside 0..100.
    """
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclasses.dataclass(frozen=True)
class Summary:
    """p50, p99 and max of one series of latencies, in milliseconds."""

    count: int
    p50: float
    p99: float
    max: float
    slowest: int  # index of the slowest sample, to find it in logs

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Summary":
        worst = max(range(len(samples)), key=samples.__getitem__)
        return cls(len(samples), percentile(samples, 50), percentile(samples, 99), samples[worst], worst)


@contextlib.contextmanager
def timed(samples: list[float]) -> Iterator[None]:
    """Append the block's wall time in milliseconds to `samples`, if the block succeeds."""
    start = time.perf_counter()
    yield
    samples.append((time.perf_counter() - start) * 1000)


def status_field_kib(pid: int, field: str = "VmRSS") -> int:
    """A `kB` field of /proc/<pid>/status (VmRSS by default), in KiB. Raises OSError if gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/{pid}/status has no {field}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, all its threads. Raises OSError if gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True)
class MachineCPU:
    """The whole machine's busy and total CPU time (/proc/stat's first line) at one moment."""

    busy: float
    total: float

    @classmethod
    def take(cls) -> "MachineCPU":
        ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = ticks[3] + ticks[4]  # idle and iowait: nothing ran
        hz = os.sysconf("SC_CLK_TCK")
        return cls((sum(ticks) - idle) / hz, sum(ticks) / hz)

    def busy_cores_since(self, before: "MachineCPU") -> float:
        """How many of the machine's cores were busy since `before`, on average."""
        return (self.busy - before.busy) / max(self.total - before.total, 1e-9) * (os.cpu_count() or 1)


async def cpu_share(pid: int, work: Awaitable[float], runtime: float) -> tuple[float, float]:
    """`work`'s result and the share of one CPU that process `pid` used meanwhile."""
    before = cpu_seconds(pid)
    value = await work
    return value, (cpu_seconds(pid) - before) / runtime


@dataclasses.dataclass(frozen=True)
class ThreadCPU:
    """CPU seconds of a process and of each of its live threads (/proc/PID/task/*/stat) at one moment."""

    pid: int
    at: float
    total: float
    threads: dict[int, tuple[str, float]]  # tid -> (name, seconds)

    @classmethod
    def take(cls, pid: int) -> "ThreadCPU":
        """Raises OSError if the process is gone; threads that exit while being read are left out."""
        tick = os.sysconf("SC_CLK_TCK")
        own = Path(f"/proc/{pid}/comm").read_text().strip()
        threads: dict[int, tuple[str, float]] = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                fields = (task / "stat").read_text().rpartition(")")[2].split()
                name = (task / "comm").read_text().strip()
            except OSError:
                continue
            tid = int(task.name)
            # QEMU 11 names its threads ("IO iothread0", "call_rcu"); 10.0 leaves the loader's name on all.
            label = "main" if tid == pid else name if name != own else f"t{tid - pid}"
            threads[tid] = (label, (int(fields[11]) + int(fields[12])) / tick)
        return cls(pid, time.monotonic(), cpu_seconds(pid), threads)

    def busiest_since(self, before: "ThreadCPU") -> float:
        """The share of one CPU the busiest thread used since `before`."""
        seconds = max(self.at - before.at, 1e-9)
        return max(((now - before.threads.get(tid, (name, 0.0))[1]) / seconds
                    for tid, (name, now) in self.threads.items()), default=0.0)

    def since(self, before: "ThreadCPU", *, floor: float = 0.03, limit: int = 4) -> str:
        """Each thread's share of one CPU since `before`, busiest first ('main 0.98 IO iothread0 0.41 ...').

        Threads under `floor`, and past the `limit` busiest, are summed as 'other'; threads that exited meanwhile (QEMU's thread-pool
        workers come and go) as 'exited', from the process total.
        """
        seconds = max(self.at - before.at, 1e-9)
        by_name: dict[str, list[float]] = {}  # threads of one name (QEMU's "worker"s) summed
        for tid, (name, now) in self.threads.items():
            was = before.threads.get(tid, (name, 0.0))[1]
            by_name.setdefault(name, []).append((now - was) / seconds)
        shares = [(name if len(values) == 1 else f"{name} x{len(values)}", sum(values))
                  for name, values in by_name.items()]
        live = sum(share for _, share in shares)
        exited = max((self.total - before.total) / seconds - live, 0.0)
        shares.sort(key=lambda item: -item[1])
        listed = [(name, share) for name, share in shares if share >= floor][:limit]
        shown = [f"{name} {share:.2f}" for name, share in listed]
        rest = live - sum(share for _, share in listed)
        if rest >= 0.01:
            shown.append(f"other {rest:.2f}")
        if exited >= 0.01:
            shown.append(f"exited {exited:.2f}")
        return ", ".join(shown) or "idle"


def open_fds(pid: int) -> int:
    """How many file descriptors process `pid` holds (a leak shows up here first)."""
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def ratio(value: float, baseline: float) -> str:
    """`value / baseline` as '12.3x' (two significant digits under 0.1: '0.0012x'), or '-' when the baseline is zero."""
    if baseline <= 0:
        return "-"
    r = value / baseline
    return f"{r:.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 10 else f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def figure(value: float) -> str:
    """IOPS or MiB/s: whole above 100, else one decimal."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def ms(value: float) -> str:
    return f"{value:.0f}" if value >= 1000 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        out = [str(cells[0]).ljust(widths[0])]
        out += [str(cell).rjust(width) for cell, width in zip(cells[1:], widths[1:])]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def sh(*argv: str) -> str:
    """Run a host command for a baseline; raise with its stderr if it fails."""
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def write_direct(device: Path, offsets: Iterable[int], size: int) -> None:
    """`size` bytes of random data at each of `offsets` of `device` (O_DIRECT, no two alike), then one fsync."""
    with mmap.mmap(-1, size) as buffer:  # page-aligned, as O_DIRECT needs
        buffer.write(os.urandom(size))
        fd = os.open(device, os.O_WRONLY | os.O_DIRECT)
        try:
            for i, offset in enumerate(offsets):
                buffer[:8] = i.to_bytes(8, "little")
                os.pwrite(fd, buffer, offset)
            os.fsync(fd)
        finally:
            os.close(fd)


async def output(*argv: str, timeout: float = 1800) -> str:
    """A host command's stdout, run as the driver runs its tools (`csi_qsd.sys.run`: C locale, HostCommandError)."""
    return (await run(*argv, timeout=timeout))[1]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def verdict(test: Callable[[], object], miss: str = "MISS") -> str:
    """PASS if `test()` holds, else `miss`; FAIL (with why) if the check itself raised: it never passes unrun."""
    try:
        return "PASS" if test() else miss
    except Exception as exc:
        return f"FAIL (the check raised {exc!r})"


def measured(value: float | None, what: str) -> float:
    """`value`, for a check; raises RuntimeError if it was never measured (the check then prints FAIL)."""
    if value is None:
        raise RuntimeError(f"{what} was not measured")
    return value


# --- cleanup shared by the benchmarks that serve the driver ---------------------------


async def retrying(what: str, call: Callable[[], Awaitable[object]], attempts: int = 20) -> None:
    """Run a cleanup call, retrying while the object is busy (a call cut short may still run)."""
    for attempt in range(attempts):
        try:
            await call()
            return
        except grpc.aio.AioRpcError as exc:
            busy = exc.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)
            if busy and attempt + 1 < attempts:
                await asyncio.sleep(0.5)
                continue
            print(f"cleanup: {what} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return


async def stop_driver_and_qsd(driver: DriverProcess) -> None:
    """Stop the served driver, then its QSDs (every shard): SIGTERM, wait, SIGKILL."""
    await driver.stop()
    for pid in qsd_pids(driver.box.state_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break
            await asyncio.sleep(0.1)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class Job:
    """One fio job: its name, I/O pattern, block size and queue depth."""

    name: str
    rw: str
    bs: str
    iodepth: int

    @property
    def sequential(self) -> bool:
        return self.rw in ("read", "write")

    @property
    def writes(self) -> bool:
        return "write" in self.rw

    @property
    def label(self) -> str:
        return f"{self.name} ({'MiB/s' if self.sequential else 'IOPS'})"


async def fio(job: Job, *files: Path, runtime: float = 0, size: int = 0, offset: int = 0,
              extra: Sequence[str] = ()) -> float:
    """`job` on every file at once (O_DIRECT, libaio, a job per file, one report): MiB/s if sequential, else IOPS.

    `runtime` seconds (0: until `size` bytes are done, the whole file if 0),
    from `offset`. Raises HostCommandError if fio fails, RuntimeError if a job did.
    """
    argv = ["fio", "--output-format=json", "--group_reporting", "--direct=1", "--ioengine=libaio",
            f"--rw={job.rw}", f"--bs={job.bs}", f"--iodepth={job.iodepth}", "--randrepeat=0", "--norandommap",
            f"--offset={offset}", *([f"--size={size}"] if size else []), *extra]
    if runtime:
        argv += ["--time_based", f"--runtime={round(runtime * 1000)}ms"]
    for index, path in enumerate(files):
        argv += [f"--name=j{index}", f"--filename={path}"]
    report = json.loads(await output(*argv))["jobs"][0]
    if report.get("error"):
        raise RuntimeError(f"fio {job.name} on {', '.join(map(str, files))} failed with error {report['error']}")
    read, write = report["read"], report["write"]
    if job.sequential:
        return float(read["bw_bytes"] + write["bw_bytes"]) / MIB
    return float(read["iops"] + write["iops"])


LAY_OUT = Job("lay out", "write", "1M", 8)


async def lay_out(path: Path, size: int, offset: int = 0) -> None:
    """Write [offset, offset+size) of `path` once, 1 MiB at a time, and flush: later jobs measure allocated data."""
    await fio(LAY_OUT, path, size=size, offset=offset, extra=["--end_fsync=1"])


# --- loop devices and filesystems for the baselines --------------------------------------


@contextlib.asynccontextmanager
async def loop_device(backing: Path, *, direct: bool = True, window: tuple[int, int] | None = None,
                      ) -> AsyncIterator[Path]:
    """A loop device over `backing` (its (offset, length) `window`), direct I/O or buffered; detached on exit."""
    carve = [f"--offset={window[0]}", f"--sizelimit={window[1]}"] if window else []
    device = Path((await output("losetup", "--find", "--show", f"--direct-io={'on' if direct else 'off'}",
                                *carve, str(backing))).strip())
    try:
        yield device
    finally:
        await run("losetup", "--detach", str(device), check=False)


@contextlib.asynccontextmanager
async def raw_file(path: Path, size: int) -> AsyncIterator[Path]:
    """A file of `size` bytes allocated at `path` (fallocate), as a baseline's backing; removed on exit."""
    await output("fallocate", "-l", str(size), str(path))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def ext4_on(device: Path, mountpoint: Path) -> AsyncIterator[Path]:
    """ext4 made as the driver makes it, mounted at `mountpoint`, unmounted on exit."""
    await filesystems.make(device, "ext4")
    mountpoint.mkdir(parents=True, exist_ok=True)
    await output("mount", str(device), str(mountpoint))
    try:
        yield mountpoint
    finally:
        await output("umount", str(mountpoint))


def loop_mode_of(path: Path) -> str:
    """'direct (loopN)' or 'buffered (loopN)': the loop device a block device file or a mounted directory sits on."""
    st = os.stat(path)
    dev = st.st_rdev if path.is_block_device() or not path.is_dir() else st.st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    try:
        dio = (sysfs / "loop" / "dio").read_text().strip()
        name = sysfs.resolve().name
    except OSError:
        return "not a loop device"
    return f"{'direct' if dio == '1' else 'buffered'} ({name})"


# --- volumes through the driver, and the skeleton of a bench that serves it ---------------


@dataclasses.dataclass(frozen=True)
class Staged:
    """A volume made, staged and (unless it is not) published through CSI, as kubelet lays out its paths."""

    id: str
    staging: Path
    target: Path


async def stage(csi: CSIClient, box: Sandbox, name: str, size: int, parameters: Mapping[str, str] | None = None,
                *, block: bool = False, fs_type: str = "", publish: bool = True,
                made: dict[str, Staged] | None = None, secrets: dict[str, str] | None = None) -> Staged:
    """CreateVolume, NodeStageVolume and NodePublishVolume (unless not `publish`) of a volume named `name`.

    `made` records the volume as soon as it exists, so a failure in between still leaves it to undo;
    `secrets` go with the create and the stage (an encrypted volume's key).
    """
    vid = (await csi.create_volume(name, size, dict(parameters or {}), block=block, fs_type=fs_type,
                                   secrets=secrets)).volume_id
    volume = Staged(vid, box.staging(name), box.target(name))
    if made is not None:
        made[vid] = volume
    await csi.stage(vid, str(volume.staging), block=block, fs_type=fs_type, secrets=secrets)
    if publish:
        await csi.publish(vid, str(volume.staging), str(volume.target), block=block, fs_type=fs_type)
    return volume


async def release(csi: CSIClient, volume: Staged, *, delete: bool = True) -> None:
    """NodeUnpublishVolume, NodeUnstageVolume and (if `delete`) DeleteVolume of `volume`."""
    await csi.unpublish(volume.id, str(volume.target))
    await csi.unstage(volume.id, str(volume.staging))
    if delete:
        await csi.delete_volume(volume.id)


class ServedBench:
    """One run against `csi-qsd serve` as a process: start it, open a client, run `phases`, undo, stop it and its QSDs.

    Whatever happened, `undo` unpublishes and unstages every volume in
    `staged` and deletes, newest first, every volume and snapshot in
    `volumes` and `snapshots` or still listed by the driver, as kubelet and
    the provisioner would; then the driver and every QSD shard are stopped.
    """

    client_timeout = 600.0

    def __init__(self, box: Sandbox, *driver_args: str) -> None:
        self.box = box
        self.driver = DriverProcess(box, "--log-level", "info", *driver_args)
        self.staged: dict[str, Staged] = {}
        self.volumes: list[str] = []
        self.snapshots: list[str] = []

    async def run(self) -> None:
        await self.driver.start(timeout=60)
        try:
            async with CSIClient(self.box.endpoint, timeout=self.client_timeout) as csi:
                try:
                    await self.phases(csi)
                finally:
                    await self.undo(csi)
        finally:
            await stop_driver_and_qsd(self.driver)

    async def phases(self, csi: CSIClient) -> None:
        raise NotImplementedError

    async def stage(self, csi: CSIClient, name: str, size: int, parameters: Mapping[str, str] | None = None,
                    *, block: bool = False, fs_type: str = "", publish: bool = True,
                    secrets: dict[str, str] | None = None) -> Staged:
        """`stage` of a volume this run undoes."""
        volume = await stage(csi, self.box, name, size, parameters, block=block, fs_type=fs_type, publish=publish,
                             made=self.staged, secrets=secrets)
        self.volumes.append(volume.id)
        return volume

    async def undo(self, csi: CSIClient) -> None:
        for vid, volume in reversed(list(self.staged.items())):
            await retrying(f"unpublish {vid}", lambda: csi.unpublish(vid, str(volume.target)))
            await retrying(f"unstage {vid}", lambda: csi.unstage(vid, str(volume.staging)))
        self.staged.clear()
        with contextlib.suppress(grpc.aio.AioRpcError):  # a call cut short may have made one we never heard of
            known = {v.volume_id for v in await csi.list_volumes()}
            self.volumes += sorted(known - set(self.volumes))
        for vid in reversed(self.volumes):
            await retrying(f"delete volume {vid}", lambda: csi.delete_volume(vid))
        self.volumes.clear()
        with contextlib.suppress(grpc.aio.AioRpcError):
            known = {s.snapshot_id for s in await csi.list_snapshots()}
            self.snapshots += sorted(known - set(self.snapshots))
        for sid in reversed(self.snapshots):
            await retrying(f"delete snapshot {sid}", lambda: csi.delete_snapshot(sid))
        self.snapshots.clear()


B = TypeVar("B", bound=ServedBench)


def missing(*tools: str) -> str:
    """Why this machine cannot run a bench that serves the driver, printed ('' if it can): root, /dev/fuse, `tools`."""
    absent = [tool for tool in tools if shutil.which(tool) is None]
    problem = ("run as root: the bench stages volumes (FUSE exports, loop devices, mounts)" if os.geteuid() != 0
               else f"needs /dev/fuse and {', '.join(absent) or 'nothing else'}"
               if absent or not Path("/dev/fuse").exists() else "")
    if problem:
        print(problem, file=sys.stderr)
    return problem


def bench_main(make: Callable[[Sandbox], B], report: Callable[[B], str], *, tools: Sequence[str] = (),
               what: str = "benchmark", log_tail: int | None = 4000) -> int:
    """Run `make(box)`'s bench in a fresh sandbox and print `report(bench)`, partial results too, and the wall time.

    The exit status: 2 if this machine cannot run it, else `run_to_end`'s.
    """
    if missing(*tools):
        return 2
    started = time.monotonic()
    with sandbox() as box:
        bench = make(box)
        status = run_to_end(bench.run(), bench.driver, what=what, log_tail=log_tail)
        print(report(bench), flush=True)
    print(f"wall time {time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    return status


def rerun_unshared(module: str, argv: Sequence[str] | None, first: str = "true") -> int | None:
    """`python -m module argv` (this bench's own arguments if None) again in a private mount namespace, after
    shell command `first` there: its exit status; None in that run itself. No namespace made meanwhile copies
    its mounts."""
    if os.environ.get("CSI_QSD_BENCH_UNSHARED"):
        return None
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", f'{first} && exec "$@"', "sh",
               sys.executable, "-m", module, *(sys.argv[1:] if argv is None else argv)]
    env = dict(os.environ, CSI_QSD_BENCH_UNSHARED="1")
    return subprocess.run(command, env=env, check=False).returncode


def run_to_end(work: Coroutine[Any, Any, object], driver: DriverProcess, *, what: str = "benchmark",
               log_tail: int | None = 4000) -> int:
    """Run a bench in its own event loop; its exit status: 0, 1 (failed: the driver log's tail printed), 130.

    The driver is SIGKILLed afterwards whatever happened: it runs in its own
    session and would outlive us. `log_tail` None prints the whole log.
    """
    try:
        asyncio.run(work)
        return 0
    except KeyboardInterrupt:
        print("interrupted: cleaned up; partial results follow", file=sys.stderr)
        return 130
    except Exception as exc:
        log = driver.log() if log_tail is None else driver.log()[-log_tail:]
        print(f"{what} failed: {exc!r}\n--- driver log (tail) ---\n{log}", file=sys.stderr)
        return 1
    finally:
        kill_driver(driver)


def log_problems(driver: DriverProcess) -> str:
    """How many warnings and errors the driver logged, and the first five."""
    lines = driver.log().splitlines() if driver.log_path.exists() else []
    problems = [line for line in lines if "level=WARNING" in line or "level=ERROR" in line]
    return f"driver log: {len(problems)} warning/error lines" + "".join(f"\n  {line[:200]}" for line in problems[:5])


def logged(driver: DriverProcess, event: str) -> dict[str, str]:
    """The key=value fields of the driver's last `event=<event>` log line; {} if it logged none."""
    lines = [line.split() for line in driver.log().splitlines() if f"event={event}" in line.split()]
    return dict(field.split("=", 1) for field in lines[-1] if "=" in field) if lines else {}


def kill_driver(driver: DriverProcess) -> None:
    """Last resort after a second Ctrl-C: the driver runs in its own session and would survive us."""
    proc = driver.proc
    if proc is not None and proc.returncode is None and Path(f"/proc/{proc.pid}").exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
