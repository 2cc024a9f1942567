"""Control plane beside the reference driver: p50 of each CSI call, ours against csi-driver-host-path's.

The reference is the Kubernetes CSI community's host-path driver, its
`hostpathplugin` release build from `../shared/bin` (or
`$CSI_QSD_SHARED_BIN`; else the one on PATH), served beside ours on a CSI
socket of its own and driven with the same calls, one volume at a time, its
call right before ours: CreateVolume, NodeStageVolume, NodePublishVolume,
NodeUnpublishVolume, NodeUnstageVolume, DeleteVolume, for filesystem and
block volumes. Without the binary the bench says where it looked and
measures nothing. Neither driver is asked for anything the other is not;
every answer of ours is durable, host-path fsyncs nothing.

By default both run as the driver's image runs them: without a writable
/etc/mtab. Where /etc/mtab can be written, libfuse forks QSD to run
`mount -f` (and `umount`) for every FUSE export it adds (removes), 3-4 ms
each under this bench's load; the image has no /etc/mtab. The bench re-runs
itself in a private mount namespace whose /proc (where the host's /etc/mtab
points) is read-only, which libfuse takes as "no mtab to keep"; nothing of
the host changes. `--mtab host` measures with the host's /etc/mtab instead.

At the end the CreateVolume and DeleteVolume ratios are held against the
target (<= 1.5x the reference, p50) and printed as PASS or MISS; the node
calls are reported, with the pairs kubelet makes (stage + publish,
unpublish + unstage) summed. Usage:

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

from csi_qsd.cli.client import CSIClient
from e2e.bench.latencies import timed
from e2e.bench.report_tables import ms, ratio, table, verdict
from e2e.bench.served_bench import ServedBench, bench_main, rerun_unshared
from e2e.bench.shell import sh
from e2e.bench.sizes import MIB
from testing import shared_bin
from testing.harness import Sandbox, terminate, until

MODES = ("filesystem", "block")
CALLS = ("CreateVolume", "NodeStageVolume", "NodePublishVolume", "NodeUnpublishVolume", "NodeUnstageVolume",
         "DeleteVolume")
PAIRS = (("Stage + Publish", ("NodeStageVolume", "NodePublishVolume")),
         ("Unpublish + Unstage", ("NodeUnpublishVolume", "NodeUnstageVolume")))
TARGETS = {"CreateVolume": 1.5, "DeleteVolume": 1.5}
REFERENCE = "hostpathplugin"

Samples = dict[tuple[str, str], list[float]]


class Driven:
    """A CSI driver driven as the provisioner and kubelet do, one call at a time: create, stage, publish and back."""

    def __init__(self, csi: CSIClient, box: Sandbox, prefix: str, size: int, parameters: dict[str, str]) -> None:
        self.csi, self.box, self.prefix, self.size, self.parameters = csi, box, prefix, size, parameters
        self.ids: dict[int, str] = {}

    def _paths(self, mode: str, i: int) -> tuple[Path, Path]:
        staging = self.box.kubelet / "plugins" / self.prefix / f"{mode}{i}"
        target = self.box.kubelet / "pods" / f"{self.prefix}-{mode}{i}" / "volume"
        return staging, target

    def prepare(self, mode: str, i: int) -> None:
        """What kubelet makes before it calls: the staging directory and the target's parent."""
        staging, target = self._paths(mode, i)
        staging.mkdir(parents=True, exist_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)

    def call(self, name: str, mode: str, i: int) -> Awaitable[object]:
        """CSI call `name` for volume `i` of `mode`, as kubelet or the provisioner would make it."""
        staging, target = self._paths(mode, i)
        block = mode == "block"
        if name == "CreateVolume":
            return self._create(mode, i)
        if name == "DeleteVolume":
            return self.csi.delete_volume(self.ids.pop(i))
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "NodeStageVolume": lambda: self.csi.stage(self.ids[i], str(staging), block=block),
            "NodePublishVolume": lambda: self.csi.publish(self.ids[i], str(staging), str(target), block=block),
            "NodeUnpublishVolume": lambda: self.csi.unpublish(self.ids[i], str(target)),
            "NodeUnstageVolume": lambda: self.csi.unstage(self.ids[i], str(staging)),
        }
        return calls[name]()

    async def _create(self, mode: str, i: int) -> None:
        volume = await self.csi.create_volume(f"{self.prefix}-{mode}-{i}", self.size, self.parameters,
                                              block=mode == "block")
        self.ids[i] = volume.volume_id


async def measure(ours: Driven, reference: Driven, n: int) -> tuple[Samples, Samples]:
    """Every call of every mode for `n` volumes, the reference's call right before ours."""
    mine: Samples = {}
    theirs: Samples = {}
    for mode in MODES:
        for name in CALLS:
            print(f"{mode}: {name} x{n} ...", file=sys.stderr, flush=True)
            for i in range(n):
                for driven, samples in ((reference, theirs), (ours, mine)):
                    if name == "NodeStageVolume":
                        driven.prepare(mode, i)
                    with timed(samples.setdefault((mode, name), [])):
                        await driven.call(name, mode, i)
    return mine, theirs


