"""A device pool as configured: the `--device-pool` flag parsed, before any device is opened."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from csi_qsd.params import DEFAULT_POOL_NAME, POOL_NAME_RE
from csi_qsd.pool_specs.kind import PoolKind
from csi_qsd.pool_specs.nvme_address import SCHEME as NVME_SCHEME
from csi_qsd.pool_specs.nvme_address import NvmeAddress


@dataclasses.dataclass(frozen=True)
class DevicePoolSpec:
    """`--device-pool NAME=PATH[,force]` or `NAME=nvme://PCI[/NAMESPACE][,force]`: a whole device carved into volumes.

    PATH should be a stable name (/dev/disk/by-id/…) so a reboot that
    renumbers devices cannot point the pool at another disk. An `nvme://`
    address names a PCI NVMe controller bound to vfio-pci that QSD drives
    itself (`nvme`, then `path` is unused). `force` lets the driver take a
    device that holds a partition table or filesystem.
    """

    name: str
    path: Path
    force: bool = False
    nvme: NvmeAddress | None = None

    @property
    def kind(self) -> PoolKind:
        """NVME for an nvme:// address, else DEVICE: which pool opens it (`csi_qsd.pools.pool_kinds`)."""
        return PoolKind.NVME if self.nvme is not None else PoolKind.DEVICE

    @property
    def source(self) -> str:
        """The device as configured: a path or an nvme:// address."""
        return str(self.nvme) if self.nvme is not None else str(self.path)

    @classmethod
    def parse(cls, text: str) -> "DevicePoolSpec":
        """Parse NAME=PATH[,force] or NAME=nvme://PCI[/NAMESPACE][,force]; raises ValueError naming what is wrong."""
        name, eq, rest = text.partition("=")
        path, _, option = rest.partition(",")
        if not eq or not path:
            raise ValueError(f"--device-pool {text!r}: expected NAME=PATH[,force] or NAME=nvme://PCI[/NS][,force]")
        if not POOL_NAME_RE.match(name) or name == DEFAULT_POOL_NAME:
            raise ValueError(f"--device-pool {text!r}: pool name must match {POOL_NAME_RE.pattern} "
                             f"and not be {DEFAULT_POOL_NAME!r} (the file pool)")
        if option not in ("", "force"):
            raise ValueError(f"--device-pool {text!r}: unknown option {option!r} (only 'force')")
        if path.startswith(NVME_SCHEME):
            try:
                address = NvmeAddress.parse(path)
            except ValueError as exc:
                raise ValueError(f"--device-pool {text!r}: {exc}") from None
            return cls(name, Path("/dev/vfio"), option == "force", address)
        if not path.startswith("/"):
            raise ValueError(f"--device-pool {text!r}: the device path must be absolute")
        return cls(name, Path(path), option == "force")
