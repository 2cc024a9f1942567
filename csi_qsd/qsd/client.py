"""Typed async wrappers over `qemu.qmp.QMPClient` for the commands the driver uses.

Every command runs under a timeout and every QMP failure comes back as a
`QSDError` that names the command and QSD's own message, never a raw QMP
exception.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, TypedDict, cast

from qemu.qmp import EventListener, ExecuteError, QMPClient, QMPError, Runstate

from csi_qsd.errors import QSDError, QSDUnavailable
from csi_qsd.qsd.graph import QMPArgs

log = logging.getLogger(__name__)


class BlockExportInfo(TypedDict):
    id: str
    type: str
    node_name: str
    shutting_down: bool


class BlockNodeInfo(TypedDict):
    node_name: str
    drv: str
    file: str
    ro: bool
    virtual_size: int


class QSDClient:
    """One QMP session with one qemu-storage-daemon."""

    def __init__(self, name: str, timeout: float) -> None:
        self._qmp = QMPClient(name)
        self._timeout = timeout

    @property
    def connected(self) -> bool:
        return self._qmp.runstate is Runstate.RUNNING

    async def connect(self, socket: Path) -> None:
        try:
            await asyncio.wait_for(self._qmp.connect(str(socket)), self._timeout)
        except (QMPError, OSError, asyncio.TimeoutError) as exc:
            await self._reset()
            raise QSDError(f"cannot reach qemu-storage-daemon at {socket}: {exc or type(exc).__name__}") from exc

    async def disconnect(self) -> None:
        await self._reset()

    async def wait_disconnected(self) -> None:
        """Return once the daemon has gone away (QMP session lost), leaving the client reusable."""
        while self._qmp.runstate is Runstate.RUNNING:
            await self._qmp.runstate_changed()
        await self._reset()

    async def execute(self, command: str, arguments: QMPArgs | None = None) -> Any:
        try:
            return await asyncio.wait_for(self._qmp.execute(command, arguments), self._timeout)
        except ExecuteError as exc:
            raise QSDError(f"qemu-storage-daemon refused {command}: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise QSDUnavailable(
                f"qemu-storage-daemon did not answer {command} within {self._timeout}s; retry shortly"
            ) from exc
        except (QMPError, OSError) as exc:
            raise QSDUnavailable(
                f"qemu-storage-daemon went away during {command} ({exc}); it is being restarted, retry shortly"
            ) from exc

    async def version(self) -> tuple[int, int, int]:
        """QSD's QEMU version (major, minor, micro), as it reports itself over QMP."""
        raw = await self.execute("query-version")
        qemu = raw["qemu"]
        return int(qemu["major"]), int(qemu["minor"]), int(qemu["micro"])

    # graph --------------------------------------------------------------

    async def node_names(self) -> set[str]:
        """Names of every named node, cheaply: the graph without image details.

        `query-named-block-nodes` carries full image info for every node
        (hundreds of KiB with hundreds of volumes); the debug graph query
        carries names only. Falls back if this QSD lacks it.
        """
        try:
            graph = await self.execute("x-debug-query-block-graph")
        except QSDError:
            return set(await self.named_nodes())
        return {node["name"] for node in graph["nodes"] if node.get("type") == "block-driver" and node.get("name")
                and not node["name"].startswith("#")}

    async def named_nodes(self) -> dict[str, BlockNodeInfo]:
        raw = await self.execute("query-named-block-nodes", {"flat": True})
        nodes: dict[str, BlockNodeInfo] = {}
        for item in raw:
            nodes[item["node-name"]] = BlockNodeInfo(
                node_name=item["node-name"], drv=item["drv"], file=item["file"], ro=item["ro"],
                virtual_size=int(item.get("image", {}).get("virtual-size", 0)),
            )
        return nodes

    async def exports(self) -> dict[str, BlockExportInfo]:
        raw = await self.execute("query-block-exports")
        return {
            item["id"]: BlockExportInfo(
                id=item["id"], type=item["type"], node_name=item["node-name"],
                shutting_down=item["shutting-down"],
            )
            for item in raw
        }

    async def iothreads(self) -> set[str]:
        """IDs of the iothread objects (QSD has no query-iothreads; the QOM tree lists them)."""
        items = await self.execute("qom-list", {"path": "/objects"})
        return {item["name"] for item in items if item.get("type") == "child<iothread>"}

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

    async def run_job(self, command: str, arguments: QMPArgs, job_id: str) -> None:
        """Start a block job and wait, without a timeout, until it completes; raise QSDError if it failed."""
        listener = EventListener(("BLOCK_JOB_COMPLETED", "BLOCK_JOB_CANCELLED", "BLOCK_JOB_ERROR"))

        async def finished() -> None:
            async for event in listener:
                data = cast(dict[str, Any], event["data"])
                if data.get("device") != job_id:
                    continue
                if event["event"] == "BLOCK_JOB_COMPLETED" and not data.get("error"):
                    return
                if event["event"] == "BLOCK_JOB_ERROR":
                    continue  # the job's on-error policy decides; completion or cancel follows
                raise QSDError(f"block job {job_id} ended without success: {data.get('error', event['event'])}")

        async def session_lost() -> None:
            while self._qmp.runstate is Runstate.RUNNING:
                await self._qmp.runstate_changed()
            raise QSDError(f"qemu-storage-daemon went away during block job {job_id}")

        with self._qmp.listen(listener):
            await self.execute(command, arguments)
            waiters = [asyncio.create_task(finished()), asyncio.create_task(session_lost())]
            try:
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
                await asyncio.gather(*waiters, return_exceptions=True)
            done.pop().result()

    async def block_resize(self, node_name: str, size: int) -> None:
        await self.execute("block_resize", {"node-name": node_name, "size": size})

    async def blockstats(self) -> list[dict[str, Any]]:
        return cast(list[dict[str, Any]], await self.execute("query-blockstats", {"query-nodes": True}))

    async def quit(self) -> None:
        await self.execute("quit")

    # plumbing -----------------------------------------------------------

    async def _reset(self) -> None:
        try:
            await self._qmp.disconnect()
        except Exception as exc:  # disconnect re-raises whatever ended the session (EOF, reset, ...)
            log.debug("qmp session ended: %r", exc)

