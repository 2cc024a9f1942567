"""Idempotency, written down case by case: every CSI call may be retried, and the answer must be the same.

The cases (CSI spec and DESIGN.md, decision 5):

- CreateVolume: same name and compatible arguments → the same volume; same
  name with another size or other parameters → ALREADY_EXISTS.
- DeleteVolume: a missing volume, or an ID the driver never issues → OK.
- NodeStageVolume: again with the same arguments → OK, still one mount; at
  another staging path → FAILED_PRECONDITION; with another fs_type or
  access type → ALREADY_EXISTS.
- NodePublishVolume: again with the same arguments → OK, still one mount;
  the same target with another readonly → ALREADY_EXISTS.
- NodeUnpublishVolume: twice, or of a target never published → OK.
- NodeUnstageVolume: twice → OK; while still published → FAILED_PRECONDITION.
- A call on a volume (or a name) while another call on it is in flight →
  ABORTED, and the retry afterwards succeeds.
- ListVolumes: pages are ordered by ID, hold every volume exactly once, and
  max_entries 0 means everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from csi_qsd.cli.client import CSIClient, capability
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.pools.base import Pool
from csi_qsd.server import Driver
from csi_qsd.sys import loop, mounts
from testing.harness import Sandbox, in_process_driver, until

MIB = 1 << 20
Code = grpc.StatusCode
T = TypeVar("T")


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def mounts_at(path: Path) -> int:
    return sum(1 for entry in mounts.mount_table() if entry.mount_point == path)


def create_request(name: str, required: int, limit: int = 0, parameters: dict[str, str] | None = None,
                   ) -> pb.CreateVolumeRequest:
    return pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=required, limit_bytes=limit),
        volume_capabilities=[capability()], parameters=parameters or {},
    )


# CreateVolume / DeleteVolume ---------------------------------------------------


async def test_create_same_name_same_arguments_returns_the_same_volume(csi: CSIClient) -> None:
    first = await csi.create_volume("pvc-same", 64 * MIB, {"format": "qcow2"})
    again = await csi.create_volume("pvc-same", 64 * MIB, {"format": "qcow2"})
    assert again == first
    compatible = await csi.controller.CreateVolume(create_request("pvc-same", 32 * MIB, 128 * MIB, {"format": "qcow2"}))
    assert compatible.volume == first  # the existing 64 MiB lies in [32, 128] MiB
    provisioner_keys = {"format": "qcow2", "csi.storage.k8s.io/pvc/name": "data"}
    assert await csi.create_volume("pvc-same", 64 * MIB, provisioner_keys) == first
    assert [v.volume_id for v in await csi.list_volumes()] == [first.volume_id]


@pytest.mark.parametrize("required, limit, parameters, why", [
    (128 * MIB, 0, {}, "larger"),
    (0, 32 * MIB, {}, "limit below the existing size"),
    (64 * MIB, 0, {"format": "raw"}, "other format"),
    (64 * MIB, 0, {"export": "vhost-user-blk"}, "other export"),
    (64 * MIB, 0, {"discard": "ignore"}, "other discard"),
])
async def test_create_same_name_other_arguments_is_already_exists(
    csi: CSIClient, required: int, limit: int, parameters: dict[str, str], why: str
) -> None:
    first = await csi.create_volume("pvc-taken", 64 * MIB)
    error = await rpc_error(csi.controller.CreateVolume(create_request("pvc-taken", required, limit, parameters)))
    assert error.code() == Code.ALREADY_EXISTS, why
    assert "'pvc-taken'" in (error.details() or "") and first.volume_id in (error.details() or "")
    assert [v.volume_id for v in await csi.list_volumes()] == [first.volume_id]


async def test_delete_missing_or_malformed_volume_is_ok(box: Sandbox, csi: CSIClient) -> None:
    volume = await csi.create_volume("pvc-del", 16 * MIB)
    await csi.delete_volume(volume.volume_id)
    await csi.delete_volume(volume.volume_id)  # twice
    await csi.delete_volume("vol-" + "0" * 24)  # never existed
    for malformed in ("pvc-123", "vol-XYZ", "../../etc/passwd", "vol-" + "a" * 24 + "\n"):
        await csi.delete_volume(malformed)  # not an ID we issue, so certainly not one of ours
    assert await csi.list_volumes() == []
    assert list((box.state_dir / "pool").iterdir()) == []


async def test_name_is_reusable_after_delete(csi: CSIClient) -> None:
    first = await csi.create_volume("pvc-again", 16 * MIB)
    await csi.delete_volume(first.volume_id)
    second = await csi.create_volume("pvc-again", 32 * MIB)
    assert second.volume_id != first.volume_id and second.capacity_bytes == 32 * MIB


# NodeStageVolume / NodeUnstageVolume -------------------------------------------


@pytest.fixture
async def staged(box: Sandbox, csi: CSIClient) -> tuple[str, Path]:
    volume = await csi.create_volume("pvc-node", 64 * MIB)
    staging = box.staging("s")
    await csi.stage(volume.volume_id, str(staging), fs_type="ext4")
    return volume.volume_id, staging


async def test_stage_twice_with_the_same_arguments_is_ok_and_mounts_once(
    box: Sandbox, csi: CSIClient, staged: tuple[str, Path]
) -> None:
    volume_id, staging = staged
    loops_before = [lp.device for lp in loop.loop_devices() if box.root in lp.backing_file.parents]
    await csi.stage(volume_id, str(staging), fs_type="ext4")
    await csi.stage(volume_id, str(staging), fs_type="")  # '' means the default, ext4: the same request
    assert mounts_at(staging) == 1
    assert [lp.device for lp in loop.loop_devices() if box.root in lp.backing_file.parents] == loops_before
    assert len(loops_before) == 1


async def test_stage_at_another_path_is_failed_precondition(
    box: Sandbox, csi: CSIClient, staged: tuple[str, Path]
) -> None:
    volume_id, staging = staged
    other = box.staging("other")
    error = await rpc_error(csi.stage(volume_id, str(other), fs_type="ext4"))
    assert error.code() == Code.FAILED_PRECONDITION
    assert volume_id in (error.details() or "") and str(staging) in (error.details() or "")
    assert mounts_at(other) == 0 and mounts_at(staging) == 1


@pytest.mark.parametrize("kwargs", [{"fs_type": "xfs"}, {"block": True}], ids=["other-fs-type", "block"])
async def test_stage_with_another_capability_is_already_exists(
    csi: CSIClient, staged: tuple[str, Path], kwargs: dict[str, Any]
) -> None:
    volume_id, staging = staged
    error = await rpc_error(csi.stage(volume_id, str(staging), **kwargs))
    assert error.code() == Code.ALREADY_EXISTS and volume_id in (error.details() or "")
    entry = mounts.mounted_at(staging)
    assert entry is not None and entry.fs_type == "ext4"


async def test_unstage_twice_is_ok(csi: CSIClient, staged: tuple[str, Path]) -> None:
    volume_id, staging = staged
    await csi.unstage(volume_id, str(staging))
    await csi.unstage(volume_id, str(staging))
    assert mounts_at(staging) == 0
    await csi.delete_volume(volume_id)


async def test_unstage_of_a_never_staged_volume_is_ok(box: Sandbox, csi: CSIClient) -> None:
    volume = await csi.create_volume("pvc-idle", 16 * MIB)
    await csi.unstage(volume.volume_id, str(box.staging("never")))


# NodePublishVolume / NodeUnpublishVolume ---------------------------------------


async def test_publish_twice_with_the_same_arguments_is_ok_and_mounts_once(
    box: Sandbox, driver: tuple[Driver, CSIClient], staged: tuple[str, Path]
) -> None:
    drv, csi = driver
    volume_id, staging = staged
    target = box.target("pod")
    for _ in range(3):
        await csi.publish(volume_id, str(staging), str(target), fs_type="ext4")
    assert mounts_at(target) == 1
    assert [p.target_path for p in await drv.catalog.publishes()] == [target]


@pytest.mark.parametrize("first, second", [(False, True), (True, False)])
async def test_publish_same_target_other_readonly_is_already_exists(
    box: Sandbox, csi: CSIClient, staged: tuple[str, Path], first: bool, second: bool
) -> None:
    volume_id, staging = staged
    target = box.target("pod")
    await csi.publish(volume_id, str(staging), str(target), readonly=first)
    error = await rpc_error(csi.publish(volume_id, str(staging), str(target), readonly=second))
    assert error.code() == Code.ALREADY_EXISTS
    assert volume_id in (error.details() or "") and str(target) in (error.details() or "")
    entry = mounts.mounted_at(target)
    assert entry is not None and entry.readonly is first and mounts_at(target) == 1


@pytest.mark.parametrize("first, second", [
    (pb.VolumeCapability.AccessMode.SINGLE_NODE_SINGLE_WRITER, pb.VolumeCapability.AccessMode.SINGLE_NODE_SINGLE_WRITER),
    (pb.VolumeCapability.AccessMode.SINGLE_NODE_SINGLE_WRITER, pb.VolumeCapability.AccessMode.SINGLE_NODE_MULTI_WRITER),
    (pb.VolumeCapability.AccessMode.SINGLE_NODE_MULTI_WRITER, pb.VolumeCapability.AccessMode.SINGLE_NODE_SINGLE_WRITER),
])
async def test_single_writer_refuses_a_second_target(
    box: Sandbox, csi: CSIClient, staged: tuple[str, Path], first: int, second: int
) -> None:
    """SINGLE_NODE_SINGLE_WRITER (ReadWriteOncePod): one target at a time, whichever publish came first."""
    volume_id, staging = staged
    one, other = box.target("one"), box.target("other")
    await csi.publish(volume_id, str(staging), str(one), mode=first)
    await csi.publish(volume_id, str(staging), str(one), mode=first)  # a retry at the same target is fine
    error = await rpc_error(csi.publish(volume_id, str(staging), str(other), mode=second))
    assert error.code() == Code.FAILED_PRECONDITION
    assert volume_id in (error.details() or "") and str(one) in (error.details() or "")
    assert mounts.mounted_at(other) is None and not other.exists()
    await csi.unpublish(volume_id, str(one))
    await csi.publish(volume_id, str(staging), str(other), mode=second)  # free again once unpublished
    await csi.unpublish(volume_id, str(other))


async def test_multi_writer_publishes_at_several_targets(
    box: Sandbox, csi: CSIClient, staged: tuple[str, Path]
) -> None:
    volume_id, staging = staged
    mode = pb.VolumeCapability.AccessMode.SINGLE_NODE_MULTI_WRITER
    targets = [box.target(f"multi{i}") for i in range(3)]
    for target in targets:
        await csi.publish(volume_id, str(staging), str(target), mode=mode)
    (targets[0] / "shared").write_text("one filesystem")
    assert all((t / "shared").read_text() == "one filesystem" for t in targets)
    for target in targets:
        await csi.unpublish(volume_id, str(target))


async def test_unpublish_twice_and_never_published_are_ok(
    box: Sandbox, csi: CSIClient, staged: tuple[str, Path]
) -> None:
    volume_id, staging = staged
    target = box.target("pod")
    await csi.publish(volume_id, str(staging), str(target))
    await csi.unpublish(volume_id, str(target))
    await csi.unpublish(volume_id, str(target))
    assert mounts_at(target) == 0 and not target.exists()
    never = box.target("never")
    await csi.unpublish(volume_id, str(never))
    assert never.parent.is_dir()  # the CO's directory is left alone


async def test_unstage_while_published_is_failed_precondition(
    box: Sandbox, csi: CSIClient, staged: tuple[str, Path]
) -> None:
    volume_id, staging = staged
    target = box.target("pod")
    await csi.publish(volume_id, str(staging), str(target))
    error = await rpc_error(csi.unstage(volume_id, str(staging)))
    assert error.code() == Code.FAILED_PRECONDITION
    assert volume_id in (error.details() or "") and str(target) in (error.details() or "")
    assert mounts_at(staging) == 1 and mounts_at(target) == 1
    await csi.unpublish(volume_id, str(target))
    await csi.unstage(volume_id, str(staging))


# calls in flight ---------------------------------------------------------------


class HeldPool:
    """Holds the next image the driver's file pool makes until the test lets it go: a call in flight.

    The pool the driver serves (found through `Volumes.pool_for`) gets its image-making methods
    wrapped, so the held call keeps exactly the locks a slow CreateVolume or CreateSnapshot keeps.
    """

    def __init__(self, pool: Pool) -> None:
        self.armed = False
        self.reached, self.released = threading.Event(), threading.Event()
        for name in ("create", "create_overlay", "check_room"):  # check_room: a blank image's CreateVolume
            setattr(pool, name, self._gated(getattr(pool, name)))

    def _hold(self) -> bool:
        """Whether this call is the one to hold (the first after `holding` armed the gate)."""
        if not self.armed:
            return False
        self.armed = False
        self.reached.set()
        return True

    def _gated(self, making: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        async def gated(*args: Any, **kwargs: Any) -> None:
            if self._hold():
                await asyncio.to_thread(self.released.wait, 60)
            await making(*args, **kwargs)
        return gated

    @contextlib.asynccontextmanager
    async def holding(self, call: Coroutine[Any, Any, T]) -> AsyncIterator[asyncio.Task[T]]:
        """Run `call` until it is making its image; release it on the way out and wait for the call."""
        self.armed, self.reached, self.released = True, threading.Event(), threading.Event()
        task = asyncio.create_task(call)
        try:
            await until(lambda: self.reached.is_set() or task.done(), "the call to reach the pool")
            assert not task.done(), f"the call ended without making an image: {task}"
            yield task
        except BaseException:
            self.released.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        self.released.set()
        await task


@pytest.fixture
async def held(box: Sandbox) -> AsyncIterator[tuple[CSIClient, HeldPool]]:
    """An in-process driver whose file pool the test can hold mid-call."""
    async with in_process_driver(box) as (driver, csi):
        yield csi, HeldPool(driver.volumes.pool_for("default"))


async def test_a_call_on_a_busy_volume_is_aborted_then_the_retry_succeeds(
    box: Sandbox, held: tuple[CSIClient, HeldPool]
) -> None:
    """Deterministic: a CreateSnapshot of the volume is held while it makes its image, as a slow call in flight would be.

    One lock per volume, shared by controller and node: while the controller's call runs, every node call
    and DeleteVolume on the volume is ABORTED.
    """
    csi, gate = held
    volume = await csi.create_volume("pvc-busy", 64 * MIB)
    volume_id, staging, target = volume.volume_id, box.staging("busy"), box.target("busy")

    calls = {
        "NodeStageVolume": lambda: csi.stage(volume_id, str(staging)),
        "NodeUnstageVolume": lambda: csi.unstage(volume_id, str(staging)),
        "NodePublishVolume": lambda: csi.publish(volume_id, str(staging), str(target)),
        "NodeUnpublishVolume": lambda: csi.unpublish(volume_id, str(target)),
        "DeleteVolume": lambda: csi.delete_volume(volume_id),
    }
    async with gate.holding(csi.create_snapshot("snap-busy", volume_id)) as snapshot:
        for method, call in calls.items():
            error = await rpc_error(call())
            assert error.code() == Code.ABORTED, method
            assert volume_id in (error.details() or ""), method
    assert snapshot.result().source_volume_id == volume_id, "the held call completes once released"
    assert mounts_at(staging) == 0 and [v.volume_id for v in await csi.list_volumes()] == [volume_id]
    for method in ("NodeStageVolume", "NodePublishVolume", "NodeUnpublishVolume", "NodeUnstageVolume", "DeleteVolume"):
        await calls[method]()  # the lock is free again: every retry goes through
    assert await csi.list_volumes() == []
    await csi.delete_snapshot(snapshot.result().snapshot_id)


# A stage and an unstage of a small volume took under a second here (a few on a loaded machine). The held
# call waits up to 60 s for its release, so a call queued behind it is still waiting when this bound runs out.
NOT_BLOCKED_S = 20.0


async def test_other_volumes_are_not_blocked(box: Sandbox, held: tuple[CSIClient, HeldPool]) -> None:
    csi, gate = held
    busy = await csi.create_volume("pvc-busy", 16 * MIB)
    free = await csi.create_volume("pvc-free", 64 * MIB)
    async with gate.holding(csi.create_snapshot("snap-busy", busy.volume_id)) as snapshot:
        try:
            async with asyncio.timeout(NOT_BLOCKED_S):
                await csi.stage(free.volume_id, str(box.staging("free")))
                await csi.unstage(free.volume_id, str(box.staging("free")))
        except TimeoutError:
            pytest.fail(f"staging and unstaging volume {free.volume_id} took over {NOT_BLOCKED_S:.0f}s while "
                        f"a CreateSnapshot of volume {busy.volume_id} was held: the other volume was blocked")
        assert not snapshot.done(), "the held call must still be in flight while the other volume is served"


async def test_create_with_a_name_in_flight_is_aborted(held: tuple[CSIClient, HeldPool]) -> None:
    csi, gate = held
    async with gate.holding(csi.create_volume("pvc-racing", 16 * MIB)) as first:
        error = await rpc_error(csi.create_volume("pvc-racing", 16 * MIB))
        assert error.code() == Code.ABORTED and "'pvc-racing'" in (error.details() or "")
        await csi.create_volume("pvc-other", 16 * MIB)  # another name is not blocked
    volume = await csi.create_volume("pvc-racing", 16 * MIB)
    assert volume.volume_id == first.result().volume_id, "the retry finds the volume the held call made"


async def test_concurrent_identical_stages_agree(box: Sandbox, csi: CSIClient) -> None:
    """Two kubelet retries racing: one may be ABORTED, never both, and the volume ends staged once."""
    volume = await csi.create_volume("pvc-race", 64 * MIB)
    staging = box.staging("race")
    results = await asyncio.gather(
        csi.stage(volume.volume_id, str(staging)), csi.stage(volume.volume_id, str(staging)),
        return_exceptions=True,
    )
    codes = sorted(r.code().name if isinstance(r, grpc.aio.AioRpcError) else repr(r) for r in results)
    assert codes in (["ABORTED", "None"], ["None", "None"]), codes
    assert mounts_at(staging) == 1
    await csi.stage(volume.volume_id, str(staging))  # the retry of the aborted one
    assert mounts_at(staging) == 1


async def test_concurrent_creates_of_one_name_make_one_volume(csi: CSIClient) -> None:
    results = await asyncio.gather(*(csi.create_volume("pvc-many", 16 * MIB) for _ in range(4)),
                                   return_exceptions=True)
    ids = {r.volume_id for r in results if isinstance(r, pb.Volume)}
    errors = {r.code() for r in results if isinstance(r, grpc.aio.AioRpcError)}
    assert len(ids) == 1 and errors <= {Code.ABORTED}
    assert [v.volume_id for v in await csi.list_volumes()] == list(ids)


# ListVolumes pagination --------------------------------------------------------


async def test_list_volumes_pages(csi: CSIClient) -> None:
    created = sorted([(await csi.create_volume(f"pvc-{n}", 16 * MIB)).volume_id for n in range(5)])
    pages: list[list[str]] = []
    token = ""
    while True:
        page = await csi.controller.ListVolumes(pb.ListVolumesRequest(max_entries=2, starting_token=token))
        pages.append([entry.volume.volume_id for entry in page.entries])
        token = page.next_token
        if not token:
            break
        assert len(pages) < 10, "pagination does not end"
    assert [len(p) for p in pages] == [2, 2, 1]
    assert [v for p in pages for v in p] == created  # every ID once, in order

    everything = await csi.controller.ListVolumes(pb.ListVolumesRequest(max_entries=0))
    assert [e.volume.volume_id for e in everything.entries] == created and everything.next_token == ""
    exact = await csi.controller.ListVolumes(pb.ListVolumesRequest(max_entries=5))
    assert len(exact.entries) == 5 and exact.next_token == ""
    more = await csi.controller.ListVolumes(pb.ListVolumesRequest(max_entries=50))
    assert len(more.entries) == 5 and more.next_token == ""


async def test_list_volumes_token_survives_deleting_its_volume(csi: CSIClient) -> None:
    created = sorted([(await csi.create_volume(f"pvc-{n}", 16 * MIB)).volume_id for n in range(3)])
    first = await csi.controller.ListVolumes(pb.ListVolumesRequest(max_entries=1))
    assert first.next_token == created[0]
    await csi.delete_volume(created[0])
    rest = await csi.controller.ListVolumes(pb.ListVolumesRequest(max_entries=5, starting_token=first.next_token))
    assert [e.volume.volume_id for e in rest.entries] == created[1:]
    again = await csi.controller.ListVolumes(pb.ListVolumesRequest(max_entries=1, starting_token=first.next_token))
    assert [e.volume.volume_id for e in again.entries] == created[1:2]  # the same request, the same page


async def test_list_volumes_of_an_empty_pool(csi: CSIClient) -> None:
    page = await csi.controller.ListVolumes(pb.ListVolumesRequest(max_entries=3))
    assert list(page.entries) == [] and page.next_token == ""
