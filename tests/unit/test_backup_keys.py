"""The passphrase of encrypted backups: read from the operator's file as it is, and put on every backup layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from csi_qsd.backup.incremental import layered_spec
from csi_qsd.backup.keys import read_key_file
from csi_qsd.errors import InvalidArgument
from csi_qsd.sys.volume_keys import VolumeKey


def test_a_key_file_is_the_passphrase_byte_for_byte(tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(b"s3cret\n")
    assert read_key_file(tmp_path / "key") == VolumeKey("s3cret\n")  # a trailing newline is part of it
    assert read_key_file(tmp_path / "key") != VolumeKey("s3cret")


@pytest.mark.parametrize("content, words", [(b"", "is empty"), (b"\xff\xfe", "UTF-8"), (None, "cannot read")])
def test_an_unusable_key_file_is_refused_naming_the_flag_and_never_the_content(
        tmp_path: Path, content: bytes | None, words: str) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InvalidArgument, match=words) as err:
        read_key_file(path)
    assert "--key-file" in str(err.value) and str(path) in str(err.value)


def test_encrypted_backups_are_layered_each_with_the_key(tmp_path: Path) -> None:
    files = [tmp_path / "full.qcow2", tmp_path / "incr.qcow2"]
    spec = layered_spec(files, encrypted=True)
    assert spec["file"]["filename"] == str(files[1]) and spec["backing"]["file"]["filename"] == str(files[0])
    assert spec["encrypt.key-secret"] == spec["backing"]["encrypt.key-secret"] == "key"
    assert spec["backing"]["backing"] is None
    assert "encrypt.key-secret" not in layered_spec(files)
