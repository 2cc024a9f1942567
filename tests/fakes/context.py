"""`FakeContext`: the part of a gRPC servicer context that `csi_qsd.csi.errors.rpc` uses, recording each abort."""

from __future__ import annotations

import grpc


class FakeContext:
    """Records every `abort(code, details)` and raises `AbortError`, as grpc.aio's context does."""

    def __init__(self) -> None:
        self.aborts: list[tuple[grpc.StatusCode, str]] = []

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.aborts.append((code, details))
        raise grpc.aio.AbortError()
