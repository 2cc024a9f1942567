"""Finds which kernel modules a guest must ``insmod`` for a device, in load order.

Debian's kernel package ships no ``modules.dep`` (``depmod`` runs in the
package's postinst, which we never execute because nothing is installed on the
host), so dependencies are read straight from each module's ``.modinfo`` ELF
section (``depends=a,b``), the same data ``depmod`` itself uses. A
``modules.dep`` is still preferred when present. Drivers built into the kernel
(``modules.builtin``) need no loading and are skipped, so the result stays
right if a future kernel turns a module into a built-in.

Busybox ``insmod`` does not decompress, so ``.ko.xz`` modules are decompressed
here; zstd (Debian 13+) would need a non-stdlib decompressor and is rejected
with a clear error instead of producing a guest that cannot see its disks.
"""

from __future__ import annotations

import lzma
import struct
from dataclasses import dataclass
from pathlib import Path


class ModuleError(RuntimeError):
    """A required module is missing or cannot be prepared for the guest."""


@dataclass(frozen=True)
class KernelModule:
    name: str
    path: Path
    depends: tuple[str, ...]


def _canonical(name: str) -> str:
    # The kernel treats '-' and '_' in module names as the same character.
    return name.replace("-", "_")


def _module_name(path: Path) -> str:
    name = path.name
    for suffix in (".xz", ".zst", ".gz"):
        name = name.removesuffix(suffix)
    return _canonical(name.removesuffix(".ko"))


def read_module_bytes(path: Path) -> bytes:
    """Returns the uncompressed ELF image of a ``.ko``/``.ko.xz`` file."""
    raw = path.read_bytes()
    if path.name.endswith(".ko"):
        return raw
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(raw)
    raise ModuleError(f"unsupported module compression: {path.name}")


def modinfo(elf: bytes) -> dict[str, str]:
    """Parses the ``.modinfo`` section (NUL-separated ``key=value``) of an ELF64 LE module."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ModuleError("not a little-endian ELF64 kernel module")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(index: int) -> tuple[int, int, int]:
        name_off, _type, _flags, _addr, offset, size = struct.unpack_from(
            "<IIQQQQ", elf, shoff + index * shentsize
        )
        return name_off, offset, size

    _, strtab_off, _ = section(shstrndx)
    for i in range(shnum):
        name_off, offset, size = section(i)
        end = elf.index(b"\0", strtab_off + name_off)
        if elf[strtab_off + name_off : end] == b".modinfo":
            info: dict[str, str] = {}
            for item in elf[offset : offset + size].split(b"\0"):
                key, sep, value = item.decode(errors="replace").partition("=")
                if sep:
                    info.setdefault(key, value)
            return info
    return {}


def _index_modules(moddir: Path) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for path in sorted(moddir.rglob("*.ko*")):
        index.setdefault(_module_name(path), path)
    return index


def _builtins(moddir: Path) -> set[str]:
    builtin = moddir / "modules.builtin"
    if not builtin.exists():
        return set()
    return {_module_name(Path(line.strip())) for line in builtin.read_text().splitlines() if line.strip()}


def _deps_from_modules_dep(moddir: Path) -> dict[str, tuple[str, ...]] | None:
    dep_file = moddir / "modules.dep"
    if not dep_file.exists():
        return None
    deps: dict[str, tuple[str, ...]] = {}
    for line in dep_file.read_text().splitlines():
        target, _, rest = line.partition(":")
        deps[_module_name(Path(target))] = tuple(_module_name(Path(d)) for d in rest.split())
    return deps


def resolve_load_order(moddir: Path, wanted: list[str]) -> list[KernelModule]:
    """Returns the loadable modules ``wanted`` needs, dependencies first.

    ``moddir`` is ``lib/modules/<release>`` of an extracted kernel package.
    Names that are built into the kernel are silently satisfied.
    """
    index = _index_modules(moddir)
    builtin = _builtins(moddir)
    dep_table = _deps_from_modules_dep(moddir)
    order: list[KernelModule] = []
    done: set[str] = set()
    visiting: set[str] = set()

    def depends_of(name: str) -> tuple[str, ...]:
        if dep_table is not None and name in dep_table:
            return dep_table[name]
        raw = modinfo(read_module_bytes(index[name])).get("depends", "")
        return tuple(_canonical(d) for d in raw.split(",") if d)

    def visit(name: str) -> None:
        name = _canonical(name)
        if name in done:
            return
        if name in visiting:
            raise ModuleError(f"module dependency cycle at {name}")
        if name not in index:
            if name in builtin:
                done.add(name)
                return
            raise ModuleError(f"kernel module {name} not found under {moddir}")
        visiting.add(name)
        depends = depends_of(name)
        for dep in depends:
            visit(dep)
        visiting.discard(name)
        done.add(name)
        order.append(KernelModule(name, index[name], depends))

    for name in wanted:
        visit(name)
    return order
