"""Node plugins with their metadata listeners and the snapshot-metadata router, as processes.

For the router's integration tests and its benchmark: each node is a
`csi-qsd serve` with its own sandbox (state dir, QSD, kubelet root) and a
mutual-TLS listener on 127.0.0.1; the router is `csi-qsd
snapshot-metadata-router` with a static node map.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from csi_qsd.cli.client import CSIClient
from csi_qsd.transport.copy_peers import SERVICE
from csi_qsd.transport.tls import PemFiles, channel_credentials
from testing.certs import Pki
from testing.harness import DriverProcess, Sandbox, free_port, sandbox, terminate, until


@dataclasses.dataclass
class Node:
    """One node plugin under test: its process, its own CSI socket, its listener, and what it holds."""

    name: str
    box: Sandbox
    process: DriverProcess
    address: str
    csi: CSIClient
    snapshots: list[str] = dataclasses.field(default_factory=list)


class Router:
    """`csi-qsd snapshot-metadata-router` as a child process, with a CSI client on its socket."""

    def __init__(self, root: Path, tls: PemFiles, nodes: list[Node], *extra: str) -> None:
        self.endpoint = f"unix://{root / 'router.sock'}"
        self.log_path = root / "router.log"
        self.argv = [sys.executable, "-m", "csi_qsd.cli", "snapshot-metadata-router", "--endpoint", self.endpoint,
                     "--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca),
                     "--node-timeout", "3", "--log-level", "debug",
                     *(arg for n in nodes for arg in ("--node", f"{n.name}={n.address}")), *extra]
        self.proc: asyncio.subprocess.Process | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def start(self) -> CSIClient:
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(*self.argv, stdout=log, stderr=log,
                                                             start_new_session=True)
        client = CSIClient(self.endpoint, timeout=30)
        proc = self.proc

        async def ready() -> bool:
            assert proc.returncode is None, f"router exited {proc.returncode}: {self.log()}"
            try:
                return await client.probe()
            except grpc.aio.AioRpcError:
                return False

        await until(ready, lambda: f"the router's Probe; its log:\n{self.log()}", 30)
        return client

    async def stop(self) -> None:
        await terminate(self.proc)



@contextlib.asynccontextmanager
async def node_plugin(name: str, pki: Pki, *extra: str, address: str = "") -> AsyncIterator[Node]:
    """A node plugin on its own sandbox and listener (`address`, default a free port), with its own certificate;
    `extra` serve flags."""
    with sandbox() as box:
        address = address or f"127.0.0.1:{free_port()}"
        tls = pki.for_node(name)
        process = DriverProcess(box, "--node-id", name, "--metadata-address", address,
                                "--metadata-cert", str(tls.cert), "--metadata-key", str(tls.key),
                                "--metadata-client-ca", str(tls.ca), *extra)
        try:
            await process.start()
            async with CSIClient(box.endpoint, timeout=60) as csi:
                yield Node(name, box, process, address, csi)
        finally:
            await process.stop()


async def copies_call(address: str, files: PemFiles, method: str, request: dict[str, str],
                      server_name: str = "node-a") -> tuple[grpc.StatusCode, str]:
    """Call `csi_qsd.v1.Copies/method` on the listener at `address` (whose certificate must name `server_name`),
    presenting `files`, as another node would; the answer's code and message."""
    options = (("grpc.ssl_target_name_override", server_name),)
    async with grpc.aio.secure_channel(address, channel_credentials(files), options=options) as channel:
        call = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=lambda m: json.dumps(m).encode(),
                                   response_deserializer=json.loads)
        try:
            await call(request, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""
