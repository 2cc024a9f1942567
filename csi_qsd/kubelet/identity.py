"""The CSI Identity calls the kubelet helpers make: the driver's name and whether it is ready.

Each call dials the driver afresh and is bounded by a timeout. A channel
kept open across a driver restart would back off between reconnects (up to
two minutes in gRPC's defaults) and report the restarted driver as gone
long after it serves again; a new connection per call costs one UNIX
connect per kubelet probe.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from csi_qsd.csi.client import CSIClient
from csi_qsd.errors import DriverUnhealthy

T = TypeVar("T")


async def plugin_name(endpoint: str, timeout: float) -> str:
    """The name the driver at `endpoint` gives in GetPluginInfo. Raises DriverUnhealthy."""
    info = await _ask(endpoint, timeout, "GetPluginInfo", CSIClient.plugin_info)
    if not info.name:
        raise DriverUnhealthy("GetPluginInfo: the driver gave an empty name")
    return str(info.name)


async def probe(endpoint: str, timeout: float) -> None:
    """Return once the driver at `endpoint` answers Probe as ready. Raises DriverUnhealthy."""
    if not await _ask(endpoint, timeout, "Probe", CSIClient.probe):
        raise DriverUnhealthy("Probe: the driver is not ready")


async def _ask(endpoint: str, timeout: float, method: str, call: Callable[[CSIClient], Awaitable[T]]) -> T:
    """`call` on a fresh connection to `endpoint`; a gRPC error becomes DriverUnhealthy naming `method`."""
    async with CSIClient(endpoint, timeout=timeout) as client:
        try:
            return await call(client)
        except grpc.aio.AioRpcError as exc:
            details = " ".join((exc.details() or "").split())
            raise DriverUnhealthy(f"{method}: {exc.code().name}: {details}") from None
