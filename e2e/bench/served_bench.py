"""The skeleton of a bench against `csi-qsd serve`: start it, open a client, run the phases, undo, stop it.

`ServedBench` undoes whatever its phases left (volumes, snapshots) and stops
the driver and every QSD shard; `bench_main` runs one in a sandbox and
prints its report; `run_to_end` gives the exit status; `rerun_unshared`
runs a bench again in a private mount namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from csi_qsd.cli.client import CSIClient
from e2e.bench.staged_volumes import Staged, stage
from testing.harness import DriverProcess, Sandbox, qsd_pids, sandbox


async def retrying(what: str, call: Callable[[], Awaitable[object]], attempts: int = 20) -> None:
    """Run a cleanup call, retrying while the object is busy (a call cut short may still run)."""
    for attempt in range(attempts):
        try:
            await call()
            return
        except grpc.aio.AioRpcError as exc:
            busy = exc.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)
            if busy and attempt + 1 < attempts:
                await asyncio.sleep(0.5)
                continue
            print(f"cleanup: {what} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return



async def stop_driver_and_qsd(driver: DriverProcess) -> None:
    """Stop the served driver, then its QSDs (every shard): SIGTERM, wait, SIGKILL."""
    await driver.stop()
    for pid in qsd_pids(driver.box.state_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break
            await asyncio.sleep(0.1)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)



class ServedBench:
    """One run against `csi-qsd serve` as a process: start it, open a client, run `phases`, undo, stop it and its QSDs.

    Whatever happened, `undo` unpublishes and unstages every volume in
    `staged` and deletes, newest first, every volume and snapshot in
    `volumes` and `snapshots` or still listed by the driver, as kubelet and
    the provisioner would; then the driver and every QSD shard are stopped.
    """

    client_timeout = 600.0

    def __init__(self, box: Sandbox, *driver_args: str) -> None:
        self.box = box
        self.driver = DriverProcess(box, "--log-level", "info", *driver_args)
        self.staged: dict[str, Staged] = {}
        self.volumes: list[str] = []
        self.snapshots: list[str] = []

    async def run(self) -> None:
        await self.driver.start(timeout=60)
        try:
            async with CSIClient(self.box.endpoint, timeout=self.client_timeout) as csi:
                try:
                    await self.phases(csi)
                finally:
                    await self.undo(csi)
        finally:
            await stop_driver_and_qsd(self.driver)

    async def phases(self, csi: CSIClient) -> None:
        raise NotImplementedError

    async def stage(self, csi: CSIClient, name: str, size: int, parameters: Mapping[str, str] | None = None,
                    *, block: bool = False, fs_type: str = "", publish: bool = True,
                    secrets: dict[str, str] | None = None) -> Staged:
        """`stage` of a volume this run undoes."""
        volume = await stage(csi, self.box, name, size, parameters, block=block, fs_type=fs_type, publish=publish,
                             made=self.staged, secrets=secrets)
        self.volumes.append(volume.id)
        return volume

    async def undo(self, csi: CSIClient) -> None:
        for vid, volume in reversed(list(self.staged.items())):
            await retrying(f"unpublish {vid}", lambda: csi.unpublish(vid, str(volume.target)))
            await retrying(f"unstage {vid}", lambda: csi.unstage(vid, str(volume.staging)))
        self.staged.clear()
        with contextlib.suppress(grpc.aio.AioRpcError):  # a call cut short may have made one we never heard of
            known = {v.volume_id for v in await csi.list_volumes()}
            self.volumes += sorted(known - set(self.volumes))
        for vid in reversed(self.volumes):
            await retrying(f"delete volume {vid}", lambda: csi.delete_volume(vid))
        self.volumes.clear()
        with contextlib.suppress(grpc.aio.AioRpcError):
            known = {s.snapshot_id for s in await csi.list_snapshots()}
            self.snapshots += sorted(known - set(self.snapshots))
        for sid in reversed(self.snapshots):
            await retrying(f"delete snapshot {sid}", lambda: csi.delete_snapshot(sid))
        self.snapshots.clear()



B = TypeVar("B", bound=ServedBench)



def missing(*tools: str) -> str:
    """Why this machine cannot run a bench that serves the driver, printed ('' if it can): root, /dev/fuse, `tools`."""
    absent = [tool for tool in tools if shutil.which(tool) is None]
    problem = ("run as root: the bench stages volumes (FUSE exports, loop devices, mounts)" if os.geteuid() != 0
               else f"needs /dev/fuse and {', '.join(absent) or 'nothing else'}"
               if absent or not Path("/dev/fuse").exists() else "")
    if problem:
        print(problem, file=sys.stderr)
    return problem



def bench_main(make: Callable[[Sandbox], B], report: Callable[[B], str], *, tools: Sequence[str] = (),
               what: str = "benchmark", log_tail: int | None = 4000) -> int:
    """Run `make(box)`'s bench in a fresh sandbox and print `report(bench)`, partial results too, and the wall time.

    The exit status: 2 if this machine cannot run it, else `run_to_end`'s.
    """
    if missing(*tools):
        return 2
    started = time.monotonic()
    with sandbox() as box:
        bench = make(box)
        status = run_to_end(bench.run(), bench.driver, what=what, log_tail=log_tail)
        print(report(bench), flush=True)
    print(f"wall time {time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    return status



def rerun_unshared(module: str, argv: Sequence[str] | None, first: str = "true") -> int | None:
    """`python -m module argv` (this bench's own arguments if None) again in a private mount namespace, after
    shell command `first` there: its exit status; None in that run itself. No namespace made meanwhile copies
    its mounts."""
    if os.environ.get("CSI_QSD_BENCH_UNSHARED"):
        return None
    command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", f'{first} && exec "$@"', "sh",
               sys.executable, "-m", module, *(sys.argv[1:] if argv is None else argv)]
    env = dict(os.environ, CSI_QSD_BENCH_UNSHARED="1")
    return subprocess.run(command, env=env, check=False).returncode



def run_to_end(work: Coroutine[Any, Any, object], driver: DriverProcess, *, what: str = "benchmark",
               log_tail: int | None = 4000) -> int:
    """Run a bench in its own event loop; its exit status: 0, 1 (failed: the driver log's tail printed), 130.

    The driver is SIGKILLed afterwards whatever happened: it runs in its own
    session and would outlive us. `log_tail` None prints the whole log.
    """
    try:
        asyncio.run(work)
        return 0
    except KeyboardInterrupt:
        print("interrupted: cleaned up; partial results follow", file=sys.stderr)
        return 130
    except Exception as exc:
        log = driver.log() if log_tail is None else driver.log()[-log_tail:]
        print(f"{what} failed: {exc!r}\n--- driver log (tail) ---\n{log}", file=sys.stderr)
        return 1
    finally:
        kill_driver(driver)



def log_problems(driver: DriverProcess) -> str:
    """How many warnings and errors the driver logged, and the first five."""
    lines = driver.log().splitlines() if driver.log_path.exists() else []
    problems = [line for line in lines if "level=WARNING" in line or "level=ERROR" in line]
    return f"driver log: {len(problems)} warning/error lines" + "".join(f"\n  {line[:200]}" for line in problems[:5])



def logged(driver: DriverProcess, event: str) -> dict[str, str]:
    """The key=value fields of the driver's last `event=<event>` log line; {} if it logged none."""
    lines = [line.split() for line in driver.log().splitlines() if f"event={event}" in line.split()]
    return dict(field.split("=", 1) for field in lines[-1] if "=" in field) if lines else {}



def kill_driver(driver: DriverProcess) -> None:
    """Last resort after a second Ctrl-C: the driver runs in its own session and would survive us."""
    proc = driver.proc
    if proc is not None and proc.returncode is None and Path(f"/proc/{proc.pid}").exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
