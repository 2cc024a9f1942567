"""Node to node: the copy calls one node plugin makes of another, over the mutual-TLS listener.

A copy's target asks its peers (`--peer NAME=HOST:PORT`, or the node plugin
pods the Kubernetes API lists, `csi_qsd.csi.peer_pods`: their metadata
listeners) to lease a snapshot or volume for it (`Lease`), and gives the lease
back when its copy is whole or its volume deleted (`Release`). These two
methods are the service `csi_qsd.v1.Copies`, which the listener serves beside
the router's calls; CSI has no message for them, so requests and answers are
small JSON objects.

Each node has a certificate of its own, from the cluster CA, whose common
name and a DNS name are its node name (`csi_qsd.csi.tls`), for TLS server and
client use (with SPIRE, its SPIFFE ID `…/csi-qsd/node/<node>` decides,
`csi_qsd.csi.tls`). A caller proves which node it is by that certificate: the
service answers only a node this node knows as a peer, and only for
itself (a Lease whose `node` is another, or a Lease or Release of a copy
leased to another node, is PERMISSION_DENIED naming both). The router's
certificate names no node, so it is refused here. A node dials a peer
checking that the certificate it is shown names that peer.

No node may take more than its share: each caller has at most
--copy-calls-per-node calls in flight here (`InFlight`) and holds at most
--copy-leases-per-node leases (`SourceLeases`); beyond either it is
RESOURCE_EXHAUSTED, naming the limit and the caller, and the other nodes
are served as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import grpc

from csi_qsd import validate
from csi_qsd.config import DEFAULT_COPY_CALLS_PER_NODE
from csi_qsd.controller.copy_leases import SourceLeases, parse_source
from csi_qsd.copy_link import Lease
from csi_qsd.csi.client import LEASES_SERVICE
from csi_qsd.csi.tls import RECONNECT_OPTIONS, ReloadingCredentials, caller_name
from csi_qsd.errors import (
    Code,
    DriverError,
    FailedPrecondition,
    Forwarded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from csi_qsd.sys import x509_name
from csi_qsd.sys.pem import PemFiles

log = logging.getLogger(__name__)

SERVICE = "csi_qsd.v1.Copies"
CALL_SECONDS = 60.0  # a lease of a volume cuts a snapshot first
_NODE_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?\Z")
MAX_LEASE_BYTES = 1 << 63  # qcow2's limit is far below; anything above is no volume


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


def _decode(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except ValueError:
        message = None
    return message if isinstance(message, dict) else {}


def _text(request: dict[str, Any], key: str) -> str:
    value = request.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{key} is required")
    return value


def same_host(a: str, b: str) -> bool:
    """True if two hosts (names or addresses, IPv6 with or without brackets) are the same one as written."""
    a, b = a.strip("[]"), b.strip("[]")
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower().rstrip(".") == b.lower().rstrip(".")


def checked_lease(name: str, peer_address: str, copy_volume_id: str, answer: dict[str, Any]) -> Lease:
    """The lease peer `name` (at `peer_address`, its --peer) granted for `copy_volume_id`, checked as a request is
    before anything of it is stored or dialled: IDs by their patterns, the export is the copy's own, the NBD
    server is on that peer's host (the one this node already trusts by --peer) at a port, the sizes are sizes.

    Raises ValueError saying what is wrong.
    """
    snapshot_id, address, export = answer.get("snapshot_id"), answer.get("address"), answer.get("export")
    size, ttl = answer.get("size"), answer.get("ttl", 0)
    if not isinstance(snapshot_id, str) or not validate.SNAPSHOT_ID_RE.match(snapshot_id):
        raise ValueError(f"snapshot_id {snapshot_id!r} is not a snapshot ID")
    if export != copy_volume_id:
        raise ValueError(f"export {export!r} is not the copy's own ({copy_volume_id})")
    address = validate.check_address(address if isinstance(address, str) else repr(address), "address")
    host = address.rpartition(":")[0]
    if not same_host(host, peer_address.rpartition(":")[0]):
        raise ValueError(f"address {address} is not on the peer's host ({peer_address}, --peer {name}): a node "
                         "serves its copies on its own address (--copy-address must be the host its --peer names)")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_LEASE_BYTES:
        raise ValueError(f"size {size!r} is not a volume size")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl < math.inf:
        raise ValueError(f"ttl {ttl!r} is not a number of seconds")
    return Lease(name, snapshot_id, address, copy_volume_id, size, float(ttl))


class PeerList(Protocol):
    """Who the other node plugins are now: node name -> HOST:PORT of their listener."""

    async def current(self) -> dict[str, str]: ...

    def described(self) -> str:
        """Where the list comes from, for messages (a flag and its value)."""
        ...


class StaticPeers:
    """The peers `--peer` names."""

    def __init__(self, peers: tuple[tuple[str, str], ...]) -> None:
        self._peers = dict(peers)

    async def current(self) -> dict[str, str]:
        return dict(self._peers)

    def described(self) -> str:
        return "--peer"


class PeerNodes:
    """The other node plugins, as `csi_qsd.copy_link.Peers`: one channel each, opened when first used."""

    def __init__(self, peers: PeerList, tls: PemFiles | None, node_id: str, timeout: float = CALL_SECONDS) -> None:
        self._list = peers
        self._tls = tls
        self._node_id = node_id
        self._timeout = timeout
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}  # node name -> (address, channel)
        self._retired: list[grpc.aio.Channel] = []  # an older certificate or address; closed with the rest
        self._credentials: ReloadingCredentials | None = None  # read when first needed: the files may come later

    async def _others(self) -> dict[str, str]:
        """The peers now, without this node (one list serves every node)."""
        return {name: address for name, address in (await self._list.current()).items() if name != self._node_id}

    def _call(self, name: str, address: str, method: str) -> Callable[..., Awaitable[dict[str, Any]]]:
        """A call on `name`'s channel to `address`; OSError while this node's TLS files cannot be read."""
        if self._credentials is None:
            assert self._tls is not None
            self._credentials = ReloadingCredentials(self._tls)
        elif self._credentials.refresh():  # a renewed certificate: new channels present it
            self._retired.extend(channel for _, channel in self._channels.values())
            self._channels = {}
        known = self._channels.get(name)
        if known is not None and known[0] != address:  # the peer's pod was made again elsewhere
            self._retired.append(known[1])
            known = None
        if known is None:
            # The peer must show a certificate for its own node name, not just any of the CA's.
            options = (("grpc.ssl_target_name_override", name), *RECONNECT_OPTIONS)
            known = self._channels[name] = (address, grpc.aio.secure_channel(
                address, self._credentials.credentials, options=options))
        return known[1].unary_unary(f"/{SERVICE}/{method}", request_serializer=_encode,  # type: ignore[no-any-return]
                                    response_deserializer=_decode)

    async def lease(self, source: str, copy_volume_id: str, node: str = "") -> Lease:
        """Ask every peer at once; the one that holds `source` serves it. A renewal (`node`: the node that granted
        the lease) asks that node alone, so no other peer can answer for it.

        Snapshot and volume IDs are random and one node holds each: when
        more than one peer grants a new lease, at least one of them lies, so
        none is used (each is given back). Raises NotFound, Unavailable,
        FailedPrecondition (more than one node claims `source`).
        """
        parse_source(source)
        peers = await self._others()
        if node:
            if node not in peers:
                raise Unavailable(f"node {node}, which serves copy {copy_volume_id}, is not among this node's peers "
                                  f"now ({self._list.described()}); its lease is asked of it alone")
            peers = {node: peers[node]}
        if not peers:
            raise NotFound(f"{source.replace(':', ' ')} is not on this node, and no other node is known "
                           f"({self._list.described()})")
        request = {"source": source, "copy_volume_id": copy_volume_id, "node": self._node_id}

        async def ask(name: str) -> Lease | str | None:
            try:
                answer = await self._call(name, peers[name], "Lease")(request, timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED):
                    return f"{name} ({peers[name]}): {exc.code().name}: {exc.details()}"
                raise _forwarded(name, exc) from None
            try:
                return checked_lease(name, peers[name], copy_volume_id, answer)
            except ValueError as exc:
                log.warning("event=copy_lease_answer_refused node=%s copy_volume_id=%s error=%r", name,
                            copy_volume_id, str(exc))
                return f"{name} ({peers[name]}): refused its answer: {exc}"

        answers = await asyncio.gather(*(ask(name) for name in peers), return_exceptions=True)
        leases = [a for a in answers if isinstance(a, Lease)]
        failures = [a for a in answers if isinstance(a, BaseException)]
        unreachable = [a for a in answers if isinstance(a, str)]
        if len(leases) > 1:
            for lease in leases:
                with contextlib.suppress(DriverError):
                    await self.release(lease.node, copy_volume_id)
            raise FailedPrecondition(
                f"{source.replace(':', ' ')} is claimed by more than one node ({', '.join(l.node for l in leases)}); "
                "one holds it, so another answers falsely: no copy is made from either")
        if leases:
            return leases[0]
        if failures:
            raise failures[0]
        if unreachable:
            raise Unavailable(f"{source.replace(':', ' ')} is on none of the nodes that answered; could not ask: "
                              + "; ".join(unreachable))
        raise NotFound(f"{source.replace(':', ' ')} does not exist on this node nor on any of the "
                       f"{len(peers)} others")

    async def release(self, node: str, copy_volume_id: str) -> None:
        """Give the lease back on `node` ('' or unknown: on every peer). Raises Unavailable."""
        peers = await self._others()
        names = [node] if node in peers else list(peers)
        for name in names:
            try:
                await self._call(name, peers[name], "Release")({"copy_volume_id": copy_volume_id, "node": self._node_id},
                                                  timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                raise Unavailable(f"cannot give the lease of copy {copy_volume_id} back to node {name}: "
                                  f"{exc.code().name}: {exc.details()}") from None

    async def close(self) -> None:
        channels = [*(channel for _, channel in self._channels.values()), *self._retired]
        self._channels, self._retired = {}, []
        await asyncio.gather(*(channel.close() for channel in channels))


def _forwarded(name: str, exc: grpc.aio.AioRpcError) -> Forwarded:
    code = exc.code().name
    return Forwarded(Code[code] if code in Code.__members__ else Code.UNAVAILABLE, f"{exc.details()} (node {name})")


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


class InFlight:
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


def copies_handler(leases: SourceLeases, peers: PeerList,
                   calls_per_node: int = DEFAULT_COPY_CALLS_PER_NODE) -> grpc.GenericRpcHandler:
    """`csi_qsd.v1.Copies` for the listener: Lease and Release for the nodes `peers` names, each for itself only,
    at most `calls_per_node` of them in flight per node.

    Errors are answered with their codes; a caller whose certificate names
    no node of `peers`, or asks for another node, is PERMISSION_DENIED; one
    with as many calls in flight as a node may have, RESOURCE_EXHAUSTED.
    """
    in_flight = InFlight(calls_per_node)

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
                    "ttl": got.ttl}
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

    handler = {"request_deserializer": _decode, "response_serializer": _encode}
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Lease": grpc.unary_unary_rpc_method_handler(lease, **handler),
        "Release": grpc.unary_unary_rpc_method_handler(release, **handler),
    })


def leases_handler(leases: SourceLeases) -> grpc.GenericRpcHandler:
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

    handler = {"request_deserializer": _decode, "response_serializer": _encode}
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
