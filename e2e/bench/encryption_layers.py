"""Where an encrypted volume's 4k I/O spends its CPU: every way QEMU can stack LUKS, with every cipher it offers.

Run as ``.venv/bin/python -m e2e.bench.encryption_layers`` (root for the pod
and VM paths; ``--paths block`` needs neither root nor the libblkio client).
It prints figures, never pass/fail.

Each layout is an image in ``--dir``, every cluster written once, opened as
QSD opens a file pool's images (io_uring, page cache):

  plain        qcow2, what an unencrypted volume is;
  qcow2-luks   qcow2 with ``encrypt.format=luks``, what an encrypted volume
               is: QEMU's qcow2 driver hands every encrypted cluster to its
               thread pool (``qcow2_co_process``, four at most per image),
               a wake-up and a switch per I/O;
  luks/qcow2   the ``luks`` driver over a plain qcow2 node: it ciphers in
               the request's own coroutine (``block/crypto.c``), no hand-off.

and each encrypted layout runs with each cipher of ``--ciphers`` (the LUKS
cipher, mode and IV generator QEMU's `luks` options take; aes-256-xts is
QEMU's default and what encrypted volumes use).

Three paths, 4k random at QD32, ``--rounds`` times each, interleaved, mean:

  block  `qemu-img bench` (the QEMU the driver runs, ``--qemu-img``): the
         block layer alone, in one process;
  pod    one standalone QSD per layout exporting it over FUSE as the driver
         exports a pod volume on QEMU 11 (growable, a queue per core), fio
         (O_DIRECT, libaio) on the exported file: no loop device, no ext4;
  vm     one standalone QSD per layout exporting it over vhost-user-blk as
         the driver exports a VM volume, driven by the polling libblkio
         client (``e2e.bench.blkio_client``), as a VM's virtio-blk would.

CPU per I/O is the process's user+system time over the I/O count. The pod
and VM rows also say what more cores would show: IOPS with a core for each
QSD thread, bounded by the busiest thread (the pool's workers counted as
the four a qcow2 image may use, the kernel's io_uring workers as many as
needed), and that ceiling's ratio to plain's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from csi_qsd.sys.tools import bundled
from e2e.bench import blkio_client
from e2e.bench.encryption_cost import cpu_offers
from e2e.bench.report_tables import figure, progress, ratio, table
from e2e.bench.standalone_qsd import Run, fuse_export, measure, serving, vhost_export

MIB = 1 << 20
EXPORT_SPAN = 256 * MIB  # what the VM and pod paths address
PASSPHRASE = "bench-passphrase"
KEY_OBJECT = "secret,id=key,file={key_file}"

# LUKS options (QEMU's QCryptoBlockCreateOptionsLUKS) per cipher name
CIPHERS: dict[str, tuple[str, ...]] = {
    "aes-256-xts": ("cipher-alg=aes-256", "cipher-mode=xts", "ivgen-alg=plain64"),
    "aes-128-xts": ("cipher-alg=aes-128", "cipher-mode=xts", "ivgen-alg=plain64"),
    "aes-256-cbc-essiv": ("cipher-alg=aes-256", "cipher-mode=cbc", "ivgen-alg=essiv", "ivgen-hash-alg=sha256"),
    "aes-128-cbc-essiv": ("cipher-alg=aes-128", "cipher-mode=cbc", "ivgen-alg=essiv", "ivgen-hash-alg=sha256"),
}


@dataclass(frozen=True)
class Layout:
    kind: str  # plain, qcow2-luks or luks/qcow2
    cipher: str = ""  # a CIPHERS name; "" for plain

    @property
    def name(self) -> str:
        return f"{self.kind} {self.cipher}".strip()

    def spec(self, path: Path) -> str:
        """The node graph with dotted keys (a --blockdev or qemu-img's --image-opts)."""
        under = "file.file." if self.kind == "luks/qcow2" else "file."
        file = f"{under}driver=file,{under}filename={str(path).replace(',', ',,')},{under}aio=io_uring"
        if self.kind == "plain":
            return f"driver=qcow2,{file}"
        if self.kind == "qcow2-luks":
            return f"driver=qcow2,encrypt.format=luks,encrypt.key-secret=key,{file}"
        return f"driver=luks,key-secret=key,file.driver=qcow2,{file}"


@dataclass
class Sample:
    seconds: float
    cpu: float


def layouts(ciphers: list[str]) -> list[Layout]:
    return [Layout("plain"), *(Layout(kind, cipher) for cipher in ciphers for kind in ("qcow2-luks", "luks/qcow2"))]


def prepare(qemu_img: str, workdir: Path, layout: Layout, key_file: Path, size: int) -> Path:
    """The layout's image, every cluster written once (a bench of allocation would measure qcow2, not LUKS)."""
    image = workdir / f"{layout.name.replace('/', '-').replace(' ', '-')}.qcow2"
    secret = ["--object", KEY_OBJECT.format(key_file=key_file)]
    luks = ["key-secret=key", "iter-time=10", *CIPHERS.get(layout.cipher, ())]
    options = ["-o", ",".join(f"encrypt.{o}" for o in ["format=luks", *luks])] if layout.kind == "qcow2-luks" else []
    subprocess.run([qemu_img, "create", "-q", *secret, "-f", "qcow2", *options, str(image), str(size + 16 * MIB)],
                   check=True)
    if layout.kind == "luks/qcow2":
        # The luks driver reads its header from the qcow2 node's first bytes: a header-only luks file copied in.
        header = workdir / "header.luks"
        subprocess.run([qemu_img, "create", "-q", *secret, "-f", "luks", "-o", ",".join(luks), str(header), "0"],
                       check=True)
        subprocess.run([qemu_img, "convert", "-n", "-f", "raw", "-O", "qcow2", str(header), str(image)], check=True)
    run_bench(qemu_img, layout, image, key_file, write=True, count=size // (64 << 10), size=64 << 10)
    return image


def run_bench(qemu_img: str, layout: Layout, image: Path, key_file: Path, *, write: bool, count: int,
              size: int = 4096) -> Sample:
    """One `qemu-img bench` run: its wall time and the CPU time it used."""
    argv = [qemu_img, "bench", "--object", KEY_OBJECT.format(key_file=key_file), "--image-opts", "-c", str(count),
            "-d", "32", "-s", str(size), "-S", str(size), *(["-w"] if write else []), layout.spec(image)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Sample(seconds, cpu)


def block_table(qemu_img: str, images: dict[Layout, Path], key_file: Path, rounds: int, count: int) -> str:
    samples: dict[tuple[Layout, bool], list[Sample]] = {}
    for turn in range(rounds):
        progress(f"block layer: round {turn + 1} of {rounds}")
        for write in (True, False):
            for layout, image in images.items():
                samples.setdefault((layout, write), []).append(
                    run_bench(qemu_img, layout, image, key_file, write=write, count=count))
    rows = []
    for write in (True, False):
        base = _iops(samples[(Layout("plain"), write)], count)
        for layout in images:
            runs = samples[(layout, write)]
            iops = _iops(runs, count)
            cpu_us = sum(s.cpu for s in runs) / len(runs) / count * 1e6
            rows.append([_job(write), layout.name, figure(iops), ratio(iops, base), f"{cpu_us:.1f}"])
    return "block layer (qemu-img bench, one process)\n" + table(
        ["job", "layout", "IOPS", "vs plain", "CPU us/IO"], rows)


async def export_table(path: str, qsd: str, images: dict[Layout, Path], key_file: Path, rounds: int,
                       seconds: float, workdir: Path) -> str:
    """The `vm` or `pod` path: each layout exported by its own QSD, in turn."""
    fuse = path == "pod"
    at = workdir / ("pod.img" if fuse else "vm.sock")
    export = fuse_export(at) if fuse else vhost_export(at)
    runs: dict[tuple[Layout, bool], list[Run]] = {}
    for turn in range(rounds):
        progress(f"{path} path: round {turn + 1} of {rounds}")
        for write in (True, False):
            for layout, image in images.items():
                async with serving(qsd, layout.spec(image), export, at, [KEY_OBJECT.format(key_file=key_file)]) as pid:
                    run = await measure(pid, at, fuse=fuse, write=write, seconds=seconds, size=EXPORT_SPAN)
                runs.setdefault((layout, write), []).append(run)
    rows = []
    for write in (True, False):
        plain = runs[(Layout("plain"), write)]
        base, base_ceiling = statistics.mean(r.iops for r in plain), statistics.mean(r.ceiling() for r in plain)
        for layout in images:
            mine = runs[(layout, write)]
            iops, ceiling = statistics.mean(r.iops for r in mine), statistics.mean(r.ceiling() for r in mine)
            busy = ", ".join(f"{name} {share:.2f}" for name, share in
                             sorted(mine[-1].threads.items(), key=lambda item: -item[1]) if share >= 0.03)
            rows.append([_job(write), layout.name, figure(iops), ratio(iops, base), figure(ceiling),
                         ratio(ceiling, base_ceiling), busy])
    how = ("QSD FUSE export, growable, a queue per core; fio O_DIRECT on the exported file" if fuse else
           "QSD vhost-user-blk export; the polling libblkio client")
    return (f"{path} path ({how}); 'more cores' is an estimate, not measured here: a core per QSD thread\n"
            + table(["job", "layout", "IOPS", "vs plain", "more cores: IOPS", "vs plain",
                     "QSD CPU per thread (last run)"], rows))


def _client_built() -> bool:
    try:
        blkio_client.ensure_built()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        print(f"vm path skipped: {exc}")
        return False
    return True


def _job(write: bool) -> str:
    return "4k randwrite QD32" if write else "4k randread QD32"


def _iops(runs: list[Sample], count: int) -> float:
    return count / (sum(s.seconds for s in runs) / len(runs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qemu-img", default=bundled("qemu-img-11"), help="the qemu-img whose block layer to measure")
    parser.add_argument("--qsd", default=bundled("qemu-storage-daemon-11"),
                        help="the QSD of the pod and VM paths (QEMU 11: a growable FUSE export)")
    parser.add_argument("--dir", default="/var/tmp", help="where the images live (a disk filesystem, not tmpfs)")
    parser.add_argument("--paths", type=lambda t: t.split(","), default=["block", "pod", "vm"],
                        help="block,pod,vm (default all)")
    parser.add_argument("--ciphers", type=lambda t: t.split(","), default=list(CIPHERS),
                        help=f"of {','.join(CIPHERS)} (default all)")
    parser.add_argument("--count", type=int, default=200_000, help="4k I/Os per block-layer run")
    parser.add_argument("--seconds", type=float, default=4, help="seconds per pod- or VM-path run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=1024, help="each image's size, written whole first")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ciphers) - set(CIPHERS))
    if unknown:
        parser.error(f"unknown cipher {', '.join(unknown)}: choose of {', '.join(CIPHERS)}")
    if {"pod", "vm"} & set(args.paths) and args.size_mib * MIB < EXPORT_SPAN:
        parser.error(f"the pod and VM paths address {EXPORT_SPAN // MIB} MiB: --size-mib must be at least that")
    print(f"CPU: {cpu_offers()}; {os.cpu_count()} cores; {args.qemu_img}; {args.qsd}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="csi-qsd-enc-layers-") as tmp:
        workdir = Path(tmp)
        key_file = workdir / "key"
        key_file.write_text(PASSPHRASE)
        progress(f"writing {len(layouts(args.ciphers))} images of {args.size_mib} MiB")
        images = {layout: prepare(args.qemu_img, workdir, layout, key_file, args.size_mib * MIB)
                  for layout in layouts(args.ciphers)}
        if "block" in args.paths:
            print(block_table(args.qemu_img, images, key_file, args.rounds, args.count))
        for path in ("pod", "vm"):
            if path not in args.paths:
                continue
            if path == "vm" and not _client_built():
                continue
            print(asyncio.run(export_table(path, args.qsd, images, key_file, args.rounds, args.seconds, workdir)))
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
