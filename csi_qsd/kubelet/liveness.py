"""/healthz for the driver container's liveness probe, as the CSI livenessprobe sidecar serves it.

kubelet's httpGet probe cannot speak gRPC, so this asks the driver's
Identity Probe on each GET: 200 `ok` when the driver answers ready within
--probe-timeout (an answer without `ready` counts as ready, as the CSI spec
says), 500 with the reason otherwise. It holds no state between probes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from http import HTTPStatus

from csi_qsd.errors import DriverUnhealthy
from csi_qsd.kubelet import identity
from csi_qsd.sys import text_http

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LivenessSettings:
    csi_endpoint: str  # unix:// URL of the driver's socket
    health_address: str  # host:port of /healthz
    probe_timeout: float = 1.0  # seconds the driver may take to answer Probe


async def run(settings: LivenessSettings, stop: asyncio.Event) -> int:
    """Serve /healthz until `stop` is set; 0. Raises OSError or ValueError when it cannot listen."""

    async def healthz() -> tuple[HTTPStatus, bytes]:
        try:
            await identity.probe(settings.csi_endpoint, settings.probe_timeout)
        except DriverUnhealthy as exc:
            log.warning("event=healthz_failed endpoint=%s error=%r", settings.csi_endpoint, str(exc))
            return HTTPStatus.INTERNAL_SERVER_ERROR, f"{exc}\n".encode()
        log.debug("event=healthz_ok endpoint=%s", settings.csi_endpoint)
        return HTTPStatus.OK, b"ok\n"

    server = await text_http.start(settings.health_address, {"/healthz": healthz})
    log.info("event=liveness_serving address=%s endpoint=%s timeout=%gs", settings.health_address,
             settings.csi_endpoint, settings.probe_timeout)
    try:
        await stop.wait()
    finally:
        server.close()
        await server.wait_closed()
    return 0
