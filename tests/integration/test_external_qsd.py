"""`--qsd-mode external`: QSD runs in its own container (`csi-qsd qsd-run`) and the plugin adopts it.

This is the Kubernetes layout: restarting or upgrading the plugin container
must not stop QSD, and a restarted QSD container must get its graph back
from the plugin.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from csi_qsd.csi.client import CSIClient
from tests.harness import DriverProcess, Sandbox, qsd_pid, wait_restored

MIB = 1 << 20


async def start_qsd_container(box: Sandbox) -> asyncio.subprocess.Process:
    """`csi-qsd qsd-run`, as the qsd container's command: QSD in the foreground."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "csi_qsd.cli", "qsd-run", "--state-dir", str(box.state_dir),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
    )


async def test_plugin_adopts_and_rebuilds_an_external_qsd(box: Sandbox) -> None:
    qsd = await start_qsd_container(box)
    driver = DriverProcess(box, "--qsd-mode", "external")
    try:
        await driver.start()
        pid = qsd_pid(box)
        assert pid == qsd.pid, "the plugin must use the QSD of the qsd container, not start its own"
        async with CSIClient(box.endpoint, timeout=60) as csi:
            vid = (await csi.create_volume("pvc-ext", 64 * MIB)).volume_id
            staging, target = box.staging("ext"), box.target("ext")
            await csi.stage(vid, str(staging))
            await csi.publish(vid, str(staging), str(target))
            (target / "a").write_bytes(b"before the plugin restart")
            os.sync()

            # Upgrading the plugin container: QSD and the mount are untouched.
            await driver.kill9()
            assert (target / "a").read_bytes() == b"before the plugin restart"
            await driver.start()
            assert qsd_pid(box) == qsd.pid
            await csi.publish(vid, str(staging), str(target))  # kubelet's retry is fine

            # The qsd container restarts: the plugin notices and rebuilds the graph.
            qsd.send_signal(signal.SIGKILL)
            await qsd.wait()
            qsd = await start_qsd_container(box)
            await wait_restored(csi, vid, target)
            assert (target / "a").read_bytes() == b"before the plugin restart"
            (target / "b").write_bytes(b"after the qsd restart")
            os.sync()
            await csi.unpublish(vid, str(target))
            await csi.unstage(vid, str(staging))
            await csi.delete_volume(vid)
    finally:
        await driver.stop()
        if qsd.returncode is None:
            qsd.send_signal(signal.SIGTERM)
            await qsd.wait()
