"""I/O limits (VolumeAttributesClass → ControllerModifyVolume) measured with fio through real volumes.

fio keeps reading while the limit is set and lifted; its per-second IOPS (or
bandwidth) log shows when each change took hold. The limits are far below
what the volume does unthrottled on a shared 2-core machine, so a busy
machine cannot fake them: a throttled second is capped from above, and an
unthrottled one is several times the limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from csi_qsd.cli.client import CSIClient, capability
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.params import QoS
from csi_qsd.qsd import graph
from csi_qsd.server import Driver
from testing import tiers
from testing.harness import Sandbox, qsd_pid, wait_restored

pytestmark = tiers.needs("integration", "" if shutil.which("fio") else "fio")

MIB = 1 << 20
TOLERANCE = 0.15
# Seconds of each phase of a live run: unthrottled, throttled, lifted again.
BEFORE, LIMITED, AFTER = 3.0, 6.0, 4.0
SETTLE = 1.0  # "within a second": samples are judged from one second after each change


async def create(csi: CSIClient, name: str, size: int, *, block: bool = False,
                 mutable: dict[str, str] | None = None, parameters: dict[str, str] | None = None) -> str:
    response: Any = await csi.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size),
        volume_capabilities=[capability(block=block)], parameters=parameters or {},
        mutable_parameters=mutable or {},
    ), timeout=60)
    return str(response.volume.volume_id)


async def modify(csi: CSIClient, volume_id: str, **mutable: str) -> None:
    await csi.controller.ControllerModifyVolume(
        pb.ControllerModifyVolumeRequest(volume_id=volume_id, mutable_parameters=mutable), timeout=60)


async def staged(box: Sandbox, csi: CSIClient, vid: str, name: str, *, block: bool) -> Path:
    """Stage and publish; the path fio works on (a file in the filesystem, or the block device)."""
    staging, target = box.staging(name), box.target(name)
    await csi.stage(vid, str(staging), block=block)
    await csi.publish(vid, str(staging), str(target), block=block)
    if block:
        return target
    data = target / "fio.dat"
    await fio(box, data, "prep", rw="write", bs="1M", size="64M", runtime=0)
    return data


async def fio(box: Sandbox, path: Path, name: str, *, rw: str = "randread", bs: str = "4k", size: str = "64M",
              runtime: float, iodepth: int = 16) -> Path:
    """Run fio on `path`; the prefix of its per-second logs (`runtime` 0: once over `size`, no logs)."""
    prefix = box.root / name
    argv = ["fio", f"--name={name}", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={size}",
            "--direct=1", "--ioengine=libaio", f"--iodepth={iodepth}", "--output-format=json",
            f"--output={prefix}.json"]
    if runtime:
        argv += ["--time_based", f"--runtime={runtime}", f"--write_iops_log={prefix}", f"--write_bw_log={prefix}",
                 "--log_avg_msec=1000", "--log_unix_epoch=1"]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), runtime + 120)
    assert proc.returncode == 0, f"fio failed: {err.decode(errors='replace')}"
    return prefix


def samples(prefix: Path, kind: str) -> list[tuple[float, float]]:
    """(end of the one-second window, wall-clock seconds; IOPS or KiB/s) from fio's log."""
    found = []
    for line in Path(f"{prefix}_{kind}.1.log").read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        found.append((int(fields[0]) / 1000, float(fields[1])))
    assert found, f"fio logged nothing in {prefix}_{kind}.1.log"
    return found


@dataclasses.dataclass
class Phases:
    before: list[float]
    limited: list[float]
    after: list[float]

    def report(self, label: str, limit: float, unit: str) -> str:
        mean = statistics.mean
        return (f"{label}: limit {limit:.0f} {unit}; before {mean(self.before):.0f}, limited {mean(self.limited):.1f} "
                f"(per second {[round(v) for v in self.limited]}), lifted {mean(self.after):.0f}")


async def live_run(box: Sandbox, path: Path, name: str, kind: str, *, bs: str,
                   limit: dict[str, str], lift: dict[str, str], csi: CSIClient, vid: str) -> Phases:
    """fio for the three phases; the limit set after BEFORE seconds, lifted after LIMITED more."""
    run = asyncio.create_task(fio(box, path, name, bs=bs, runtime=BEFORE + LIMITED + AFTER))
    await asyncio.sleep(BEFORE)
    asked = time.time()
    await modify(csi, vid, **limit)
    limited_at = time.time()
    await asyncio.sleep(LIMITED)
    lifting_at = time.time()
    await modify(csi, vid, **lift)
    lifted_at = time.time()
    got = samples(await run, kind)
    print(f"\nModifyVolume answered in {limited_at - asked:.3f}s")
    # A one-second window counts when it lies wholly inside its phase: the first limited one
    # starts as the change is answered, so it shows the limit holding within that second.
    return Phases(
        before=[v for t, v in got if t <= asked],
        limited=[v for t, v in got if t - SETTLE >= limited_at and t <= lifting_at],
        after=[v for t, v in got if t - SETTLE >= lifted_at],
    )


