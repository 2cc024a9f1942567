"""The FUSE path probe's pure parts: the QMP schema walk and what the driver asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from csi_qsd.qsd import fuse_paths, graph

NODES = graph.nodes_for("vol-0123456789abcdef01234567")


def schema(fuse_members: list[str] | None) -> list[dict[str, Any]]:
    """A schema shaped as QEMU's introspection is (type names hidden as numbers)."""
    entries: list[dict[str, Any]] = [
        {"name": "block-export-add", "meta-type": "command", "arg-type": "12", "ret-type": "0"},
        {"name": "query-version", "meta-type": "command", "arg-type": "0", "ret-type": "5"},
        {"name": "12", "meta-type": "object", "tag": "type",
         "members": [{"name": "type", "type": "13"}, {"name": "id", "type": "str"}],
         "variants": [{"case": "nbd", "type": "14"}] + ([{"case": "fuse", "type": "15"}] if fuse_members else [])},
        {"name": "14", "meta-type": "object", "members": [{"name": "name", "type": "str"}]},
    ]
    if fuse_members:
        entries.append({"name": "15", "meta-type": "object",
                        "members": [{"name": name, "type": "bool"} for name in fuse_members]})
    return entries


def test_members_of_the_fuse_export_are_found() -> None:
    found = fuse_paths.fuse_export_members(schema(["mountpoint", "growable", "allow-other"]))
    assert found == {"mountpoint", "growable", "allow-other"}
    assert fuse_paths.IO_URING_OPTION not in found


def test_the_io_uring_option_is_seen_the_day_qsd_offers_it() -> None:
    found = fuse_paths.fuse_export_members(schema(["mountpoint", "growable", "allow-other", "io-uring"]))
    assert fuse_paths.IO_URING_OPTION in found


def test_no_fuse_export_no_members() -> None:
    assert fuse_paths.fuse_export_members(schema(None)) == frozenset()
    assert fuse_paths.fuse_export_members([]) == frozenset()


@pytest.mark.parametrize("option,kernel,used", [
    (True, "on", True), (True, "off", False), (True, "absent", False), (False, "on", False),
])
def test_io_uring_needs_both_qsd_and_kernel(option: bool, kernel: str, used: bool) -> None:
    paths = fuse_paths.FusePaths(io_uring_option=option, kernel=kernel, async_dio=None)
    assert paths.io_uring is used
    assert f"fuse_io_uring={'on' if used else 'off'}" in paths.describe()


def test_export_asks_for_io_uring_only_when_chosen() -> None:
    assert graph.fuse_export(NODES, Path("/e/disk"), writable=True, io_uring=True)["io-uring"] is True
    assert "io-uring" not in graph.fuse_export(NODES, Path("/e/disk"), writable=True)


def test_kernel_setting_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enable_uring"
    monkeypatch.setattr(fuse_paths, "KERNEL_URING", setting)
    assert fuse_paths.kernel_uring() == "absent"
    setting.write_text("N\n")
    assert fuse_paths.kernel_uring() == "off"
    setting.write_text("Y\n")
    assert fuse_paths.kernel_uring() == "on"
