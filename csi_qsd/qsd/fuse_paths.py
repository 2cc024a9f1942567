"""Which faster FUSE paths this QSD and kernel offer: FUSE over io_uring, and asynchronous direct I/O.

A pod's volume reaches QSD as FUSE requests from a direct-I/O loop device.
Two things decide how many of them QSD sees at once and what each costs:

* **FUSE_ASYNC_DIO.** A loop device submits every request as asynchronous
  direct I/O; the kernel passes such requests on without waiting only if the
  FUSE server asked for FUSE_ASYNC_DIO in its FUSE_INIT reply. Otherwise the
  loop device's worker waits for each in turn: one request in flight however
  deep the pod's queue. QSD 10.0's export (libfuse) asks for it; QEMU 11's
  rewritten export (11.1.3) asks for it only when the export is `growable`
  (measured: fusectl's `waiting` never above 1 on a plain export, the whole
  queue on a growable one). So the probe tries the plain export, and the
  growable one where the plain one lacks it, and the driver adds growable
  exports (`FusePaths.growable`) on a size guard (`graph.fuse_export`).
* **FUSE over io_uring.** Linux 6.14+ (`enable_uring`, off by default) lets a
  server take requests from and answer them on io_uring queues, one per CPU,
  instead of a read and a write on /dev/fuse per request. QEMU's FUSE export
  gains it as the export option `io-uring` in a series posted to qemu-devel,
  not in any release bundled here.

Both are asked of QSD, never assumed from a version: the option from QSD's
own QMP schema (`query-qmp-schema`), FUSE_ASYNC_DIO from what the kernel
does (`async_dio`): a direct-I/O loop device over a probe export whose reads
take `PROBE_LATENCY_NS` each, read by several threads at once, shows more
than one request waiting only if the server asked for it. The driver takes
up what QSD offers (`FusePaths`) and logs so (`event=fuse_paths`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import mmap
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from csi_qsd.errors import HostCommandError, QSDError
from csi_qsd.qsd.client import QSDClient
from csi_qsd.sys import fusectl, loop_ioctl, mounts

log = logging.getLogger(__name__)

IO_URING_OPTION = "io-uring"
KERNEL_URING = Path("/sys/module/fuse/parameters/enable_uring")
PROBE_NODE = "csi-qsd-fuse-probe"
PROBE_EXPORT = "csi-qsd-fuse-probe-export"
PROBE_SIZE = 1 << 20
PROBE_LATENCY_NS = 20_000_000  # each probe read takes 20 ms inside QSD: a request waits long enough to be seen
PROBE_READERS = 4


def fuse_export_members(schema: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """The options `block-export-add` takes for `type: fuse`, from `query-qmp-schema`'s answer.

    QEMU hides its type names in the schema (they become numbers), so the
    export's options are found from the command: its argument type, that
    type's variant for `fuse`, and the members of that variant's type.
    Empty if the schema has no FUSE export (a QSD built without FUSE).
    """
    by_name = {entry.get("name"): entry for entry in schema}
    command = next((e for e in by_name.values() if e.get("meta-type") == "command"
                    and e.get("name") == "block-export-add"), None)
    if command is None:
        return frozenset()
    arguments = by_name.get(command.get("arg-type"), {})
    variants = arguments.get("variants") or []
    fuse = next((v for v in variants if v.get("case") == "fuse"), None)
    if fuse is None:
        return frozenset()
    members = by_name.get(fuse.get("type"), {}).get("members") or []
    return frozenset(member["name"] for member in members if "name" in member)


def kernel_uring() -> str:
    """'on', 'off' (the kernel has FUSE over io_uring, not enabled) or 'absent'."""
    try:
        value = KERNEL_URING.read_text().strip()
    except OSError:
        return "absent"
    return "on" if value in ("Y", "1") else "off"


@dataclasses.dataclass(frozen=True)
class FusePaths:
    """What this QSD's FUSE export and this kernel offer, and so what the driver asks for."""

    io_uring_option: bool  # QSD's FUSE export takes `io-uring`
    kernel: str  # kernel_uring()
    async_dio: bool | None  # QSD's FUSE_INIT reply asks for FUSE_ASYNC_DIO; None: not measured
    growable: bool = False  # exports are added `growable`: only then does this QSD ask for FUSE_ASYNC_DIO

    @property
    def io_uring(self) -> bool:
        """Whether FUSE exports are added with `io-uring: true` (QSD offers it and the kernel has it on)."""
        return self.io_uring_option and self.kernel == "on"

    def describe(self) -> str:
        dio = {True: "yes", False: "no", None: "unknown"}[self.async_dio]
        return (f"fuse_io_uring={'on' if self.io_uring else 'off'} qsd_option={'yes' if self.io_uring_option else 'no'} "
                f"kernel_uring={self.kernel} async_dio={dio} growable={'yes' if self.growable else 'no'}")


