"""Contents of the guest's initramfs: the cached base archive and the per-run one.

The guest never has a root filesystem of its own: the kernel unpacks the
initramfs into its tmpfs rootfs and runs ``/init`` from it. Per-run inputs
(the caller's script, how many disks to expect, optional data files) go into a
second, tiny archive that is appended to the cached base one; the kernel
unpacks concatenated archives in order, so later files simply overlay earlier
ones and the expensive base never has to be rebuilt per test.

The console protocol between ``/init`` and the host is three marker lines,
chosen so they cannot be produced by accident by a script or by the kernel:

* ``CSI_QSD_GUEST_READY disks=<n> uptime=<s>``: modules loaded, all expected
  ``/dev/vd*`` disks present, ``/run.sh`` about to start;
* ``CSI_QSD_GUEST_EXIT=<rc>``: ``/run.sh`` finished with exit status ``rc``;
* ``CSI_QSD_GUEST_INIT_FAILED <reason>``: the guest could not get that far.
"""

from __future__ import annotations

import gzip
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from .cpio import CpioWriter

READY_MARKER = "CSI_QSD_GUEST_READY"
EXIT_MARKER = "CSI_QSD_GUEST_EXIT="
INIT_FAILED_MARKER = "CSI_QSD_GUEST_INIT_FAILED"

MODULE_DIR = "/lib/modules"
MODULE_ORDER_FILE = "/etc/csi-qsd-modules"
RUN_SCRIPT = "/run.sh"
RUN_ENV = "/run.env"

# Kept deliberately free of bashisms: it runs under busybox ash.
# The script's stdin is /dev/null: the console has no input (QEMU's stdin is
# /dev/null too), so a stray `read` would otherwise block until the deadline.
# No `sync` before poweroff: scripts own their durability (O_DIRECT + fsync),
# and a sync against a dead vhost-user backend would hang the guest forever.
INIT_SCRIPT = f"""#!/bin/sh
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() {{
    echo "{INIT_FAILED_MARKER} $*"
    poweroff -f
}}
for m in $(cat {MODULE_ORDER_FILE}); do
    insmod {MODULE_DIR}/$m.ko || fail "insmod $m"
done
CSI_QSD_EXPECTED_DISKS=0
CSI_QSD_DISK_WAIT_TENTHS=300
[ -f {RUN_ENV} ] && . {RUN_ENV}
waited=0
while :; do
    set -- /sys/block/vd*
    if [ -e "$1" ]; then found=$#; else found=0; fi
    [ "$found" -ge "$CSI_QSD_EXPECTED_DISKS" ] && break
    waited=$((waited + 1))
    [ "$waited" -gt "$CSI_QSD_DISK_WAIT_TENTHS" ] && \\
        fail "expected $CSI_QSD_EXPECTED_DISKS disks, found $found"
    sleep 0.1
done
read uptime idle < /proc/uptime
echo "{READY_MARKER} disks=$found uptime=$uptime"
[ -f {RUN_SCRIPT} ] || fail "no {RUN_SCRIPT}"
cd /
sh {RUN_SCRIPT} </dev/null
echo "{EXIT_MARKER}$?"
poweroff -f
"""

_BASE_DIRS = (
    "bin", "sbin", "usr", "usr/bin", "usr/sbin", "dev", "proc", "sys", "tmp",
    "etc", "root", "lib", "lib/modules",
)


def _parents(path: PurePosixPath) -> list[str]:
    return [str(p) for p in reversed(path.parents) if str(p) not in ("/", ".")]


def write_base_initramfs(
    out: Path,
    busybox: bytes,
    applets: Sequence[str],
    modules: Sequence[tuple[str, bytes]],
) -> None:
    """Writes the gzip'd base archive: busybox + applet links, modules, ``/init``.

    ``applets`` are paths as printed by ``busybox --list-full`` (``bin/ls``);
    ``modules`` are (name, uncompressed .ko bytes) in load order.
    """
    with gzip.open(out, "wb", compresslevel=6) as gz:
        cpio = CpioWriter(gz)
        for d in _BASE_DIRS:
            cpio.add_dir(d)
        cpio.add_chardev("dev/console", 5, 1)
        cpio.add_chardev("dev/null", 1, 3, perm=0o666)
        cpio.add_file("bin/busybox", busybox, perm=0o755)
        for applet in applets:
            applet = applet.strip("/")
            if applet and applet != "bin/busybox":
                cpio.add_symlink(applet, "/bin/busybox")
        for name, data in modules:
            cpio.add_file(f"{MODULE_DIR}/{name}.ko".lstrip("/"), data)
        cpio.add_file(MODULE_ORDER_FILE.lstrip("/"), "".join(f"{n}\n" for n, _ in modules).encode())
        cpio.add_file("init", INIT_SCRIPT.encode(), perm=0o755)
        cpio.finish()


def write_run_initrd(
    out: Path,
    base: Path,
    script: str,
    *,
    expected_disks: int,
    disk_wait_s: float = 30.0,
    files: Mapping[str, bytes] | None = None,
) -> None:
    """Writes ``base`` followed by an archive holding this run's script and files.

    The appended archive is left uncompressed (it is small) and starts on a
    4-byte boundary, which the kernel requires of an uncompressed cpio that
    follows another archive; NUL padding between archives is skipped.
    """
    env = (
        f"CSI_QSD_EXPECTED_DISKS={int(expected_disks)}\n"
        f"CSI_QSD_DISK_WAIT_TENTHS={max(1, round(disk_wait_s * 10))}\n"
        f"CSI_QSD_DISKS={shlex.quote(' '.join(guest_disk_path(i) for i in range(expected_disks)))}\n"
        "export CSI_QSD_DISKS\n"
    )
    with out.open("wb") as f:
        data = base.read_bytes()
        f.write(data + b"\0" * (-len(data) % 4))
        cpio = CpioWriter(f)
        seen: set[str] = set()
        for name, content in sorted((files or {}).items()):
            path = PurePosixPath("/") / name
            for parent in _parents(path):
                if parent not in seen:
                    seen.add(parent)
                    cpio.add_dir(parent)
            cpio.add_file(str(path), content)
        cpio.add_file(RUN_ENV, env.encode())
        cpio.add_file(RUN_SCRIPT, script.encode(), perm=0o755)
        cpio.finish()


def guest_disk_path(index: int) -> str:
    """Guest device node of the ``index``-th disk passed to the VM (``/dev/vda``...).

    virtio-blk names disks in PCI probe order, which is command-line order
    because each device takes the next free slot on the root bus.
    """
    if not 0 <= index < 26:
        raise ValueError("the harness supports at most 26 disks (vda..vdz)")
    return f"/dev/vd{chr(ord('a') + index)}"
