"""Encrypted volumes beside plain ones, one run: 4k QD32 random reads and writes on the pod and VM paths.

Run as ``.venv/bin/python -m e2e.bench.encryption_cost`` (root). It prints
figures, never pass/fail.

One served driver (`csi-qsd serve` with its defaults) makes two volumes per
path, alike but for `encrypted: "true"` (qcow2 with LUKS, AES-256-XTS in
QEMU's block layer, keyed over the CSI secrets as the sidecars pass them):

  pod  ext4 in each volume (FUSE export, direct-I/O loop device), fio
       (O_DIRECT, libaio) on a file laid out once in each;
  vm   vhost-user-blk exports (cache=writeback, preallocation=full), the
       polling libblkio client `blkio_bench` (as a VM's virtio-blk with
       polling) on each socket; skipped without it.

The encrypted volume runs first in even rounds, the plain one in odd ones
(ABBA), over ``--rounds``; a figure is the mean. The ratio is encrypted over
plain. The head line says what the CPU offers for AES (`/proc/cpuinfo`
flags: `aes` is AES-NI, `vaes`/`vpclmulqdq` its wide forms) and the busy
cores and CPU per I/O on each side say what the cipher costs.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import statistics
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from csi_qsd.exports.fuse_loop import export_file
from e2e.bench import blkio_client, scaling
from e2e.bench.fio import fio, lay_out
from e2e.bench.report_tables import progress, ratio, table
from e2e.bench.served_bench import ServedBench, logged, missing, rerun_unshared, run_to_end
from e2e.bench.sizes import GIB, MIB
from testing.harness import Sandbox, sandbox

VOLUME_SIZE = 1 * GIB
REGION = 512 * MIB
ENCRYPTED = {"encrypted": "true"}
VM_PARAMS = {"export": "vhost-user-blk", "cache": "writeback", "preallocation": "full"}
JOBS = ("randwrite", "randread")
AES_FLAGS = ("aes", "vaes", "vpclmulqdq", "avx2", "avx512f")


def cpu_offers() -> str:
    """The CPU's model and which AES-related flags /proc/cpuinfo shows."""
    model, flags = "?", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name":
            model = value.strip()
        elif name.strip() == "flags":
            flags = set(value.split())
            break
    shown = [flag for flag in AES_FLAGS if flag in flags]
    return f"{model}; /proc/cpuinfo flags: {' '.join(shown) or 'no aes (no AES-NI)'}"


