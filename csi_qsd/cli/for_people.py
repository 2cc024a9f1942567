"""How a command a person typed ends: an answer as a table or JSON lines, an error as one line, never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence

import grpc
from google.protobuf.message import Message

from csi_qsd.cli import present
from csi_qsd.errors import DriverError
from csi_qsd.sys.endpoint import socket_path


def show(args: argparse.Namespace, records: Sequence[Message | Mapping[str, object]], table: Callable[[], str],
         empty: str = "") -> None:
    """Records as a table (`empty` said on stderr when there are none), or as JSON lines with `-o json`."""
    if args.output_format == "json":
        for record in records:
            print(present.json_line(record))
    elif records or not empty:
        print(table())
    else:
        print(empty, file=sys.stderr)


def error_line(exc: Exception, endpoint: str = "") -> str:
    """An error for a person, on one line: `CODE: message` with the CSI (gRPC) code of a call or DriverError.

    A local file or value error has no code and keeps its own message.
    """
    if isinstance(exc, grpc.aio.AioRpcError):
        code, message = exc.code().name, exc.details() or ""
        if exc.code() is grpc.StatusCode.UNAVAILABLE and _no_socket(endpoint):
            message = f"nothing serves {endpoint}: no such socket (is `csi-qsd serve` running?)"
    elif isinstance(exc, DriverError):
        code, message = exc.code.value, str(exc)
    else:
        return " ".join(str(exc).split())
    return f"{code}: {' '.join(message.split())}"


def _no_socket(endpoint: str) -> bool:
    try:
        return not socket_path(endpoint).exists()
    except ValueError:
        return False


def for_a_person(command: Callable[[], int], endpoint: str = "") -> int:
    """Run a command a person typed: an error is one line on stderr (exit status 1), never a traceback."""
    try:
        return command()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (grpc.aio.AioRpcError, DriverError, OSError, ValueError) as exc:
        print(f"error: {error_line(exc, endpoint)}", file=sys.stderr)
        return 1
