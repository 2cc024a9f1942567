"""A QSD that stops answering is a dead QSD: noticed within the QMP timeout, diagnosed, killed, replaced.

QSD is frozen with SIGSTOP, the closest stand-in for a monitor that never
answers again (on 7.2 a `block-export-del` left it silent for 12 minutes).
The driver runs in this event loop with a short `qmp_timeout`, so the idle
liveness ping finds the freeze within a second or two; the runstate, Probe,
the log and the volume behind its target path are watched as a CO and an
operator would see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.errors import QSDError
from csi_qsd.qsd.daemon import QSDState, ping_interval, process_state, running_pid
from csi_qsd.server import Driver
from testing.harness import Sandbox, in_process_driver, qsd_pid, wait_restored, write_synced

MIB = 1 << 20
QMP_TIMEOUT = 1.0
# Generous on purpose: the machine is shared and a restart remounts a filesystem.
DETECT_MARGIN = 10.0
RECOVER_MARGIN = 30.0


# The line the supervisor logs as it makes each transition (`QSDDaemon._set_state`).
STATE_LOGGED = re.compile(r"\bevent=qsd_state from=\S+ to=(\w+)")


class Transitions(logging.Handler):
    """Every runstate transition with its time, recorded synchronously (none can be missed).

    Read from the supervisor's log, which it writes in the transition itself; the driver here runs one QSD.
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[QSDState, float]] = []
        self._changed = asyncio.Event()
        self._logger = logging.getLogger("csi_qsd.qsd.daemon")
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        found = STATE_LOGGED.search(record.getMessage())
        if found is not None:
            self.seen.append((QSDState(found.group(1)), asyncio.get_running_loop().time()))
            self._changed.set()

    def close(self) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
        super().close()

    def states(self) -> list[QSDState]:
        return [state for state, _ in self.seen]

    async def reach(self, wanted: list[QSDState], timeout: float) -> float:
        """Wait until the transitions contain `wanted` in order; return the time of its last step."""
        async def until() -> float:
            while True:
                at = self._subsequence(wanted)
                if at is not None:
                    return at
                self._changed.clear()
                await self._changed.wait()
        try:
            return await asyncio.wait_for(until(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"runstates {wanted} not seen within {timeout}s; saw {self.states()}") from None

    def _subsequence(self, wanted: list[QSDState]) -> float | None:
        index = 0
        for state, at in self.seen:
            if state is wanted[index]:
                index += 1
                if index == len(wanted):
                    return at
        return None


class ProbeWatch:
    """Probe over gRPC, called back to back; records each change of its answer."""

    def __init__(self, csi: CSIClient) -> None:
        self.answers: list[bool] = []
        self._csi = csi
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="probe-watch")

    async def _run(self) -> None:
        while True:
            ready = await self._csi.probe()
            if not self.answers or self.answers[-1] != ready:
                self.answers.append(ready)
                self._changed.set()
            await asyncio.sleep(0.01)

    async def reach(self, wanted: list[bool], timeout: float) -> None:
        async def until() -> None:
            while self.answers != wanted:
                self._changed.clear()
                await self._changed.wait()
        try:
            await asyncio.wait_for(until(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"Probe answers {wanted} not seen within {timeout}s: {self.answers}") from None

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def frozen(box: Sandbox, pid: int) -> AsyncIterator[None]:
    """SIGSTOP our QSD; whatever happens, leave no stopped QSD of ours behind."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        # Only the process our sandbox's QSD was: its command line names our state dir.
        with contextlib.suppress(OSError):
            if str(box.state_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


async def test_sigstopped_qsd_under_a_mounted_volume_is_replaced(
    box: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="csi_qsd")
    async with in_process_driver(box, qmp_timeout=QMP_TIMEOUT) as (driver, csi):
        vid = (await csi.create_volume("pvc-frozen", 64 * MIB)).volume_id
        staging, target = box.staging("frozen"), box.target("frozen-pod")
        await csi.stage(vid, str(staging))
        await csi.publish(vid, str(staging), str(target))
        payload = os.urandom(MIB)
        await asyncio.to_thread(write_synced, target / "synced", payload)
        assert await csi.probe()

        old_pid = qsd_pid(box)
        assert old_pid is not None
        transitions = Transitions()
        probes = ProbeWatch(csi)
        try:
            loop = asyncio.get_running_loop()
            async with frozen(box, old_pid):
                stopped_at = loop.time()
                bound = QMP_TIMEOUT + 2 * ping_interval(QMP_TIMEOUT)
                wedged_at = await transitions.reach([QSDState.WEDGED], bound + DETECT_MARGIN)
                running_at = await transitions.reach(
                    [QSDState.WEDGED, QSDState.RESTARTING, QSDState.RUNNING], bound + RECOVER_MARGIN)
            print(f"\nwedge noticed after {wedged_at - stopped_at:.2f}s, QSD replaced and volume rebuilt "
                  f"after {running_at - stopped_at:.2f}s (qmp_timeout {QMP_TIMEOUT}s)")
            assert transitions.states() == [QSDState.WEDGED, QSDState.RESTARTING, QSDState.RUNNING]
            # Probe went not-ready while QSD was being replaced and is ready again.
            await probes.reach([True, False, True], RECOVER_MARGIN)
            await wait_restored(csi, vid, target)
        finally:
            await probes.close()
            transitions.close()

        new_pid = qsd_pid(box)
        assert new_pid is not None and new_pid != old_pid
        # Gone, or dead and waiting for whoever inherited it to reap it.
        assert process_state(old_pid)[:1] in ("", "Z"), "the frozen QSD must be dead"
        assert driver.daemon.wedges == 1 and driver.daemon.restarts == 1

        # What a bug report needs was logged at error level.
        wedged = [r.getMessage() for r in caplog.records
                  if r.levelno == logging.ERROR and "event=qsd_wedged" in r.getMessage()]
        assert len(wedged) == 1, wedged
        assert f"pid={old_pid}" in wedged[0] and "command=query-version" in wedged[0]
        assert "proc_state='T (stopped)'" in wedged[0] and '"wchan"' in wedged[0]
        assert '"stack": ["' in wedged[0], "root can read the kernel stacks of QSD's threads"

        # The volume works again through the same target path, with every synced byte.
        assert (await asyncio.to_thread((target / "synced").read_bytes)) == payload
        await asyncio.to_thread(write_synced, target / "after", b"written after the wedge")
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        await csi.stage(vid, str(staging))
        await csi.publish(vid, str(staging), str(target))
        assert (await asyncio.to_thread((target / "after").read_bytes)) == b"written after the wedge"
        assert (await asyncio.to_thread((target / "synced").read_bytes)) == payload
        await csi.unpublish(vid, str(target))
        await csi.unstage(vid, str(staging))
        await csi.delete_volume(vid)


async def test_a_frozen_qsd_found_at_start_is_replaced(box: Sandbox) -> None:
    """A driver restarting next to a QSD that no longer answers does not adopt it: it kills and replaces it."""
    async with in_process_driver(box, qmp_timeout=QMP_TIMEOUT) as (driver, csi):
        vid = (await csi.create_volume("pvc-adopt", 64 * MIB)).volume_id
        await csi.stage(vid, str(box.staging("adopt")))
        await driver.daemon.close()  # the driver goes away; QSD keeps running
        old_pid = qsd_pid(box)
        assert old_pid is not None
        async with frozen(box, old_pid):
            await driver.daemon.start(driver.node.rebuild(0))
        assert driver.daemon.runstate is QSDState.RUNNING and driver.daemon.wedges == 1
        new_pid = running_pid(driver.config)
        assert new_pid is not None and new_pid != old_pid
        assert await csi.probe()
        await wait_restored(csi, vid, box.staging("adopt"))
        await csi.unstage(vid, str(box.staging("adopt")))
        await csi.delete_volume(vid)


async def test_refusals_keep_qemus_error_class(driver: tuple[Driver, CSIClient]) -> None:
    """Callers decide by QEMU's error class, so it must survive the wrapping."""
    client = driver[0].daemon.client
    with pytest.raises(QSDError) as unknown:
        await client.execute("no-such-command")
    assert unknown.value.error_class == "CommandNotFound"
    with pytest.raises(QSDError) as missing:
        await client.blockdev_del("cq-no-such-node")
    assert missing.value.error_class == "GenericError"
    assert isinstance(await client.blockstats(), dict)
