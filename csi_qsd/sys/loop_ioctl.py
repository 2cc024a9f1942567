"""Loop devices attached and detached with the kernel's own ioctls: no `losetup` process per call.

`losetup` costs 2-4 ms a call (more on a loaded node) and a stage and an
unstage each run one. It does what is done here: ask /dev/loop-control for
a free device (LOOP_CTL_GET_FREE), open the backing file (O_DIRECT for a
direct-I/O device, as losetup opens it) and hand both to the device in one
LOOP_CONFIGURE (Linux 5.8+); detaching is LOOP_CLR_FD, which the kernel
defers to the last close of a device still held open. A device another
process took between the two steps answers EBUSY and the next free one is
tried. Every call blocks, so callers run it in a worker thread.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path

from csi_qsd.errors import HostCommandError

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LOOP_CLR_FD = 0x4C01
LOOP_GET_STATUS64 = 0x4C05
LO_FLAGS_READ_ONLY = 1
LO_FLAGS_DIRECT_IO = 16
NAME_SIZE = 64
# struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
# struct loop_info64 { u64 device, inode, rdevice, offset, sizelimit; u32 number, encrypt_type,
#                      encrypt_key_size, flags; u8 file_name[64], crypt_name[64], encrypt_key[32]; u64 init[2]; }
_LOOP_CONFIG = struct.Struct("=II5Q4I64s64s32s2Q8Q")
_LOOP_INFO64 = struct.Struct("=5Q4I64s64s32s2Q")
ATTEMPTS = 16


def config(backing_fd: int, flags: int, name: str) -> bytes:
    """The LOOP_CONFIGURE argument: the backing file's fd, the flags, its name (as losetup records it)."""
    encoded = os.fsencode(name)[: NAME_SIZE - 1]
    return _LOOP_CONFIG.pack(backing_fd, 0, 0, 0, 0, 0, 0, 0, 0, 0, flags, encoded, b"", b"", 0, 0, *([0] * 8))


def attach(backing_file: Path, *, readonly: bool, direct_io: bool) -> Path:
    """Attach `backing_file` to a free loop device; the device. Raises HostCommandError."""
    flags = (LO_FLAGS_READ_ONLY if readonly else 0) | (LO_FLAGS_DIRECT_IO if direct_io else 0)
    mode = os.O_RDONLY if readonly else os.O_RDWR
    try:
        backing = os.open(backing_file, mode | os.O_CLOEXEC | (os.O_DIRECT if direct_io else 0))
    except OSError as exc:  # a dead FUSE export answers EIO or ENOTCONN: the caller decides what that means
        raise HostCommandError(f"cannot open {backing_file} for a loop device: {exc.strerror}") from exc
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(ATTEMPTS):
                device = Path(f"/dev/loop{fcntl.ioctl(control, LOOP_CTL_GET_FREE)}")
                fd = os.open(device, mode | os.O_CLOEXEC)
                try:
                    fcntl.ioctl(fd, LOOP_CONFIGURE, config(backing, flags, str(backing_file)))
                    return device
                except OSError as exc:
                    if exc.errno != errno.EBUSY:  # EBUSY: taken by another process meanwhile
                        raise HostCommandError(f"cannot attach {backing_file} to {device}: {exc.strerror}") from exc
                finally:
                    os.close(fd)
        finally:
            os.close(control)
    except OSError as exc:
        raise HostCommandError(f"cannot attach a loop device to {backing_file}: {exc.strerror}") from exc
    finally:
        os.close(backing)
    raise HostCommandError(f"no free loop device for {backing_file} after {ATTEMPTS} tries")


def detach(device: Path) -> bool:
    """Detach `device` (the kernel finishes on its last close); False if it had nothing attached."""
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, LOOP_CLR_FD)
        return True
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return False
        raise HostCommandError(f"cannot detach loop device {device}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def backing_identity(device: Path) -> tuple[int, int, int] | None:
    """(major, minor, inode) of the file `device` is attached to; None if nothing is (or it is gone).

    The kernel keeps the backing file's device and inode (LOOP_GET_STATUS64), which stay the same in
    every mount namespace, unlike sysfs' `backing_file`: that path is worked out from the mount the
    file was opened through, and once that mount's namespace is gone (a plugin container that
    restarted) it no longer reads as the export's path.
    """
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(_LOOP_INFO64.size))
    except OSError:
        return None  # ENXIO: nothing attached
    finally:
        os.close(fd)
    lo_device, lo_inode = _LOOP_INFO64.unpack(raw)[:2]
    return os.major(lo_device), os.minor(lo_device), lo_inode
