"""The copy services this node answers: `csi_qsd.v1.Copies` for its peers, `csi_qsd.v1.CopyLeases` for its operator.

Each node has a certificate of its own, from the cluster CA, whose common
name and a DNS name are its node name (`csi_qsd.transport.tls`), for TLS
server and client use (with SPIRE, its SPIFFE ID `…/csi-qsd/node/<node>`
decides). A caller proves which node it is by that certificate: the service
answers only a node this node knows as a peer, and only for itself (a Lease
whose `node` is another, or a Lease or Release of a copy leased to another
node, is PERMISSION_DENIED naming both). The router's certificate names no
node, so it is refused here.

No node may take more than its share: each caller has at most
--copy-calls-per-node calls in flight here (`CopyCallsCopyCallsInFlight`) and holds
at most --copy-leases-per-node leases (`CopySources`); beyond either it is
RESOURCE_EXHAUSTED, naming the limit and the caller, and the other nodes are
served as before. The operator's service (`csi-qsd volume leases`,
`drop-lease`, `lift-lease`) is served on the driver's own UNIX socket only.
"""


from __future__ import annotations

import collections
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc

from csi_qsd import validate
from csi_qsd.config import DEFAULT_COPY_CALLS_PER_NODE
from csi_qsd.controller.copy_sources import CopySources
from csi_qsd.errors import (
    DriverError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from csi_qsd.sys import x509_name
from csi_qsd.transport.copy_peers import LEASES_SERVICE, SERVICE, CopyPeerList, decode_message, encode_message
from csi_qsd.transport.tls import caller_name

log = logging.getLogger(__name__)

_NODE_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?\Z")


def _text(request: dict[str, Any], key: str) -> str:
    value = request.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{key} is required")
    return value


def client_subject(context: grpc.aio.ServicerContext) -> str:
    """The subject of the caller's certificate as QEMU writes it (`csi_qsd.sys.x509_name`): the one identity its
    copy server will let in. Raises FailedPrecondition if it cannot be written exactly."""
    pems = list(context.auth_context().get("x509_pem_cert", ()))
    try:
        if len(pems) != 1:
            raise ValueError("no client certificate")
        return x509_name.pem_subject(pems[0])
    except ValueError as exc:
        raise FailedPrecondition(
            f"the caller's certificate ({caller_name(context) or 'no name'}) has a subject its copy server could "
            f"not match exactly: {exc}; give each node a certificate whose subject holds plain names") from None


class CopyCallsInFlight:
    """The copy calls each node has in flight here, at most `limit` at once per node."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._calls: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def call(self, node: str) -> Iterator[None]:
        """One call of `node` while the block runs. Raises ResourceExhausted if it has `limit` in flight."""
        if self._calls[node] >= self._limit:
            raise ResourceExhausted(
                f"node {node} has {self._calls[node]} copy calls in flight on this node, the most one node may "
                f"have (--copy-calls-per-node {self._limit}); it may call again once some have answered")
        self._calls[node] += 1
        try:
            yield
        finally:
            self._calls[node] -= 1
            if not self._calls[node]:
                del self._calls[node]


def copy_handler(leases: CopySources, peers: CopyPeerList,
                   calls_per_node: int = DEFAULT_COPY_CALLS_PER_NODE) -> grpc.GenericRpcHandler:
    """`csi_qsd.v1.Copies` for the listener: Lease and Release for the nodes `peers` names, each for itself only,
    at most `calls_per_node` of them in flight per node.

    Errors are answered with their codes; a caller whose certificate names
    no node of `peers`, or asks for another node, is PERMISSION_DENIED; one
    with as many calls in flight as a node may have, RESOURCE_EXHAUSTED.
    """
    in_flight = CopyCallsInFlight(calls_per_node)

    async def caller(context: grpc.aio.ServicerContext) -> str:
        name = caller_name(context)
        known = await peers.current()
        if name not in known:
            raise PermissionDenied(
                f"the caller's certificate names {name or 'nothing'!r}, not a node this node copies with "
                f"({peers.described()}: {', '.join(sorted(known)) or 'none'}); each node needs a certificate "
                "whose common name is its node name")
        return name

    async def lease(request: dict[str, Any], context: grpc.aio.ServicerContext) -> dict[str, Any]:
        async def grant() -> dict[str, Any]:
            asking = await caller(context)
            with in_flight.call(asking):
                return await granted(asking)

        async def granted(asking: str) -> dict[str, Any]:
            copy_volume_id = validate.volume_id(_text(request, "copy_volume_id"), "copy_volume_id")
            node = _text(request, "node")
            if not _NODE_RE.match(node):
                raise InvalidArgument(f"node {node!r} is not a node name")
            if node != asking:
                raise PermissionDenied(f"node {asking} asked for a lease for node {node}: a node leases for itself "
                                       "only")
            got = await leases.lease(copy_volume_id, node, _text(request, "source"), client_subject(context))
            return {"snapshot_id": got.snapshot_id, "address": got.address, "export": got.export, "size": got.size,
                    "ttl": got.ttl, "encrypted": got.encrypted, "older": list(got.older)}
        return await _answer("CopyLease", request, context, grant)

    async def release(request: dict[str, Any], context: grpc.aio.ServicerContext) -> dict[str, Any]:
        async def give_back() -> dict[str, Any]:
            asking = await caller(context)
            with in_flight.call(asking):
                return await given_back(asking)

        async def given_back(asking: str) -> dict[str, Any]:
            node = request.get("node", asking)
            if node != asking:
                raise PermissionDenied(f"node {asking} asked to release a lease for node {node}: a node releases "
                                       "its own only")
            await leases.release(validate.volume_id(_text(request, "copy_volume_id"), "copy_volume_id"), asking)
            return {}
        return await _answer("CopyRelease", request, context, give_back)

    handler = {"request_deserializer": decode_message, "response_serializer": encode_message}
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Lease": grpc.unary_unary_rpc_method_handler(lease, **handler),
        "Release": grpc.unary_unary_rpc_method_handler(release, **handler),
    })


def copy_leases_handler(leases: CopySources) -> grpc.GenericRpcHandler:
    """`csi_qsd.v1.CopyLeases` for this node's operator, on the driver's own UNIX socket only (never the
    listener): List the leases this node serves, Drop one, Lift a drop (`csi-qsd volume leases`, `drop-lease`,
    `lift-lease`)."""

    async def listed(request: dict[str, Any], context: grpc.aio.ServicerContext) -> dict[str, Any]:
        async def work() -> dict[str, Any]:
            return {"leases": [
                {"copy_volume_id": r.volume_id, "node": r.node, "source": r.source, "state": r.state.value,
                 "snapshot_id": r.snapshot_id, "address": r.address, "idle_seconds": round(idle, 1)}
                for r, idle in await leases.leases()]}
        return await _answer("CopyLeaseList", request, context, work)

    async def drop(request: dict[str, Any], context: grpc.aio.ServicerContext) -> dict[str, Any]:
        async def work() -> dict[str, Any]:
            record = await leases.drop(validate.volume_id(_text(request, "copy_volume_id"), "copy_volume_id"))
            return {"copy_volume_id": record.volume_id, "node": record.node, "snapshot_id": record.snapshot_id}
        return await _answer("CopyLeaseDrop", request, context, work)

    async def lift(request: dict[str, Any], context: grpc.aio.ServicerContext) -> dict[str, Any]:
        async def work() -> dict[str, Any]:
            record = await leases.lift(validate.volume_id(_text(request, "copy_volume_id"), "copy_volume_id"))
            return {"copy_volume_id": record.volume_id, "node": record.node}
        return await _answer("CopyLeaseLift", request, context, work)

    handler = {"request_deserializer": decode_message, "response_serializer": encode_message}
    return grpc.method_handlers_generic_handler(LEASES_SERVICE, {
        "List": grpc.unary_unary_rpc_method_handler(listed, **handler),
        "Drop": grpc.unary_unary_rpc_method_handler(drop, **handler),
        "Lift": grpc.unary_unary_rpc_method_handler(lift, **handler),
    })


async def _answer(method: str, request: dict[str, Any], context: grpc.aio.ServicerContext,
                  work: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    start = time.monotonic()
    ident = request.get("copy_volume_id", "")
    try:
        answer = await work()
    except DriverError as exc:
        log.info("rpc=%s copy_volume_id=%s caller=%s code=%s error=%r seconds=%.4f", method, ident,
                 caller_name(context) or "-", exc.code.value, str(exc), time.monotonic() - start)
        await context.abort(getattr(grpc.StatusCode, exc.code.value), str(exc))
        raise
    except Exception:
        log.exception("rpc=%s copy_volume_id=%s code=INTERNAL", method, ident)
        await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed; see the node plugin's log")
        raise
    log.info("rpc=%s copy_volume_id=%s caller=%s code=OK seconds=%.4f", method, ident, caller_name(context) or "-",
             time.monotonic() - start)
    return answer
