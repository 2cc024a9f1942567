"""Which `PoolDirectory` the file pool gets: a plain directory, or the managed kind `--managed-pool` names."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from csi_qsd.pool_specs.managed_spec import ManagedPoolSpec
from csi_qsd.pools.managed_xfs import ManagedXfs
from csi_qsd.pools.pool_dirs import PlainDirectory, PoolDirectory
from csi_qsd.sys.failpoints import NONE as NO_FAILPOINTS
from csi_qsd.sys.failpoints import Failpoints

KINDS: dict[str, Callable[[ManagedPoolSpec, Path, Path, Failpoints], PoolDirectory]] = {"xfs": ManagedXfs}


def pool_directory(spec: ManagedPoolSpec | None, path: Path, state_dir: Path,
                   failpoints: Failpoints = NO_FAILPOINTS) -> PoolDirectory:
    """The file pool's directory `path`: plain without `spec`, else made and mounted by the driver in `state_dir`."""
    if spec is None:
        return PlainDirectory(path, state_dir)
    return KINDS[spec.kind](spec, path, state_dir, failpoints)
