"""QSD's pool of iothreads, and which vhost-user-blk export runs in which.

A vhost-user-blk (or VDUSE, NBD) export runs in one iothread; only a FUSE
export takes a list. So the many VM disks of a node can be spread over a pool
of `--iothreads` threads (default: one per core the driver may run on), each
new export in the thread that serves the fewest, where QSD is known to
survive that (`csi_qsd.qsd.features.vhost_exports_spread`; else all in the
first), and a FUSE export on QEMU >= 11 gets the whole pool. The pool is `iothread0`..`iothreadN-1`: the first
is the one iothread older drivers made, so an adopted QSD keeps its exports
and gets the rest added live (`object-add`).

Placement lives in memory: after a driver restart the adopted exports are
not known to the pool (QSD does not report an export's iothread), which
only makes the spread less even until they come and go, never wrong.
Never speaks QMP itself beyond the arguments it builds.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable
from typing import Any

PREFIX = "iothread"
# More threads than this per core only adds context switches; also the usage error's bound.
MAX_PER_CORE = 4


def node_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except OSError:
        return os.cpu_count() or 1


def check_size(count: int, cores: int) -> int:
    """`count` if it is a pool size this node can use; raises ValueError saying the bounds."""
    if not 1 <= count <= cores * MAX_PER_CORE:
        raise ValueError(f"{count} iothreads: must be 1..{cores * MAX_PER_CORE} "
                         f"({MAX_PER_CORE} per core, {cores} cores)")
    return count


def pool_ids(count: int) -> list[str]:
    return [f"{PREFIX}{index}" for index in range(count)]


def object_args(thread_id: str, poll_max_ns: int | None) -> dict[str, Any]:
    """`object-add` arguments for one pool thread; QEMU's default polling budget (32 us) unless given."""
    args: dict[str, Any] = {"qom-type": "iothread", "id": thread_id}
    if poll_max_ns is not None:
        args["poll-max-ns"] = poll_max_ns
    return args


def command_line(count: int, poll_max_ns: int | None) -> list[str]:
    """QSD's `--object iothread,...` arguments for the pool."""
    argv = []
    for thread_id in pool_ids(count):
        spec = f"iothread,id={thread_id}"
        if poll_max_ns is not None:
            spec += f",poll-max-ns={poll_max_ns}"
        argv += ["--object", spec]
    return argv


class IOThreadPool:
    """The pool's thread IDs and where each export this process added runs."""

    def __init__(self, count: int, poll_max_ns: int | None = None, *, spread: bool = True) -> None:
        self.ids = pool_ids(count)
        self.poll_max_ns = poll_max_ns
        self.spread = spread  # False: every export in the first thread (see csi_qsd.qsd.features)
        self._placed: dict[str, str] = {}

    def place(self, export_id: str, live: Iterable[str]) -> str:
        """The thread for `export_id`: where it already is, else the one serving the fewest of `live` exports."""
        live = set(live)
        for gone in set(self._placed) - live - {export_id}:
            del self._placed[gone]
        if export_id in self._placed:
            return self._placed[export_id]
        load = collections.Counter(self._placed.values())
        candidates = self.ids if self.spread else self.ids[:1]
        chosen = min(candidates, key=lambda thread: (load[thread], self.ids.index(thread)))
        self._placed[export_id] = chosen
        return chosen

    def load(self) -> dict[str, int]:
        """How many placed exports each thread serves."""
        counts = collections.Counter(self._placed.values())
        return {thread: counts[thread] for thread in self.ids}
