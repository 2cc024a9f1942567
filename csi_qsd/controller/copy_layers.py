"""The older layers of an encrypted snapshot a lease serves: one qemu-nbd per layer, their ports kept on disk.

An encrypted snapshot is copied as its image files as they lie on disk
(ciphertext, each with its own LUKS header): the snapshot's own on the
lease's address (`csi_qsd.controller.copy_sources`), and each older layer
of its chain on a port of its own, since qemu-nbd serves one image per
process. Those ports are kept beside the lease's pid files (`<copy>.older`,
next older first), so a driver that starts serves each layer where the
copy's node already reads it. They start, stop and move with the lease.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from csi_qsd.sys import durable, nbd_tcp


class OlderLayers:
    """Where a lease's older layers are served, and their servers."""

    def __init__(self, copies_dir: Path, qemu_nbd: str, host: Callable[[], str]) -> None:
        self._dir = copies_dir
        self._qemu_nbd = qemu_nbd
        self._host = host

    def pid_file(self, copy_volume_id: str, layer: int) -> Path:
        return self._dir / f"{copy_volume_id}.{layer}.pid"

    def _file(self, copy_volume_id: str) -> Path:
        return self._dir / f"{copy_volume_id}.older"

    async def addresses(self, copy_volume_id: str) -> list[str]:
        """host:port of each older layer of a lease, next older first; [] for one image."""
        try:
            return list(json.loads(await asyncio.to_thread(self._file(copy_volume_id).read_text)))
        except FileNotFoundError:
            return []

    async def serving(self, copy_volume_id: str, count: int) -> bool:
        """Whether a server of each of a lease's `count` older layers runs where it was recorded."""
        older = await self.addresses(copy_volume_id)
        return len(older) == count and all(
            nbd_tcp.serving_pid(self.pid_file(copy_volume_id, i), port(a)) for i, a in enumerate(older, 1))

    async def stop(self, copy_volume_id: str) -> None:
        """Stop the servers of a lease's older layers; forget where they were."""
        for i, address in enumerate(await self.addresses(copy_volume_id), 1):
            await nbd_tcp.stop(self.pid_file(copy_volume_id, i), port(address))
        await asyncio.to_thread(self._file(copy_volume_id).unlink, missing_ok=True)

    async def serve(self, copy_volume_id: str, specs: list[str], *, tls: Path, admit: str, ports: list[int],
                    free_port: Callable[[], Awaitable[int]]) -> None:
        """Serve each older layer (`specs`, next older first) on `ports` (the ones it had), else on free ones
        (`free_port`: not the ones just started, which listen); recorded as each starts."""
        served: list[str] = []
        for i, spec in enumerate(specs, 1):
            at = ports[i - 1] if len(ports) == len(specs) else await free_port()
            await nbd_tcp.start(self._qemu_nbd, spec, host=self._host(), port=at, export=copy_volume_id, tls=tls,
                                pid_file=self.pid_file(copy_volume_id, i), admit=admit)
            served.append(f"{self._host()}:{at}")
            data = json.dumps(served).encode()
            await asyncio.to_thread(durable.create, self._file(copy_volume_id), lambda fd: os.write(fd, data))


def port(address: str) -> int:
    return int(address.rpartition(":")[2])
