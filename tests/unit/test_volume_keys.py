"""Keys of staged encrypted volumes: files of mode 0600 in a 0700 directory, never printed, dropped when unstaged."""

from __future__ import annotations

import stat
from pathlib import Path

from csi_qsd.params import VolumeParameters
from csi_qsd.qsd import encryption
from csi_qsd.sys.volume_keys import KeyStore, VolumeKey

VOL_A = "vol-" + "a" * 24
VOL_B = "vol-" + "b" * 24


def test_a_key_outlives_the_process_in_its_file_and_goes_when_forgotten(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    KeyStore(directory).put(VOL_A, VolumeKey("pass-a"))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / VOL_A).stat().st_mode) == 0o600
    restarted = KeyStore(directory)  # a driver started again reads what the last one held
    assert restarted.get(VOL_A) == VolumeKey("pass-a") and restarted.get(VOL_B) is None
    restarted.forget(VOL_A)
    assert restarted.get(VOL_A) is None and not (directory / VOL_A).exists()


def test_keys_of_volumes_no_longer_staged_are_removed_at_start(tmp_path: Path) -> None:
    store = KeyStore(tmp_path)
    store.put(VOL_A, VolumeKey("a"))
    store.put(VOL_B, VolumeKey("b"))
    store.keep_only({VOL_B})
    assert sorted(p.name for p in tmp_path.iterdir()) == [VOL_B]


def test_a_key_never_prints_and_goes_to_qemu_as_base64_of_its_text() -> None:
    key = VolumeKey("pässphrase")
    assert "ss" not in repr(key) + str(key) + f"{key!r} {[key]}"
    obj = encryption.secret_object("cq-k", key)
    assert obj == {"qom-type": "secret", "id": "cq-k", "data": "cMOkc3NwaHJhc2U=", "format": "base64"}


def test_every_layer_below_the_top_is_opened_with_the_key_bottom_last(tmp_path: Path) -> None:
    chain = [tmp_path / "vol.2.qcow2", tmp_path / "vol.1.qcow2"]
    spec = encryption.backing_spec(chain, VolumeParameters(), "cq-k", "threads")
    seen = []
    while isinstance(spec, dict):
        assert spec["encrypt"] == {"format": "luks", "key-secret": "cq-k"} and spec["driver"] == "qcow2"
        seen.append(spec["file"]["filename"])
        spec = spec.get("backing")
    assert seen == [str(p) for p in chain]
    assert encryption.backing_spec([], VolumeParameters(), "cq-k", "threads") is None
