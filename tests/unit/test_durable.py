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
