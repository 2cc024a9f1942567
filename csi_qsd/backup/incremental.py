"""Full and incremental backups of snapshots as qcow2 files, and restores from a full plus incrementals.

A backup asks the driver over CSI which ranges to copy (GetMetadataAllocated
for a full backup, GetMetadataDelta since an older snapshot for an
incremental) and reads exactly those ranges from the snapshot's frozen image
chain on this node, served read-only by `qemu-nbd` on a private UNIX socket;
they are written into a new qcow2 of the volume's capacity through a second,
writable `qemu-nbd`. A range that reads as zeros is written as zero clusters
(NBD WRITE_ZEROES), so it still overrides older data when the files are
layered. The backup file allocates in 4 KiB subclusters, the finest
changed-block granularity: a range written into a plain 64 KiB cluster
would allocate the whole cluster, and the zeros around the range would
hide the older backup's data beneath it in a restore. Only the listed ranges are ever read, so an incremental costs what
changed, not what the volume holds.

Each backup gets a sidecar `FILE.json` naming its snapshot and base, so a
restore can check it is given a full backup and then an unbroken sequence of
incrementals. A restore layers the files in a `json:` backing chain (the
backups themselves are never modified) and lets `qemu-img convert` write one
standalone image. Frozen images are read beside the running QSD with
`force-share`, as `qemu-img map -U` does. No gRPC types here: the caller
passes in the ranges.

A backup of an encrypted volume is an encrypted qcow2 (LUKS, the volume's
passphrase): the snapshot's chain is read and the backup written by
qemu-nbd opened with the key (`csi_qsd.qcow2.keyed`, on stdin), and a
restore of encrypted backups writes an encrypted qcow2. The key is checked
before anything is written (`csi_qsd.backup.keys`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import struct
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from csi_qsd.backup import keys
from csi_qsd.catalog import Catalog
from csi_qsd.errors import InvalidArgument, NBDError
from csi_qsd.qcow2 import keyed
from csi_qsd.qcow2.extents import Extent
from csi_qsd.qcow2.granularity import BACKUP_OPTIONS
from csi_qsd.qcow2.imagemap import qcow2_spec
from csi_qsd.sys import durable, nbd_unix
from csi_qsd.sys.run import run
from csi_qsd.sys.volume_keys import VolumeKey

CHUNK = 4 << 20  # bytes per NBD request; qemu-nbd accepts up to 32 MiB

# NBD protocol constants (the NBD protocol document, "fixed newstyle" negotiation).
_NBDMAGIC = b"NBDMAGIC"
_IHAVEOPT = 0x49484156454F5054
_OPT_EXPORT_NAME = 1
_FLAG_FIXED_NEWSTYLE, _FLAG_NO_ZEROES = 1, 2
_REQUEST_MAGIC, _REPLY_MAGIC = 0x25609513, 0x67446698
_CMD_READ, _CMD_WRITE, _CMD_DISC, _CMD_FLUSH, _CMD_WRITE_ZEROES = 0, 1, 2, 3, 6


class NBDClient:
    """A minimal NBD client: one export, one request at a time, simple replies."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int) -> None:
        self._reader, self._writer, self.size = reader, writer, size
        self._cookie = 0

    @classmethod
    async def connect(cls, socket: Path) -> "NBDClient":
        reader, writer = await asyncio.open_unix_connection(str(socket))
        head = await reader.readexactly(18)
        if head[:8] != _NBDMAGIC or struct.unpack(">Q", head[8:16])[0] != _IHAVEOPT:
            raise NBDError(f"{socket} is not a newstyle NBD server")
        (server_flags,) = struct.unpack(">H", head[16:18])
        flags = _FLAG_FIXED_NEWSTYLE | (_FLAG_NO_ZEROES if server_flags & _FLAG_NO_ZEROES else 0)
        writer.write(struct.pack(">I", flags) + struct.pack(">QII", _IHAVEOPT, _OPT_EXPORT_NAME, 0))
        await writer.drain()
        size, _transmission = struct.unpack(">QH", await reader.readexactly(10))
        if not flags & _FLAG_NO_ZEROES:
            await reader.readexactly(124)
        return cls(reader, writer, size)

    async def _request(self, command: int, offset: int, length: int, payload: bytes = b"") -> None:
        self._cookie += 1
        self._writer.write(struct.pack(">IHHQQI", _REQUEST_MAGIC, 0, command, self._cookie, offset, length) + payload)
        await self._writer.drain()
        if command == _CMD_DISC:
            return
        magic, error, cookie = struct.unpack(">IIQ", await self._reader.readexactly(16))
        if magic != _REPLY_MAGIC or cookie != self._cookie:
            raise NBDError("NBD reply out of sequence")
        if error:
            raise NBDError(f"NBD command {command} at {offset}+{length} failed: errno {error}")

    async def read(self, offset: int, length: int) -> bytes:
        await self._request(_CMD_READ, offset, length)
        return await self._reader.readexactly(length)

    async def write(self, offset: int, data: bytes) -> None:
        await self._request(_CMD_WRITE, offset, len(data), data)

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self._request(_CMD_WRITE_ZEROES, offset, length)

    async def flush(self) -> None:
        await self._request(_CMD_FLUSH, 0, 0)

    async def close(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self._request(_CMD_DISC, 0, 0)
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()


class SnapshotRanges(Protocol):
    """What a backup asks the served driver over CSI (`csi_qsd.cli.client.CSIClient` answers it): the ranges a
    snapshot holds, or changed since an older one, each as (volume capacity, [(offset, length), ...])."""

    async def metadata_allocated(self, snapshot_id: str) -> tuple[int, list[tuple[int, int]]]: ...

    async def metadata_delta(self, base_snapshot_id: str,
                             target_snapshot_id: str) -> tuple[int, list[tuple[int, int]]]: ...



@contextlib.asynccontextmanager
async def nbd_export(qemu_nbd: str, spec: str, socket: Path, *, read_only: bool,
                     key: bytes | None = None) -> AsyncIterator[NBDClient]:
    """Serve `spec` with qemu-nbd on `socket`, connected as its one client; the server is gone when this exits.

    Its exit is awaited (bounded, `csi_qsd.sys.nbd_unix`), so a written
    image is closed before the caller uses it. `key`: the base64 passphrase
    of an encrypted `spec`, given to qemu-nbd on its stdin.
    """
    async with nbd_unix.serving(qemu_nbd, spec, socket, writable=not read_only,
                                secret=keyed.SECRET if key is not None else "", stdin=key):
        client = await NBDClient.connect(socket)
        try:
            yield client
        finally:
            await client.close()


def private_file(path: Path) -> None:
    """An empty file at `path`, mode 0600 whatever the umask, for qemu-img to write into (it keeps the mode of a
    file that exists): a backup holds a whole volume. Replaces a leftover of an earlier run."""
    os.close(durable.exclusive(path))


@dataclasses.dataclass(frozen=True)
class BackupReport:
    snapshot_id: str
    base_snapshot_id: str  # '' for a full backup
    capacity: int
    extents: int
    bytes_read: int
    zero_bytes: int  # of bytes_read, written as zero clusters
    encrypted: bool = False  # a LUKS qcow2, opened by the volume's passphrase (older descriptions have no field)


@dataclasses.dataclass(frozen=True)
class Specs:
    """How qemu-nbd opens the snapshot and the new backup file, and the key it reads on stdin (or none)."""

    source: str
    target: str
    stdin: bytes | None = None

    @classmethod
    def of(cls, image: Path, tmp: Path, key: VolumeKey | None) -> "Specs":
        if key is None:
            return cls(qcow2_spec(image, read_only=True), qcow2_spec(tmp, read_only=False))
        return cls(keyed.json_name(keyed.chain_spec(image)), keyed.json_name(keyed.layer(tmp, None, read_only=False)),
                   key.base64().encode())


async def backup(
    image: Path, ranges: list[Extent], capacity: int, out: Path, *, snapshot_id: str, base_snapshot_id: str = "",
    qemu_img: str = "qemu-img", qemu_nbd: str = "qemu-nbd", key: VolumeKey | None = None,
) -> BackupReport:
    """Copy `ranges` of the snapshot whose frozen image is `image` into a new qcow2 `out` (and `out`.json).

    `key`: the snapshot is encrypted with it, and so is `out`. Raises
    HostCommandError (NBDError) if an image cannot be read or written.
    """
    out = out.absolute()
    tmp = out.with_name(f".{out.name}.tmp")
    read = zeros = 0
    with tempfile.TemporaryDirectory(prefix="csi-qsd-backup-") as work:
        private_file(tmp)
        try:
            await _create(qemu_img, tmp, capacity, key)
            specs = Specs.of(image, tmp, key)
            async with (
                nbd_export(qemu_nbd, specs.source, Path(work) / "src.sock", read_only=True, key=specs.stdin) as src,
                nbd_export(qemu_nbd, specs.target, Path(work) / "dst.sock", read_only=False, key=specs.stdin) as dst,
            ):
                for offset, length in ranges:
                    for at in range(offset, offset + length, CHUNK):
                        size = min(CHUNK, offset + length - at)
                        data = await src.read(at, size)
                        read += size
                        if data.count(0) == size:
                            zeros += size
                            await dst.write_zeroes(at, size)
                        else:
                            await dst.write(at, data)
                await dst.flush()
            report = BackupReport(snapshot_id, base_snapshot_id, capacity, len(ranges), read, zeros, key is not None)
            text = (json.dumps(dataclasses.asdict(report)) + "\n").encode()
            await asyncio.to_thread(durable.create, Path(f"{out}.json"), lambda fd: os.write(fd, text))
            await asyncio.to_thread(durable.replace, tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return report


async def _create(qemu_img: str, tmp: Path, capacity: int, key: VolumeKey | None) -> None:
    """The empty backup file: in 4 KiB subclusters, LUKS-encrypted with `key` if given (the key on stdin)."""
    if key is None:
        await run(qemu_img, "create", "-q", "-f", "qcow2", "-o", BACKUP_OPTIONS, str(tmp), str(capacity))
        return
    await run(qemu_img, "create", "-q", "-f", "qcow2", "--object", keyed.SECRET,
              "-o", ",".join([BACKUP_OPTIONS, *keyed.CREATE_OPTIONS]), str(tmp), str(capacity),
              stdin=key.base64().encode())


def describe(backup_file: Path) -> BackupReport:
    """A backup's sidecar; InvalidArgument if it is missing or not one of ours."""
    try:
        return BackupReport(**json.loads(Path(f"{backup_file}.json").read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"{backup_file} has no readable backup description ({backup_file}.json): {exc}") from exc


def check_sequence(reports: list[BackupReport]) -> None:
    """A full backup first, then incrementals each based on the previous one's snapshot."""
    if not reports:
        raise InvalidArgument("give at least a full backup")
    if reports[0].base_snapshot_id:
        raise InvalidArgument(f"the first backup must be a full one; it is incremental since {reports[0].base_snapshot_id}")
    for before, after in zip(reports, reports[1:]):
        if after.base_snapshot_id != before.snapshot_id:
            raise InvalidArgument(
                f"backup of {after.snapshot_id} is incremental since {after.base_snapshot_id or 'nothing (full)'}, "
                f"not since the previous backup's snapshot {before.snapshot_id}"
            )


def layered_spec(files: list[Path], *, encrypted: bool = False) -> dict[str, Any]:
    """A blockdev tree reading `files[-1]` over `files[-2]` … over `files[0]`, which has no backing; each layer
    opened with the key if `encrypted`."""
    spec: dict[str, Any] | None = None
    for path in files:
        spec = {"driver": "qcow2", "read-only": True,
                "file": {"driver": "file", "filename": str(path.absolute())}, "backing": spec}
        if encrypted:
            spec["encrypt.key-secret"] = keyed.SECRET_ID
    assert spec is not None
    return spec


async def restore(files: list[Path], out: Path, *, qemu_img: str = "qemu-img", fmt: str = "qcow2",
                  key: VolumeKey | None = None) -> BackupReport:
    """Write one standalone image `out` holding the newest backup's snapshot, from a full plus incrementals.

    Encrypted backups (opened by `key`) restore to a qcow2 encrypted with it.
    Raises InvalidArgument for a broken sequence, a missing or needless key
    or raw output of encrypted backups, PermissionDenied for a key that does
    not open them, HostCommandError if qemu-img fails.
    """
    reports = [describe(f) for f in files]
    check_sequence(reports)
    encrypted = await keys.encrypted_with(qemu_img, files, key, "the backups")
    if encrypted and fmt != "qcow2":
        raise InvalidArgument(f"encrypted backups restore to an encrypted qcow2 only, not {fmt}: nothing was written")
    argv = ["-O", fmt]
    if key is not None:
        argv = ["--object", keyed.SECRET, "-O", "qcow2", "-o", ",".join(keyed.CREATE_OPTIONS)]
    tmp = out.with_name(f".{out.name}.tmp")
    private_file(tmp)
    try:
        await run(qemu_img, "convert", *argv, "json:" + json.dumps(layered_spec(files, encrypted=encrypted)),
                  str(tmp), timeout=24 * 3600, stdin=key.base64().encode() if key is not None else None)
        await asyncio.to_thread(durable.replace, tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return reports[-1]



async def backup_snapshot(
    client: SnapshotRanges, catalog_path: Path, snapshot_id: str, out: Path, *, since: str = "",
    qemu_img: str = "qemu-img", qemu_nbd: str = "qemu-nbd", key: VolumeKey | None = None,
) -> BackupReport:
    """Ask the driver which ranges to copy, find the snapshot's frozen image in its catalog, copy them.

    An encrypted snapshot needs its volume's `key` (the backup is encrypted with it).
    Raises grpc errors from the driver, InvalidArgument, PermissionDenied, HostCommandError.
    """
    if since:
        capacity, ranges = await client.metadata_delta(since, snapshot_id)
    else:
        capacity, ranges = await client.metadata_allocated(snapshot_id)
    if not catalog_path.exists():
        raise InvalidArgument(f"no driver catalog at {catalog_path}: run the backup on the snapshot's node")
    async with Catalog(catalog_path) as catalog:
        record = await catalog.snapshot(snapshot_id)
    if record is None:
        raise InvalidArgument(f"snapshot {snapshot_id} is not in the catalog at {catalog_path}")
    await keys.encrypted_with(qemu_img, [record.image], key, f"snapshot {snapshot_id}")
    return await backup(record.image, ranges, capacity, out, snapshot_id=snapshot_id, base_snapshot_id=since,
                        qemu_img=qemu_img, qemu_nbd=qemu_nbd, key=key)
