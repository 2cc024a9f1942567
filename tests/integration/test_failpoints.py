"""A crash inside every step: SIGKILL at each named point, restart, and check the result.

After the restart, the start-up reconcile must have finished or undone the
interrupted step (nothing half-made: no stray mount, loop device, export or
image), the CO's retry of the step must succeed, and the user's data must be
intact.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import grpc
import pytest

from csi_qsd.cli.client import CSIClient
from csi_qsd.sys import loop, mounts
from testing.harness import DriverProcess, Sandbox, until

MIB = 1 << 20
PAYLOAD = b"user data that must survive every crash\n" * 1000


class Flow:
    """One volume walked through its lifecycle, step by step."""

    def __init__(self, box: Sandbox, csi: CSIClient) -> None:
        self.box, self.csi = box, csi
        self.staging, self.target = box.staging("fp"), box.target("fp-pod")
        self.vid = ""

    async def create(self) -> None:
        self.vid = (await self.csi.create_volume("pvc-failpoint", 64 * MIB)).volume_id

    async def stage(self) -> None:
        await self.csi.stage(self.vid, str(self.staging))

    async def publish(self) -> None:
        await self.csi.publish(self.vid, str(self.staging), str(self.target))

    async def unpublish(self) -> None:
        await self.csi.unpublish(self.vid, str(self.target))

    async def unstage(self) -> None:
        await self.csi.unstage(self.vid, str(self.staging))

    async def delete(self) -> None:
        await self.csi.delete_volume(self.vid)

    async def check_data(self) -> None:
        """Stage and publish, find PAYLOAD, and put the volume back unstaged."""
        await self.stage()
        await self.publish()
        assert (self.target / "data").read_bytes() == PAYLOAD
        await self.unpublish()
        await self.unstage()

    def export_loops(self) -> list[loop.LoopDevice]:
        return loop.find_loop(self.box.state_dir / "exports" / self.vid / "disk")


STEPS = {
    "create": ["create.before_settle", "create.after_images_settled"],
    "stage": ["stage.after_intent", "stage.after_export", "stage.after_loop", "stage.after_mount"],
    "publish": ["publish.after_intent", "publish.after_bind"],
    "unpublish": ["unpublish.after_intent", "unpublish.after_unmount"],
    "unstage": ["unstage.after_intent", "unstage.after_unmount", "unstage.after_detach"],
    "delete": ["delete.after_intent", "delete.after_image"],
}
# Points reached after the call has answered (a created volume's image is written, and a deleted one's
# storage freed, in the background).
AFTER_ANSWER = {"create.after_images_settled", "delete.after_image"}
ORDER = list(STEPS)
CASES = [(step, point) for step, points in STEPS.items() for point in points]


@pytest.mark.parametrize(("step", "point"), CASES, ids=[point for _, point in CASES])
async def test_crash_inside_step(box: Sandbox, process: DriverProcess, step: str, point: str) -> None:
    async with CSIClient(box.endpoint, timeout=60) as csi:
        flow = Flow(box, csi)
        if ORDER.index(step) > 0:
            # Put user data on the volume first, then walk up to the step under test.
            for earlier in ("create", "stage", "publish"):
                await getattr(flow, earlier)()
            (flow.target / "data").write_bytes(PAYLOAD)
            os.sync()
            for earlier in ("unpublish", "unstage"):
                await getattr(flow, earlier)()
            for earlier in ORDER[1:ORDER.index(step)]:
                await getattr(flow, earlier)()

        await process.stop()
        await process.start(failpoints=point)
        if point in AFTER_ANSWER:
            with contextlib.suppress(grpc.aio.AioRpcError):  # answered, unless the kill outran the answer
                await getattr(flow, step)()
        else:
            with pytest.raises(grpc.aio.AioRpcError):
                await getattr(flow, step)()
        assert await process.wait_exit() != 0, "the armed failpoint must have killed the driver"
        assert f"event=failpoint name={point}" in process.log()
        await process.start()

        # Nothing half-made survives the restart.
        if step in ("stage", "unstage"):
            assert mounts.mounted_at(flow.staging) is None
            assert flow.export_loops() == []
        if step in ("publish", "unpublish"):
            assert mounts.mounted_at(flow.target) is None
        listed = [v.volume_id for v in await csi.list_volumes()]
        if step == "create" and (listed or point == "create.before_settle"):
            # The row committed before the kill (its image is written after it): the volume exists,
            # its image written again by the reconcile, and it holds data like any other.
            assert "event=reconcile_settle_image" in process.log()
            await flow.create()  # the provisioner's retry finds it
            assert listed == [flow.vid]
            await flow.stage()
            await flow.publish()
            (flow.target / "data").write_bytes(PAYLOAD)
            os.sync()
            await flow.unpublish()
            await flow.unstage()
            await flow.check_data()
            await flow.delete()
            await until_pool_empty(box)
            return
        if step == "create":
            assert await csi.list_volumes() == []
            assert list((box.state_dir / "pool").iterdir()) == []
            await flow.create()  # the provisioner's retry
            return
        if step == "delete":
            assert await csi.list_volumes() == []
            assert list((box.state_dir / "pool").iterdir()) == []
            await flow.delete()
            return

        # The CO's retry succeeds, and the data is intact.
        await getattr(flow, step)()
        remaining = ORDER[ORDER.index(step) + 1:]
        if step in ("stage", "publish"):
            if step == "stage":
                await flow.publish()
            assert (flow.target / "data").read_bytes() == PAYLOAD
            await flow.unpublish()
            await flow.unstage()
        else:
            for later in remaining[:-1]:
                await getattr(flow, later)()
            await flow.check_data()
        await flow.delete()
        await until_pool_empty(box)


async def until_pool_empty(box: Sandbox) -> None:
    """A deleted volume's image goes right after DeleteVolume answers, in the background."""
    await until(lambda: list(Path(box.state_dir / "pool").iterdir()) == [], "the pool to be empty", 10)
