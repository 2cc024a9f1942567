"""`csi-qsd kubelet-registrar` and `csi-qsd liveness-probe` beside a served driver, with the test as kubelet.

Both run as child processes with the flags deploy/node.yaml gives the
upstream sidecars; the test dials the registration socket as kubelet does
and fetches /healthz as kubelet's httpGet probe does.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from csi_qsd.csi_pb import pluginregistration_pb2 as pb
from csi_qsd.csi_pb import pluginregistration_pb2_grpc as pb_grpc
from tests.harness import Sandbox, free_port, http_get, running_driver, terminate, until

HOST_SOCKET = "/var/lib/kubelet/plugins/csi-qsd.io/csi.sock"


class Helper:
    """`csi-qsd ARGV...` as a child process, its output in a log file."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, *argv: str) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "csi_qsd.cli", *argv, stdout=log, stderr=log, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def until(self, predicate: Callable[[], object], what: str) -> object:
        """Until `predicate` (sync or async) holds while the helper runs, and its value; fails at once if it exits."""

        def check() -> object:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise AssertionError(f"exited {self.proc.returncode} before {what}; log:\n{self.log()[-3000:]}")
            return predicate()

        return await until(check, lambda: f"{what}; log:\n{self.log()[-3000:]}", 30)

    async def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def healthz(self, port: int, status: int) -> bytes:
        """The body of the first /healthz answer with `status` (the helper may still be starting)."""

        async def answer() -> bytes | None:
            got = await http_get(port, "/healthz")
            return got[1] if got is not None and got[0] == status else None

        body = await self.until(answer, f"/healthz to answer {status}")
        assert isinstance(body, bytes)
        return body


async def register(socket: Path, registered: bool, error: str = "") -> pb.PluginInfo:
    """What kubelet does on finding `socket`: GetInfo, then NotifyRegistrationStatus."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.RegistrationStub(channel)
        info: pb.PluginInfo = await stub.GetInfo(pb.InfoRequest(), timeout=10)
        await stub.NotifyRegistrationStatus(pb.RegistrationStatus(plugin_registered=registered, error=error),
                                            timeout=10)
    return info


async def test_registrar_registers_the_driver_with_kubelet(box: Sandbox, tmp_path: Path) -> None:
    registry, port = tmp_path / "registry", free_port()
    registry.mkdir()
    socket = registry / "csi-qsd.io-reg.sock"
    registrar = Helper(tmp_path / "registrar.log")
    refused = Helper(tmp_path / "refused.log")
    await registrar.start(
        "kubelet-registrar", "--v=2", f"--csi-address={box.state_dir / 'csi.sock'}",
        f"--kubelet-registration-path={HOST_SOCKET}", f"--plugin-registration-path={registry}",
        f"--http-endpoint=127.0.0.1:{port}", "--timeout=5s")
    try:
        # No driver yet: the registrar keeps asking its name, and says so.
        await registrar.until(lambda: "event=driver_unanswered" in registrar.log(), "a failed GetPluginInfo logged")
        assert b"not registered yet" in await registrar.healthz(port, 500)
        assert not socket.exists()

        async with running_driver(box) as driver:
            await registrar.until(socket.is_socket, f"{socket}")
            info = await register(socket, registered=True)
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
                "CSIPlugin", "csi-qsd.io", HOST_SOCKET, ["1.0.0"])
            assert "event=kubelet_registered name=csi-qsd.io" in registrar.log()
            assert await registrar.healthz(port, 200) == b"ok\n"

            # kubelet refuses a second registrar's plugin: it exits non-zero, its socket gone.
            other = tmp_path / "other-registry"
            await refused.start("kubelet-registrar", f"--csi-address=unix://{box.state_dir / 'csi.sock'}",
                                f"--kubelet-registration-path={HOST_SOCKET}", f"--plugin-registration-path={other}")
            other_socket = other / "csi-qsd.io-reg.sock"
            await refused.until(other_socket.is_socket, f"{other_socket}")
            await register(other_socket, registered=False, error="x")
            assert await refused.wait_exit() != 0
            assert "event=kubelet_registration_failed name=csi-qsd.io error='x'" in refused.log()
            assert not other_socket.exists()

            await driver.stop()
            body = await registrar.healthz(port, 500)
            assert body.startswith(b"GetPluginInfo: UNAVAILABLE"), body

        assert registrar.proc is not None
        registrar.proc.send_signal(signal.SIGTERM)
        assert await registrar.wait_exit() == 0, registrar.log()[-3000:]
        assert not socket.exists()
    finally:
        await terminate(registrar.proc)
        await terminate(refused.proc)


async def test_liveness_probe_answers_with_the_driver(box: Sandbox, tmp_path: Path) -> None:
    port = free_port()
    probe = Helper(tmp_path / "liveness.log")
    await probe.start("liveness-probe", f"--csi-address=unix://{box.state_dir / 'csi.sock'}",
                      f"--health-port={port}", "--probe-timeout=3s")
    try:
        assert (await probe.healthz(port, 500)).startswith(b"Probe: UNAVAILABLE")
        async with running_driver(box) as driver:
            assert await probe.healthz(port, 200) == b"ok\n"
            await driver.stop()
            assert (await probe.healthz(port, 500)).startswith(b"Probe: UNAVAILABLE")
        assert probe.proc is not None
        probe.proc.send_signal(signal.SIGTERM)
        assert await probe.wait_exit() == 0, probe.log()[-3000:]
    finally:
        await terminate(probe.proc)
