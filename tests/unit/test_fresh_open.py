"""What QSD is sent to open a volume it holds nothing of, and to close it again (an in-memory QSD)."""

from __future__ import annotations

from pathlib import Path

from csi_qsd.params import VolumeParameters
from csi_qsd.qsd import attach, graph
from csi_qsd.qsd.storage import ExtentOnDevice, HostDevice, ImageFile, Storage
from tests.fakes.daemons import FakeQSDClient

VID = "vol-" + "ab" * 12
IMAGE = Path("/pool") / f"{VID}.qcow2"


async def opened(storage: Storage) -> tuple[FakeQSDClient, list[dict[str, object]]]:
    client = FakeQSDClient()
    await attach.ensure_top(client, attach.TopImage(VID, 0, storage, VolumeParameters()))
    return client, [args for command, args in client.calls if command == "blockdev-add"]


async def test_an_image_file_opens_inside_its_format_node_and_closes_with_it() -> None:
    nodes = graph.nodes_for(VID)
    client, added = await opened(ImageFile(IMAGE, aio="io_uring"))
    assert [args["node-name"] for args in added] == [nodes.format, nodes.throttle]
    assert added[0]["file"] == {"driver": "file", "filename": str(IMAGE), "discard": "unmap", "aio": "io_uring"}
    assert nodes.file not in await client.node_names()  # unnamed: nothing can address it on its own

    await attach.remove_volume(client, VID)
    assert graph.volume_node_names(await client.node_names(), VID) == set()
    removed = [(command, args) for command, args in client.calls if command in ("blockdev-del", "object-del")]
    assert removed == [("blockdev-del", {"node-name": nodes.throttle}), ("object-del", {"id": nodes.throttle_group}),
                       ("blockdev-del", {"node-name": nodes.format})]  # the file node went with its format node


async def test_a_device_window_stays_a_node_of_its_own() -> None:
    nodes = graph.nodes_for(VID)
    window = ExtentOnDevice(HostDevice(Path("/dev/fast")), offset=1 << 20, size=64 << 20)
    client, added = await opened(window)
    assert [args["node-name"] for args in added] == [nodes.file, nodes.format, nodes.throttle]
    assert added[1]["file"] == nodes.file  # reopened by name when the volume grows

    await attach.remove_volume(client, VID)
    assert graph.volume_node_names(await client.node_names(), VID) == set()
