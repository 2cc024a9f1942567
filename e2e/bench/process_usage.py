"""What a process uses, read from /proc: memory, CPU time (per thread too), file descriptors, and the
machine's busy cores.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path


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

    def shares_since(self, before: "ThreadCPU", label: Callable[[str], str] = lambda name: name) -> dict[str, float]:
        """Each live thread's share of one CPU since `before`, summed by `label(thread name)`."""
        seconds = max(self.at - before.at, 1e-9)
        shares: dict[str, float] = {}
        for tid, (name, now) in self.threads.items():
            key = label(name)
            shares[key] = shares.get(key, 0.0) + (now - before.threads.get(tid, (name, 0.0))[1]) / seconds
        return shares

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
