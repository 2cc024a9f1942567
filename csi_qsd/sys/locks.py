"""Per-key try-locks: one CSI call at a time per volume (or name); a second one gets ABORTED.

A CSI call never queues behind another. Only the driver's own repair work
waits for a key (`wait_hold`), and only for a bound, after which it decides
without the lock: the rebuild after a QSD restart (`csi_qsd.node.rebuild`)
then repairs the volume anyway, beside the call still holding it (a staged
volume left without its export is the worse outcome), while settling a move
skips the volume instead. So these locks keep CSI calls apart from each
other; they do not keep the rebuild from a call that outlives its wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from csi_qsd.errors import Aborted


class KeyedLocks:
    """Non-blocking exclusive locks keyed by string; no global mutex."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._held: set[str] = set()
        self._released: dict[str, asyncio.Event] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        if key in self._held:
            raise Aborted(f"an operation on {self._kind} {key!r} is already in progress; retry later")
        async with self._holding(key):
            yield

    @contextlib.asynccontextmanager
    async def wait_hold(self, key: str, timeout: float) -> AsyncIterator[bool]:
        """Hold `key` once it is free; yields False (unheld) if it stays busy for `timeout` seconds.

        On False the caller goes on without the lock or gives up: its choice.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while key in self._held:
            released = self._released.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(released.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                yield False
                return
        async with self._holding(key):
            yield True

    @contextlib.asynccontextmanager
    async def _holding(self, key: str) -> AsyncIterator[None]:
        self._held.add(key)
        try:
            yield
        finally:
            self._held.discard(key)
            released = self._released.pop(key, None)
            if released is not None:
                released.set()

    def busy(self, key: str) -> bool:
        return key in self._held
