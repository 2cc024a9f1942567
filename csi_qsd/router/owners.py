"""Which node holds a snapshot: asked of every node plugin once, then remembered.

A snapshot ID (`snap-` and 96 random bits) does not name its node, and
Kubernetes records the node only indirectly (the source volume's PV
affinity). The node plugins know for certain: each answers GetSnapshot from
its own catalog. A miss asks all of them at once and takes the first that
holds the snapshot; a snapshot never moves, so the answer is cached (LRU)
and forgotten only when that node no longer knows the snapshot or cannot be
reached. No node holds it: NOT_FOUND, unless a node could not be asked, in
which case the snapshot may be there: UNAVAILABLE, naming that node.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import grpc

from csi_qsd import validate
from csi_qsd.csi_pb import csi_pb2 as pb
from csi_qsd.errors import NotFound, Unavailable
from csi_qsd.router.nodes import Node, NodeDirectory

log = logging.getLogger(__name__)

# What a node answered: it holds the snapshot, it does not, or why it could not tell.
Verdict = bool | str


class Owners:
    def __init__(self, directory: NodeDirectory, timeout: float, cache_size: int) -> None:
        self._directory = directory
        self._timeout = timeout
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[str, Node] = collections.OrderedDict()

    async def locate(self, snapshot_id: str, nodes: list[Node] | None = None) -> Node:
        """The node that holds `snapshot_id`, among `nodes` (default: the directory's now).

        Raises NotFound or Unavailable (see the module's docstring).
        """
        validate.snapshot_id(snapshot_id)
        if nodes is None:
            nodes = await self._directory.nodes()
        cached = self._cache.get(snapshot_id)
        if cached is not None and cached in nodes:
            self._cache.move_to_end(snapshot_id)
            return cached
        self.forget(snapshot_id)
        if not nodes:
            raise Unavailable(f"no node plugin is known, so snapshot {snapshot_id} cannot be found")
        owner, unreachable = await self._ask_all(nodes, snapshot_id)
        if owner is not None:
            self._cache[snapshot_id] = owner
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            log.debug("event=snapshot_located snapshot_id=%s node=%s", snapshot_id, owner.name)
            return owner
        if unreachable:
            raise Unavailable(f"snapshot {snapshot_id} is on none of the {len(nodes) - len(unreachable)} nodes that "
                              f"answered; could not ask: {'; '.join(unreachable)}")
        raise NotFound(f"snapshot {snapshot_id} does not exist on any of the {len(nodes)} nodes")

    def forget(self, snapshot_id: str) -> None:
        self._cache.pop(snapshot_id, None)

    async def _ask_all(self, nodes: list[Node], snapshot_id: str) -> tuple[Node | None, list[str]]:
        """The first node that holds the snapshot (the others' questions cancelled), and who could not be asked."""
        tasks = [asyncio.ensure_future(self._ask(node, snapshot_id)) for node in nodes]
        unreachable: list[str] = []
        try:
            for next_answer in asyncio.as_completed(tasks):
                node, verdict = await next_answer
                if verdict is True:
                    return node, unreachable
                if isinstance(verdict, str):
                    unreachable.append(f"{node.name} ({verdict})")
            return None, unreachable
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _ask(self, node: Node, snapshot_id: str) -> tuple[Node, Verdict]:
        try:
            await self._directory.controller(node).GetSnapshot(
                pb.GetSnapshotRequest(snapshot_id=snapshot_id), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return node, False
            return node, f"{node.address}: {exc.code().name}: {exc.details()}"
        return node, True
