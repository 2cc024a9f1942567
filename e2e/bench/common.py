"""Shared helpers for the benchmarks: timing, percentiles, process memory and plain tables.

Benchmarks print every figure beside a baseline measured in the same run;
these helpers only measure and format. They never decide pass or fail, and
never start or stop anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from tests.harness import DriverProcess, qsd_pids

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


async def cpu_share(pid: int, work: Awaitable[float], runtime: int) -> tuple[float, float]:
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
    """`value / baseline` as '12.3x', or '-' when the baseline is zero."""
    if baseline <= 0:
        return "-"
    r = value / baseline
    return f"{r:.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


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


def run_to_end(run: Coroutine[Any, Any, object], driver: DriverProcess, *, what: str = "benchmark",
               log_tail: int | None = 4000) -> int:
    """Run a bench in its own event loop; its exit status: 0, 1 (failed: the driver log's tail printed), 130.

    The driver is SIGKILLed afterwards whatever happened: it runs in its own
    session and would outlive us. `log_tail` None prints the whole log.
    """
    try:
        asyncio.run(run)
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


def log_problems(driver: DriverProcess) -> list[str]:
    """The driver log's warnings and errors."""
    if not driver.log_path.exists():
        return []
    return [line for line in driver.log_path.read_text(errors="replace").splitlines()
            if "level=WARNING" in line or "level=ERROR" in line]


def kill_driver(driver: DriverProcess) -> None:
    """Last resort after a second Ctrl-C: the driver runs in its own session and would survive us."""
    proc = driver.proc
    if proc is not None and proc.returncode is None and Path(f"/proc/{proc.pid}").exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
