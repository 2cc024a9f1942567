"""The client's own record of QSD's named nodes, exports and objects.

The driver is QSD's only QMP client, so it can know what QSD holds without
asking: every listing of the whole graph (`x-debug-query-block-graph`,
`query-block-exports`, `qom-list /objects`) costs QSD a reply that grows
with the node count, and glibc keeps the heap high-water mark those replies
leave between the nodes added after them. One listing per stage made QSD
hold 615 KiB per idle volume at 300 volumes where the nodes themselves need
169 KiB (QSD 10.0.13, measured with the same nodes and exports).

The record is a cache with a strict rule: it is only ever kept from a
listing plus the effects of commands that QSD confirmed. A command whose
effect on names is not known here (a transaction, a block job, anything
new), any failed or unanswered command, a new session, or an event saying
QSD changed the graph by itself (an export gone, a job ended) drops the
record, and the next question lists again. A listing that was overtaken by
a confirmed change is answered but not kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypedDict

# Commands that never add, remove or rename a node, an export or an object.
NEUTRAL = frozenset({
    "qmp_capabilities", "query-version", "query-block-exports", "query-named-block-nodes",
    "query-blockstats", "query-block-jobs", "query-jobs", "x-debug-query-block-graph",
    "qom-list", "qom-get", "qom-set", "block_resize", "blockdev-reopen", "block-set-write-threshold",
    "block-dirty-bitmap-add", "block-dirty-bitmap-remove", "block-dirty-bitmap-clear",
    "block-dirty-bitmap-enable", "block-dirty-bitmap-disable", "block-dirty-bitmap-merge",
})

# Events after which QSD's graph may differ from what the commands said: an export that ended
# (cut off, or its FUSE mount gone) and block jobs that ended (a stream removes the nodes it merged).
EVENTS = ("BLOCK_EXPORT_DELETED", "BLOCK_JOB_COMPLETED", "BLOCK_JOB_CANCELLED", "JOB_STATUS_CHANGE")
JOB_ENDED = frozenset({"concluded", "null"})


class BlockExportInfo(TypedDict):
    """An export as `query-block-exports` describes it, the fields the driver reads."""

    id: str
    type: str
    node_name: str
    shutting_down: bool


class GraphView:
    """What QSD holds, as far as confirmed commands tell; None in a field means "list it again"."""

    def __init__(self) -> None:
        self.nodes: set[str] | None = None
        self.exports: dict[str, BlockExportInfo] | None = None
        self.objects: dict[str, str] | None = None  # id -> QOM child type, e.g. "child<throttle-group>"
        #: Bumped by every change, so a listing that a change overtook is not kept.
        self.epoch = 0

    def forget(self) -> None:
        self.nodes = None
        self.exports = None
        self.objects = None
        self.epoch += 1

    def failed(self, command: str) -> None:
        """A command was refused, cut off or left unanswered: what it did is not known for sure."""
        if command not in NEUTRAL:
            self.forget()

    def confirmed(self, command: str, arguments: dict[str, Any] | None, ended_exports: set[str]) -> None:
        """QSD answered `command` with success: apply its effect, or forget what it may have changed.

        `ended_exports`: exports QSD said it deleted while the command was
        answered. Events and answers are not ordered against each other here,
        so an export added under one of those IDs is listed again rather than guessed.
        """
        if command in NEUTRAL:
            return
        args = arguments or {}
        self.epoch += 1
        if command == "block-export-add" and str(args.get("id")) in ended_exports:
            self.exports = None
            return
        if command == "blockdev-add":
            if self.nodes is not None:
                self.nodes.update(_named_nodes(args))
        elif command == "blockdev-del":
            if self.nodes is not None:
                self.nodes.discard(str(args.get("node-name")))
        elif command == "object-add":
            if self.objects is not None:
                self.objects[str(args["id"])] = f"child<{args['qom-type']}>"
        elif command == "object-del":
            if self.objects is not None:
                self.objects.pop(str(args.get("id")), None)
        elif command == "block-export-add":
            if self.exports is not None:
                export_id = str(args["id"])
                self.exports[export_id] = BlockExportInfo(
                    id=export_id, type=str(args["type"]), node_name=str(args["node-name"]), shutting_down=False)
        elif command == "block-export-del":
            # QSD removes the export once its clients are gone and says so with BLOCK_EXPORT_DELETED.
            if self.exports is not None and (export := self.exports.get(str(args.get("id")))) is not None:
                export["shutting_down"] = True
        else:
            self.forget()

    def event(self, name: str, data: dict[str, Any]) -> None:
        """QSD changed something by itself."""
        if name == "BLOCK_EXPORT_DELETED":
            self.epoch += 1
            if self.exports is not None:
                self.exports.pop(str(data.get("id")), None)
        elif name != "JOB_STATUS_CHANGE" or data.get("status") in JOB_ENDED:
            self.forget()


def _named_nodes(spec: dict[str, Any]) -> Iterator[str]:
    """Every node name a blockdev-add creates: the node's own and those of children defined inline."""
    name = spec.get("node-name")
    if isinstance(name, str):
        yield name
    for value in spec.values():
        if isinstance(value, dict) and "driver" in value:
            yield from _named_nodes(value)