def check_phases(phases: Phases, limit: float) -> None:
    assert len(phases.before) >= 1 and len(phases.limited) >= 4 and len(phases.after) >= 2, phases
    assert statistics.mean(phases.limited) == pytest.approx(limit, rel=TOLERANCE), phases
    assert max(phases.limited) <= limit * (1 + TOLERANCE), phases  # capped from the first second on
    for free in (phases.before, phases.after):
        assert statistics.mean(free) > 3 * limit, phases


async def test_filesystem_volume_iops_limit_set_and_lifted_live(
    box: Sandbox, driver: tuple[Driver, CSIClient]
) -> None:
    _, csi = driver
    vid = await create(csi, "pvc-qos-fs", 256 * MIB)
    path = await staged(box, csi, vid, "fs", block=False)
    phases = await live_run(box, path, "fs", "iops", bs="4k", limit={"iopsTotal": "200"}, lift={"iopsTotal": "0"},
                            csi=csi, vid=vid)
    print("\n" + phases.report("filesystem 4k randread QD16, iopsTotal", 200, "IOPS"))
    check_phases(phases, 200)


async def test_block_volume_read_iops_limit_set_and_lifted_live(
    box: Sandbox, driver: tuple[Driver, CSIClient]
) -> None:
    _, csi = driver
    vid = await create(csi, "pvc-qos-blk", 256 * MIB, block=True)
    path = await staged(box, csi, vid, "blk", block=True)
    phases = await live_run(box, path, "blk", "iops", bs="4k", limit={"iopsRead": "500"}, lift={"iopsRead": "0"},
                            csi=csi, vid=vid)
    print("\n" + phases.report("block 4k randread QD16, iopsRead", 500, "IOPS"))
    check_phases(phases, 500)


async def test_block_volume_bandwidth_limit_from_creation_then_lifted(
    box: Sandbox, driver: tuple[Driver, CSIClient]
) -> None:
    """Limits given at CreateVolume (a claim with a VolumeAttributesClass) hold from the first stage on."""
    drv, csi = driver
    limit = 8 * MIB
    vid = await create(csi, "pvc-qos-bw", 256 * MIB, block=True, mutable={"bpsTotal": str(limit)})
    record = await drv.catalog.volume(vid)
    assert record is not None and record.qos == QoS(bps_total=limit)
    path = await staged(box, csi, vid, "bw", block=True)
    run = asyncio.create_task(fio(box, path, "bw", bs="64k", runtime=LIMITED + AFTER))
    await asyncio.sleep(LIMITED)
    lifting_at = time.time()  # a second that ends after this may hold the lift already
    await modify(csi, vid, bpsTotal="0")
    lifted_at = time.time()
    got = samples(await run, "bw")
    limited = [v * 1024 for t, v in got if t <= lifting_at]
    after = [v * 1024 for t, v in got if t - SETTLE >= lifted_at]
    print(f"\nblock 64k randread QD16, bpsTotal: limit {limit} B/s; limited {statistics.mean(limited):.0f} "
          f"(per second {[round(v / MIB, 2) for v in limited]} MiB), lifted {statistics.mean(after):.0f} B/s")
    assert len(limited) >= 4 and len(after) >= 2
    assert statistics.mean(limited) == pytest.approx(limit, rel=TOLERANCE)
    assert max(limited) <= limit * (1 + TOLERANCE)
    assert statistics.mean(after) > 3 * limit


async def wait_new_qsd(box: Sandbox, old: int, timeout: float = 60.0) -> None:
    """Until the supervisor has started a QSD other than `old`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while qsd_pid(box) in (None, old):
        assert asyncio.get_running_loop().time() < deadline, f"no new QSD replaced pid {old}"
        await asyncio.sleep(0.1)


async def iops(box: Sandbox, path: Path, name: str, seconds: float = 5.0) -> float:
    """Median of fio's per-second IOPS, the first second (start-up) left out."""
    return float(statistics.median(v for _, v in samples(await fio(box, path, name, runtime=seconds), "iops")[1:]))


