"""Where an encrypted volume's 4k I/O spends its CPU: QEMU's block layer alone, three ways to stack LUKS.

Run as ``.venv/bin/python -m e2e.bench.encryption_layers`` (no root, no
driver). It prints figures, never pass/fail.

`qemu-img bench` (the QEMU the driver runs: ``--qemu-img``) drives 4k
random reads and writes at queue depth 32 on images in ``--dir``, opened as
QSD opens a file pool's images (io_uring, page cache), so only the block
layer is measured: no FUSE, no vhost-user, no guest. Each layout runs
``--rounds`` times, interleaved; a figure is the mean:

  plain        qcow2, what an unencrypted volume is;
  qcow2-luks   qcow2 with ``encrypt.format=luks``, what an encrypted volume
               is: QEMU's qcow2 driver hands every encrypted cluster to its
               thread pool (``qcow2_co_process``, four at most per image),
               a wake-up and a switch per I/O;
  luks/qcow2   the ``luks`` driver over a plain qcow2 node: it ciphers in
               the request's own coroutine (``block/crypto.c``), no hand-off.

CPU per I/O is the process's user+system time over the I/O count: on more
cores a layout's IOPS scale until one thread saturates, so the CPU per I/O,
not the ratio on this machine's cores, is what carries over.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from csi_qsd.sys.tools import bundled
from e2e.bench.encryption_cost import cpu_offers
from e2e.bench.report_tables import figure, ratio, table

MIB = 1 << 20
PASSPHRASE = "bench-passphrase"


@dataclass(frozen=True)
class Layout:
    name: str
    create: tuple[str, ...]  # qemu-img create arguments after the secret object, image path last but size
    spec: str  # --image-opts for qemu-img bench, with {path}


LAYOUTS = (
    Layout("plain", ("-f", "qcow2"), "driver=qcow2,file.filename={path},file.aio=io_uring"),
    Layout("qcow2-luks", ("-f", "qcow2", "-o", "encrypt.format=luks,encrypt.key-secret=key,encrypt.iter-time=10"),
           "driver=qcow2,encrypt.key-secret=key,file.filename={path},file.aio=io_uring"),
    Layout("luks/qcow2", ("-f", "qcow2"),
           "driver=luks,key-secret=key,file.driver=qcow2,file.file.filename={path},file.file.aio=io_uring"),
)


@dataclass
class Sample:
    seconds: float
    cpu: float


def _secret(key_file: Path) -> str:
    return f"secret,id=key,file={key_file}"


def prepare(qemu_img: str, workdir: Path, layout: Layout, key_file: Path, size: int) -> Path:
    """The layout's image, every cluster written once (a bench of allocation would measure qcow2, not LUKS)."""
    image = workdir / f"{layout.name.replace('/', '-')}.qcow2"
    subprocess.run([qemu_img, "create", "-q", "--object", _secret(key_file), *layout.create, str(image),
                    str(size + 16 * MIB)], check=True)
    if layout.name == "luks/qcow2":
        # The luks driver reads its header from the qcow2 node's first bytes: a header-only luks file copied in.
        header = workdir / "header.luks"
        subprocess.run([qemu_img, "create", "-q", "--object", _secret(key_file), "-f", "luks", "-o",
                        "key-secret=key,iter-time=10", str(header), "0"], check=True)
        subprocess.run([qemu_img, "convert", "-n", "-f", "raw", "-O", "qcow2", str(header), str(image)], check=True)
    run_bench(qemu_img, layout, image, key_file, write=True, count=size // (64 << 10), size=64 << 10)
    return image


def run_bench(qemu_img: str, layout: Layout, image: Path, key_file: Path, *, write: bool, count: int,
              size: int = 4096) -> Sample:
    """One `qemu-img bench` run: its wall time and the CPU time it used."""
    argv = [qemu_img, "bench", "--object", _secret(key_file), "--image-opts", "-c", str(count), "-d", "32",
            "-s", str(size), "-S", str(size), *(["-w"] if write else []), layout.spec.format(path=image)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Sample(seconds, cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qemu-img", default=bundled("qemu-img-11"), help="the qemu-img whose block layer to measure")
    parser.add_argument("--dir", default="/var/tmp", help="where the images live (a disk filesystem, not tmpfs)")
    parser.add_argument("--count", type=int, default=200_000, help="4k I/Os per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=1024, help="each image's size, written whole first")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_offers()}; {os.cpu_count()} cores; {args.qemu_img}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="csi-qsd-enc-layers-") as tmp:
        workdir = Path(tmp)
        key_file = workdir / "key"
        key_file.write_text(PASSPHRASE)
        images = {layout.name: prepare(args.qemu_img, workdir, layout, key_file, args.size_mib * MIB)
                  for layout in LAYOUTS}
        samples: dict[tuple[str, bool], list[Sample]] = {}
        for _ in range(args.rounds):
            for write in (True, False):
                for layout in LAYOUTS:
                    sample = run_bench(args.qemu_img, layout, images[layout.name], key_file, write=write,
                                       count=args.count)
                    samples.setdefault((layout.name, write), []).append(sample)
    rows = []
    for write in (True, False):
        base = _iops(samples[("plain", write)], args.count)
        for layout in LAYOUTS:
            runs = samples[(layout.name, write)]
            iops = _iops(runs, args.count)
            cpu_us = sum(s.cpu for s in runs) / len(runs) / args.count * 1e6
            rows.append(["4k randwrite QD32" if write else "4k randread QD32", layout.name, figure(iops),
                         ratio(iops, base), f"{cpu_us:.1f}"])
    print(table(["job", "layout", "IOPS", "vs plain", "CPU us/IO"], rows))
    return 0


def _iops(runs: list[Sample], count: int) -> float:
    return count / (sum(s.seconds for s in runs) / len(runs))


if __name__ == "__main__":
    sys.exit(main())
