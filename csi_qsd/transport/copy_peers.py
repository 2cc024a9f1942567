"""Node to node, the caller's side: the copy calls one node plugin makes of another, over mutual TLS.

A copy's target asks its peers (`--peer NAME=HOST:PORT`, or the node plugin
pods the Kubernetes API lists, `csi_qsd.transport.copy_peer_pods`: their
metadata listeners) to lease a snapshot or volume for it (`Lease`), and
gives the lease back when its copy is whole or its volume deleted
(`Release`). These two methods are the service `csi_qsd.v1.Copies`, which
the listener serves beside the router's calls (`csi_qsd.csi.copy_service`);
CSI has no message for them, so requests and answers are small JSON objects
(`encode_message`, `decode_message`). A node dials a peer checking that the
certificate it is shown names that peer, and checks a granted lease as a
request is checked before anything of it is stored or dialled
(`checked_lease`).
"""


from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc

from csi_qsd import validate
from csi_qsd.copy_terms import CopyLease, parse_source
from csi_qsd.errors import (
    Code,
    DriverError,
    FailedPrecondition,
    Forwarded,
    NotFound,
    Unavailable,
)
from csi_qsd.sys.pem import PemFiles
from csi_qsd.transport.tls import RECONNECT_OPTIONS, ReloadingCredentials

log = logging.getLogger(__name__)

SERVICE = "csi_qsd.v1.Copies"
LEASES_SERVICE = "csi_qsd.v1.CopyLeases"  # csi_qsd.csi.copy_service serves it on the driver's UNIX socket
CALL_SECONDS = 60.0  # a lease of a volume cuts a snapshot first
MAX_LEASE_BYTES = 1 << 63  # qcow2's limit is far below; anything above is no volume
MAX_OLDER_LAYERS = 255  # a chain is at most 256 images deep (`csi_qsd.qcow2.backing.MAX_DEPTH`)


def encode_message(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


def decode_message(data: bytes) -> dict[str, Any]:
    """A JSON object, or {} for anything else (the handler then finds the fields it needs missing)."""
    try:
        message = json.loads(data)
    except ValueError:
        message = None
    return message if isinstance(message, dict) else {}


def same_host(a: str, b: str) -> bool:
    """True if two hosts (names or addresses, IPv6 with or without brackets) are the same one as written."""
    a, b = a.strip("[]"), b.strip("[]")
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower().rstrip(".") == b.lower().rstrip(".")


def checked_lease(name: str, peer_address: str, copy_volume_id: str, answer: dict[str, Any]) -> CopyLease:
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
    older = answer.get("older", [])  # absent from an earlier version's answer: one image
    if not isinstance(older, list) or len(older) > MAX_OLDER_LAYERS:
        raise ValueError(f"older {older!r} is not a list of at most {MAX_OLDER_LAYERS} addresses")
    address, *rest = [_peer_address(a, name, peer_address) for a in [address, *older]]
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_LEASE_BYTES:
        raise ValueError(f"size {size!r} is not a volume size")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl < math.inf:
        raise ValueError(f"ttl {ttl!r} is not a number of seconds")
    encrypted = answer.get("encrypted", False)  # absent from an earlier version's answer: it served data
    if not isinstance(encrypted, bool):
        raise ValueError(f"encrypted {encrypted!r} is not true or false")
    return CopyLease(name, snapshot_id, address, copy_volume_id, size, float(ttl), encrypted, tuple(rest))


def _peer_address(address: object, name: str, peer_address: str) -> str:
    """`address` checked as host:port on the peer's host (the one this node already trusts by --peer)."""
    address = validate.check_address(address if isinstance(address, str) else repr(address), "address")
    host = address.rpartition(":")[0]
    if not same_host(host, peer_address.rpartition(":")[0]):
        raise ValueError(f"address {address} is not on the peer's host ({peer_address}, --peer {name}): a node "
                         "serves its copies on its own address (--copy-address must be the host its --peer names)")
    return address


class CopyPeerList(Protocol):
    """Who the other node plugins are now: node name -> HOST:PORT of their listener."""

    async def current(self) -> dict[str, str]: ...

    def described(self) -> str:
        """Where the list comes from, for messages (a flag and its value)."""
        ...


class StaticCopyPeers:
    """The peers `--peer` names."""

    def __init__(self, peers: tuple[tuple[str, str], ...]) -> None:
        self._peers = dict(peers)

    async def current(self) -> dict[str, str]:
        return dict(self._peers)

    def described(self) -> str:
        return "--peer"


class CopyPeerNodes:
    """The other node plugins, as `csi_qsd.copy_terms.Peers`: one channel each, opened when first used."""

    def __init__(self, peers: CopyPeerList, tls: PemFiles | None, node_id: str, timeout: float = CALL_SECONDS) -> None:
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
        return known[1].unary_unary(f"/{SERVICE}/{method}", request_serializer=encode_message,  # type: ignore[no-any-return]
                                    response_deserializer=decode_message)

    async def lease(self, source: str, copy_volume_id: str, node: str = "") -> CopyLease:
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

        async def ask(name: str) -> CopyLease | str | None:
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
        leases = [a for a in answers if isinstance(a, CopyLease)]
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