async def offered(client: QSDClient) -> frozenset[str]:
    """The FUSE export's options, from this QSD's schema."""
    return fuse_export_members(await client.execute("query-qmp-schema"))


async def async_dio(client: QSDClient, workdir: Path, *, growable: bool = False) -> bool:
    """Whether this QSD's FUSE export takes asynchronous direct I/O (FUSE_ASYNC_DIO), shown by the kernel.

    A 1 MiB `null-co` node whose reads each take 20 ms is exported over FUSE
    at `workdir`/disk and put under a direct-I/O loop device; four threads
    read it at once while fusectl's `waiting` is sampled. Without
    FUSE_ASYNC_DIO the loop device passes one request at a time. Everything
    made is removed. Raises QSDError or HostCommandError if the probe cannot
    be set up (no FUSE, no loop device).
    """
    mountpoint = workdir / "disk"
    if mounts.mounted_at(mountpoint) is not None:  # a probe a crash cut off
        await mounts.unmount(mountpoint, lazy=True)
    await asyncio.to_thread(_prepare, mountpoint)
    names = await client.node_names()
    if PROBE_NODE in names:  # a probe a crash cut off
        with contextlib.suppress(QSDError):
            await client.execute("block-export-del", {"id": PROBE_EXPORT, "mode": "hard"})
        await _removed(client)
    await client.blockdev_add({"driver": "null-co", "node-name": PROBE_NODE, "size": PROBE_SIZE,
                               "latency-ns": PROBE_LATENCY_NS, "read-zeroes": True})
    try:
        spec: dict[str, Any] = {"type": "fuse", "id": PROBE_EXPORT, "node-name": PROBE_NODE, "mountpoint": str(mountpoint),
                "writable": growable, "allow-other": "off"}
        if growable:  # QEMU 11 takes growable on writable exports only
            spec["growable"] = True
        await client.export_add(spec)
        try:
            await fusectl.raise_background(mountpoint)
            device = await asyncio.to_thread(loop_ioctl.attach, mountpoint, readonly=True, direct_io=True)
            try:
                most = await asyncio.to_thread(_most_waiting, device, mountpoint)
            finally:
                await asyncio.to_thread(loop_ioctl.detach, device)
        finally:
            await client.execute("block-export-del", {"id": PROBE_EXPORT, "mode": "hard"})
    finally:
        await _removed(client)
    return most > 1


async def _removed(client: QSDClient) -> None:
    """Delete the probe node once its export is gone (block-export-del finishes in the background)."""
    for _ in range(100):
        try:
            await client.blockdev_del(PROBE_NODE)
            return
        except QSDError:
            if PROBE_NODE not in await client.node_names():
                return
            await asyncio.sleep(0.02)
    await client.blockdev_del(PROBE_NODE)


def _prepare(mountpoint: Path) -> None:
    mountpoint.parent.mkdir(parents=True, exist_ok=True)
    mountpoint.touch(mode=0o600, exist_ok=True)


def _most_waiting(device: Path, export: Path) -> int:
    """The most FUSE requests seen waiting while PROBE_READERS threads read `device` (O_DIRECT) at once."""
    waiting = fusectl.CONNECTIONS / str(os.minor(os.stat(export).st_dev)) / "waiting"
    done = False

    def read(index: int) -> None:
        buffer = mmap.mmap(-1, 4096)
        try:
            fd = os.open(device, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            try:
                for turn in range(3):
                    os.preadv(fd, [buffer], ((index * 3 + turn) * 4096) % PROBE_SIZE)
            finally:
                os.close(fd)
        finally:
            buffer.close()

    most = 0
    with concurrent.futures.ThreadPoolExecutor(PROBE_READERS) as pool:
        futures = [pool.submit(read, index) for index in range(PROBE_READERS)]
        deadline = time.monotonic() + 5
        while not done and time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                most = max(most, int(waiting.read_text()))
            done = all(f.done() for f in futures)
            time.sleep(0.002)
        for future in futures:
            future.result()
    return most


async def probe(client: QSDClient, workdir: Path, *, measure_async_dio: bool) -> FusePaths:
    """What this QSD and kernel offer; FUSE_ASYNC_DIO measured only when `measure_async_dio`."""
    option = IO_URING_OPTION in await offered(client)
    dio: bool | None = None
    growable = False
    if measure_async_dio:
        try:
            dio = await async_dio(client, workdir)
            if not dio:
                growable = dio = await async_dio(client, workdir, growable=True)
        except (QSDError, HostCommandError, OSError) as exc:
            log.warning("event=fuse_probe_failed what=async_dio error=%r", str(exc))
    paths = FusePaths(option, kernel_uring(), dio, growable)
    log.info("event=fuse_paths %s", paths.describe())
    return paths