async def test_limits_survive_unstage_snapshot_expansion_and_a_qsd_crash(
    box: Sandbox, driver: tuple[Driver, CSIClient]
) -> None:
    """Set while not staged, the limit holds once staged, through a live snapshot, a resize and a QSD rebuild."""
    drv, csi = driver
    vid = await create(csi, "pvc-qos-life", 128 * MIB, block=True)
    await modify(csi, vid, iopsTotal="200")  # not staged: stored, applied at stage
    path = await staged(box, csi, vid, "life", block=True)
    measured = {"staged": await iops(box, path, "a")}
    await csi.create_snapshot("snap-qos", vid)  # blockdev-snapshot under the throttle filter
    measured["after snapshot"] = await iops(box, path, "b")
    await csi.expand(vid, str(box.target("life")), 192 * MIB)
    with open(path, "rb") as device:
        assert device.seek(0, os.SEEK_END) == 192 * MIB
    measured["after expansion"] = await iops(box, path, "c")
    old = qsd_pid(box)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    await wait_new_qsd(box, old)
    await wait_restored(csi, vid, box.target("life"))
    measured["after QSD restart"] = await iops(box, path, "d")
    print(f"\niopsTotal 200 through the volume's life: {measured}")
    for when, value in measured.items():
        assert value == pytest.approx(200, rel=TOLERANCE), when
    client = drv.daemon.client
    nodes = graph.nodes_for(vid)
    exports = await client.exports()
    # The export stands on the throttle filter; a growable one (QEMU 11) on the size guard over it.
    if drv.daemon.fuse_paths.growable:
        assert exports[nodes.fuse_export]["node_name"] == nodes.size_guard
        assert await client.child_of(nodes.size_guard) == nodes.throttle
    else:
        assert exports[nodes.fuse_export]["node_name"] == nodes.throttle
    await csi.unpublish(vid, str(box.target("life")))
    await csi.unstage(vid, str(box.staging("life")))
    assert nodes.throttle_group not in await client.throttle_groups()
    assert not {n for n in await client.node_names() if graph.volume_of(n) == vid}


async def test_a_lost_live_change_is_applied_when_the_volume_is_brought_up_again(
    box: Sandbox, driver: tuple[Driver, CSIClient]
) -> None:
    """The catalog is the truth: QSD's group with other limits (a crash between commit and qom-set) is corrected."""
    drv, csi = driver
    vid = await create(csi, "pvc-qos-drift", 64 * MIB, block=True, mutable={"iopsWrite": "300"})
    await staged(box, csi, vid, "drift", block=True)
    client = drv.daemon.client
    group = graph.nodes_for(vid).throttle_group
    assert (await client.throttle_limits(group))["iops-write"] == 300
    await client.set_throttle_limits(group, graph.throttle_limits(QoS()))
    await csi.stage(vid, str(box.staging("drift")), block=True)  # the kubelet's periodic re-stage
    assert (await client.throttle_limits(group))["iops-write"] == 300


@pytest.mark.parametrize("mutable, key", [
    ({"iops": "100"}, "iops"),
    ({"iopsTotal": "fast"}, "iopsTotal"),
    ({"iopsTotal": "-1"}, "iopsTotal"),
    ({"bpsRead": "1e6"}, "bpsRead"),
    ({"burstSeconds": "0"}, "burstSeconds"),
    ({"iopsTotal": "100", "iopsRead": "50"}, "iopsRead"),
    ({"iopsTotalMax": "100"}, "iopsTotalMax"),
    ({"bpsWrite": "100", "bpsWriteMax": "50"}, "bpsWriteMax"),
])
async def test_bad_mutable_parameters_are_invalid_argument_naming_the_key(
    csi: CSIClient, mutable: dict[str, str], key: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await create(csi, "pvc-bad", 16 * MIB, mutable=mutable)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and repr(key) in (info.value.details() or "")
    vid = await create(csi, "pvc-good", 16 * MIB)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await modify(csi, vid, **mutable)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and repr(key) in (info.value.details() or "")


async def test_modify_merges_keys_and_checks_the_result(driver: tuple[Driver, CSIClient]) -> None:
    """Only the keys given change (CSI: nothing for an absent key); the merged limits must make sense."""
    drv, csi = driver
    vid = await create(csi, "pvc-merge", 16 * MIB, mutable={"iopsTotal": "200"})
    await modify(csi, vid, iopsTotalMax="400", burstSeconds="10")
    record = await drv.catalog.volume(vid)
    assert record is not None and record.qos == QoS(iops_total=200, iops_total_max=400, burst_seconds=10)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await modify(csi, vid, iopsTotal="0")  # would leave a burst rate without a limit
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'iopsTotal'" in (info.value.details() or "")
    await modify(csi, vid, iopsTotal="0", iopsTotalMax="0", iopsRead="100")
    record = await drv.catalog.volume(vid)
    assert record is not None and record.qos == QoS(iops_read=100, burst_seconds=10)


async def test_modify_of_an_unknown_volume_and_limits_in_the_storageclass(csi: CSIClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await modify(csi, "vol-" + "0" * 24, iopsTotal="100")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "vol-" + "0" * 24 in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await create(csi, "pvc-sc", 16 * MIB, parameters={"iopsTotal": "100"})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'iopsTotal'" in (info.value.details() or "") and "VolumeAttributesClass" in (info.value.details() or "")
    caps = await csi.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest())
    assert pb.ControllerServiceCapability.RPC.MODIFY_VOLUME in {c.rpc.type for c in caps.capabilities}


async def test_create_is_idempotent_only_with_the_same_limits(csi: CSIClient) -> None:
    vid = await create(csi, "pvc-idem", 16 * MIB, mutable={"bpsRead": "1000000"})
    assert await create(csi, "pvc-idem", 16 * MIB, mutable={"bpsRead": "1000000"}) == vid
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await create(csi, "pvc-idem", 16 * MIB, mutable={"bpsRead": "2000000"})
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