def find_reference() -> Path | None:
    """The release build in the shared directory, else one on PATH."""
    found = shared_bin.find(REFERENCE)
    on_path = shutil.which(REFERENCE)
    return found or (Path(on_path) if on_path else None)


async def serve_reference(box: Sandbox, stack: AsyncExitStack, binary: Path) -> str:
    """Start `hostpathplugin` beside ours; its endpoint."""
    state = box.root / "hostpath"
    state.mkdir()
    endpoint = f"unix://{state / 'csi.sock'}"
    log = open(box.root / "hostpath.log", "ab")
    proc = await asyncio.create_subprocess_exec(
        str(binary), f"--endpoint={endpoint}", "--nodeid=node-a", f"--statedir={state}",
        "--drivername=hostpath.csi.k8s.io", stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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


def _p50s(samples: Samples, mode: str, names: tuple[str, ...]) -> float:
    return sum(statistics.median(samples[(mode, name)]) for name in names)


def report(mine: Samples, theirs: Samples, reference: str, header: str) -> str:
    rows = []
    verdicts = []
    for mode in MODES:
        lines = [(name, (name,)) for name in CALLS] + list(PAIRS)
        for label, names in lines:
            ours_p50, ref_p50 = _p50s(mine, mode, names), _p50s(theirs, mode, names)
            rows.append([f"{label} ({mode})", ms(ours_p50), ms(ref_p50), ratio(ours_p50, ref_p50)])
            if label in TARGETS:
                r = ours_p50 / ref_p50 if ref_p50 else float("inf")
                target = TARGETS[label]
                verdicts.append([f"{label} ({mode}) <= {target}x", f"{r:.2f}x", verdict(lambda: r <= target)])
    return "\n\n".join([
        header,
        table(["p50, ms", "csi-qsd", reference, "ratio"], rows),
        table(["target (from the issue)", "measured", "result"], verdicts),
    ])


def mtab_kept() -> bool:
    """Whether libfuse would record FUSE mounts in /etc/mtab here (it skips a missing or read-only one)."""
    return os.path.lexists("/etc/mtab") and os.access("/etc/mtab", os.W_OK)


class Bench(ServedBench):
    """Ours served and driven beside the reference; whatever a failed run left, through the driver."""

    client_timeout = 120.0

    def __init__(self, box: Sandbox, n: int, size: int, reference: Path) -> None:
        super().__init__(box, "--log-level", "warning")
        self.n, self.size, self.reference = n, size, reference
        self.text = "not measured"

    async def phases(self, csi: CSIClient) -> None:
        self.text = await run(self.box, csi, self.n, self.size, self.reference)


async def run(box: Sandbox, csi: CSIClient, n: int, size: int, binary: Path) -> str:
    async with AsyncExitStack() as stack:
        ours = Driven(csi, box, "ours", size, {})
        endpoint = await serve_reference(box, stack, binary)
        ref_csi = await stack.enter_async_context(CSIClient(endpoint, timeout=120))
        mine, theirs = await measure(ours, Driven(ref_csi, box, "ref", size, {}), n)
    qsd = sh("qemu-storage-daemon", "--version").splitlines()[0]
    mtab = "a writable /etc/mtab (libfuse forks QSD per FUSE mount)" if mtab_kept() else "no writable /etc/mtab"
    known = shared_bin.release(REFERENCE, binary.parent)
    version = f"{known[1]} ({known[0]} {known[2]})" if known else f"unknown release, {binary}"
    header = (f"csi-qsd vs {REFERENCE} {version}, served: {n} volumes of {size // MIB} MiB per mode "
              f"(qcow2; ext4 / block), p50 per call; {qsd}; {mtab}; {os.cpu_count()} CPUs; "
              f"load average at the end {os.getloadavg()[0]:.2f}")
    return report(mine, theirs, f"{REFERENCE} (served)", header)


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
    reference = find_reference()
    if reference is None:
        print(f"no {REFERENCE} in {shared_bin.directory()} (${shared_bin.ENV}) or on PATH: nothing to measure "
              "against", file=sys.stderr)
        return 2
    if args.mtab == "image" and mtab_kept():  # hidden by a read-only /proc, where /etc/mtab points
        if (status := rerun_unshared("e2e.bench.vs_hostpath", argv, "mount -o remount,bind,ro /proc")) is not None:
            return status
    return bench_main(lambda box: Bench(box, args.volumes, args.size_mib * MIB, reference), lambda bench: bench.text)


if __name__ == "__main__":
    sys.exit(main())
