"""The qcow2 header, parsed and packed in one place (QEMU's docs/interop/qcow2.txt).

Every reader of an image's own metadata starts here: the tables of a frozen
layer (`tables`), whether an image holds data (`blank.holds_nothing`), the
backing file an image names (`backing`). `blank` packs the header of the
images it writes. Only the fixed fields are read (version 2's 72 bytes,
version 3's 104); header extensions are the caller's. This never writes a file.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

MAGIC = b"QFI\xfb"
STRUCT = struct.Struct(">4sIQIIQIIQQIIQQQQII")  # the fields of version 3, in file order
V2_LENGTH = 72  # a version 2 header ends after the snapshots' offset: no feature bits, refcount order 4
INCOMPAT_COMPRESSION_TYPE = 1 << 3
INCOMPAT_EXTENDED_L2 = 1 << 4
CRYPT_LUKS = 2  # crypt_method of an image encrypted with LUKS (1 is the old AES, which QEMU no longer opens)


@dataclasses.dataclass(frozen=True)
class Header:
    """The fixed fields of a qcow2 header, version 2's with version 3's defaults, or version 3's."""

    version: int
    backing_offset: int  # 0: the image names no backing file
    backing_size: int
    cluster_bits: int
    size: int  # the virtual disk's size in bytes
    crypt_method: int
    l1_size: int  # entries
    l1_offset: int
    refcount_table_offset: int
    refcount_table_clusters: int
    snapshots: int
    snapshots_offset: int
    incompatible: int = 0
    compatible: int = 0
    autoclear: int = 0
    refcount_order: int = 4
    length: int = V2_LENGTH

    def pack(self) -> bytes:
        """The header's fixed fields as they stand on disk (version 3's layout)."""
        return STRUCT.pack(MAGIC, *dataclasses.astuple(self))


def parse(data: bytes) -> Header | None:
    """The header at the start of `data`; None unless it is a whole qcow2 header of version 2 or later."""
    if len(data) < STRUCT.size or data[:4] != MAGIC:
        return None
    fields = STRUCT.unpack(data[:STRUCT.size])[1:]
    if fields[0] < 3:  # the bytes after a version 2 header are not header fields
        return Header(*fields[:12])
    return Header(*fields)


def read(fd: int) -> Header | None:
    """The header of the image open as `fd` (read at offset 0, the file position is kept). Raises OSError."""
    return parse(os.pread(fd, STRUCT.size, 0))


def read_file(image: Path) -> Header | None:
    """The header of the image file `image`; None if it is not qcow2. Raises OSError."""
    fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read(fd)
    finally:
        os.close(fd)
