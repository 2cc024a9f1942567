"""Remote pools through QEMU's own drivers: an iSCSI LUN served by tgtd (CHAP), NBD exports of a second QSD (x509).

Real targets on this machine (`testing/remote_targets.py`), read back from
their backing files. Checks: a block volume lands at its extent on the
target, the pool's label at its start; the CHAP password reaches neither
the log nor QMP; a target that goes away makes the volume report
abnormal, I/O fail within the `on-error=fail` bound (or wait, with
`on-error=wait`, until the target is back) while the node's QSD keeps
answering with the same pid; the same target back serves the same bytes;
bad credentials and unreachable targets stop the start with errors naming
the flag.

The target outages run on QEMU 11 with FUSE exports in iothreads: on QSD
10.0.13 a FUSE export's request waits in QSD's main loop (see
`test_cascade_pool.py`), which a failing bound of a few seconds keeps short
of the watchdog, but a waiting one does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.config import parse_remote_pool
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.errors import StartupError
from csi_qsd.pools.block_device import LABEL_MAGIC
from csi_qsd.pools.remote import RemotePool
from csi_qsd.qsd import features
from csi_qsd.qsd.storage import FAIL_AFTER_SECONDS
from csi_qsd.server import Driver
from csi_qsd.sys.tools import bundled
from testing.harness import Sandbox, free_port, in_process_driver, qsd_pid, until
from testing.remote_targets import CHAP_PASSWORD, NbdServer, Tgt, read_at

MIB = 1 << 20
TARGET_BYTES = 64 * MIB
PATTERN = b"on a remote target\n" * 3449  # just under 64 KiB
AGAIN = b"after the target came back\n" * 2427
QEMU_11: dict[str, object] = {"qsd_binary": bundled("qemu-storage-daemon-11"), "iothreads": 2,
                              "fuse_threads": features.FuseThreads.POOL}


def remote_pool(driver: Driver, name: str) -> RemotePool:
    pool = driver.pools[name]
    assert isinstance(pool, RemotePool)
    return pool


async def condition(csi: CSIClient, vid: str) -> Any:
    response: Any = await csi.controller.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vid), timeout=30)
    return response.status.volume_condition


async def healthy(csi: CSIClient, vid: str) -> bool:
    return not (await condition(csi, vid)).abnormal


@contextlib.asynccontextmanager
async def block_volume(box: Sandbox, csi: CSIClient, pool: str) -> AsyncIterator[tuple[str, Path]]:
    vol = await csi.create_volume(f"pvc-{pool}", 16 * MIB, {"pool": pool}, block=True)
    staging, target = box.staging(pool), box.target(pool)
    await csi.stage(vol.volume_id, str(staging), block=True)
    await csi.publish(vol.volume_id, str(staging), str(target), block=True)
    yield vol.volume_id, target
    await csi.unpublish(vol.volume_id, str(target))
    await csi.unstage(vol.volume_id, str(staging))
    await csi.delete_volume(vol.volume_id)


async def direct_write(device: Path, offset: int, data: bytes) -> tuple[int, str]:
    """dd with O_DIRECT and fsync, past every cache: its exit code and complaint."""
    proc = await asyncio.create_subprocess_exec(
        "dd", f"of={device}", "oflag=direct,seek_bytes", f"seek={offset}", "bs=64k", "conv=notrunc,fsync",
        "status=none", stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(data), 60)
    return proc.returncode or 0, err.decode(errors="replace")


async def qsd_answers(driver: Driver, box: Sandbox, pid: int | None) -> None:
    """The node's QSD answers its monitor at once, and it is the same process (nothing replaced it)."""
    assert await asyncio.wait_for(driver.daemon.client.node_names(), 2.0)
    assert driver.daemon.ready and qsd_pid(box) == pid


async def waits_until_back(
    driver: Driver, box: Sandbox, pid: int | None, device: Path, come_back: Callable[[], Awaitable[None]],
) -> None:
    """With on-error=wait, a write to a target that is gone waits for it, QSD answering; then it completes."""
    writer = asyncio.create_task(direct_write(device, MIB, AGAIN))
    await qsd_answers(driver, box, pid)
    assert not writer.done(), f"a write to a target that is gone did not wait for it: {writer.result()}"
    await come_back()
    assert await writer == (0, "")
    await qsd_answers(driver, box, pid)


