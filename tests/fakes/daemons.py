"""A QSD as far as the domain reaches it: `FakeQSDClient`, one `FakeDaemon` per shard, and `fake_shards`.

The client answers the `QSDClient` methods the domain calls from an
in-memory block graph and refuses what QEMU refuses where the driver
depends on it (a node that exists, is missing or in use); `fail_next`
makes the next command refused, or carried out with its answer lost.
`fake_shards` puts the daemons in the driver's own `QSDShards`, so
placement is the real one.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from csi_qsd.config import Config
from csi_qsd.errors import QSDError, QSDUnavailable
from csi_qsd.qsd import graph
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.graph import QMPArgs
from csi_qsd.qsd.shards import QSDShards
from csi_qsd.qsd.view import BlockExportInfo


@dataclasses.dataclass
class _Fault:
    answer_lost: bool
    error_class: str


class FakeQSDClient(QSDClient):
    """A `QSDClient` whose commands an in-memory block graph answers instead of a QMP session.

    `execute` is the protocol: the client's own typed wrappers run over it
    (`blockdev_add`, `job`, `stream`, `version`…). The listings the real
    client keeps a record of (node names, exports, QOM objects), `child_of`
    and `export_del` read the graph directly. Nodes are kept as the
    `blockdev-add` arguments that made them, so a node's children are its
    `file` and `backing` members. Every command is appended to `calls` as
    (QMP name, arguments), queries under the QMP command the real client
    sends for them.
    """

    def __init__(self, version: tuple[int, int, int] = (10, 1, 0)) -> None:
        super().__init__("csi-qsd-fake", timeout=10.0)
        self.qemu_version = version
        self.up = True
        self.calls: list[tuple[str, QMPArgs]] = []
        self._faults: dict[str, list[_Fault]] = {}
        self.nodes: dict[str, QMPArgs] = {}
        self.block_exports: dict[str, QMPArgs] = {}
        self.objects: dict[str, QMPArgs] = {}
        self.jobs: dict[str, QMPArgs] = {}

    @property
    def connected(self) -> bool:
        return self.up

    def new_process(self) -> None:
        """A restarted QSD: an empty graph, a live session."""
        self.nodes, self.block_exports, self.objects, self.jobs = {}, {}, {}, {}
        self.up = True

    def fail_next(self, command: str, *, answer_lost: bool = False, error_class: str = "GenericError") -> None:
        """Refuse the next `command` (QSDError), or carry it out and lose the answer (QSDUnavailable)."""
        self._faults.setdefault(command, []).append(_Fault(answer_lost, error_class))

    def commands(self) -> list[str]:
        return [name for name, _ in self.calls]

    def changes(self) -> list[str]:
        """The commands that changed QSD (queries left out)."""
        return [name for name in self.commands() if name not in _QUERIES]

    def reads(self, volume_id: str) -> str | None:
        """The node the volume's throttle filter (under every export) reads, or None without one."""
        spec = self.nodes.get(graph.nodes_for(volume_id).throttle)
        return None if spec is None else spec.get("file")

    def volume_nodes(self, volume_id: str) -> set[str]:
        """Every name of the volume in the graph: nodes, exports, objects."""
        names = set(self.nodes) | set(self.block_exports) | set(self.objects)
        return {name for name in names if graph.volume_of(name) == volume_id}

    # the QSDClient surface ---------------------------------------------

    async def execute(self, command: str, arguments: QMPArgs | None = None) -> Any:
        args = copy.deepcopy(arguments or {})
        self.calls.append((command, args))
        if not self.up:
            raise QSDUnavailable(f"qemu-storage-daemon went away during {command}")
        faults = self._faults.get(command)
        fault = faults.pop(0) if faults else None
        if fault is not None and not fault.answer_lost:
            raise QSDError(f"qemu-storage-daemon refused {command}: told to", error_class=fault.error_class)
        handler = _HANDLERS.get(command)
        if handler is None:
            raise AssertionError(f"the fake QSD does not model {command}")
        result = handler(self, args)
        if fault is not None:
            raise QSDUnavailable(f"qemu-storage-daemon went away during {command}")
        return result

    async def node_names(self) -> set[str]:
        await self.execute("x-debug-query-block-graph")
        return set(self.nodes)

    async def child_of(self, node: str, role: str = "file") -> str | None:
        await self.execute("x-debug-query-block-graph")
        child = self.nodes.get(node, {}).get(role)
        return child if isinstance(child, str) else None

    async def exports(self) -> dict[str, BlockExportInfo]:
        await self.execute("query-block-exports")
        return {
            export_id: BlockExportInfo(id=export_id, type=spec["type"], node_name=spec["node-name"],
                                       shutting_down=False)
            for export_id, spec in self.block_exports.items()
        }

    async def iothreads(self) -> set[str]:
        return await self._objects_of("iothread")

    async def throttle_groups(self) -> set[str]:
        return await self._objects_of("throttle-group")

    async def _objects_of(self, qom_type: str) -> set[str]:
        await self.execute("qom-list", {"path": "/objects"})
        return {name for name, spec in self.objects.items() if spec["qom-type"] == qom_type}

    async def export_del(self, export_id: str) -> None:
        if export_id in await self.exports():
            await self.execute("block-export-del", {"id": export_id, "mode": "hard"})

    # the graph's rules ---------------------------------------------------

    def _refuse(self, message: str) -> QSDError:
        return QSDError(f"qemu-storage-daemon refused: {message}", error_class="GenericError")

    def _users(self, name: str) -> list[str]:
        users = [n for n, spec in self.nodes.items() if name in (spec.get("file"), spec.get("backing"))]
        return users + [e for e, spec in self.block_exports.items() if spec["node-name"] == name]

    def _filename(self, name: str) -> str:
        spec = self.nodes.get(name, {})
        if "filename" in spec:
            return str(spec["filename"])
        child = spec.get("file")
        return self._filename(child) if isinstance(child, str) else ""

    def _blockdev_add(self, spec: QMPArgs) -> None:
        name = spec["node-name"]
        if name in self.nodes:
            raise self._refuse(f"Duplicate nodes with node-name='{name}'")
        for role in ("file", "backing"):
            child = spec.get(role)
            if isinstance(child, str) and child not in self.nodes:
                raise self._refuse(f"Cannot find device= nor node-name={child}")
        group = spec.get("throttle-group")
        if group is not None and group not in self.objects:
            raise self._refuse(f"Throttle group '{group}' does not exist")
        self.nodes[name] = spec

    def _blockdev_del(self, args: QMPArgs) -> None:
        name = args["node-name"]
        if name not in self.nodes:
            raise self._refuse(f"Failed to find node with node-name='{name}'")
        if self._users(name):
            raise self._refuse(f"Node '{name}' is busy: in use by {self._users(name)}")
        del self.nodes[name]

    def _export_add(self, spec: QMPArgs) -> None:
        if spec["id"] in self.block_exports:
            raise self._refuse(f"Block export id '{spec['id']}' is already in use")
        if spec["node-name"] not in self.nodes:
            raise self._refuse(f"Cannot find node {spec['node-name']}")
        self.block_exports[spec["id"]] = spec

    def _export_del(self, args: QMPArgs) -> None:
        if self.block_exports.pop(args["id"], None) is None:
            raise self._refuse(f"Export '{args['id']}' is not found")

    def _object_add(self, args: QMPArgs) -> None:
        if args["id"] in self.objects:
            raise self._refuse(f"attempt to add duplicate property '{args['id']}'")
        self.objects[args["id"]] = args

    def _object_del(self, args: QMPArgs) -> None:
        if args["id"] not in self.objects:
            raise self._refuse(f"object '{args['id']}' not found")
        if any(spec.get("throttle-group") == args["id"] for spec in self.nodes.values()):
            raise self._refuse(f"object '{args['id']}' is in use")
        del self.objects[args["id"]]

    def _object(self, path: str) -> QMPArgs:
        name = path.removeprefix("/objects/")
        if name not in self.objects:
            raise self._refuse(f"Device '{path}' not found")
        return self.objects[name]

    def _transaction(self, args: QMPArgs) -> None:
        """All or nothing, like QEMU's: every action is checked before any is applied."""
        actions = args["actions"]
        for action in actions:
            if action["type"] != "blockdev-snapshot":
                raise AssertionError(f"the fake QSD does not model transaction action {action['type']}")
            node, overlay = action["data"]["node"], action["data"]["overlay"]
            if node not in self.nodes or overlay not in self.nodes:
                raise self._refuse(f"Cannot find node {node if node not in self.nodes else overlay}")
            if self.nodes[overlay].get("backing") is not None:
                raise self._refuse(f"The overlay '{overlay}' already has a backing image")
        for action in actions:
            node, overlay = action["data"]["node"], action["data"]["overlay"]
            for spec in self.nodes.values():
                if spec.get("file") == node and spec["node-name"] != overlay:
                    spec["file"] = overlay
            self.nodes[overlay]["backing"] = node

    def _reopen(self, args: QMPArgs) -> None:
        for spec in args["options"]:
            name = spec["node-name"]
            if name not in self.nodes:
                raise self._refuse(f"Cannot find node {name}")
            if isinstance(spec.get("file"), str) and spec["file"] not in self.nodes:
                raise self._refuse(f"Cannot find node {spec['file']}")
        for spec in args["options"]:
            self.nodes[spec["node-name"]] = spec

    def _named_nodes(self, args: QMPArgs) -> list[QMPArgs]:
        return [{"node-name": name, "drv": spec["driver"], "file": self._filename(name),
                 "ro": bool(spec.get("read-only", False)), "dirty-bitmaps": []}
                for name, spec in self.nodes.items()]

    def _stream(self, args: QMPArgs) -> None:
        """Everything below the node is copied into it: it stands alone."""
        node = args["device"]
        if node not in self.nodes:
            raise self._refuse(f"Cannot find device={node}")
        self.nodes[node]["backing"] = None
        self.jobs[args["job-id"]] = {"device": args["job-id"], "status": "concluded"}

    def _cancel_job(self, args: QMPArgs) -> None:
        self.jobs[args["device"]]["status"] = "concluded"

    def _dismiss_job(self, args: QMPArgs) -> None:
        if self.jobs.pop(args["id"], None) is None:
            raise self._refuse(f"Job '{args['id']}' not found")

    def _resize(self, args: QMPArgs) -> None:
        if args["node-name"] not in self.nodes:
            raise self._refuse(f"Cannot find node {args['node-name']}")


