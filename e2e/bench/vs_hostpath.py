"""Control plane beside the reference driver: p50 of each CSI step, ours against csi-driver-host-path's.

The reference is the Kubernetes CSI community's host-path driver. When its
`hostpathplugin` binary is on PATH it is served beside ours and driven with
the same calls. Otherwise this bench prints a fixed floor in its place: the
same gRPC round trip (a Probe to our own server, measured in the same run)
plus the host work that driver does for each call, run with the host's tools:

    CreateVolume         filesystem: mkdir            block: fallocate -l SIZE
    Stage + Publish      filesystem: truncate, losetup, mkfs.ext4 (our options), mount, bind mount
                         block:      truncate, losetup, bind mount of the device onto a file
    Unpublish + Unstage  the same undone: umount(s), losetup -d
    DeleteVolume         rmdir / unlink

That floor is not durable (nothing is fsynced), as the reference is not;
every answer of ours is.

By default both run as the driver's image runs them: without a writable
/etc/mtab. Where /etc/mtab can be written, libfuse forks QSD to run
`mount -f` (and `umount`) for every FUSE export it adds (removes), 3-4 ms
each under this bench's load; the image has no /etc/mtab. The bench re-runs
itself in a private mount namespace whose /proc (where the host's /etc/mtab
points) is read-only, which libfuse takes as "no mtab to keep"; nothing of
the host changes. `--mtab host` measures with the host's /etc/mtab instead.

Each floor sample is taken right before the sample it is compared with. At
the end each ratio is held against the target (<= 2x the reference, p50)
and printed as PASS or MISS. Usage:

    .venv/bin/python -m e2e.bench.vs_hostpath [--volumes 40] [--size-mib 1024] [--mtab image|host]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

from csi_qsd.csi.client import CSIClient
from e2e.bench.common import MIB, ServedBench, bench_main, ms, ratio, rerun_unshared, sh, table, timed, verdict
from e2e.bench.control_plane import MKFS_EXT4
from tests.harness import Sandbox, terminate, until

MODES = ("filesystem", "block")
STEPS = ("CreateVolume", "Stage + Publish", "Unpublish + Unstage", "DeleteVolume")
TARGET = 2.0
REFERENCE = "hostpathplugin"

Samples = dict[tuple[str, str], list[float]]


class Floor:
    """The reference driver's host work per call, plus one measured round trip to a CSI server."""

    def __init__(self, base: Path, size: int, csi: CSIClient) -> None:
        self.base, self.size, self.csi = base, size, csi
        self.devices: dict[int, str] = {}

    async def _rtt(self) -> None:
        await self.csi.probe()

    async def create(self, mode: str, i: int) -> None:
        await self._rtt()
        if mode == "filesystem":
            os.mkdir(self.base / f"v{i}")
        else:
            sh("fallocate", "-l", str(self.size), str(self.base / f"v{i}.img"))

    async def stage_publish(self, mode: str, i: int) -> None:
        await self._rtt()
        raw = self.base / f"raw{i}.img"
        with open(raw, "wb") as handle:
            handle.truncate(self.size)
        device = sh("losetup", "--find", "--show", str(raw)).strip()
        self.devices[i] = device
        target = self.base / f"target{i}"
        if mode == "filesystem":
            staging = self.base / f"staging{i}"
            sh(*MKFS_EXT4, device)
            staging.mkdir()
            sh("mount", "-t", "ext4", device, str(staging))
            await self._rtt()
            target.mkdir()
            sh("mount", "--bind", str(staging), str(target))
        else:
            await self._rtt()
            target.touch()
            sh("mount", "--bind", device, str(target))

    async def unpublish_unstage(self, mode: str, i: int) -> None:
        await self._rtt()
        target = self.base / f"target{i}"
        sh("umount", str(target))
        if mode == "filesystem":
            target.rmdir()
            await self._rtt()
            sh("umount", str(self.base / f"staging{i}"))
            (self.base / f"staging{i}").rmdir()
        else:
            target.unlink()
            await self._rtt()
        sh("losetup", "--detach", self.devices.pop(i))
        (self.base / f"raw{i}.img").unlink()

    async def delete(self, mode: str, i: int) -> None:
        await self._rtt()
        if mode == "filesystem":
            os.rmdir(self.base / f"v{i}")
        else:
            os.unlink(self.base / f"v{i}.img")


