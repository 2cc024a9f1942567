"""The registrar and the liveness endpoint in this event loop, against a stand-in CSI Identity service.

The integration tests run both beside the real driver; these pin the cases
the real driver never shows: a Probe answer without `ready`, a driver that
says it is not ready, a stale socket or a stranger's file where the
registration socket goes, the socket vanishing under a running registrar.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import wrappers_pb2

from csi_qsd.csi import unix_socket
from csi_qsd.csi_pb import csi_pb2, csi_pb2_grpc
from csi_qsd.csi_pb import pluginregistration_pb2 as pb
from csi_qsd.csi_pb import pluginregistration_pb2_grpc as pb_grpc
from csi_qsd.errors import StartupError
from csi_qsd.kubelet import liveness, registrar
from tests.harness import free_port, http_get, until

NAME = "fake.csi.example"


class FakeIdentity(csi_pb2_grpc.IdentityServicer):
    def __init__(self) -> None:
        self.ready: bool | None = None  # None: Probe answers without `ready`

    async def GetPluginInfo(self, request: csi_pb2.GetPluginInfoRequest,
                            context: grpc.aio.ServicerContext) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=NAME, vendor_version="1")

    async def Probe(self, request: csi_pb2.ProbeRequest, context: grpc.aio.ServicerContext) -> csi_pb2.ProbeResponse:
        if self.ready is None:
            return csi_pb2.ProbeResponse()
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=self.ready))


@contextlib.asynccontextmanager
async def serving_identity(endpoint: str) -> AsyncIterator[FakeIdentity]:
    identity = FakeIdentity()
    server = grpc.aio.server()
    csi_pb2_grpc.add_IdentityServicer_to_server(identity, server)  # type: ignore[no-untyped-call]
    async with unix_socket.serving(server, endpoint):
        yield identity


@contextlib.asynccontextmanager
async def running(task: asyncio.Task[int], stop: asyncio.Event) -> AsyncIterator[None]:
    """Let `task` run in the block; stop it on the way out, whatever happened."""
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


async def healthz(port: int) -> tuple[int, bytes]:
    answer = await until(lambda: http_get(port, "/healthz"), f"/healthz on port {port}", 10)
    assert answer is not None
    return answer


def settings(tmp_path: Path, port: int = 0) -> registrar.RegistrarSettings:
    return registrar.RegistrarSettings(
        csi_endpoint=f"unix://{tmp_path}/csi.sock", kubelet_registration_path="/host/csi.sock",
        registration_dir=tmp_path / "registry", health_address=f"127.0.0.1:{port}" if port else "", timeout=2.0)


async def test_registrar_serves_kubelet_and_reports_a_vanished_socket(tmp_path: Path) -> None:
    port, stop = free_port(), asyncio.Event()
    reg_socket = tmp_path / "registry" / f"{NAME}-reg.sock"
    async with serving_identity(f"unix://{tmp_path}/csi.sock"):
        task = asyncio.create_task(registrar.run(settings(tmp_path, port), stop))
        async with running(task, stop):
            await until(reg_socket.is_socket, "the registration socket", 10)
            async with grpc.aio.insecure_channel(f"unix://{reg_socket}") as channel:
                info = await pb_grpc.RegistrationStub(channel).GetInfo(pb.InfoRequest(), timeout=5)
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
                "CSIPlugin", NAME, "/host/csi.sock", ["1.0.0"])
            assert await healthz(port) == (200, b"ok\n")
            reg_socket.unlink()  # e.g. kubelet's plugins_registry wiped
            status, body = await healthz(port)
            assert status == 500 and b"is gone" in body
            stop.set()
            assert await asyncio.wait_for(task, 10) == 0


async def test_a_refusal_ends_the_registrar_with_status_1(tmp_path: Path) -> None:
    stop = asyncio.Event()
    reg_socket = tmp_path / "registry" / f"{NAME}-reg.sock"
    async with serving_identity(f"unix://{tmp_path}/csi.sock"):
        task = asyncio.create_task(registrar.run(settings(tmp_path), stop))
        async with running(task, stop):
            await until(reg_socket.is_socket, "the registration socket", 10)
            async with grpc.aio.insecure_channel(f"unix://{reg_socket}") as channel:
                await pb_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
                    pb.RegistrationStatus(plugin_registered=False, error="plugin name taken"), timeout=5)
            assert await asyncio.wait_for(task, 10) == 1
    assert not reg_socket.exists()


async def test_a_stale_socket_is_replaced_and_anything_else_is_left_alone(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    registry.mkdir()
    reg_socket = registry / f"{NAME}-reg.sock"
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(reg_socket))  # a socket file nobody listens on, as a killed registrar leaves
    stop = asyncio.Event()
    async with serving_identity(f"unix://{tmp_path}/csi.sock"):
        task = asyncio.create_task(registrar.run(settings(tmp_path), stop))
        async with running(task, stop):
            async with grpc.aio.insecure_channel(f"unix://{reg_socket}") as channel:
                stub = pb_grpc.RegistrationStub(channel)
                info = await stub.GetInfo(pb.InfoRequest(), timeout=10, wait_for_ready=True)
            assert info.name == NAME
        assert task.result() == 0

        reg_socket.write_text("not a socket")
        with pytest.raises(StartupError, match="not a socket"):
            await registrar.run(settings(tmp_path), asyncio.Event())
        assert reg_socket.read_text() == "not a socket"


async def test_the_registrar_waits_for_the_driver_and_stops_while_waiting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(registrar.run(settings(tmp_path), stop))
    async with running(task, stop):
        await until(lambda: caplog.text.count("event=driver_unanswered") >= 2, "two failed GetPluginInfo logged", 10)
        assert "GetPluginInfo: UNAVAILABLE" in caplog.text and not task.done()
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0
    assert not (tmp_path / "registry").exists()


@pytest.mark.parametrize("ready, status, body", [
    (None, 200, b"ok\n"),  # no `ready` in the answer: ready, as the CSI spec says
    (True, 200, b"ok\n"),
    (False, 500, b"Probe: the driver is not ready\n"),
])
async def test_liveness_follows_probe(tmp_path: Path, ready: bool | None, status: int, body: bytes) -> None:
    port, stop = free_port(), asyncio.Event()
    async with serving_identity(f"unix://{tmp_path}/csi.sock") as identity:
        identity.ready = ready
        task = asyncio.create_task(liveness.run(
            liveness.LivenessSettings(f"unix://{tmp_path}/csi.sock", f"127.0.0.1:{port}", 2.0), stop))
        async with running(task, stop):
            assert await healthz(port) == (status, body)
            assert await http_get(port, "/other") == (404, b"not found\n")
            stop.set()
            assert await asyncio.wait_for(task, 10) == 0
