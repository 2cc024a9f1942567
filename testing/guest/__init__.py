"""Tiny Linux guest for end-to-end tests of VM volumes.

A stock Debian 12 kernel plus a busybox initramfs, booted in QEMU with the
disks under test attached as vhost-user-blk (or, for comparison, QEMU's own
virtio-blk). The guest runs one caller-supplied shell script and reports its
exit status on the serial console. Typical use::

    image = build_guest_image()                     # cached after first call
    disk = VhostUserDisk(Path("/run/qsd/vol.sock"), num_queues=2)
    script = guest_script(write_pattern("/dev/vda", seed=1, blocks=8),
                          verify_pattern("/dev/vda", seed=1, blocks=8))
    result = await run_guest(image, [disk], script)
    assert result.exit_code == 0
"""

from .disks import Disk, FileDisk, VhostUserDisk
from .image import GuestImage, GuestImageError, build_guest_image, default_cache_root
from .initramfs import guest_disk_path
from .reference_qsd import StorageDaemon, StorageDaemonError, VhostUserExport, start_storage_daemon
from .scripts import (
    BLOCK_SIZE,
    VerifySummary,
    WriteSummary,
    acknowledged_blocks,
    count_kernel_io_errors,
    device_stat_samples,
    device_stats,
    guest_script,
    pattern_block,
    verify_pattern,
    verify_summaries,
    write_pattern,
    write_summaries,
)
from .vm import (
    GuestError,
    GuestResult,
    GuestTimeout,
    RunningVM,
    default_accel,
    qemu_command,
    run_guest,
    start_vm,
)

__all__ = [
    "BLOCK_SIZE",
    "Disk",
    "FileDisk",
    "GuestError",
    "GuestImage",
    "GuestImageError",
    "GuestResult",
    "GuestTimeout",
    "RunningVM",
    "StorageDaemon",
    "StorageDaemonError",
    "VerifySummary",
    "VhostUserDisk",
    "VhostUserExport",
    "WriteSummary",
    "acknowledged_blocks",
    "build_guest_image",
    "count_kernel_io_errors",
    "device_stat_samples",
    "device_stats",
    "default_accel",
    "default_cache_root",
    "guest_disk_path",
    "guest_script",
    "pattern_block",
    "qemu_command",
    "run_guest",
    "start_storage_daemon",
    "start_vm",
    "verify_pattern",
    "verify_summaries",
    "write_pattern",
    "write_summaries",
]
