"""Register the driver with kubelet, as the CSI node-driver-registrar does.

kubelet watches its plugins_registry directory (mounted in the pod at
--plugin-registration-path) for sockets. The registrar asks the driver its
name over CSI (GetPluginInfo, retried until it answers), then serves
kubelet's plugin registration API on `<dir>/<name>-reg.sock`: GetInfo tells
kubelet the plugin is a CSI driver of that name whose socket is at
--kubelet-registration-path (a path on the host, where kubelet dials it),
and kubelet reports its verdict with NotifyRegistrationStatus. A refusal
ends the registrar with a non-zero status, so its container restarts and
registration is tried afresh, as upstream does. SIGTERM removes the socket
(kubelet then deregisters the plugin) and ends it with status 0.

/healthz, on --http-endpoint, answers 200 while the registration socket
exists and the driver answers GetPluginInfo within --timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

import grpc

from csi_qsd.csi import unix_socket
from csi_qsd.csi_pb import pluginregistration_pb2 as pb
from csi_qsd.csi_pb import pluginregistration_pb2_grpc as pb_grpc
from csi_qsd.errors import DriverUnhealthy
from csi_qsd.kubelet import identity
from csi_qsd.sys import text_http

log = logging.getLogger(__name__)

CSI_PLUGIN = "CSIPlugin"  # kubelet's plugin type of a CSI driver
SUPPORTED_VERSIONS = ("1.0.0",)  # the CSI versions kubelet may speak to the driver
RETRY_FIRST = 0.5  # seconds before asking a silent driver its name again; doubles up to RETRY_MAX
RETRY_MAX = 5.0


@dataclass(frozen=True)
class RegistrarSettings:
    csi_endpoint: str  # unix:// URL of the driver's socket, as the registrar sees it
    kubelet_registration_path: str  # the same socket as the host (kubelet) sees it
    registration_dir: Path  # kubelet's plugins_registry, as the registrar sees it
    health_address: str = ""  # host:port of /healthz; "" for none
    timeout: float = 1.0  # seconds the driver may take to answer GetPluginInfo


class RegistrationService(pb_grpc.RegistrationServicer):
    """kubelet's side of registration: GetInfo, then NotifyRegistrationStatus; a refusal sets `stop`."""

    def __init__(self, info: pb.PluginInfo, stop: asyncio.Event) -> None:
        self._info = info
        self._stop = stop
        self.refusal: str | None = None

    async def GetInfo(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.PluginInfo:
        log.info("event=kubelet_get_info name=%s endpoint=%s", self._info.name, self._info.endpoint)
        return self._info

    async def NotifyRegistrationStatus(
        self, request: pb.RegistrationStatus, context: grpc.aio.ServicerContext
    ) -> pb.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("event=kubelet_registered name=%s", self._info.name)
        else:
            self.refusal = request.error
            log.error("event=kubelet_registration_failed name=%s error=%r", self._info.name, request.error)
            self._stop.set()
        return pb.RegistrationStatusResponse()


@dataclass
class _Health:
    settings: RegistrarSettings
    socket: Path | None = field(default=None)  # set once the registration socket is served

    async def healthz(self) -> tuple[HTTPStatus, bytes]:
        if self.socket is None:
            return HTTPStatus.INTERNAL_SERVER_ERROR, b"not registered yet: the driver has not told its name\n"
        if not self.socket.is_socket():
            return HTTPStatus.INTERNAL_SERVER_ERROR, f"registration socket {self.socket} is gone\n".encode()
        try:
            await identity.plugin_name(self.settings.csi_endpoint, self.settings.timeout)
        except DriverUnhealthy as exc:
            log.warning("event=healthz_failed error=%r", str(exc))
            return HTTPStatus.INTERNAL_SERVER_ERROR, f"{exc}\n".encode()
        return HTTPStatus.OK, b"ok\n"


async def run(settings: RegistrarSettings, stop: asyncio.Event) -> int:
    """Register with kubelet and serve until `stop` is set (0) or kubelet refuses the plugin (1).

    Raises StartupError when the registration socket's path holds something
    else, OSError or ValueError when /healthz cannot be served.
    """
    health = _Health(settings)
    async with contextlib.AsyncExitStack() as stack:
        if settings.health_address:
            server = await text_http.start(settings.health_address, {"/healthz": health.healthz})
            stack.push_async_callback(_closed, server)
            log.info("event=healthz_serving address=%s", settings.health_address)
        name = await _driver_name(settings, stop)
        if name is None:
            return 0
        info = pb.PluginInfo(type=CSI_PLUGIN, name=name, endpoint=settings.kubelet_registration_path,
                             supported_versions=list(SUPPORTED_VERSIONS))
        service = RegistrationService(info, stop)
        grpc_server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(service, grpc_server)
        socket = settings.registration_dir / f"{name}-reg.sock"
        async with unix_socket.serving(grpc_server, f"unix://{socket}"):
            health.socket = socket
            log.info("event=registration_serving socket=%s name=%s endpoint=%s", socket, name,
                     settings.kubelet_registration_path)
            await stop.wait()
        health.socket = None
    if service.refusal is not None:
        return 1
    log.info("event=registrar_stopped socket_removed=%s", socket)
    return 0


async def _driver_name(settings: RegistrarSettings, stop: asyncio.Event) -> str | None:
    """The driver's name, asked until it answers; None if `stop` is set first."""
    delay = RETRY_FIRST
    while not stop.is_set():
        try:
            name = await identity.plugin_name(settings.csi_endpoint, settings.timeout)
        except DriverUnhealthy as exc:
            log.warning("event=driver_unanswered endpoint=%s error=%r retry_in=%.1fs", settings.csi_endpoint,
                        str(exc), delay)
        else:
            log.info("event=driver_named endpoint=%s name=%s", settings.csi_endpoint, name)
            return name
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        delay = min(delay * 2, RETRY_MAX)
    return None


async def _closed(server: asyncio.Server) -> None:
    server.close()
    await server.wait_closed()
