"""Builds (once) and caches the guest kernel + base initramfs.

Building costs a ~70 MB download and a few seconds of extraction, so results
live in a per-user cache outside the repository, keyed by everything that
changes the output: kernel and busybox package versions plus a digest of the
build recipe (init script, module list, this module's format version). A hit
costs one ``apt-cache`` lookup the first time per process and nothing after.

Entries are assembled in a private temp dir next to the cache and published
with a single ``rename``, so a crash or a concurrent builder can never expose
a half-written entry; stale temp dirs from crashed builds are swept later.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import debian, initramfs, kernel, kmod

log = logging.getLogger(__name__)

# Everything the stock Debian kernel needs to see a virtio-blk PCI disk, which
# is also what vhost-user-blk-pci presents to the guest. Dependencies
# (virtio, virtio_ring, virtio_pci_{modern,legacy}_dev) are resolved from the
# modules themselves.
GUEST_MODULES = ("virtio_pci", "virtio_blk")

# Bump when the layout of a cache entry or the build procedure changes in a
# way the recipe digest below cannot see.
_FORMAT_VERSION = 1
_KERNEL_FILES = ("vmlinux", "vmlinuz")  # PVH-bootable ELF preferred, bzImage fallback
_INITRD_FILE = "initrd.cpio.gz"
_MANIFEST_FILE = "manifest.json"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 6 * 3600

_memo: dict[Path, "GuestImage"] = {}


class GuestImageError(RuntimeError):
    """The guest image could not be built or found in the cache."""


@dataclass(frozen=True)
class GuestImage:
    """A bootable guest: kernel plus base initramfs (without any run script)."""

    kernel: Path
    initrd: Path
    kernel_release: str = ""
    modules: tuple[str, ...] = ()


def default_cache_root() -> Path:
    """``$CSI_QSD_GUEST_CACHE``, else ``$XDG_CACHE_HOME/csi-qsd/guest``, else ``~/.cache/...``."""
    explicit = os.environ.get("CSI_QSD_GUEST_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "csi-qsd" / "guest"


def _recipe_digest() -> str:
    recipe = json.dumps(
        {
            "format": _FORMAT_VERSION,
            "init": initramfs.INIT_SCRIPT,
            "modules": GUEST_MODULES,
            "kernels": _KERNEL_FILES,
        },
        sort_keys=True,
    )
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def _entry_key(packages: debian.GuestPackages) -> str:
    material = f"{_recipe_digest()}|{packages.kernel.version}|{packages.busybox.version}"
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def _load_entry(entry: Path) -> GuestImage | None:
    try:
        manifest = json.loads((entry / _MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    kernel, initrd = entry / str(manifest.get("kernel_file")), entry / _INITRD_FILE
    if manifest.get("kernel_file") not in _KERNEL_FILES or not (kernel.is_file() and initrd.is_file()):
        return None
    return GuestImage(kernel, initrd, str(manifest["kernel_release"]), tuple(manifest["modules"]))


def _newest_cached_entry(root: Path) -> GuestImage | None:
    """Fallback when apt cannot resolve (no package lists): newest entry of this recipe."""
    recipe = _recipe_digest()
    candidates: list[tuple[float, Path]] = []
    for manifest in root.glob(f"*/*/{_MANIFEST_FILE}"):
        try:
            if json.loads(manifest.read_text()).get("recipe") == recipe:
                candidates.append((manifest.stat().st_mtime, manifest.parent))
        except (OSError, ValueError):
            continue
    for _, entry in sorted(candidates, reverse=True):
        image = _load_entry(entry)
        if image is not None:
            return image
    return None


def _sweep_stale_tmp(root: Path) -> None:
    now = time.time()
    for tmp in root.glob(f"{_TMP_PREFIX}*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            continue


def _busybox_applets(busybox: Path) -> list[str]:
    # The static busybox runs on any x86-64 Linux host, and asking it is the
    # only authoritative list of applets compiled into this build.
    out = subprocess.run(
        [str(busybox), "--list-full"], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def _build_into(entry: Path, work: Path, packages: debian.GuestPackages) -> GuestImage:
    root = work / "root"
    debian.download_and_extract([packages.kernel, packages.busybox], work / "debs", root)
    release = packages.kernel_release
    vmlinuz = root / "boot" / f"vmlinuz-{release}"
    moddir = root / "lib" / "modules" / release
    busybox = root / "bin" / "busybox"
    for needed in (vmlinuz, moddir, busybox):
        if not needed.exists():
            raise GuestImageError(f"extracted packages lack {needed.relative_to(root)}")
    order = kmod.resolve_load_order(moddir, list(GUEST_MODULES))
    modules = [(m.name, kmod.read_module_bytes(m.path)) for m in order]
    kernel_file = _install_kernel(vmlinuz, entry)
    initramfs.write_base_initramfs(
        entry / _INITRD_FILE, busybox.read_bytes(), _busybox_applets(busybox), modules
    )
    names = tuple(m.name for m in order)
    manifest = {
        "recipe": _recipe_digest(),
        "kernel_package": f"{packages.kernel.name}={packages.kernel.version}",
        "busybox_package": f"{packages.busybox.name}={packages.busybox.version}",
        "kernel_release": release,
        "kernel_file": kernel_file,
        "modules": list(names),
        "module_depends": {m.name: list(m.depends) for m in order},
    }
    (entry / _MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return GuestImage(entry / kernel_file, entry / _INITRD_FILE, release, names)


def _install_kernel(vmlinuz: Path, entry: Path) -> str:
    """Stores the kernel in the fastest form QEMU can boot; returns its file name."""
    bzimage = vmlinuz.read_bytes()
    elf = kernel.extract_vmlinux(bzimage)
    if elf is not None and kernel.has_pvh_entry(elf):
        name = _KERNEL_FILES[0]
        (entry / name).write_bytes(elf)
    else:
        log.warning("kernel has no PVH-bootable payload; booting the (slower) bzImage")
        name = _KERNEL_FILES[1]
        (entry / name).write_bytes(bzimage)
    return name


def build_guest_image(cache_dir: Path | None = None) -> GuestImage:
    """Returns the cached guest image for today's Debian 12 kernel, building it if needed."""
    root = (cache_dir or default_cache_root()).expanduser().resolve()
    if root in _memo:
        return _memo[root]
    root.mkdir(parents=True, exist_ok=True)
    try:
        packages = debian.resolve_packages()
        final = root / packages.kernel_release / _entry_key(packages)
        image = _load_entry(final) or _build(root, final, packages)
    except debian.PackageError as exc:
        # Offline, no apt lists, or lists so stale the mirror dropped the
        # candidate: an image of the same recipe is still a valid guest.
        cached = _newest_cached_entry(root)
        if cached is None:
            raise GuestImageError(f"{exc} (and no cached guest image in {root})") from exc
        log.warning("apt failed (%s); using cached guest image %s", exc, cached.kernel.parent)
        image = cached
    _memo[root] = image
    return image


def _build(root: Path, final: Path, packages: debian.GuestPackages) -> GuestImage:
    _sweep_stale_tmp(root)
    started = time.monotonic()
    log.info("building guest image for %s into %s", packages.kernel_release, final)
    with tempfile.TemporaryDirectory(prefix=_TMP_PREFIX, dir=root) as tmp:
        staging = Path(tmp) / "entry"
        staging.mkdir()
        _build_into(staging, Path(tmp) / "work", packages)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging, final)
        except OSError:
            # A concurrent builder published first; its entry is equivalent.
            if _load_entry(final) is None:
                raise
    image = _load_entry(final)
    if image is None:
        raise GuestImageError(f"guest image entry {final} is incomplete after build")
    log.info("built guest image in %.1fs", time.monotonic() - started)
    return image