class Driven:
    """A CSI driver driven as the provisioner and kubelet do: create, stage, publish and back."""

    def __init__(self, csi: CSIClient, box: Sandbox, prefix: str, size: int, parameters: dict[str, str]) -> None:
        self.csi, self.box, self.prefix, self.size, self.parameters = csi, box, prefix, size, parameters
        self.ids: dict[int, str] = {}

    def _paths(self, mode: str, i: int) -> tuple[Path, Path]:
        staging = self.box.kubelet / "plugins" / self.prefix / f"{mode}{i}"
        target = self.box.kubelet / "pods" / f"{self.prefix}-{mode}{i}" / "volume"
        return staging, target

    async def create(self, mode: str, i: int) -> None:
        volume = await self.csi.create_volume(f"{self.prefix}-{mode}-{i}", self.size, self.parameters,
                                              block=mode == "block")
        self.ids[i] = volume.volume_id

    def prepare(self, mode: str, i: int) -> None:
        """What kubelet makes before it calls: the staging directory and the target's parent."""
        staging, target = self._paths(mode, i)
        staging.mkdir(parents=True, exist_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)

    async def stage_publish(self, mode: str, i: int) -> None:
        staging, target = self._paths(mode, i)
        block = mode == "block"
        await self.csi.stage(self.ids[i], str(staging), block=block)
        await self.csi.publish(self.ids[i], str(staging), str(target), block=block)

    async def unpublish_unstage(self, mode: str, i: int) -> None:
        staging, target = self._paths(mode, i)
        await self.csi.unpublish(self.ids[i], str(target))
        await self.csi.unstage(self.ids[i], str(staging))

    async def delete(self, mode: str, i: int) -> None:
        await self.csi.delete_volume(self.ids.pop(i))


async def measure(ours: Driven, reference: Floor | Driven, n: int) -> tuple[Samples, Samples]:
    """Every step of every mode for `n` volumes, the reference's sample right before ours."""
    mine: Samples = {}
    theirs: Samples = {}
    for mode in MODES:
        steps: list[tuple[str, Callable[[str, int], Awaitable[None]], Callable[[str, int], Awaitable[None]]]] = [
            ("CreateVolume", reference.create, ours.create),
            ("Stage + Publish", reference.stage_publish, ours.stage_publish),
            ("Unpublish + Unstage", reference.unpublish_unstage, ours.unpublish_unstage),
            ("DeleteVolume", reference.delete, ours.delete),
        ]
        for step, theirs_call, our_call in steps:
            print(f"{mode}: {step} x{n} ...", file=sys.stderr, flush=True)
            for i in range(n):
                for driven in (ours, reference):
                    if step == "Stage + Publish" and isinstance(driven, Driven):
                        driven.prepare(mode, i)
                with timed(theirs.setdefault((mode, step), [])):
                    await theirs_call(mode, i)
                with timed(mine.setdefault((mode, step), [])):
                    await our_call(mode, i)
    return mine, theirs


