"""Test-wide guards: no test may leak an asyncio task; every test uses one QEMU; no tier is skipped silently;
every test has a time limit; a run starts by sweeping what a killed run left.

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

from testing import stale_runs, tiers, timeouts

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


# A leaked loop device outlives every sandbox: once its FUSE export is gone, sysfs shows its backing
# file as "/" and no cleanup by path can find it. The session fails if it ends with more of those.
_ORPHANS_AT_START: set[str] = set()


def _orphaned_loop_devices() -> set[str]:
    found = set()
    for attribute in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if attribute.read_text().strip() in ("/", "/ (deleted)"):
                found.add(attribute.parent.parent.name)
        except OSError:
            continue  # detached meanwhile
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test gets its tier's time limit (testing/timeouts.py), or its own `timeout` mark's seconds."""
    for item in items:
        mark = item.get_closest_marker("timeout")
        explicit = (mark.args[0] if mark.args else mark.kwargs.get("timeout")) if mark else None
        limit = timeouts.limit_for(Path(item.path).relative_to(config.rootpath).as_posix(), explicit)
        item.add_marker(pytest.mark.timeout(limit.seconds, func_only=limit.func_only), append=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test whose tier lacks a tool fails in CI and is skipped elsewhere, before its fixtures build anything."""
    tiers.enforce(item)


_SWEPT: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _SWEPT:
        terminalreporter.write_line(f"swept at the start, left by a killed run: {'; '.join(_SWEPT)}")
    tiers.report(terminalreporter.write_line)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Sweep what a killed run left (testing/stale_runs.py: only what it provably made), then count orphans."""
    if os.geteuid() == 0 and not hasattr(session.config, "workerinput"):
        _SWEPT.extend(stale_runs.sweep_all())
    _ORPHANS_AT_START.update(_orphaned_loop_devices())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    leaked = sorted(_orphaned_loop_devices() - _ORPHANS_AT_START)
    if leaked and not hasattr(session.config, "workerinput"):
        session.config.get_terminal_writer().line(
            f"leaked loop devices whose backing file is gone (attached during this run): {leaked}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
