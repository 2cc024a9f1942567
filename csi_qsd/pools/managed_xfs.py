"""The file pool's directory on an XFS filesystem the driver makes in one file of its state directory.

Why: QSD's io_uring completes a buffered write in QSD's own thread on XFS,
where on ext4 each one takes an io_uring worker thread (docs/benchmarks.md);
a node whose only filesystem is ext4 gets XFS through a direct-I/O loop
device over one file on it (`--managed-pool xfs:SIZE[,sparse]`).

The file is `<state-dir>/managed-pool/xfs.img`. It is made under a
temporary name, formatted through a loop device and renamed into place, so
its name exists only over a whole XFS: mkfs runs only on a file this very
start made, and a file under that name that is not XFS is refused, never
formatted. Every start then reuses or re-attaches the loop device (gone
after a node restart), reuses or makes the mount at the pool directory, and
grows the file and the filesystem to the configured size (never shrinks).
A crash at any step leaves what the next start finishes or removes: a
temporary file and a loop device over it are removed, a loop device over
the file and a mount of it are taken up again. Nothing here ever unmounts
the pool or detaches its loop device: QSD holds the images on it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path

from csi_qsd.errors import HostCommandError, StartupError
from csi_qsd.pool_specs.managed_spec import ManagedPoolSpec
from csi_qsd.pools.pool_dirs import IMAGE_SUFFIX, MANAGED_DIR, PoolDirectory, managed_images
from csi_qsd.sys import durable, filesystems, loop, mounts
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints

log = logging.getLogger(__name__)

KIND = "xfs"
# xfs_growfs leaves out a last allocation group smaller than 64 blocks (256 KiB at 4 KiB): a filesystem
# within this of its device fills it.
GROWTH_SLACK = 1 << 20


class ManagedXfs(PoolDirectory):
    """XFS on a direct-I/O loop device over `<state_dir>/managed-pool/xfs.img`, mounted at `path`."""

    def __init__(self, spec: ManagedPoolSpec, path: Path, state_dir: Path,
                 failpoints: Failpoints = NO_FAILPOINTS) -> None:
        self.spec = spec
        self.path = path
        self.image = state_dir / MANAGED_DIR / f"{KIND}{IMAGE_SUFFIX}"
        self.device: Path | None = None  # the loop device, once `ready`
        self._failpoints = failpoints

    def describe(self) -> str:
        return f"{self.path} (xfs on {self.device or 'a loop device'} over {self.image})"

    async def ready(self) -> None:
        """Make, attach, mount and grow what is missing, in that order; reuse what is there. Raises StartupError."""
        await asyncio.to_thread(self._check_place)
        device = await self._mounted_device()
        if device is None:
            await asyncio.to_thread(self._check_mount_point)
        if not self.image.exists():
            await self._make()
        await asyncio.to_thread(self._check_file)
        await asyncio.to_thread(self._size_file)
        if device is None:
            device = await self._mount(await self._loop())
        await self._grow(device)
        self.device = device
        await asyncio.to_thread(self._note, device)

    def _check_place(self) -> None:
        """The managed pools' directory exists (private), and holds no pool of another kind."""
        self.image.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        others = [image for image in managed_images(self.image.parent.parent) if image != self.image]
        if others:
            raise StartupError(f"{others[0]} holds a managed {others[0].name.removesuffix(IMAGE_SUFFIX)} pool, "
                               f"not {KIND}: start with --managed-pool naming that kind, or move the file away")

    async def _make(self) -> None:
        """A new file, an XFS made in it through a loop device, then its name: the name means a whole XFS.

        The loop device stays attached for the mount that follows.
        """
        tmp = self.image.with_name(self.image.name + durable.TMP_SUFFIX)
        for leftover in loop.find_loop(tmp):  # a creation a crash cut off: never anyone's data
            await loop.detach(leftover.device)
            log.info("event=managed_pool_leftover_detached device=%s file=%s", leftover.device, tmp)
        await asyncio.to_thread(self._new_file, tmp)
        self._failpoints.hit("managed_pool.after_file")
        try:
            device = await loop.attach(tmp, direct_io=True)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:
            self._failpoints.hit("managed_pool.after_make_loop")
            await filesystems.make(device, KIND)
            self._failpoints.hit("managed_pool.after_mkfs")
            await asyncio.to_thread(durable.replace, tmp, self.image)
        except BaseException:
            await loop.detach(device)
            tmp.unlink(missing_ok=True)
            raise
        log.info("event=managed_pool_made file=%s size=%d preallocated=%s device=%s", self.image, self.spec.size,
                 "yes" if self.spec.preallocate else "no", device)

    def _new_file(self, tmp: Path) -> None:
        fd = durable.exclusive(tmp)
        try:
            self._reserve(fd, tmp) if self.spec.preallocate else os.ftruncate(fd, self.spec.size)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def _reserve(self, fd: int, path: Path) -> None:
        """Allocate the whole file on the host's filesystem (holes filled, data kept); StartupError without room."""
        st = os.statvfs(path.parent)  # before: a failed fallocate may keep what it took until the file goes
        try:
            os.posix_fallocate(fd, 0, self.spec.size)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise StartupError(
                f"cannot preallocate {self.spec.size} bytes for the managed pool {path}: the host's filesystem "
                f"had {st.f_bavail * st.f_frsize} bytes free ({exc.strerror}); free space, give a smaller size, "
                f"or give ',sparse' (the host's space is then taken as the pool fills)") from exc

    def _check_file(self) -> None:
        """The file is an XFS this driver made, and no larger than the size asked (XFS cannot shrink)."""
        if not filesystems.holds_xfs(self.image):
            raise StartupError(
                f"{self.image} is not an XFS filesystem: the driver formats only a file it has just made, never "
                "one it finds. Move it out of the state directory to have a new, empty pool made (the volumes "
                "the catalog records on it are then lost), or put back the pool's own file")
        size = self.image.stat().st_size
        if self.spec.size < size:
            raise StartupError(
                f"--managed-pool {self.spec} is smaller than the pool's file {self.image} ({size >> 20}Mi): "
                f"XFS cannot shrink; give at least {size >> 20}Mi")

    def _size_file(self) -> None:
        """Grow the file to the size asked; with `preallocate`, (re)allocate all of it (a trim punches holes)."""
        size = self.image.stat().st_size
        if size == self.spec.size and not self.spec.preallocate:
            return
        fd = os.open(self.image, os.O_RDWR | os.O_CLOEXEC)
        try:
            if self.spec.preallocate:
                self._reserve(fd, self.image)
            elif size < self.spec.size:
                os.ftruncate(fd, self.spec.size)
            os.fsync(fd)
        finally:
            os.close(fd)
        if size < self.spec.size:
            log.info("event=managed_pool_file_grown file=%s from=%d to=%d", self.image, size, self.spec.size)
            self._failpoints.hit("managed_pool.after_grow_file")

    async def _mounted_device(self) -> Path | None:
        """The loop device of the pool's mount, if it is mounted (a restarted driver); refuse any other mount there."""
        entry = await asyncio.to_thread(mounts.mounted_at, self.path)
        if entry is None:
            return None
        device = Path(entry.source)
        if entry.fs_type != KIND or not await asyncio.to_thread(loop.serves, device, self.image):
            raise StartupError(
                f"{self.path} has {entry.fs_type} from {entry.source} mounted, not the managed pool's loop device "
                f"over {self.image}: unmount it, or give --pool-dir a directory of its own for the managed pool")
        log.info("event=managed_pool_mount_reused device=%s pool_dir=%s", device, self.path)
        return device

    def _check_mount_point(self) -> None:
        """The pool directory exists and is empty: mounting over files would hide them from the driver."""
        self.path.mkdir(parents=True, exist_ok=True)
        entries = sorted(os.listdir(self.path))
        if entries:
            raise StartupError(
                f"{self.path} holds {len(entries)} entries ({', '.join(entries[:3])}{', …' if len(entries) > 3 else ''}) "
                "and the managed pool would be mounted over them, hiding them: it needs an empty pool directory. "
                "Volumes of a file pool stay where they are: give the managed pool its own --pool-dir on a new "
                "state directory, or move them out")

    async def _loop(self) -> Path:
        """The loop device over the file: the one a crash or a restarted driver left, else a new one."""
        found = await asyncio.to_thread(loop.find_loop, self.image, readonly=False)
        if found:
            log.info("event=managed_pool_loop_reused device=%s direct_io=%s", found[0].device,
                     "yes" if loop.uses_direct_io(found[0].device) else "no")
            return found[0].device
        device = await loop.attach(self.image, direct_io=True)
        log.info("event=managed_pool_loop_attached device=%s file=%s", device, self.image)
        self._failpoints.hit("managed_pool.after_loop")
        return device

    async def _mount(self, device: Path) -> Path:
        try:
            await mounts.mount(device, self.path, fs_type=KIND, options=[])
        except HostCommandError as exc:
            raise StartupError(f"cannot mount the managed pool {self.image} ({device}) at {self.path}: {exc}; "
                               "`xfs_repair` the file (unmounted) if it is damaged") from exc
        log.info("event=managed_pool_mounted device=%s pool_dir=%s", device, self.path)
        self._failpoints.hit("managed_pool.after_mount")
        return device

    async def _grow(self, device: Path) -> None:
        """The loop device and the filesystem fill the file (after a grown size, or a crash between the steps)."""
        size = (await asyncio.to_thread(self.image.stat)).st_size
        if await asyncio.to_thread(loop.device_size, device) < size:
            await loop.refresh_capacity(device, size)
        before = await filesystems.xfs_size(self.path)
        if before >= size - GROWTH_SLACK:
            return
        await filesystems.grow(self.path, KIND, device)
        log.info("event=managed_pool_grown pool_dir=%s from=%d to=%d", self.path, before,
                 await filesystems.xfs_size(self.path))

    def _note(self, device: Path) -> None:
        """Log what the pool is, and warn when the host's filesystem cannot hold what a sparse file may still take."""
        st = os.stat(self.image)
        host = os.statvfs(self.image.parent)
        free = host.f_bavail * host.f_frsize
        unallocated = max(st.st_size - st.st_blocks * 512, 0)
        log.info("event=managed_pool kind=%s pool_dir=%s file=%s device=%s size=%d allocated=%d host_free=%d "
                 "preallocated=%s", KIND, self.path, self.image, device, st.st_size, st.st_blocks * 512, free,
                 "yes" if self.spec.preallocate else "no")
        if unallocated > free:
            log.warning("event=managed_pool_overcommitted file=%s unallocated=%d host_free=%d hint=%r", self.image,
                        unallocated, free, "the sparse pool file may need more than the host's filesystem has "
                        "left; when that fills, XFS gets write errors and shuts down, and every volume on it "
                        "fails: free space, or drop ',sparse'")
