"""Open the configured device pools, each by its way in (`pool_kinds`: the host's block device, QSD's NVMe driver,
or a remote target through QSD's iSCSI or NBD driver), and refuse two pools on one device."""

from __future__ import annotations

from pathlib import Path

from csi_qsd.catalog import Catalog
from csi_qsd.errors import StartupError
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pool_specs.remote_spec import RemotePoolSpec
from csi_qsd.pools import pool_kinds
from csi_qsd.pools.device import DevicePool
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints


async def open_device_pools(
    specs: tuple[DevicePoolSpec, ...], catalog: Catalog, state_dir: Path, failpoints: Failpoints = NO_FAILPOINTS,
    remote: tuple[RemotePoolSpec, ...] = (),
) -> list[DevicePool]:
    """Open every configured device and remote pool, by its way in; two pools on one device are refused."""
    pools: list[DevicePool] = []
    for spec in specs + remote:
        pool = pool_kinds.pool_for(spec, catalog, state_dir, failpoints)
        await pool.open()
        clash = next((p for p in pools if p.same_device(pool)), None)
        if clash is not None:
            raise StartupError(f"device pools {clash.id} and {pool.id} name the same device {pool.describe()}")
        pools.append(pool)
    return pools
