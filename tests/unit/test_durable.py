"""sys.durable: what each step fsyncs, seen by the file descriptors os.fsync is given."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from csi_qsd.sys import durable


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kinds ("file" or "dir") of what os.fsync was called on, in order."""
    seen: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        seen.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return seen


def test_replace_syncs_the_data_then_the_directory(tmp_path: Path, synced: list[str]) -> None:
    tmp, final = tmp_path / "x.tmp", tmp_path / "x"
    final.write_bytes(b"old")
    tmp.write_bytes(b"new")
    durable.replace(tmp, final)
    assert final.read_bytes() == b"new" and not tmp.exists()
    assert synced == ["file", "dir"]


def test_unlink_syncs_the_directory(tmp_path: Path, synced: list[str]) -> None:
    victim = tmp_path / "x"
    victim.write_bytes(b"gone")
    durable.unlink(victim)
    durable.unlink(victim)  # a missing one is fine
    assert not victim.exists() and synced == ["dir", "dir"]


def test_create_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path: Path) -> None:
    """A symlink planted at `<out>.json.tmp` (a backup's sidecar) is removed, not followed: its target keeps its
    bytes and the file made is a regular file of its own."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"host file")
    out = tmp_path / "backup.qcow2.json"
    (tmp_path / "backup.qcow2.json.tmp").symlink_to(victim)
    durable.create(out, lambda fd: os.write(fd, b"{}\n"))
    assert victim.read_bytes() == b"host file"
    assert not out.is_symlink() and out.read_bytes() == b"{}\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_exclusive_gives_up_on_a_name_planted_again_each_time(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "x.tmp"
    real_unlink = Path.unlink

    def replant(self: Path, missing_ok: bool = False) -> None:
        real_unlink(self, missing_ok=missing_ok)
        self.symlink_to(tmp_path / "elsewhere")

    monkeypatch.setattr(Path, "unlink", replant)
    with pytest.raises(FileExistsError):
        durable.exclusive(target)
    assert not (tmp_path / "elsewhere").exists()
