"""The operator's --file-io setting, resolved without asking QSD where the setting leaves no choice."""

from __future__ import annotations

import asyncio
from pathlib import Path

from csi_qsd.qsd import file_aio
from csi_qsd.qsd.file_aio import Engine, FileIO


def _resolve(setting: FileIO) -> Engine:
    # None as the client: `threads` and `native` must not ask QSD anything.
    return asyncio.run(file_aio.resolve(setting, None, Path("/nonexistent")))  # type: ignore[arg-type]


def test_threads_stays_in_the_page_cache() -> None:
    assert _resolve(FileIO.THREADS) == Engine("threads", direct=False)


def test_native_needs_and_gets_o_direct() -> None:
    assert _resolve(FileIO.NATIVE) == Engine("native", direct=True)
