"""ext4 made on a device known to read as zeros: no zeros written, and a filesystem e2fsck finds whole.

A blank thin image reads as zeros, so mke2fs need not write its inode
tables and journal (`assume_storage_prezeroed`): the image stays as thin as
the filesystem's metadata. Run on a sparse file, as on the loop device over
an export; the allocation of each shows what mke2fs wrote.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from csi_qsd.sys import filesystems

MIB = 1 << 20


def _sparse(path: Path, size: int) -> Path:
    path.touch()
    os.truncate(path, size)
    return path


async def test_ext4_on_zeros_writes_only_its_metadata_and_checks_clean(tmp_path: Path) -> None:
    if await filesystems.mke2fs_version() < filesystems.PREZEROED_SINCE:
        pytest.skip(f"mke2fs {await filesystems.mke2fs_version()} predates assume_storage_prezeroed")
    zeroed, written = _sparse(tmp_path / "zeroed.img", 256 * MIB), _sparse(tmp_path / "written.img", 256 * MIB)
    await filesystems.make(zeroed, "ext4", zeroed=True)
    await filesystems.make(written, "ext4")
    allocated = {path: os.stat(path).st_blocks * 512 for path in (zeroed, written)}
    assert allocated[zeroed] * 4 < allocated[written], allocated  # tables and journal not written
    for path in (zeroed, written):
        check = subprocess.run(["e2fsck", "-f", "-n", str(path)], capture_output=True, text=True,
                               env=dict(os.environ, LC_ALL="C"), check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        groups = subprocess.run(["dumpe2fs", str(path)], capture_output=True, text=True,
                                env=dict(os.environ, LC_ALL="C"), check=True).stdout
        # Every group's inode table counts as initialised: no lazy init writes behind our back later.
        described = [line for line in groups.splitlines() if re.match(r"Group \d+: ", line)]
        assert described and all("ITABLE_ZEROED" in line for line in described)
