"""A pool of qcow2/raw image files in one directory.

Image names derive from validated volume IDs only. Creation goes through a
temporary name and an atomic rename, so a crash never leaves a half-written
image under a volume's name.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from csi_qsd.errors import ResourceExhausted
from csi_qsd.params import DEFAULT_POOL_NAME, ImageFormat, Preallocation, VolumeParameters
from csi_qsd.pools.base import NewImage, Pool, PoolUsage
from csi_qsd.qcow2 import blank, image_bitmaps, keyed, layer_bitmaps
from csi_qsd.qcow2.granularity import qcow2_options
from csi_qsd.qsd import file_aio
from csi_qsd.qsd.client import QSDClient
from csi_qsd.qsd.storage import ImageFile
from csi_qsd.sys import durable
from csi_qsd.sys.durable import fsync_path
from csi_qsd.sys.run import run, secret_pipes
from csi_qsd.sys.volume_keys import VolumeKey

__all__ = ["FilePool", "PoolUsage"]

TMP_SUFFIX = durable.TMP_SUFFIX
CHECK_TIMEOUT = 60.0
CHECK_CACHE_MAX = 4096
CHECKS_AT_ONCE = 2
# qemu-img check's exit codes: 2 corruptions, 3 leaked clusters only (harmless), 63 format without checks (raw).
_CHECK_CORRUPT = 2
_CHECK_FINE = (0, 3, 63)


class FilePool(Pool):
    """Image files in `directory`, one per volume."""

    def __init__(self, directory: Path, qemu_img: str = "qemu-img", pool_id: str = DEFAULT_POOL_NAME,
                 aio_probe: Path | None = None, file_io: file_aio.FileIO = file_aio.FileIO.AUTO) -> None:
        """`aio_probe`: an empty file of the driver's own (not in the pool) that QSD opens to show it can use
        io_uring (`csi_qsd.qsd.file_aio`); without one, QSD's thread pool serves the images. `file_io`: the
        operator's choice of engine and cache."""
        self.id = pool_id
        self.directory = directory
        self._aio_probe = aio_probe
        self._qemu_img = qemu_img
        self._checked: dict[Path, tuple[tuple[int, int, int], str]] = {}
        self._check_slots = asyncio.Semaphore(CHECKS_AT_ONCE)
        self._file_io = file_io
        self._engine = file_aio.Engine(file_aio.THREADS, direct=False)  # until `attach` has asked QSD
        self._settling = threading.Lock()

    def prepare(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def image_path(self, volume_id: str, fmt: ImageFormat, generation: int = 0) -> Path:
        """A volume's image of `generation`: 0 is the one it was created with, later ones are overlays."""
        if generation == 0:
            return self.directory / f"{volume_id}.{fmt.value}"
        return self.directory / f"{volume_id}.{generation}.qcow2"

    def usage(self) -> PoolUsage:
        st = os.statvfs(self.directory)
        return PoolUsage(total=st.f_blocks * st.f_frsize, available=st.f_bavail * st.f_frsize)

    async def allocated(self, images: list[Path]) -> dict[Path, int]:
        """The blocks each image file occupies (`st_blocks`, what QEMU reports as `actual-size`); one stat each.

        A file deleted since the caller listed it is left out. Raises OSError
        for any other failure to stat (an unreadable pool is not an empty one).
        """
        return await asyncio.to_thread(_allocated_blocks, images)

    async def create(self, image: Path, size: int, params: VolumeParameters, *, key: VolumeKey | None = None) -> None:
        """Create `image` of `size` bytes (LUKS-encrypted with `key`); RESOURCE_EXHAUSTED if the pool cannot hold it."""
        await self.check_room(size)
        if key is not None:
            await self._create_encrypted(image, size, params.granularity, key,
                                         preallocation=params.preallocation.value)
            return
        if params.preallocation is Preallocation.OFF:
            await asyncio.to_thread(durable.create, image, _blank(size, params))
            return
        tmp = image.with_name(image.name + TMP_SUFFIX)
        tmp.unlink(missing_ok=True)
        argv = [self._qemu_img, "create", "-q", "-f", params.format.value,
                "-o", f"preallocation={params.preallocation.value}"]
        if params.format is ImageFormat.QCOW2:
            argv[-1] += ",".join(["", "lazy_refcounts=off", *qcow2_options(params.granularity)])
        try:
            await run(*argv, str(tmp), str(size), timeout=3600)
            if params.format is ImageFormat.QCOW2:
                await image_bitmaps.add_tracking(self._qemu_img, tmp, params.granularity)
            await asyncio.to_thread(durable.replace, tmp, image)
        finally:
            tmp.unlink(missing_ok=True)

    def settles_later(self, params: VolumeParameters) -> bool:
        """An image made in-process (not preallocated, not encrypted): a few KiB that `settle` writes in a batch."""
        return params.preallocation is Preallocation.OFF and not params.encrypted

    async def _create_encrypted(
        self, image: Path, size: int, granularity: int, key: VolumeKey, *, preallocation: str = "off",
        backing: Path | None = None, backing_name: str = "",
    ) -> None:
        """A qcow2 `image` with a LUKS header of its own, opened by `key` (over `backing`, unopened: O(1) in data).

        qemu-img reads the key from its stdin (a pipe), never from argv or a
        file. The image gets the changed-block record a plain one has (a
        second qemu-img, the key on its stdin again).
        """
        tmp = image.with_name(image.name + TMP_SUFFIX)
        tmp.unlink(missing_ok=True)
        options = [*keyed.CREATE_OPTIONS, f"preallocation={preallocation}", "lazy_refcounts=off",
                   *qcow2_options(granularity)]
        argv = [self._qemu_img, "create", "-q", "-f", "qcow2", "--object", keyed.SECRET, "-o", ",".join(options)]
        name = backing_name or (backing.name if backing is not None else "")
        if name:  # not opened (-u): another node's link is opened by QSD, with the key
            argv += ["-u", "-b", name, "-F", "qcow2"]
        try:
            await run(*argv, str(tmp), str(size), timeout=3600, stdin=key.base64().encode())
            await image_bitmaps.add_tracking(self._qemu_img, tmp, granularity, key=key)
            await asyncio.to_thread(durable.replace, tmp, image)
        finally:
            tmp.unlink(missing_ok=True)

    async def check_room(self, size: int) -> None:
        available = self.usage().available
        if size > available:
            raise ResourceExhausted(
                f"pool {self.directory} has {available} bytes free, volume needs {size}"
            )

    async def settle(self, images: list[NewImage]) -> list[Path]:
        """Write each image not there yet, fsync each, then the pool's directory (which holds their names) once."""
        return await asyncio.to_thread(self._settle, images)

    def _settle(self, images: list[NewImage]) -> list[Path]:
        # One at a time: a stage settling its own image beside a batch must not write the same file twice at once.
        settled = []
        with self._settling:
            try:
                for image in images:
                    if not image.path.exists():  # names appear only whole (durable.create's rename)
                        durable.create(image.path, _blank(image.size, image.params), sync=False)
                for image in images:
                    try:
                        fsync_path(image.path)
                    except FileNotFoundError:
                        continue  # removed from outside meanwhile: its row stays pending, the reconcile rewrites it
                    settled.append(image.path)
                fsync_path(self.directory)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ResourceExhausted(f"pool {self.directory} is full: cannot write the empty image "
                                            f"of a created volume ({exc.strerror})") from exc
                raise
        return settled

    async def create_overlay(
        self, image: Path, backing: Path, size: int, granularity: int, *, key: VolumeKey | None = None,
    ) -> None:
        """Create a thin qcow2 `image` over `backing` (same directory, named relatively): O(1).

        It allocates in units of `granularity` whatever `backing` does: what
        a delta reports is what the overlay holds. The backing is named
        relatively and not opened (the size is given), so it costs no process;
        an encrypted one (`key`) costs a qemu-img that writes its LUKS header.
        """
        if key is not None:
            await self._create_encrypted(image, size, granularity, key, backing=backing)
            return
        backing_format = "qcow2" if backing.suffix == ".qcow2" else "raw"
        pieces = blank.image_bytes(
            size, granularity, layer_bitmaps.OWN, backing=backing.name, backing_format=backing_format)
        await asyncio.to_thread(durable.create, image, lambda fd: blank.write(fd, pieces))

    async def create_encrypted_copy(self, image: Path, size: int, granularity: int, key: VolumeKey,
                                    backing_name: str) -> None:
        """An encrypted copy image over another node's encrypted image (`backing_name`: a `json:` NBD link), unopened."""
        await self._create_encrypted(image, size, granularity, key, backing_name=backing_name)

    async def opens_with(self, image: Path, key: VolumeKey) -> bool:
        """Whether `key` unlocks `image`'s LUKS header (`csi_qsd.qcow2.keyed.opens_with`)."""
        return await keyed.opens_with(self._qemu_img, image, key)

    async def add_key(self, image: Path, opened_by: VolumeKey, key: VolumeKey, *, in_use: bool) -> None:
        """A keyslot for `key` in `image`'s LUKS header, written by qemu-img (never QSD: see `_amend_key`)."""
        await self._amend_key(image, opened_by, key, ["encrypt.state=active", "encrypt.new-secret=k2",
                                                      f"encrypt.iter-time={keyed.ITER_TIME_MS}"], in_use=in_use)

    async def remove_key(self, image: Path, opened_by: VolumeKey, key: VolumeKey, *, in_use: bool) -> None:
        """Erase `image`'s keyslots that `key` opens; QEMU refuses to erase the last one (`opened_by` must open
        another)."""
        await self._amend_key(image, opened_by, key, ["encrypt.state=inactive", "encrypt.old-secret=k2"],
                              in_use=in_use)

    async def _amend_key(self, image: Path, opened_by: VolumeKey, key: VolumeKey, options: list[str], *,
                         in_use: bool) -> None:
        """`qemu-img amend` of `image`'s LUKS keyslots, opened alone (each layer has its own header) by `opened_by`.

        Both keys come through pipes (`secret_pipes`). `in_use`: QSD holds
        the image open read-only (a layer below a staged volume's top), so
        qemu-img opens it without taking QEMU's file locks: it writes only
        the keyslot area of the LUKS header, which QEMU reads once, when it
        opens a layer, and a read-only layer never writes. A crash midway
        leaves a keyslot written or not: LUKS marks a slot active only once
        its key material is on disk, and erases material only after.
        """
        file: dict[str, object] = {"driver": "file", "filename": str(image)}
        if in_use:
            file["locking"] = "off"
        spec = {"driver": "qcow2", "encrypt.key-secret": "k1", "backing": None, "file": file}
        with secret_pipes(opened_by.base64().encode(), key.base64().encode()) as (first, second):
            await run(self._qemu_img, "amend", "-q",
                      "--object", f"secret,id=k1,file=/dev/fd/{first},format=base64",
                      "--object", f"secret,id=k2,file=/dev/fd/{second},format=base64",
                      "-o", ",".join(options), "json:" + json.dumps(spec),
                      timeout=CHECK_TIMEOUT, pass_fds=(first, second))

    async def backing_of(self, image: Path) -> str:
        """The absolute backing file an image's header names, or ''."""
        _, out = await run(self._qemu_img, "info", "--force-share", "--output=json", str(image))
        info = json.loads(out)
        return str(info.get("full-backing-filename", "") or "")

    async def flatten(self, image: Path) -> None:
        """Copy everything the backing chain holds into `image` and drop its backing (offline).

        qemu-img rewrites the header last, so a crash midway leaves the old, valid chain.
        The layers' changed-block records are carried into `image` first.
        """
        await image_bitmaps.carry_before_flatten(self._qemu_img, image)
        await run(self._qemu_img, "rebase", "-q", "-f", "qcow2", "-b", "", str(image), timeout=24 * 3600)

    async def delete(self, image: Path) -> None:
        await asyncio.to_thread(durable.unlink, image)

    async def delete_all(self, images: list[Path]) -> None:
        """Unlink every image, then fsync the pool's directory once for all of them."""
        await asyncio.to_thread(durable.unlink_all, self.directory, images)

    def leftovers(self) -> list[Path]:
        """Temporary files a crash left during creation: never user data."""
        return sorted(self.directory.glob(f"vol-*{TMP_SUFFIX}"))

    def images(self) -> list[Path]:
        return sorted(p for p in self.directory.glob("vol-*") if not p.name.endswith(TMP_SUFFIX))

    def reads_as_zeros(self, image: Path) -> bool:
        """A qcow2 image with no backing and no L2 table, or a raw file with no data extent."""
        return self._empty(image, backing_allowed=False)

    def holds_no_data(self, image: Path) -> bool:
        """A qcow2 image with no L2 table (over a backing or not), or a raw file with no data extent."""
        return self._empty(image, backing_allowed=True)

    def _empty(self, image: Path, *, backing_allowed: bool) -> bool:
        try:
            fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if image.suffix == ".qcow2":
                return blank.holds_nothing(fd, backing_allowed=backing_allowed)
            os.lseek(fd, 0, os.SEEK_DATA)
            return False
        except OSError as exc:
            return exc.errno == errno.ENXIO and image.suffix != ".qcow2"  # raw, no data from offset 0 on: all hole
        finally:
            os.close(fd)

    def storage(self, image: Path) -> ImageFile:
        return ImageFile(image, self._engine.aio, self._engine.direct)

    async def attach(self, client: QSDClient) -> None:
        """Ask this QSD how it can read and write image files (io_uring or its thread pool)."""
        if self._aio_probe is not None:
            self._engine = await file_aio.resolve(self._file_io, client, self._aio_probe)
            file_aio.note_filesystem(self.id, self.directory, self._engine)

    async def check(self, image: Path, *, in_use: bool) -> str:
        """A missing image; for one QSD does not hold, also what `qemu-img check` finds (cached).

        An image QSD has open is never checked from outside: its metadata may
        sit in QSD's cache, and a check would report corruption that is not
        there. `-U` keeps the check from taking the image lock, so it never
        stops a stage that opens the image meanwhile. A result is kept until
        the file changes (inode, size, mtime), so a volume list costs one
        stat per idle image.
        """
        try:
            st = await asyncio.to_thread(os.stat, image)
        except FileNotFoundError:
            return f"image file {image} is missing"
        except OSError as exc:
            return f"image file {image} cannot be read: {os.strerror(exc.errno or 0)}"
        if in_use:
            return ""
        signature = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._checked.get(image)
        if cached is not None and cached[0] == signature:
            return cached[1]
        async with self._check_slots:
            # The format from the name, never probed: a qcow2 whose header is lost must not pass as raw.
            if image.suffix != ".qcow2":
                code, out = await run(self._qemu_img, "check", "-U", "-f", "raw", "--output=json", str(image),
                                      timeout=CHECK_TIMEOUT, check=False)
            else:
                # Alone: a check reads only the image's own metadata, and a copy's backing is a link to another
                # node that only QSD opens (with its TLS credentials). QEMU checks an encrypted image only
                # opened with its key, which this node holds only while it is staged: its headers are read
                # instead (`qemu-img info` does no I/O, takes no key).
                spec = {"driver": "qcow2", "backing": None, "file": {"driver": "file", "filename": str(image)}}
                tool = "info" if await asyncio.to_thread(_encrypted, image) else "check"
                code, out = await run(self._qemu_img, tool, "-U", "--output=json", "json:" + json.dumps(spec),
                                      timeout=CHECK_TIMEOUT, check=False)
        problem = _check_result(image, code, out)
        if len(self._checked) >= CHECK_CACHE_MAX:
            self._checked.clear()
        self._checked[image] = (signature, problem)
        return problem


def _encrypted(image: Path) -> bool:
    """Whether `image`'s qcow2 header says LUKS (False for one that cannot be read: the check tells why)."""
    try:
        return keyed.encrypted(image)
    except OSError:
        return False


def _check_result(image: Path, code: int, out: str) -> str:
    """What a `qemu-img check --output=json` exit code (and report) says about `image`."""
    if code in _CHECK_FINE:
        return ""
    if code == _CHECK_CORRUPT:
        try:
            corruptions = int(json.loads(out).get("corruptions", 0))
        except (ValueError, AttributeError):
            corruptions = 0
        return f"image file {image} is corrupt: qemu-img check found {corruptions or 'some'} corrupt clusters"
    return f"image file {image} cannot be opened as an image (qemu-img check exit {code})"


def _allocated_blocks(images: list[Path]) -> dict[Path, int]:
    found: dict[Path, int] = {}
    for image in images:
        try:
            found[image] = os.stat(image).st_blocks * 512  # st_blocks counts 512-byte units on every filesystem
        except FileNotFoundError:
            continue
    return found


def _blank(size: int, params: VolumeParameters) -> Callable[[int], object]:
    """What writes an empty image to a descriptor: a few qcow2 tables (`csi_qsd.qcow2.blank`), or a raw file's size."""
    if params.format is ImageFormat.QCOW2:
        pieces = blank.image_bytes(size, params.granularity, layer_bitmaps.OWN)
        return lambda fd: blank.write(fd, pieces)
    return lambda fd: os.ftruncate(fd, size)


