"""Typed async wrappers over `qemu.qmp.QMPClient` for the commands the driver uses.

Every command runs under a timeout and every QMP failure comes back as a
`QSDError` that names the command and QSD's own message, never a raw QMP
exception; a refusal keeps QEMU's `error_class`, so callers decide by class.
A command QSD does not answer within the timeout is reported to the owner of
the client (the daemon supervisor), which treats a silent monitor as a dead
QSD. QMP JSON never leaves this package: results come back as TypedDicts.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypedDict, TypeVar, cast

from qemu.qmp import EventListener, ExecuteError, QMPClient, QMPError, Runstate

from csi_qsd.errors import InFlight, NoAnswer, QSDError, QSDNoAnswer, QSDUnavailable
from csi_qsd.qsd.graph import QMPArgs
from csi_qsd.qsd.view import EVENTS, BlockExportInfo, GraphView

log = logging.getLogger(__name__)
T = TypeVar("T")


# Every block job is made so: it waits for `finish_job` to finalize and dismiss it (see there why).
JOB_BY_HAND: QMPArgs = {"auto-finalize": False, "auto-dismiss": False}
JOB_POLL = 0.05

class BlockNodeInfo(TypedDict):
    node_name: str
    drv: str
    file: str
    ro: bool
    virtual_size: int


def node_info(item: dict[str, Any]) -> BlockNodeInfo:
    """One entry of `query-named-block-nodes` (QMP's BlockDeviceInfo), the fields read here."""
    return BlockNodeInfo(node_name=item["node-name"], drv=item["drv"], file=item["file"], ro=item["ro"],
                         virtual_size=int(item.get("image", {}).get("virtual-size", 0)))


class _RawBlockStatsCounters(TypedDict, total=False):
    """The part of QMP's BlockDeviceStats the driver reads (QEMU sends many more)."""

    wr_highest_offset: int
    rd_bytes: int
    wr_bytes: int
    rd_operations: int
    wr_operations: int
    flush_operations: int


# One entry of `query-blockstats` with query-nodes=true (QMP's BlockStats), the fields read here.
_RawBlockStats = TypedDict("_RawBlockStats", {"node-name": str, "stats": _RawBlockStatsCounters}, total=False)


class NodeStats(TypedDict):
    """Per-node figures from `query-blockstats`.

    On export backends QSD counts nothing (they are anonymous and skipped),
    so of the node-level counters only `wr_highest_offset` carries meaning;
    the others are kept for nodes a future QEMU does count.
    """

    node_name: str
    wr_highest_offset: int
    rd_bytes: int
    wr_bytes: int
    rd_operations: int
    wr_operations: int
    flush_operations: int


def parse_blockstats(raw: list[_RawBlockStats]) -> dict[str, NodeStats]:
    """Node name → figures, for every named node in a `query-blockstats` reply (anonymous ones skipped)."""
    found: dict[str, NodeStats] = {}
    for entry in raw:
        name = entry.get("node-name")
        stats = entry.get("stats")
        if not isinstance(name, str) or not name or not isinstance(stats, dict):
            continue
        found[name] = NodeStats(
            node_name=name,
            wr_highest_offset=int(stats.get("wr_highest_offset", 0)),
            rd_bytes=int(stats.get("rd_bytes", 0)),
            wr_bytes=int(stats.get("wr_bytes", 0)),
            rd_operations=int(stats.get("rd_operations", 0)),
            wr_operations=int(stats.get("wr_operations", 0)),
            flush_operations=int(stats.get("flush_operations", 0)),
        )
    return found


class _ShortIds(QMPClient):
    """qemu.qmp's client, naming each command with a few characters instead of eleven (`__qmp#00042`).

    QSD's monitor reads its input one byte per system call (about 3 us a
    byte, measured on QSD 10.0.13 and 11.1.3), so a stage's four commands
    wait about 0.1 ms for their IDs alone. Replies are matched by ID however
    it is spelt; a qemu.qmp that stops asking this method keeps its own IDs.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._next_id = itertools.count()

    def _get_exec_id(self) -> str:
        return f"#{next(self._next_id):x}"


class QSDClient:
    """One QMP session with one qemu-storage-daemon."""

    def __init__(self, name: str, timeout: float) -> None:
        self._qmp = _ShortIds(name)
        self._timeout = timeout
        self._tokens = itertools.count()
        self._in_flight: dict[int, InFlight] = {}
        self._last_answer = 0.0
        #: Bumped on every connect, so a report about an old session is told from one about this one.
        self.session = 0
        #: Called (synchronously) when QSD leaves a command unanswered past the timeout.
        self.on_no_answer: Callable[[NoAnswer], None] | None = None
        self._view = GraphView()
        self._events: EventListener | None = None

    @property
    def connected(self) -> bool:
        return self._qmp.runstate is Runstate.RUNNING

    @property
    def timeout(self) -> float:
        return self._timeout

    def in_flight(self) -> tuple[InFlight, ...]:
        """Commands sent and not yet answered, oldest first."""
        return tuple(sorted(self._in_flight.values(), key=lambda item: item.started))

    def idle_for(self) -> float:
        """Seconds since QSD last answered a command on this session (0 while one is in flight)."""
        if self._in_flight:
            return 0.0
        return asyncio.get_running_loop().time() - self._last_answer

    async def connect(self, socket: Path) -> None:
        """Open a session; raise QSDNoAnswer if QSD accepts but never greets, QSDError if unreachable."""
        loop = asyncio.get_running_loop()
        self.session += 1
        started = loop.time()
        try:
            await asyncio.wait_for(self._qmp.connect(str(socket)), self._timeout)
        except asyncio.TimeoutError as exc:
            await self._reset()
            # The socket took the connection (the kernel's backlog does that for a frozen QSD),
            # but QSD never sent its greeting: the monitor is stuck.
            report = NoAnswer("qmp_capabilities", loop.time() - started, self.session, ())
            raise QSDNoAnswer(
                f"qemu-storage-daemon at {socket} accepted a connection but did not greet within "
                f"{self._timeout}s", report,
            ) from exc
        except (QMPError, OSError) as exc:
            await self._reset()
            raise QSDError(f"cannot reach qemu-storage-daemon at {socket}: {exc or type(exc).__name__}") from exc
        self._last_answer = loop.time()
        self._view.forget()
        self._events = EventListener(EVENTS)
        self._qmp.register_listener(self._events)

    async def disconnect(self) -> None:
        await self._reset()

    async def wait_disconnected(self) -> None:
        """Return once the daemon has gone away (QMP session lost), leaving the client reusable."""
        while self._qmp.runstate is Runstate.RUNNING:
            await self._qmp.runstate_changed()
        await self._reset()

    async def execute(self, command: str, arguments: QMPArgs | None = None) -> Any:
        """Run one command; raise QSDError (with `error_class`) if refused, QSDUnavailable if cut off.

        A command left unanswered past the timeout raises QSDNoAnswer and is
        reported through `on_no_answer` first.
        """
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        started = loop.time()
        self._in_flight[token] = InFlight(command, started, self.session)
        try:
            result = await self._send(command, arguments, started)
        except BaseException:
            self._view.failed(command)
            raise
        finally:
            del self._in_flight[token]
        self._last_answer = loop.time()
        self._view.confirmed(command, arguments, self._take_events())
        return result

    async def execute_in_turn(self, commands: list[tuple[str, QMPArgs]]) -> list[Any | QSDError]:
        """Send `commands` at once, in order, and collect every answer: each result, or the QSDError of a refusal.

        QSD's monitor runs them one after the other as they arrive, so this
        saves a round trip per command, not QSD's work. A QSD that goes away
        or leaves one unanswered raises, as `execute` does.
        """
        answers = await asyncio.gather(*(self.execute(c, a) for c, a in commands), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and (
                    isinstance(answer, QSDUnavailable) or not isinstance(answer, QSDError)):
                raise answer
        return answers

    async def _send(self, command: str, arguments: QMPArgs | None, started: float) -> Any:
        """One command on the wire, its failures translated into the driver's errors."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout):  # no task per command, as wait_for would make
                return await self._qmp.execute(command, arguments)
        except ExecuteError as exc:
            self._last_answer = loop.time()
            raise QSDError(f"qemu-storage-daemon refused {command}: {exc}", error_class=exc.error_class) from exc
        except asyncio.TimeoutError as exc:
            report = NoAnswer(command, loop.time() - started, self.session, self.in_flight())
            if self.on_no_answer is not None:
                self.on_no_answer(report)
            raise QSDNoAnswer(
                f"qemu-storage-daemon did not answer {command} within {self._timeout}s; "
                "it is being replaced, retry shortly", report,
            ) from exc
        except (QMPError, OSError) as exc:
            raise QSDUnavailable(
                f"qemu-storage-daemon went away during {command} ({exc}); it is being restarted, retry shortly"
            ) from exc

    def _take_events(self) -> set[str]:
        """Hand the events QSD sent since the last look to the view; the IDs of exports that ended among them."""
        ended: set[str] = set()
        for event in self._events.clear() if self._events is not None else []:
            name, data = str(event["event"]), cast(dict[str, Any], event.get("data", {}))
            if name == "BLOCK_EXPORT_DELETED":
                ended.add(str(data.get("id")))
            self._view.event(name, data)
        return ended

    async def version(self) -> tuple[int, int, int]:
        """QSD's QEMU version (major, minor, micro), as it reports itself over QMP."""
        raw = await self.execute("query-version")
        qemu = raw["qemu"]
        return int(qemu["major"]), int(qemu["minor"]), int(qemu["micro"])

    async def ping(self) -> None:
        """The cheapest command that needs QSD's monitor to turn: proof of life, bounded like any other."""
        await self.execute("query-version")

    # graph --------------------------------------------------------------

    async def _recorded(self, part: str, listing: Callable[[], Awaitable[T]]) -> T:
        """One part of the client's record (`view.GraphView`), or QSD's listing of it where the record has none.

        A listing is kept unless a confirmed change overtook it; callers get copies either way.
        """
        self._take_events()
        kept = getattr(self._view, part)
        if kept is not None:
            return cast(T, copy.deepcopy(kept))
        epoch = self._view.epoch
        listed = await listing()
        if self._view.epoch == epoch:
            setattr(self._view, part, copy.deepcopy(listed))
        return listed

    async def node_names(self) -> set[str]:
        """Names of every named node."""
        return await self._recorded("nodes", self._list_node_names)

    async def _list_node_names(self) -> set[str]:
        """Every named node, asked of QSD: the debug graph query carries names only.

        `query-named-block-nodes` carries full image info for every node
        (hundreds of KiB with hundreds of volumes); it is the fallback for a
        QSD that lacks the debug query.
        """
        try:
            graph = await self.execute("x-debug-query-block-graph")
        except QSDError as exc:
            if exc.error_class != "CommandNotFound":
                raise
            return set(await self.named_nodes())
        return {node["name"] for node in graph["nodes"] if node.get("type") == "block-driver" and node.get("name")
                and not node["name"].startswith("#")}

    async def child_of(self, node: str, role: str = "file") -> str | None:
        """The name of `node`'s child in `role` (None if it has none, or the child has no name)."""
        graph = await self.execute("x-debug-query-block-graph")
        names = {item["id"]: item.get("name") for item in graph["nodes"]}
        parents = [item["id"] for item in graph["nodes"] if item.get("name") == node and item.get("type") == "block-driver"]
        for edge in graph["edges"]:
            if edge["parent"] in parents and edge["name"] == role:
                name = names.get(edge["child"])
                return str(name) if name and not str(name).startswith("#") else None
        return None

    async def named_nodes(self) -> dict[str, BlockNodeInfo]:
        raw = await self.execute("query-named-block-nodes", {"flat": True})
        return {item["node-name"]: node_info(item) for item in raw}

    async def corrupt_nodes(self) -> set[str]:
        """Names of the qcow2 nodes QSD has found corrupt (it marks them so and stops writing to them)."""
        raw = await self.execute("query-named-block-nodes", {"flat": True})
        found = set()
        for item in raw:
            specific = item.get("image", {}).get("format-specific", {})
            if specific.get("type") == "qcow2" and specific.get("data", {}).get("corrupt"):
                found.add(item["node-name"])
        return found

    async def exports(self) -> dict[str, BlockExportInfo]:
        """Every export by ID."""
        return await self._recorded("exports", self._list_exports)

    async def _list_exports(self) -> dict[str, BlockExportInfo]:
        raw = await self.execute("query-block-exports")
        return {
            item["id"]: BlockExportInfo(
                id=item["id"], type=item["type"], node_name=item["node-name"],
                shutting_down=item["shutting-down"],
            )
            for item in raw
        }

    async def _objects(self) -> dict[str, str]:
        """QOM objects under /objects: id -> child type."""
        return await self._recorded("objects", self._list_objects)

    async def _list_objects(self) -> dict[str, str]:
        items = await self.execute("qom-list", {"path": "/objects"})
        return {str(item["name"]): str(item.get("type", "")) for item in items}

    async def iothreads(self) -> set[str]:
        """IDs of the iothread objects (QSD has no query-iothreads; the QOM tree lists them)."""
        return {name for name, kind in (await self._objects()).items() if kind == "child<iothread>"}

    async def throttle_groups(self) -> set[str]:
        """IDs of the throttle-group objects (from the QOM tree, like iothreads)."""
        return {name for name, kind in (await self._objects()).items() if kind == "child<throttle-group>"}

    async def throttle_limits(self, group: str) -> QMPArgs:
        """A throttle group's limits as QEMU holds them (ThrottleLimits, every field)."""
        return cast(QMPArgs, await self.execute("qom-get", {"path": f"/objects/{group}", "property": "limits"}))

    async def set_throttle_limits(self, group: str, limits: QMPArgs) -> None:
        """Change a throttle group's limits live; QEMU changes only the fields given and refuses bad ones."""
        await self.execute("qom-set", {"path": f"/objects/{group}", "property": "limits", "value": limits})

    async def blockdev_add(self, spec: QMPArgs) -> None:
        await self.execute("blockdev-add", spec)

    async def blockdev_del(self, node_name: str) -> None:
        await self.execute("blockdev-del", {"node-name": node_name})

    async def export_add(self, spec: QMPArgs) -> None:
        await self.execute("block-export-add", spec)

    async def export_del(self, export_id: str) -> None:
        """Remove an export and wait until QSD reports it gone (clients are cut off)."""
        listener = EventListener(("BLOCK_EXPORT_DELETED",))
        with self._qmp.listen(listener):
            if export_id not in await self.exports():
                return
            await self.execute("block-export-del", {"id": export_id, "mode": "hard"})
            async def deleted() -> None:
                async for event in listener:
                    data = cast(dict[str, Any], event["data"])
                    if data.get("id") == export_id:
                        return
            try:
                await asyncio.wait_for(deleted(), self._timeout)
            except asyncio.TimeoutError as exc:
                raise QSDError(f"export {export_id} was not removed within {self._timeout}s") from exc

    async def stream(self, job_id: str, node: str, before_finalize: Callable[[], Awaitable[None]] | None = None,
                     ) -> None:
        """Flatten into `node`: copy everything below it into it (block-stream), and wait for the end.

        `before_finalize` runs once the copy is done, while `node` is still
        open read-write and the images below it still in the graph; if it
        fails, the job is cancelled and its error raised. No timeout on the
        copy itself (it takes as long as the data); a QSD that goes away ends
        it with QSDUnavailable. Raises QSDError if the job fails.
        """
        await self.execute("block-stream", {"job-id": job_id, "device": node, **JOB_BY_HAND})
        await self.finish_job(job_id, before_finalize)

    async def run_job(self, command: str, arguments: QMPArgs, job_id: str) -> None:
        """Start a block job (made with `JOB_BY_HAND`) and see it through, without a timeout; QSDError if it failed."""
        await self.execute(command, arguments)
        await self.finish_job(job_id)

    async def job(self, job_id: str) -> QMPArgs | None:
        """The block job `job_id` as query-block-jobs shows it (ready, actively-synced…), or None."""
        for info in await self.execute("query-block-jobs"):
            if info["device"] == job_id:
                return dict(info)
        return None

    async def finish_plain_job(self, job_id: str) -> None:
        """Wait for a job that is no block job (an amend: query-jobs lists it, query-block-jobs does not) and
        finalizes itself to conclude, then dismiss it; nothing if there is none. QSDError if it failed."""
        while True:
            info = next((job for job in await self.execute("query-jobs") if job["id"] == job_id), None)
            if info is None:
                return
            if info["status"] == "concluded":
                await self.execute("job-dismiss", {"id": job_id})
                if info.get("error"):
                    raise QSDError(f"job {job_id} ended without success: {info['error']}")
                return
            await asyncio.sleep(JOB_POLL)

    async def finish_job(self, job_id: str, before_finalize: Callable[[], Awaitable[None]] | None = None) -> None:
        """Wait for a job made with `JOB_BY_HAND` to end: finalize it from here, dismiss it; QSDError if it failed.

        Finalizing drains the job's nodes. QSD 10.0's FUSE export serves a
        request inside its fd handler, polling the main loop until the
        request is done; a job left to finalize itself does so from that
        loop, so it can drain inside such a request and wait for it forever
        (measured: a full backup under a writing xfs hung QSD in 5 of 6 runs).
        The monitor runs commands outside those polls, so a job-finalize
        sent here cannot.
        """
        failed: BaseException | None = None
        while True:
            info = await self.job(job_id)
            if info is None:
                raise QSDError(f"block job {job_id} is gone")
            if info["status"] == "pending" and before_finalize is not None:
                step, before_finalize = before_finalize, None
                try:
                    await step()
                except QSDError as exc:
                    failed = exc
                    await self.execute("job-cancel", {"id": job_id})
                    continue
            if info["status"] == "pending" and failed is None:
                await self.execute("job-finalize", {"id": job_id})
            elif info["status"] == "concluded":
                await self.execute("job-dismiss", {"id": job_id})
                if failed is not None:
                    raise failed
                if info.get("error"):
                    raise QSDError(f"block job {job_id} ended without success: {info['error']}")
                return
            await asyncio.sleep(JOB_POLL)

    async def block_resize(self, node_name: str, size: int) -> None:
        await self.execute("block_resize", {"node-name": node_name, "size": size})

    async def blockstats(self) -> dict[str, NodeStats]:
        """Figures of every named node (`query-blockstats` with query-nodes), by node name."""
        raw = await self.execute("query-blockstats", {"query-nodes": True})
        return parse_blockstats(cast(list[_RawBlockStats], raw))

    async def quit(self) -> None:
        await self.execute("quit")

    # plumbing -----------------------------------------------------------

    async def _reset(self) -> None:
        self._view.forget()
        if self._events is not None:
            self._qmp.remove_listener(self._events)
            self._events = None
        try:
            await self._qmp.disconnect()
        except Exception as exc:  # disconnect re-raises whatever ended the session (EOF, reset, ...)
            log.debug("qmp session ended: %r", exc)