_QUERIES = frozenset({"query-version", "x-debug-query-block-graph", "query-block-exports", "qom-list", "qom-get",
                      "query-named-block-nodes", "query-block-jobs"})
_HANDLERS: dict[str, Callable[[FakeQSDClient, QMPArgs], Any]] = {
    "query-version": lambda qsd, _: {"qemu": dict(zip(("major", "minor", "micro"), qsd.qemu_version))},
    "x-debug-query-block-graph": lambda qsd, _: None,
    "query-block-exports": lambda qsd, _: None,
    "qom-list": lambda qsd, _: None,
    "qom-get": lambda qsd, args: qsd._object(args["path"]).get(args["property"], {}),
    "qom-set": lambda qsd, args: qsd._object(args["path"]).__setitem__(args["property"], args["value"]),
    "blockdev-add": FakeQSDClient._blockdev_add,
    "blockdev-del": FakeQSDClient._blockdev_del,
    "block-export-add": FakeQSDClient._export_add,
    "block-export-del": FakeQSDClient._export_del,
    "object-add": FakeQSDClient._object_add,
    "object-del": FakeQSDClient._object_del,
    "transaction": FakeQSDClient._transaction,
    "blockdev-reopen": FakeQSDClient._reopen,
    "query-named-block-nodes": FakeQSDClient._named_nodes,
    "query-block-jobs": lambda qsd, _: list(copy.deepcopy(qsd.jobs).values()),
    "block-stream": FakeQSDClient._stream,
    "block-job-cancel": FakeQSDClient._cancel_job,
    "job-dismiss": FakeQSDClient._dismiss_job,
    "block_resize": FakeQSDClient._resize,
}


class FakeDaemon:
    """One shard's QSD as the domain sees it: whether it serves calls, and its client.

    `ready` alone models a QSD that answers but is not serving yet (starting,
    rebuilding); `stop` a QSD that is gone, whose client's calls fail.
    """

    def __init__(self, client: FakeQSDClient | None = None) -> None:
        self.client = client or FakeQSDClient()
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        self.client.up = False

    def restart(self) -> None:
        """A new QSD process: nothing of the old graph, a fresh session, not `ready` until rebuilt."""
        self.client.new_process()
        self.ready = False


def fake_shards(state_dir: Path, daemons: list[FakeDaemon]) -> QSDShards:
    """The driver's own `QSDShards` (placement and its map of volumes) over fake daemons."""
    shards = QSDShards(Config(state_dir=state_dir, qsd_shards=len(daemons)), len(daemons))
    shards.daemons = daemons  # type: ignore[assignment]
    return shards