async def serve_reference(box: Sandbox, stack: AsyncExitStack) -> str:
    """Start `hostpathplugin` beside ours; its endpoint."""
    binary = shutil.which(REFERENCE)
    assert binary is not None
    state = box.root / "hostpath"
    state.mkdir()
    endpoint = f"unix://{state / 'csi.sock'}"
    log = open(box.root / "hostpath.log", "ab")
    proc = await asyncio.create_subprocess_exec(
        binary, f"--endpoint={endpoint}", "--nodeid=node-a", f"--statedir={state}", "--drivername=hostpath.csi.k8s.io",
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    stack.push_async_callback(terminate, proc)
    async with CSIClient(endpoint, timeout=5) as probe:
        async def ready() -> bool:
            try:
                return bool(await probe.probe())
            except Exception:  # not serving yet
                return False
        await until(ready, f"{REFERENCE} to answer Probe", 30)
    return endpoint


def report(mine: Samples, theirs: Samples, reference: str, header: str) -> str:
    rows = []
    verdicts = []
    for mode in MODES:
        for step in STEPS:
            ours_p50 = statistics.median(mine[(mode, step)])
            ref_p50 = statistics.median(theirs[(mode, step)])
            r = ours_p50 / ref_p50 if ref_p50 else float("inf")
            rows.append([f"{step} ({mode})", ms(ours_p50), ms(ref_p50), ratio(ours_p50, ref_p50)])
            verdicts.append([f"{step} ({mode}) <= {TARGET:.0f}x", f"{r:.2f}x", verdict(lambda: r <= TARGET)])
    return "\n\n".join([
        header,
        table(["p50, ms", "csi-qsd", reference, "ratio"], rows),
        table(["target (from the issue)", "measured", "result"], verdicts),
    ])


def mtab_kept() -> bool:
    """Whether libfuse would record FUSE mounts in /etc/mtab here (it skips a missing or read-only one)."""
    return os.path.lexists("/etc/mtab") and os.access("/etc/mtab", os.W_OK)


class Bench(ServedBench):
    """Ours served and driven beside the reference (or its floor); whatever a failed run left, through the driver."""

    client_timeout = 120.0

    def __init__(self, box: Sandbox, n: int, size: int) -> None:
        super().__init__(box, "--log-level", "warning")
        self.n, self.size = n, size
        self.text = "not measured"

    async def phases(self, csi: CSIClient) -> None:
        self.text = await run(self.box, csi, self.n, self.size)


async def run(box: Sandbox, csi: CSIClient, n: int, size: int) -> str:
    async with AsyncExitStack() as stack:
        ours = Driven(csi, box, "ours", size, {})
        if shutil.which(REFERENCE):
            endpoint = await serve_reference(box, stack)
            ref_csi = await stack.enter_async_context(CSIClient(endpoint, timeout=120))
            reference: Floor | Driven = Driven(ref_csi, box, "ref", size, {})
            name = f"{REFERENCE} (served)"
        else:
            base = box.root / "floor"
            base.mkdir()
            reference = Floor(base, size, csi)
            name = "floor: round trip + host-path's host work"
        mine, theirs = await measure(ours, reference, n)
    qsd = sh("qemu-storage-daemon", "--version").splitlines()[0]
    mtab = "a writable /etc/mtab (libfuse forks QSD per FUSE mount)" if mtab_kept() else "no writable /etc/mtab"
    header = (f"csi-qsd vs {name}: {n} volumes of {size // MIB} MiB per mode (qcow2; ext4 / block), p50; "
              f"{qsd}; {mtab}; {os.cpu_count()} CPUs; load average at the end {os.getloadavg()[0]:.2f}")
    return report(mine, theirs, name, header)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.vs_hostpath", description=__doc__.split("\n")[0])
    parser.add_argument("--volumes", type=int, default=40, help="volumes per mode (default 40)")
    parser.add_argument("--size-mib", type=int, default=1024, help="volume size in MiB (default 1024)")
    parser.add_argument("--mtab", choices=("image", "host"), default="image",
                        help="image: no writable /etc/mtab, as in the driver's image (default); host: as this host has")
    args = parser.parse_args(argv)
    if args.volumes < 1 or args.size_mib < 64:
        parser.error("--volumes must be at least 1 and --size-mib at least 64")
    if os.geteuid() != 0:
        print("run as root: the bench mounts filesystems and attaches loop devices", file=sys.stderr)
        return 2
    if args.mtab == "image" and mtab_kept():  # hidden by a read-only /proc, where /etc/mtab points
        if (status := rerun_unshared("e2e.bench.vs_hostpath", argv, "mount -o remount,bind,ro /proc")) is not None:
            return status
    return bench_main(lambda box: Bench(box, args.volumes, args.size_mib * MIB), lambda bench: bench.text)


if __name__ == "__main__":
    sys.exit(main())
