"""`FakeExport`: an export kind whose QSD side is the driver's own and whose host side is a `FakeHostState`."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from csi_qsd.catalog import AccessType, PublishRecord, StageRecord, VolumeRecord
from csi_qsd.exports.base import ExportHost, ExportPath, VolumeStats
from csi_qsd.exports.export_kinds import ExportPaths
from csi_qsd.params import ExportKind
from csi_qsd.qsd import attach, export_nodes, graph
from csi_qsd.qsd import move as qsd_move
from csi_qsd.qsd.client import QSDClient
from tests.fakes.crash import Crash


@dataclasses.dataclass
class FakeHostState:
    """What an export kind leaves on the host, kept across a driver restart like the host keeps it."""

    loops: dict[str, str] = dataclasses.field(default_factory=dict)  # loop device -> volume ID
    mounts: dict[Path, str] = dataclasses.field(default_factory=dict)  # staging path -> volume ID
    binds: dict[Path, str] = dataclasses.field(default_factory=dict)  # target path -> volume ID
    frozen: set[str] = dataclasses.field(default_factory=set)  # volumes held still (`quiesced`)
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # what `expand` grew each volume to
    broken: set[str] = dataclasses.field(default_factory=set)  # volumes whose export reports QSD gone
    _numbers: itertools.count[int] = dataclasses.field(default_factory=itertools.count)

    def attach_loop(self, volume_id: str) -> str:
        device = f"/dev/loop{next(self._numbers)}"
        self.loops[device] = volume_id
        return device

    def of(self, volume_id: str) -> list[object]:
        """Everything on the host that still belongs to the volume: empty once it is torn down."""
        return [*(d for d, v in self.loops.items() if v == volume_id),
                *(p for p, v in self.mounts.items() if v == volume_id),
                *(t for t, v in self.binds.items() if v == volume_id),
                *({volume_id} & self.frozen)]


@dataclasses.dataclass(frozen=True)
class Call:
    """One call the orchestrator made on the export kind."""

    method: str
    volume_id: str
    client: object = None
    thorough: bool | None = None
    target: Path | None = None


Action = Callable[[], Awaitable[None]]


class FakeExport(ExportPath):
    """An export kind with the QSD side of the real ones and a host side in `FakeHostState`.

    Steps in order: bring_up → export → loop → mount; tear_down; publish;
    unpublish; expand; quiesce … thaw; move.copied, move.held (held still,
    before the switch), move.switched, move.committed (where
    `commits_before_switch` puts it). `at(step, action)` runs `action` once
    when the step is reached; `fail_at(step, error)` raises there.
    """

    kind = ExportKind.FILESYSTEM

    def __init__(self, host: ExportHost, state: FakeHostState | None = None, *,
                 commits_before_switch: bool = False) -> None:
        super().__init__(host)
        self.state = state if state is not None else FakeHostState()
        self.commits_before_switch = commits_before_switch
        self.calls: list[Call] = []
        self._actions: dict[str, list[Action]] = {}

    def at(self, step: str, action: Action) -> None:
        self._actions.setdefault(step, []).append(action)

    def fail_at(self, step: str, error: BaseException) -> None:
        async def fail() -> None:
            raise error
        self.at(step, fail)

    def called(self, method: str) -> list[Call]:
        return [call for call in self.calls if call.method == method]

    async def _step(self, step: str) -> None:
        actions = self._actions.get(step)
        if actions:
            await actions.pop(0)()

    def fs_type(self, block: bool, requested: str) -> str:
        return "" if block else requested or "ext4"

    def export_broken(self, volume_id: str) -> bool:
        return volume_id in self.state.broken

    async def bring_up(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], client: QSDClient,
    ) -> StageRecord:
        self.calls.append(Call("bring_up", volume.id, client))
        await self._step("bring_up")
        top = self.host.top_image(volume)
        fresh = not await export_nodes.has_export(client, top.nodes.fuse_export)
        if fresh:  # a new export: whatever stood on an old one is dead
            self._drop_host_side(volume.id, stage.loop_device)
        await attach.ensure_top(client, top)
        if fresh:
            await client.export_add(graph.fuse_export(top.nodes, self.host.volume_dir(volume.id) / "disk",
                                                      writable=True))
        await self._step("export")
        device = stage.loop_device if stage.loop_device in self.state.loops else self.state.attach_loop(volume.id)
        await self._step("loop")
        if stage.access_type is AccessType.MOUNT:
            self.state.mounts[stage.staging_path] = volume.id
            await self._step("mount")
        return dataclasses.replace(stage, loop_device=device)

    async def tear_down(self, volume: VolumeRecord, stage: StageRecord, client: QSDClient, *, thorough: bool) -> None:
        self.calls.append(Call("tear_down", volume.id, client, thorough=thorough))
        await self._step("tear_down")
        if self.state.mounts.get(stage.staging_path) == volume.id:
            del self.state.mounts[stage.staging_path]
        self._drop_loops(volume.id, stage.loop_device, every=thorough)
        await attach.remove_volume(client, volume.id)

    async def publish(
        self, volume: VolumeRecord, stage: StageRecord, record: PublishRecord, others: list[PublishRecord],
    ) -> PublishRecord:
        self.calls.append(Call("publish", volume.id, target=record.target_path))
        await self._step("publish")
        self.state.binds[record.target_path] = volume.id
        return record

    async def unpublish(self, volume: VolumeRecord, stage: StageRecord | None, record: PublishRecord) -> None:
        self.calls.append(Call("unpublish", volume.id, target=record.target_path))
        await self._step("unpublish")
        self.state.binds.pop(record.target_path, None)

    async def condition(self, volume: VolumeRecord) -> tuple[bool, str]:
        return False, ""

    async def stats(self, volume: VolumeRecord, stage: StageRecord, path: Path) -> VolumeStats:
        return VolumeStats(block=stage.access_type is AccessType.BLOCK, total_bytes=volume.capacity,
                           available_bytes=volume.capacity, used_bytes=0)

    async def expand(
        self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord], size: int,
    ) -> None:
        self.calls.append(Call("expand", volume.id))
        await self._step("expand")
        self.state.sizes[volume.id] = size

    @contextlib.asynccontextmanager
    async def quiesced(self, volume: VolumeRecord, stage: StageRecord) -> AsyncIterator[None]:
        self.calls.append(Call("quiesce", volume.id))
        await self._step("quiesce")
        self.state.frozen.add(volume.id)
        try:
            yield
        except Crash:
            raise  # the process is gone: nothing thaws the consumer (`release` does, after the restart)
        except BaseException:
            await self._thaw(volume.id)
            raise
        await self._thaw(volume.id)

    async def _thaw(self, volume_id: str) -> None:
        self.state.frozen.discard(volume_id)
        self.calls.append(Call("thaw", volume_id))
        await self._step("thaw")

    async def release(self, volume: VolumeRecord, stage: StageRecord) -> None:
        self.calls.append(Call("release", volume.id))
        self.state.frozen.discard(volume.id)

    def check_move(self, volume: VolumeRecord, stage: StageRecord, publishes: list[PublishRecord]) -> None:
        self.calls.append(Call("check_move", volume.id))

    async def move(
        self, volume: VolumeRecord, stage: StageRecord, old: attach.TopImage, new: attach.TopImage,
        commit: Callable[[], Awaitable[None]],
    ) -> None:
        """Open the new home, copy, then switch and commit (or commit, then switch: a mirror's order)."""
        self.calls.append(Call("move", volume.id))
        client = self.host.client_of(volume.id)
        await qsd_move.open_new_home(client, new)
        await self._step("move.copied")
        if self.commits_before_switch:
            await commit()
            await self._step("move.committed")
        async with self.quiesced(volume, stage):
            await self._step("move.held")
            await qsd_move.switch(client, new)
        await self._step("move.switched")
        if not self.commits_before_switch:
            await commit()
            await self._step("move.committed")

    async def finish_move(self, volume: VolumeRecord, stage: StageRecord, old: attach.TopImage,
                          new: attach.TopImage) -> None:
        self.calls.append(Call("finish_move", volume.id))
        async with self.quiesced(volume, stage):
            await qsd_move.switch(self.host.client_of(volume.id), new)

    def _drop_host_side(self, volume_id: str, loop_device: str) -> None:
        self.state.mounts = {p: v for p, v in self.state.mounts.items() if v != volume_id}
        self._drop_loops(volume_id, loop_device, every=True)

    def _drop_loops(self, volume_id: str, recorded: str, *, every: bool) -> None:
        for device in [d for d, v in self.state.loops.items() if v == volume_id and (every or d == recorded)]:
            del self.state.loops[device]


class FakeExportPaths(ExportPaths):
    """Every volume served by one `FakeExport`, whatever its parameters."""

    def __init__(self, host: ExportHost, kind: FakeExport) -> None:
        self.host = host
        self.kind = kind

    def of(self, volume: VolumeRecord) -> ExportPath:
        return self.kind

    def export_broken(self, volume_id: str) -> bool:
        return self.kind.export_broken(volume_id)