async def test_iscsi_lun_carved_with_chap_and_a_target_that_goes_away(
    box: Sandbox, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    tgt = Tgt(box.root, TARGET_BYTES)
    await tgt.start()
    try:
        spec = parse_remote_pool(f"san={tgt.url},secret={tgt.secret}")  # on-error=wait
        async with in_process_driver(box, remote_pools=(spec,), **QEMU_11) as (driver, csi):
            pool = remote_pool(driver, "san")
            assert read_at(tgt.lun, 0, len(LABEL_MAGIC)) == LABEL_MAGIC  # labelled through QSD, over iSCSI
            assert pool.usage().total == pool.layout.data_size and pool.layout.device_size == TARGET_BYTES
            async with block_volume(box, csi, "san") as (vid, device):
                extent = pool.extent_of(vid)
                assert extent is not None
                assert await direct_write(device, 0, PATTERN) == (0, "")
                assert read_at(tgt.lun, extent.start, len(PATTERN)) == PATTERN
                assert await healthy(csi, vid)
                pid = qsd_pid(box)

                await tgt.kill()
                status = await condition(csi, vid)
                assert status.abnormal and tgt.url in status.message and "unreachable" in status.message, status
                await waits_until_back(driver, box, pid, device, tgt.start)
                assert read_at(tgt.lun, extent.start + MIB, len(AGAIN)) == AGAIN
                assert read_at(tgt.lun, extent.start, len(PATTERN)) == PATTERN
                await until(lambda: healthy(csi, vid), "the volume healthy again", 30)
            await driver.volumes.freed()  # DeleteVolume answered; the extent is scrubbed right after
            assert read_at(tgt.lun, extent.start, len(PATTERN)) == bytes(len(PATTERN))  # scrubbed through QSD
        assert CHAP_PASSWORD not in caplog.text
        assert "password-secret" not in caplog.text or CHAP_PASSWORD not in caplog.text

        (tgt.secret / "password").write_text("wrong-password-123")
        with pytest.raises(StartupError, match=r"--remote-pool san \(iscsi://127\.0\.0\.1:\d+/.*\): "
                                               r"qemu-storage-daemon cannot open it"):
            async with in_process_driver(box, remote_pools=(spec,)):
                pass
    finally:
        await tgt.stop()


@pytest.mark.parametrize("unix,on_error", [(False, "fail"), (True, "wait")], ids=["nbd-tcp", "nbd-unix"])
async def test_nbd_export_over_tls_and_a_server_that_goes_away(box: Sandbox, unix: bool, on_error: str) -> None:
    server = NbdServer(box.root, TARGET_BYTES, unix=unix)
    await server.start()
    try:
        name = ",tls-name=csi-qsd-node" if unix else ""  # the name the test certificates carry
        spec = parse_remote_pool(f"nas={server.url},tls={server.client_dir}{name},on-error={on_error}")
        async with in_process_driver(box, remote_pools=(spec,), **QEMU_11) as (driver, csi):
            assert read_at(server.image, 0, len(LABEL_MAGIC)) == LABEL_MAGIC
            async with block_volume(box, csi, "nas") as (vid, device):
                extent = remote_pool(driver, "nas").extent_of(vid)
                assert extent is not None
                assert await direct_write(device, 0, PATTERN) == (0, "")
                assert read_at(server.image, extent.start, len(PATTERN)) == PATTERN
                pid = qsd_pid(box)

                await server.kill()
                status = await condition(csi, vid)
                assert status.abnormal and "nas" in status.message and "unreachable" in status.message, status
                if on_error == "wait":
                    await waits_until_back(driver, box, pid, device, server.start)
                else:
                    started = asyncio.get_running_loop().time()
                    code, _ = await direct_write(device, MIB, AGAIN)
                    took = asyncio.get_running_loop().time() - started
                    assert code != 0 and took < FAIL_AFTER_SECONDS + 10, (code, took)
                    await qsd_answers(driver, box, pid)
                    await server.start()

                    async def written() -> bool:
                        return (await direct_write(device, MIB, AGAIN))[0] == 0
                    await until(written, "a write once the server is back", 30)
                assert read_at(server.image, extent.start + MIB, len(AGAIN)) == AGAIN
                assert read_at(server.image, extent.start, len(PATTERN)) == PATTERN
                await until(lambda: healthy(csi, vid), "the volume healthy again", 30)
    finally:
        await server.stop()


async def test_start_up_refuses_an_unreachable_target_or_a_server_that_wants_tls(box: Sandbox) -> None:
    nowhere = parse_remote_pool(f"gone=nbd://127.0.0.1:{free_port()}/pool,insecure")
    with pytest.raises(StartupError, match=r"--remote-pool gone \(nbd://127\.0\.0\.1:\d+/pool\): target .* "
                                           "is unreachable"):
        async with in_process_driver(box, remote_pools=(nowhere,)):
            pass
    server = NbdServer(box.root, TARGET_BYTES, unix=False)
    await server.start()
    try:
        no_tls = parse_remote_pool(f"plain={server.url},insecure")  # the server requires TLS
        with pytest.raises(StartupError, match=r"--remote-pool plain .*cannot open it"):
            async with in_process_driver(box, remote_pools=(no_tls,)):
                pass
    finally:
        await server.stop()
