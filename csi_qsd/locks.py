"""Per-key try-locks: one call at a time per volume (or name); a second one gets ABORTED."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from csi_qsd.errors import Aborted


class KeyedLocks:
    """Non-blocking exclusive locks keyed by string; no global mutex."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._held: set[str] = set()

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        if key in self._held:
            raise Aborted(f"an operation on {self._kind} {key!r} is already in progress; retry later")
        self._held.add(key)
        try:
            yield
        finally:
            self._held.discard(key)

    def busy(self, key: str) -> bool:
        return key in self._held
