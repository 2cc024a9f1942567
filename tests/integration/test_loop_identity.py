"""A loop device attached through another mount namespace's view of a file is still found as that file's.

Found in a real cluster: the plugin container attaches the loop device through its own mount of the
FUSE export; once that container restarts, its namespace is gone and sysfs' `backing_file` no longer
reads as the export's path. The restarted plugin took the volume for broken, attached a second loop
device and failed on the staging path ("already has /dev/loopN mounted"). The kernel's record of the
backing file's device and inode does not change, and that is what the driver matches on.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from csi_qsd.sys import loop

pytestmark = pytest.mark.integration


def test_loop_attached_from_a_namespace_that_is_gone_is_found_by_identity(tmp_path: Path) -> None:
    image = tmp_path / "disk.img"
    image.write_bytes(bytes(1 << 20))
    view = tmp_path / "view"
    view.mkdir()
    device = Path(subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-ec",
         f"mount --bind {tmp_path} {view}; losetup --find --show {view / 'disk.img'}"],
        check=True, capture_output=True, text=True).stdout.strip())
    try:
        assert loop.backing_of(device) != image  # the namespace that made the path is gone
        assert loop.serves(device, image)
        assert device in {lp.device for lp in loop.find_loop(image)}
        assert not loop.serves(device, tmp_path / "other.img")
        other = tmp_path / "other.img"
        other.write_bytes(bytes(1 << 20))
        assert not loop.serves(device, other) and device not in {lp.device for lp in loop.find_loop(other)}
    finally:
        subprocess.run(["losetup", "-d", str(device)], check=True)