class Bench(ServedBench):
    def __init__(self, box: Sandbox, seconds: float, rounds: int, kinds: list[str], region: int = REGION) -> None:
        super().__init__(box)
        self.seconds, self.rounds, self.kinds, self.region = seconds, rounds, kinds, region
        self.rows: list[scaling.Row] = []
        self.setting = "?"
        self.key = {"key": secrets.token_urlsafe(32)}

    async def phases(self, csi: CSIClient) -> None:
        version = logged(self.driver, "qsd_version")
        self.setting = f"QSD {version.get('version', '?')}"
        if "pod" in self.kinds:
            await self._pods(csi)
        if "vm" in self.kinds:
            await self._vms(csi)

    async def _pods(self, csi: CSIClient) -> None:
        plain = await self.stage(csi, "pod-plain", VOLUME_SIZE)
        sealed = await self.stage(csi, "pod-encrypted", VOLUME_SIZE, ENCRYPTED, secrets=self.key)
        files = {name: volume.target / "fio.dat" for name, volume in (("plain", plain), ("encrypted", sealed))}
        progress(f"laying out {self.region // MIB} MiB in each volume")
        for path in files.values():
            await lay_out(path, self.region)
        exports = [export_file(self.box.state_dir / "exports", sealed.id)]
        for rw in JOBS:
            job = scaling.qd32(rw)
            await self._compare(scaling.Row("pod", job.name, 1),
                                functools.partial(fio, job, files["encrypted"], runtime=self.seconds, size=self.region),
                                functools.partial(fio, job, files["plain"], runtime=self.seconds, size=self.region),
                                exports)

    async def _vms(self, csi: CSIClient) -> None:
        try:
            blkio_client.ensure_built()
        except (RuntimeError, OSError) as exc:
            progress(f"vm path skipped: {exc}")
            return
        plain = await self.stage(csi, "vm-plain", scaling.SIZE, VM_PARAMS)
        sealed = await self.stage(csi, "vm-encrypted", scaling.SIZE, {**VM_PARAMS, **ENCRYPTED}, secrets=self.key)
        sockets = {name: v.target / "vhost-user-blk.sock" for name, v in (("plain", plain), ("encrypted", sealed))}
        for write in (True, False):
            await self._compare(
                scaling.Row("vm", f"4k rand{'write' if write else 'read'} QD32", 1),
                functools.partial(scaling.blkio_iops, "virtio-blk-vhost-user", [sockets["encrypted"]], write,
                                  self.seconds),
                functools.partial(scaling.blkio_iops, "virtio-blk-vhost-user", [sockets["plain"]], write,
                                  self.seconds))

    async def _compare(self, row: scaling.Row, encrypted: Callable[[], Awaitable[float]],
                       plain: Callable[[], Awaitable[float]], exports: list[Path] | None = None) -> None:
        progress(f"{row.kind} {row.job}: {self.rounds} x {self.seconds:g} s each side")
        await scaling.compare(row, scaling.qsd_pids_of(self.box, 1), self.rounds, encrypted, plain, exports)
        self.rows.append(row)

    def render(self) -> str:
        head = (f"encrypted (qcow2 + LUKS aes-256-xts) vs plain (qcow2), same driver, same run; {self.setting}; "
                f"{os.cpu_count()} cores; {cpu_offers()}; {self.rounds} x {self.seconds:g} s each side, mean; "
                f"load average {os.getloadavg()[0]:.2f}")
        rows = []
        for row in self.rows:
            sealed, plain = statistics.mean(row.volume), statistics.mean(row.baseline)
            cost_sealed, cost_plain = row.cpu_per_io()
            rows.append([row.kind, row.job, f"{sealed / 1000:.1f}k",
                         f"{min(row.volume) / 1000:.1f}-{max(row.volume) / 1000:.1f}k", f"{plain / 1000:.1f}k",
                         f"{min(row.baseline) / 1000:.1f}-{max(row.baseline) / 1000:.1f}k", ratio(sealed, plain),
                         f"{cost_sealed:.1f} / {cost_plain:.1f}",
                         f"{statistics.mean(row.volume_cores):.2f} / {statistics.mean(row.baseline_cores):.2f}",
                         row.threads[-1] if row.threads else "-"])
        headers = ["path", "job", "encrypted", "spread", "plain", "spread", "ratio", "CPU us/IO enc / plain",
                   "busy cores enc / plain", "QSD CPU per thread (encrypted, last run)"]
        return "\n".join((head, table(headers, rows)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.encryption_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", type=float, default=5, help="seconds per run (default 5)")
    parser.add_argument("--rounds", type=int, default=4, help="runs on each side, alternating (default 4)")
    parser.add_argument("--kinds", type=lambda t: t.split(","), default=["pod", "vm"], help="pod,vm (default both)")
    parser.add_argument("--region-mib", type=int, default=REGION // MIB,
                        help="MiB of the fio file in each pod volume (default 512)")
    args = parser.parse_args(argv)
    if missing("fio", "unshare"):
        return 2
    if args.runtime <= 0 or args.rounds < 1 or not set(args.kinds) <= {"pod", "vm"} or \
            not 0 < args.region_mib * MIB < VOLUME_SIZE:
        parser.error("--runtime must be positive, --rounds at least 1, --kinds of pod and vm, --region-mib under "
                     "the volume's 1024")
    if (rerun := rerun_unshared("e2e.bench.encryption_cost", argv)) is not None:
        return rerun
    with sandbox() as box:
        bench = Bench(box, args.runtime, args.rounds, args.kinds, args.region_mib * MIB)
        status = run_to_end(bench.run(), bench.driver, what="encrypted")
        print(bench.render(), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
