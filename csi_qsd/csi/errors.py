"""Map domain errors to gRPC status codes, in one place, and log every call.

Each handler is wrapped by `rpc`: first the request's REQUIRED fields are
checked (`csi.required`), so a missing field is INVALID_ARGUMENT before any
lookup can answer NOT_FOUND; then the handler runs. A DriverError (matched by
isinstance, so a subclass keeps its code) becomes `context.abort` with its
code and message; anything else becomes INTERNAL and is logged with its
traceback. Every call is logged key=value with its method, volume ID, code
and duration. An RPC the driver does not offer is wrapped by `not_offered`
instead: the spec's "call not implemented" means the RPC is not there at all,
so UNIMPLEMENTED wins over whatever the request lacks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from csi_qsd.csi import required
from csi_qsd.errors import DriverError

log = logging.getLogger("csi_qsd.rpc")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]
Observer = Callable[[str, str, float], None]

class RpcObservers:
    """Who hears of every finished RPC, as (method, code name, seconds): metrics, tests.

    Given to each servicer when the server is built, so who listens is
    decided where the server is assembled, not by a module-wide list.
    """

    def __init__(self) -> None:
        self._observers: list[Observer] = []

    def add(self, observer: Observer) -> None:
        self._observers.append(observer)

    def remove(self, observer: Observer) -> None:
        self._observers.remove(observer)

    def notify(self, method: str, code: str, seconds: float) -> None:
        for observer in list(self._observers):
            observer(method, code, seconds)


def _object_id(request: Any) -> str:
    for field in ("volume_id", "snapshot_id", "target_snapshot_id", "source_volume_id", "name"):
        value = getattr(request, field, "")
        if isinstance(value, str) and value:
            return f"{field}={value}"
    return "-"


def rpc(handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Wrap a servicer method with the REQUIRED-field check, error mapping, logging and timing.

    The servicer's `rpc_observers` (if it has one) hears of every call.
    """
    return _wrap(handler, check_required=True)


def not_offered(handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Wrap a method that answers UNIMPLEMENTED: error mapping and logging, no REQUIRED-field check."""
    return _wrap(handler, check_required=False)


def _wrap(handler: Handler[Req, Resp], *, check_required: bool) -> Handler[Req, Resp]:
    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        start = time.monotonic()
        code = "OK"
        level = logging.DEBUG if method == "Probe" else logging.INFO
        try:
            if check_required:
                required.check(request)
            return await handler(self, request, context)
        except DriverError as exc:
            code = exc.code.value
            log.log(level, "rpc=%s %s code=%s error=%r seconds=%.4f",
                    method, _object_id(request), code, str(exc), time.monotonic() - start)
            await context.abort(getattr(grpc.StatusCode, exc.code.value), str(exc))
            raise  # unreachable: abort raises
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:  # the caller went away or its deadline passed: not an OK
            code = "CANCELLED"
            log.log(level, "rpc=%s %s code=CANCELLED seconds=%.4f", method, _object_id(request), time.monotonic() - start)
            raise
        except Exception as exc:
            code = "INTERNAL"
            log.exception("rpc=%s %s code=INTERNAL", method, _object_id(request))
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {exc}")
            raise
        finally:
            elapsed = time.monotonic() - start
            if code == "OK":
                log.log(level, "rpc=%s %s code=OK seconds=%.4f", method, _object_id(request), elapsed)
            observers: RpcObservers | None = getattr(self, "rpc_observers", None)
            if observers is not None:
                observers.notify(method, code, elapsed)

    return wrapper
