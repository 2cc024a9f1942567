"""Test-wide guards: no test may leak an asyncio task; every test uses one QEMU.

By default tests use the QEMU the install put into the venv (>= 10.0.8 on a
Debian 12 host). `CSI_QSD_HOST_QEMU=1` runs them against the host's own
QEMU instead (7.2 on Debian 12), on the safe buffered data path.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

if os.environ.get("CSI_QSD_HOST_QEMU") == "1":
    os.environ.setdefault("CSI_QSD_QSD_BINARY", "/usr/bin/qemu-storage-daemon")
    os.environ.setdefault("CSI_QSD_QEMU_IMG", "/usr/bin/qemu-img")
else:
    os.environ["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
    assert not leaked, f"test leaked asyncio tasks: {leaked}"
