"""csi.errors.rpc: the one place domain errors become gRPC statuses.

Driven with a fake servicer context whose `abort` records the status and
raises like grpc.aio's does, so no server is needed.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from csi_qsd import errors as E
from csi_qsd.csi.errors import RpcObservers, rpc
from tests.fakes.context import FakeContext


class Request:
    def __init__(self, **fields: str) -> None:
        self.__dict__.update(fields)


class Servicer:
    def __init__(self, raise_: BaseException | None = None, result: object = "response",
                 observers: RpcObservers | None = None) -> None:
        self.raise_ = raise_
        self.result = result
        self.rpc_observers = observers

    @rpc
    async def DeleteVolume(self, request: Any, context: Any) -> Any:
        await asyncio.sleep(0)
        if self.raise_ is not None:
            raise self.raise_
        return self.result


class VolumeGone(E.NotFound):
    """A subclass a future module might add: must keep NOT_FOUND (IBM's exact-type table would not)."""


class DeepVolumeGone(VolumeGone):
    pass


async def call(exc: BaseException | None, observers: RpcObservers | None = None,
               **fields: str) -> list[tuple[grpc.StatusCode, str]]:
    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        await Servicer(exc, observers=observers).DeleteVolume(Request(**fields), context)
    return context.aborts


@pytest.mark.parametrize("exc, code", [
    (E.InvalidArgument("volume_id is required"), grpc.StatusCode.INVALID_ARGUMENT),
    (E.NotFound("volume vol-1 does not exist"), grpc.StatusCode.NOT_FOUND),
    (VolumeGone("volume vol-1 went away"), grpc.StatusCode.NOT_FOUND),
    (DeepVolumeGone("volume vol-1 went far away"), grpc.StatusCode.NOT_FOUND),
    (E.AlreadyExists("name pvc-1 taken"), grpc.StatusCode.ALREADY_EXISTS),
    (E.FailedPrecondition("still staged"), grpc.StatusCode.FAILED_PRECONDITION),
    (E.ResourceExhausted("pool full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.OutOfRange("too big"), grpc.StatusCode.OUT_OF_RANGE),
    (E.Aborted("busy"), grpc.StatusCode.ABORTED),
    (E.Unimplemented("no snapshots"), grpc.StatusCode.UNIMPLEMENTED),
    (E.Unavailable("qsd restarting"), grpc.StatusCode.UNAVAILABLE),
    (E.Internal("broken"), grpc.StatusCode.INTERNAL),
    (E.QSDError("blockdev-add failed: Duplicate node name"), grpc.StatusCode.INTERNAL),
    (E.HostCommandError("mkfs.ext4 exited 1"), grpc.StatusCode.INTERNAL),
    (E.NBDError("NBD reply out of sequence"), grpc.StatusCode.INTERNAL),
    (E.QSDNoAnswer("qemu-storage-daemon did not answer query-version", E.NoAnswer("query-version", 30.0, 1, ())),
     grpc.StatusCode.UNAVAILABLE),
    (E.Unavailable("the catalog is closed: the driver is stopping"), grpc.StatusCode.UNAVAILABLE),
    (E.Forwarded(E.Code.NOT_FOUND, "no snapshot snap-1 (node a)"), grpc.StatusCode.NOT_FOUND),
    (E.DriverError("base class"), grpc.StatusCode.INTERNAL),
])
async def test_driver_errors_keep_their_code_and_message(exc: E.DriverError, code: grpc.StatusCode) -> None:
    assert await call(exc, volume_id="vol-1") == [(code, str(exc))]


@pytest.mark.parametrize("exc", [ValueError("bad int"), KeyError("x"), OSError(5, "Input/output error"),
                                 RuntimeError("dictionary changed size during iteration"), AssertionError("oops")])
async def test_unknown_exceptions_become_internal_with_a_logged_traceback(
    exc: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="csi_qsd.rpc"):
        aborts = await call(exc, volume_id="vol-" + "a" * 24)
    assert len(aborts) == 1
    code, details = aborts[0]
    assert code is grpc.StatusCode.INTERNAL
    assert "DeleteVolume" in details and str(exc) in details
    (record,) = [r for r in caplog.records if "code=INTERNAL" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[1] is exc
    assert "volume_id=vol-" + "a" * 24 in record.getMessage()


async def test_every_code_is_a_grpc_status() -> None:
    for code in E.Code:
        assert isinstance(getattr(grpc.StatusCode, code.value), grpc.StatusCode)


async def test_success_returns_the_response_and_aborts_nothing() -> None:
    context = FakeContext()
    assert await Servicer(result="ok").DeleteVolume(Request(volume_id="vol-1"), context) == "ok"
    assert context.aborts == []


async def test_an_abort_from_the_handler_passes_through_untouched() -> None:
    assert await call(grpc.aio.AbortError()) == []


async def test_observers_see_method_code_and_duration() -> None:
    seen: list[tuple[str, str, float]] = []

    def observer(method: str, code: str, seconds: float) -> None:
        seen.append((method, code, seconds))

    observers = RpcObservers()
    observers.add(observer)
    await Servicer(result="ok", observers=observers).DeleteVolume(Request(), FakeContext())
    await call(VolumeGone("x"), observers)
    await call(ZeroDivisionError(), observers)
    await call(ZeroDivisionError())  # a servicer given no observers tells no one
    observers.remove(observer)
    await call(ZeroDivisionError(), observers)
    assert [(m, c) for m, c, _ in seen] == [
        ("DeleteVolume", "OK"), ("DeleteVolume", "NOT_FOUND"), ("DeleteVolume", "INTERNAL"),
    ]
    assert all(s >= 0 for _, _, s in seen)


async def test_a_cancelled_call_is_not_counted_as_ok(caplog: pytest.LogCaptureFixture) -> None:
    """A caller that goes away (or whose deadline passes) cancels the handler: that is no success."""
    seen: list[str] = []

    def observer(method: str, code: str, seconds: float) -> None:
        seen.append(code)

    observers = RpcObservers()
    observers.add(observer)
    with caplog.at_level(logging.INFO, logger="csi_qsd.rpc"), pytest.raises(asyncio.CancelledError):
        await Servicer(asyncio.CancelledError(), observers=observers).DeleteVolume(
            Request(volume_id="vol-2"), FakeContext())
    assert seen == ["CANCELLED"]
    assert not any("code=OK" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fields, named", [
    ({"volume_id": "vol-1", "name": "pvc"}, "volume_id=vol-1"), ({"name": "pvc-9"}, "name=pvc-9"), ({}, "-"),
])
async def test_object_id_in_logs(fields: dict[str, str], named: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="csi_qsd.rpc"):
        await Servicer().DeleteVolume(Request(**fields), FakeContext())
    assert [r.getMessage().partition(" seconds=")[0] for r in caplog.records] == [f"rpc=DeleteVolume {named} code=OK"]


def test_wrapper_keeps_the_handler_name() -> None:
    assert Servicer.DeleteVolume.__name__ == "DeleteVolume"


def test_every_exception_the_driver_defines_is_in_errors_py() -> None:
    """One tree, one place: a class deriving from an exception anywhere else in the package is refused."""
    package = Path(E.__file__).parent
    exceptions = {name for name, value in vars(builtins).items() if isinstance(value, type)
                  and issubclass(value, BaseException)}
    exceptions |= {name for name, value in vars(E).items() if isinstance(value, type)
                   and issubclass(value, BaseException)}
    elsewhere = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "errors.py" and path.parent == package or "csi_pb" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    (base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else "")
                    in exceptions for base in node.bases):
                elsewhere.append(f"{path.relative_to(package)}:{node.lineno} {node.name}")
    assert not elsewhere, f"exceptions defined outside csi_qsd/errors.py: {elsewhere}"
