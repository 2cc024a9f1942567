"""New, empty qcow2 images written in-process: a volume's first image and every overlay, with its bitmap.

`qemu-img create` and `qemu-img bitmap --add` cost a process each (with the
bundled QEMU, each also starts through its own loader): 12-25 ms of a
CreateVolume that is otherwise a catalog row. An empty qcow2 image is a few
fixed tables, so it is laid out here instead, exactly as the qcow2
specification (QEMU's docs/interop/qcow2.txt, version 3) describes:

    cluster 0         header, header extensions, backing file name
    cluster 1         refcount table (one entry: the refcount block)
    cluster 2         refcount block (16-bit refcounts, one per used cluster)
    clusters 3..      L1 table, all zero: nothing is allocated
    then              the bitmap's table (all zero: nothing is dirty) and
                      the bitmap directory (one enabled, persistent bitmap)

The bitmap is the one `image_bitmaps.add_tracking` would add: enabled
("auto"), not in use, of the volume's granularity, so QSD marks every write
from the moment it opens the image. Only this one layout is written (no
preallocation, no encryption, no external data file, no compression); every
other image is left to `qemu-img`. The bytes go to a file the caller names
and makes durable; this module knows nothing of pools or volumes.
"""

from __future__ import annotations

import dataclasses
import os
import struct

from csi_qsd.qcow2 import header
from csi_qsd.qcow2.granularity import DEFAULT, SUBCLUSTERS

VERSION = 3
HEADER_LENGTH = 112  # version 3 with the compression type byte (zlib), padded to 8
REFCOUNT_ORDER = 4  # 16-bit refcounts, QEMU's default
AUTOCLEAR_BITMAPS = 1 << 0  # the bitmaps extension is consistent with the image
EXT_END = 0x00000000
EXT_BACKING_FORMAT = 0xE2792ACA
EXT_BITMAPS = 0x23852875
BITMAP_AUTO = 1 << 1  # enabled: every write marks it
BITMAP_TYPE_DIRTY_TRACKING = 1
FIRST_L1_CLUSTER = 3

_EXTENSION = struct.Struct(">II")
_BITMAPS_EXTENSION = struct.Struct(">IIQQ")
_BITMAP_ENTRY = struct.Struct(">QIIBBHI")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an image allocates: cluster size and whether L2 entries are extended (32 subclusters)."""

    cluster_size: int
    extended_l2: bool

    @classmethod
    def for_granularity(cls, granularity: int) -> Layout:
        """The layout `csi_qsd.qcow2.granularity` gives a volume: clusters of G from 64 KiB, else 32 subclusters of G."""
        if granularity >= DEFAULT:
            return cls(granularity, False)
        return cls(SUBCLUSTERS * granularity, True)


def _clusters(length: int, cluster: int) -> int:
    return -(-length // cluster)


def _pad8(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 8)


def _extension(kind: int, data: bytes) -> bytes:
    return _EXTENSION.pack(kind, len(data)) + _pad8(data)


def image_bytes(
    size: int, granularity: int, bitmap: str, *, backing: str = "", backing_format: str = "",
) -> list[tuple[int, bytes]]:
    """The (offset, bytes) pieces of an empty qcow2 image of `size` bytes; the rest of the file reads as zeros.

    `bitmap` names the enabled persistent bitmap of `granularity` it carries;
    `backing` (a file name, relative to the image's directory) and its
    format make it an overlay. Raises ValueError for what qcow2 cannot hold.
    """
    layout = Layout.for_granularity(granularity)
    cluster = layout.cluster_size
    if size <= 0 or size % 512:
        raise ValueError(f"image size {size} must be a positive multiple of 512")
    if not bitmap or len(bitmap.encode()) > 1023:
        raise ValueError("a bitmap needs a name of 1 to 1023 bytes")
    if bool(backing) != bool(backing_format) or backing_format not in ("", "qcow2", "raw"):
        raise ValueError("a backing file needs its format, qcow2 or raw")
    cluster_bits = cluster.bit_length() - 1
    l2_entries = cluster // (16 if layout.extended_l2 else 8)
    l1_size = _clusters(size, cluster * l2_entries)
    l1_clusters = _clusters(l1_size * 8, cluster)
    bitmap_bytes = _clusters(_clusters(size, granularity), 8)
    table_entries = _clusters(bitmap_bytes, cluster)
    table_clusters = _clusters(table_entries * 8, cluster)
    table_offset = (FIRST_L1_CLUSTER + l1_clusters) * cluster
    directory_offset = table_offset + table_clusters * cluster
    used = FIRST_L1_CLUSTER + l1_clusters + table_clusters + 1
    if used > cluster // 2:  # one refcount block of 16-bit entries holds them all
        raise ValueError(f"an image of {size} bytes needs more metadata than one refcount block covers")

    name = bitmap.encode()
    directory = _pad8(_BITMAP_ENTRY.pack(
        table_offset, table_entries, BITMAP_AUTO, BITMAP_TYPE_DIRTY_TRACKING,
        granularity.bit_length() - 1, len(name), 0) + name)
    extensions = b""
    if backing_format:
        extensions += _extension(EXT_BACKING_FORMAT, backing_format.encode())
    extensions += _extension(EXT_BITMAPS, _BITMAPS_EXTENSION.pack(1, 0, len(directory), directory_offset))
    extensions += _EXTENSION.pack(EXT_END, 0)
    backing_name = backing.encode()
    backing_offset = HEADER_LENGTH + len(extensions) if backing_name else 0
    if backing_offset + len(backing_name) > cluster:
        raise ValueError(f"backing file name {backing!r} does not fit the image's header cluster")
    fixed = header.Header(
        VERSION, backing_offset, len(backing_name), cluster_bits, size, 0, l1_size,
        FIRST_L1_CLUSTER * cluster, cluster, 1, 0, 0,
        incompatible=header.INCOMPAT_EXTENDED_L2 if layout.extended_l2 else 0, autoclear=AUTOCLEAR_BITMAPS,
        refcount_order=REFCOUNT_ORDER, length=HEADER_LENGTH,
    ).pack()
    fixed += b"\0" * (HEADER_LENGTH - len(fixed))  # compression type 0 (zlib) and padding
    return [
        (0, fixed + extensions + backing_name),
        (cluster, struct.pack(">Q", 2 * cluster)),
        (2 * cluster, struct.pack(f">{used}H", *([1] * used))),
        (directory_offset, directory + b"\0" * (cluster - len(directory))),  # also sets the file's length
    ]


def write(fd: int, pieces: list[tuple[int, bytes]]) -> None:
    """Write `image_bytes` into the empty file open as `fd` (its holes read as the zero tables)."""
    for offset, data in pieces:
        if os.pwrite(fd, data, offset) != len(data):
            raise OSError(f"short write of qcow2 metadata at offset {offset}")


def holds_nothing(fd: int, *, backing_allowed: bool = False) -> bool:
    """True when the qcow2 image open as `fd` holds no data of its own: no L2 table (and no backing, unless allowed).

    Without a backing, such an image reads as zeros everywhere: what a volume
    never written holds, so the driver need not probe it for a filesystem
    before making one. False whenever unsure (another version, an external
    data file, a header this does not know): the caller then assumes data.
    """
    head = header.read(fd)
    if head is None or head.version != VERSION or head.incompatible & ~header.INCOMPAT_EXTENDED_L2:
        return False
    if head.backing_offset and not backing_allowed:
        return False
    table = os.pread(fd, head.l1_size * 8, head.l1_offset)
    return len(table) == head.l1_size * 8 and not any(table)
