"""Which pool opens a configured device pool: one line per kind, as `csi_qsd.exports.export_kinds` is for exports.

A new kind of device pool is a spec in `csi_qsd.pool_specs` whose `kind`
names a new `PoolKind`, a module here with its `DevicePool` subclass, and a
line in `KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from csi_qsd.catalog import Catalog
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pool_specs.kind import PoolKind
from csi_qsd.pool_specs.remote_spec import RemotePoolSpec
from csi_qsd.pools.device import DevicePool
from csi_qsd.pools.nvme import NvmeDevicePool
from csi_qsd.pools.remote import RemotePool
from csi_qsd.sys.failpoints import Failpoints

# (its spec, the catalog, the directory of QSD's views of pools, failpoints) -> the pool, not yet open.
Opener = Callable[[Any, Catalog, Path, Failpoints], DevicePool]


def _host_device(spec: DevicePoolSpec, catalog: Catalog, view_dir: Path, failpoints: Failpoints) -> DevicePool:
    return DevicePool(spec, catalog, failpoints)  # the driver opens the device itself: no QSD view


KINDS: dict[PoolKind, Opener] = {
    PoolKind.DEVICE: _host_device,
    PoolKind.NVME: NvmeDevicePool,
    PoolKind.REMOTE: RemotePool,
}


def pool_for(spec: DevicePoolSpec | RemotePoolSpec, catalog: Catalog, state_dir: Path,
             failpoints: Failpoints) -> DevicePool:
    """The pool of `spec`'s kind, not yet opened."""
    return KINDS[spec.kind](spec, catalog, state_dir / "pools", failpoints)
