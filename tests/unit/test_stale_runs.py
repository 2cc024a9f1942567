"""Which FUSE mounts belong to a killed run's base directory, and who owns what (pure logic of testing.stale_runs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from testing import owner
from testing.stale_runs import fuse_devices, inside

BASE = Path("/var/tmp/csi-qsd-cluster-ab12cd34")
# A host mount table as a cluster node sees it: the host's root, a live sandbox's FUSE export inherited
# from the host, the node's bind of the run's csi-qsd directory, and a QSD export below that bind.
NODE_MOUNTINFO = "\n".join([
    "1 0 8:1 / / rw - ext4 /dev/sda1 rw",
    "50 1 0:60 / /tmp/cqlive1234/state/exports/v1 rw - fuse /dev/fuse rw",
    "70 1 0:40 / /var/lib rw - tmpfs node-var-lib rw",
    "71 70 8:1 /var/tmp/csi-qsd-cluster-ab12cd34/node/csi-qsd /var/lib/csi-qsd rw - ext4 /dev/sda1 rw",
    "90 71 0:77 / /var/lib/csi-qsd/exports/v2 rw - fuse /dev/fuse rw",
    r"91 71 0:78 / /var/lib/csi-qsd/exports/with\040space rw - fuse.qsd /dev/fuse rw",
])


def test_a_nodes_exports_belong_to_its_run_and_an_inherited_export_does_not() -> None:
    assert fuse_devices(NODE_MOUNTINFO, BASE) == {(0, 77), (0, 78)}
    assert fuse_devices(NODE_MOUNTINFO, Path("/var/tmp/csi-qsd-cluster-other")) == set()


def test_a_sandboxs_export_belongs_to_it_by_its_mount_point() -> None:
    assert fuse_devices(NODE_MOUNTINFO, Path("/tmp/cqlive1234")) == {(0, 60)}
    assert fuse_devices(NODE_MOUNTINFO, Path("/tmp/cqlive")) == set()  # a prefix of the name is not the directory


def test_inside_is_by_whole_path_components() -> None:
    assert inside("/tmp/cq1", Path("/tmp/cq1")) and inside("/tmp/cq1/state", Path("/tmp/cq1"))
    assert not inside("/tmp/cq12/state", Path("/tmp/cq1"))


def test_this_process_is_alive_and_an_exited_one_is_not() -> None:
    assert owner.alive(owner.owner_token())
    proc = subprocess.Popen(["sleep", "30"])
    token = owner.owner_token(proc.pid)
    assert owner.alive(token)
    proc.kill()
    proc.wait()
    assert not owner.alive(token)


def test_a_recycled_pid_is_not_the_owner() -> None:
    pid = os.getpid()
    assert not owner.alive(f"{pid}-{owner.start_time(pid)}1")  # same pid, another start time


def test_a_token_not_ours_counts_as_alive() -> None:
    assert owner.alive("not a token") and owner.alive("")


def test_a_base_is_marked_with_its_owner(tmp_path: Path) -> None:
    base = owner.make_base("cq", tmp_path)
    assert base.parent == tmp_path and base.name.startswith("cq")
    assert (base / owner.OWNER_FILE).read_text().strip() == owner.owner_token()
    assert owner.cgroup_name().startswith(f"{owner.CGROUP_PREFIX}{owner.owner_token()}-")


def test_a_base_is_removed_with_its_owner_file_once_empty(tmp_path: Path) -> None:
    base = owner.make_base("cq", tmp_path)
    (base / "left").write_text("x")
    with pytest.raises(OSError):
        owner.remove_base(base)  # something of the test's is still there: kept, and said
    (base / "left").unlink()
    owner.remove_base(base)
    assert not base.exists()
