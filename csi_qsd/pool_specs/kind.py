"""The kinds of device pool, as a spec names them: each is one opener in `csi_qsd.pools.pool_kinds`."""

from __future__ import annotations

import enum


class PoolKind(enum.Enum):
    DEVICE = "device"  # a host block device, opened by the driver (`csi_qsd.pools.device`)
    NVME = "nvme"  # a PCI NVMe controller bound to vfio-pci that QSD drives itself (`csi_qsd.pools.nvme`)
    REMOTE = "remote"  # an iSCSI LUN or NBD export QSD's own drivers reach (`csi_qsd.pools.remote`)
