"""Writers that keep a published volume in use while a test grows or moves it.

`Writer` is a thread appending synced 64 KiB blocks to a file on a
published filesystem, each block's bytes derived from its index, so that
whatever happened under it (a growth, a move, a QSD restart) can be
checked afterwards block by block. `fs_bytes` is the filesystem's size as
statvfs reports it, to see a growth reach the mounted filesystem.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from testing.harness import until


class Writer:
    """A thread appending synced 64 KiB blocks to a file until stopped: the volume is in use throughout.

    Paced (`PACE` seconds between blocks, at most ~6 MiB/s), so a fast data path cannot fill a
    small filesystem before the growth a test waits for.
    """

    PACE = 0.01

    def __init__(self, path: Path) -> None:
        self.path = path
        self.blocks = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with open(self.path, "ab") as f:
                while not self._stop.is_set():
                    f.write(bytes([self.blocks % 251]) * (64 << 10))
                    f.flush()
                    os.fsync(f.fileno())
                    self.blocks += 1
                    self._stop.wait(self.PACE)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    async def __aenter__(self) -> "Writer":
        self._thread.start()
        await until(lambda: self.blocks >= 4, "the writer to get going")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 30)
        assert self.error is None, f"the writer failed during expansion: {self.error!r}"

    def verify(self) -> None:
        data = self.path.read_bytes()
        assert len(data) == self.blocks * (64 << 10)
        for i in range(self.blocks):
            assert data[i << 16:(i + 1) << 16] == bytes([i % 251]) * (64 << 10), f"block {i} changed"


def fs_bytes(path: Path) -> int:
    """The size of the filesystem mounted at `path`, as statvfs reports it."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize
