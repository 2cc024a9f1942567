"""Data-plane speed: a csi-qsd VM volume and the container path, each beside its baseline, in one run.

Run as ``.venv/bin/python -m e2e.bench.dataplane [--runtime 5]`` (root; about 6
minutes with the default 5 s per job). It prints figures, never pass/fail.

The same six fio jobs (4k random read/write at QD1 and QD32, 1 MiB sequential
read/write at QD8; O_DIRECT, libaio, a 256 MiB region, the sequential write
first so later jobs read written data) run over:

VM table, inside the busybox guest (fio is the host's Debian binary, shipped
into the per-run initramfs with its shared libraries and started through the
bundled ``ld-linux``; 1 vCPU, one queue):
  (a)  a csi-qsd vhost-user-blk volume of the default class (qcow2, export
       ``writethrough=on``), staged and published through the CSI socket;
  (a') the opt-in ``cache: writeback`` class with a VM that flushes
       (``config-wce=off``), to show what the write-through default costs;
  (b)  QEMU's own virtio-blk (iothread) on the same image file, with the same
       cache semantics as (a): ``cache=writethrough`` (host page cache, a flush
       after every write), ``aio=threads``;
  (b') the same with ``cache=none,aio=native`` (O_DIRECT), the usual production choice;
  (c)  host fio straight on a raw file of the same size in the pool directory.

Container table, all on the host: fio on QSD's FUSE export file of a csi-qsd
volume vs the raw file (c); and a csi-qsd filesystem volume (ext4 on the
driver's loop device over the FUSE export) vs ext4 made the same way on a loop
device over a raw file, in the mode the driver chose for its own (direct I/O
on QSD >= 10.0.8, buffered before: `csi_qsd.qsd.features`), read from sysfs
and printed with the table.

Caveats printed with the tables: guests run under TCG here (``/dev/kvm`` on
these machines hangs a stock kernel), so guest figures are bounded by CPU
emulation and only their ratios mean much; QSD and (b) open the image through
the host page cache, (b') and (c) do not.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from csi_qsd.cli.client import CSIClient
from e2e.bench.fio import Job, fio
from e2e.bench.loop_devices import ext4_on, loop_device, loop_mode_of, raw_file
from e2e.bench.report_tables import figure, progress, ratio, table
from e2e.bench.served_bench import ServedBench, bench_main
from e2e.bench.sizes import MIB
from e2e.bench.staged_volumes import release
from testing.guest import Disk, FileDisk, GuestImage, VhostUserDisk, build_guest_image, default_accel, run_guest
from testing.harness import Sandbox

VOLUME_SIZE = 512 * MIB
REGION = 256 * MIB
GUEST_MEMORY_MIB = 768  # the initramfs carries ~80 MiB of fio and its libraries
GUEST_FIO_DIR = "/opt/fio"
TERSE_PREFIX = "3;fio-"


JOBS = (
    Job("seq-write-1M-qd8", "write", "1M", 8),
    Job("seq-read-1M-qd8", "read", "1M", 8),
    Job("rand-read-4k-qd1", "randread", "4k", 1),
    Job("rand-read-4k-qd32", "randread", "4k", 32),
    Job("rand-write-4k-qd1", "randwrite", "4k", 1),
    Job("rand-write-4k-qd32", "randwrite", "4k", 32),
)


Results = dict[str, float]  # job name -> MiB/s if sequential, else IOPS


def job_file(filename: str, runtime: float) -> str:
    lines = [
        "[global]", f"filename={filename}", "direct=1", "ioengine=libaio", f"size={REGION // MIB}M",
        "time_based", f"runtime={round(runtime * 1000)}ms", "randrepeat=0", "norandommap",
    ]
    for job in JOBS:
        lines += [f"[{job.name}]", "stonewall", f"rw={job.rw}", f"bs={job.bs}", f"iodepth={job.iodepth}"]
    return "\n".join(lines) + "\n"


def parse_terse(output: str) -> Results:
    """fio --minimal (terse v3) lines -> figures: fields 7/8 are read KiB/s/IOPS, 48/49 the writes'."""
    results: Results = {}
    by_name = {job.name: job for job in JOBS}
    for line in output.splitlines():
        start = line.find(TERSE_PREFIX)
        if start < 0:
            continue
        fields = line[start:].split(";")
        job = by_name.get(fields[2])
        if job is None:
            continue
        if int(fields[4]) != 0:
            raise RuntimeError(f"fio job {job.name} failed with error {fields[4]}")
        bw_kib, iops = (fields[47], fields[48]) if job.writes else (fields[6], fields[7])
        results[job.name] = float(bw_kib) / 1024 if job.sequential else float(iops)
    missing = [job.name for job in JOBS if job.name not in results]
    if missing:
        raise RuntimeError(f"fio printed no result for {missing}:\n{output[-2000:]}")
    return results


# --- host side -------------------------------------------------------------------


async def fio_host(filename: Path, runtime: float) -> Results:
    """The jobs in turn, as in the guest."""
    return {job.name: await fio(job, filename, runtime=runtime, size=REGION) for job in JOBS}


# --- guest side ------------------------------------------------------------------


def fio_guest_files(jobs: str) -> dict[str, bytes]:
    """The host's fio, every shared library ldd names (by soname), its loader, and the job file."""
    out = subprocess.run(["ldd", "/usr/bin/fio"], capture_output=True, text=True, check=True).stdout
    files = {f"{GUEST_FIO_DIR}/fio": Path("/usr/bin/fio").read_bytes(), f"{GUEST_FIO_DIR}/jobs.fio": jobs.encode()}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            soname, path = parts[0], parts[2]
        elif parts and parts[0].startswith("/"):
            soname, path = Path(parts[0]).name, parts[0]
        else:
            continue  # linux-vdso
        files[f"{GUEST_FIO_DIR}/lib/{soname}"] = Path(path).resolve().read_bytes()
    return files


def fio_guest_script() -> str:
    lib = f"{GUEST_FIO_DIR}/lib"
    return (
        f"chmod 0755 {GUEST_FIO_DIR}/fio {lib}/*\n"
        f"{lib}/ld-linux-x86-64.so.2 --library-path {lib} {GUEST_FIO_DIR}/fio --minimal {GUEST_FIO_DIR}/jobs.fio\n"
    )


async def fio_guest(image: GuestImage, disk: Disk, files: Mapping[str, bytes], runtime: float) -> Results:
    result = await run_guest(
        image, [disk], fio_guest_script(), files=files, memory_mib=GUEST_MEMORY_MIB, cpus=1,
        timeout=round(120 + 3 * runtime * len(JOBS)),
    )
    if result.exit_code != 0:
        raise RuntimeError(f"fio failed in the guest (exit {result.exit_code}):\n{result.output[-3000:]}")
    return parse_terse(result.output)


# --- csi-qsd volumes ---------------------------------------------------------------


class Bench(ServedBench):
    """The driver's volumes and their baselines, in a guest (`vm`) and on the host (`host`)."""

    client_timeout = 120.0

    def __init__(self, box: Sandbox, runtime: float) -> None:
        super().__init__(box)
        self.runtime = runtime
        self.vm: dict[str, Results] = {}
        self.host: dict[str, Results] = {}
        self.loops = "?"

    async def phases(self, csi: CSIClient) -> None:
        image = build_guest_image()
        runtime, box, vm, host = self.runtime, self.box, self.vm, self.host
        files = fio_guest_files(job_file("/dev/vda", runtime))
        vm_class = {"export": "vhost-user-blk", "format": "qcow2", "preallocation": "full"}
        progress("(a) csi-qsd vhost-user-blk volume, default class")
        volume = await self.stage(csi, "bench-vm", VOLUME_SIZE, vm_class)
        vm["a"] = await fio_guest(image, VhostUserDisk(volume.target / "vhost-user-blk.sock"), files, runtime)
        await release(csi, volume, delete=False)
        qcow2 = box.state_dir / "pool" / f"{volume.id}.qcow2"  # closed by QSD now
        progress("(b) QEMU virtio-blk on the same image, cache=writethrough")
        disk: Disk = FileDisk(qcow2, format="qcow2", cache="writethrough", aio="threads", iothread=True)
        vm["b"] = await fio_guest(image, disk, files, runtime)
        progress("(b') QEMU virtio-blk on the same image, cache=none")
        disk = FileDisk(qcow2, format="qcow2", cache="none", aio="native", iothread=True)
        vm["b'"] = await fio_guest(image, disk, files, runtime)

        progress("(a') csi-qsd volume, cache=writeback class, VM with config-wce=off")
        volume = await self.stage(csi, "bench-vm-wb", VOLUME_SIZE, {**vm_class, "cache": "writeback"})
        disk = VhostUserDisk(volume.target / "vhost-user-blk.sock", config_wce=False)
        vm["a'"] = await fio_guest(image, disk, files, runtime)
        await release(csi, volume, delete=False)

        progress("(c) host fio on a raw file in the pool directory")
        async with raw_file(box.state_dir / "pool" / "bench.raw", VOLUME_SIZE) as raw:
            host["raw"] = await fio_host(raw, runtime)

            progress("host fio on the FUSE export file of a csi-qsd volume")
            volume = await self.stage(csi, "bench-fuse", VOLUME_SIZE, {"preallocation": "full"}, block=True,
                                      publish=False)
            host["fuse"] = await fio_host(box.state_dir / "exports" / volume.id / "disk", runtime)
            await csi.unstage(volume.id, str(volume.staging))

            progress("host fio on ext4 / loop / FUSE (a csi-qsd filesystem volume)")
            volume = await self.stage(csi, "bench-ext4", VOLUME_SIZE, {"preallocation": "full"})
            mode = loop_mode_of(volume.target)  # the driver's choice: the baseline's loop device is made the same
            host["ext4-fuse"] = await fio_host(volume.target / "fio.dat", runtime)
            await release(csi, volume, delete=False)

            progress(f"host fio on ext4 / loop / raw file, loop device {mode.split()[0]} as the driver's")
            async with loop_device(raw, direct=mode.startswith("direct")) as device, \
                    ext4_on(device, box.root / "ext4-raw") as mountpoint:
                self.loops = f"the volume's loop device {mode}, the baseline's {loop_mode_of(mountpoint)}"
                host["ext4-raw"] = await fio_host(mountpoint / "fio.dat", runtime)


def render(bench: Bench) -> str:
    vm_rows, host_rows = [], []
    for job in JOBS:
        v = {key: results[job.name] for key, results in {**bench.vm, **bench.host}.items()}
        vm_rows.append([job.label, *(figure(v[key]) for key in ("a", "a'", "b", "b'", "raw")),
                        ratio(v["a"], v["b"]), ratio(v["a"], v["b'"]), ratio(v["a"], v["raw"])])
        host_rows.append([job.label, figure(v["fuse"]), figure(v["raw"]), ratio(v["fuse"], v["raw"]),
                          figure(v["ext4-fuse"]), figure(v["ext4-raw"]), ratio(v["ext4-fuse"], v["ext4-raw"])])
    accel, runtime = default_accel(), bench.runtime
    return "\n".join([
        f"VM volumes: fio in the guest ({accel.upper()}, 1 vCPU), {runtime:g} s per job, O_DIRECT, "
        f"{REGION // MIB}M region",
        table(["job", "(a) csi-qsd", "(a') wb+wce=off", "(b) qemu wt", "(b') qemu none", "(c) host raw",
               "a/b", "a/b'", "a/c"], vm_rows),
        "",
        f"Container path: fio on the host, {runtime:g} s per job, O_DIRECT; {bench.loops}",
        table(["job", "FUSE file", "raw file", "ratio", "ext4/loop/FUSE", "ext4/loop/raw", "ratio"], host_rows),
        "",
        "(a) default class: qcow2, export writethrough=on (QSD flushes after every write), host page cache",
        "(a') cache=writeback class, VM config-wce=off (the guest flushes on fsync)",
        "(b) QEMU virtio-blk, same image, cache=writethrough,aio=threads,iothread (same semantics as (a))",
        "(b') QEMU virtio-blk, same image, cache=none,aio=native,iothread (O_DIRECT, no host page cache)",
        "(c) host fio on a raw file in the pool directory (O_DIRECT)",
        f"guest figures are bounded by {accel.upper()} CPU emulation: compare ratios, not absolutes",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runtime", type=float, default=5, help="seconds per fio job (default 5)")
    args = parser.parse_args(argv)
    return bench_main(lambda box: Bench(box, args.runtime), render, tools=("fio", "qemu-system-x86_64"))


if __name__ == "__main__":
    sys.exit(main())
