"""Request checks in csi_qsd.validate: IDs, names, paths (with real symlinks) and mount flags."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from csi_qsd import validate
from csi_qsd.errors import InvalidArgument, NotFound

# IDs ---------------------------------------------------------------------


def test_new_ids_match_their_patterns_and_differ() -> None:
    volumes = {validate.new_volume_id() for _ in range(200)}
    snapshots = {validate.new_snapshot_id() for _ in range(200)}
    assert len(volumes) == 200 and len(snapshots) == 200
    assert all(validate.VOLUME_ID_RE.match(v) for v in volumes)
    assert all(validate.SNAPSHOT_ID_RE.match(s) for s in snapshots)
    assert all(validate.volume_id(v) == v for v in volumes)


def test_empty_volume_id_is_invalid_argument_naming_the_field() -> None:
    with pytest.raises(InvalidArgument, match="source_volume_id is required"):
        validate.volume_id("", "source_volume_id")


@pytest.mark.parametrize("value", [
    "vol-", "vol-123", "vol-" + "a" * 23, "vol-" + "a" * 25, "vol-" + "A" * 24, "vol-" + "g" * 24,
    "VOL-" + "a" * 24, "snap-" + "a" * 24, " vol-" + "a" * 24, "vol-" + "a" * 24 + "\n",
    "../vol-" + "a" * 24, "vol-" + "a" * 23 + "/", "pvc-0b5f", "x" * 5000,
])
def test_malformed_volume_id_is_not_found_naming_the_value(value: str) -> None:
    with pytest.raises(NotFound) as info:
        validate.volume_id(value)
    assert repr(value)[:40] in str(info.value)


@pytest.mark.parametrize("value", ["", "snap-1", "vol-" + "a" * 24, "snap-" + "a" * 24 + "0"])
def test_snapshot_id(value: str) -> None:
    with pytest.raises(InvalidArgument if not value else NotFound):
        validate.snapshot_id(value)


# names -------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    "pvc-0b5f9c1e-6a4f-4c61-8bde-3f1f0e8b7c2a", "a", "A.b_c:d-e", "9" * 128,
])
def test_good_names(value: str) -> None:
    assert validate.name(value) == value


@pytest.mark.parametrize("value", [
    "-leading-dash", ".hidden", "_x", "has space", "slash/inside", "../up", "tab\tx", "nul\x00x",
    "ünïcode", "a" * 129, "semi;colon", "new\nline",
])
def test_bad_names_name_the_field_and_value(value: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate.name(value, "name")
    assert "name" in str(info.value) and repr(value) in str(info.value)


def test_empty_name_is_required() -> None:
    with pytest.raises(InvalidArgument, match="name is required"):
        validate.name("")


# paths -------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(root, state dir, outside) as siblings, like the harness's sandbox."""
    root, state, outside = tmp_path / "kubelet", tmp_path / "state", tmp_path / "outside"
    for directory in (root / "pods" / "p1", state, outside):
        directory.mkdir(parents=True)
    return root, state, outside


def check(value: str, root: Path, *forbidden: Path) -> Path:
    return validate.request_path(value, "target_path", root=root, forbidden=forbidden)


def test_paths_below_the_root_are_accepted_as_written(tree: tuple[Path, Path, Path]) -> None:
    root, state, _ = tree
    for value in (f"{root}/pods/p1/volume", f"{root}/pods/p1", f"{root}/not/yet/created/at/all"):
        assert check(value, root, state) == Path(value)


def test_symlink_inside_the_root_to_elsewhere_inside_is_accepted(tree: tuple[Path, Path, Path]) -> None:
    root, state, _ = tree
    (root / "alias").symlink_to(root / "pods")
    assert check(f"{root}/alias/p1/volume", root, state) == root / "alias" / "p1" / "volume"


@pytest.mark.parametrize("make, needle", [
    (lambda r: "", "target_path is required"),
    (lambda r: "pods/p1/volume", "must be an absolute path"),
    (lambda r: f"{r}/pods/../pods/p1", "must be normalised"),
    (lambda r: f"{r}/pods/./p1", "must be normalised"),
    (lambda r: f"{r}//pods/p1", "must be normalised"),
    (lambda r: f"{r}/pods/p1/", "must be normalised"),
    (lambda r: f"{r}/..", "must be normalised"),
    (lambda r: f"{r}/pods/p1\x00/x", "NUL"),
    (lambda r: f"{r}/" + "a" * 5000, "too long"),
    (lambda r: f"{r}-sibling/pods", "outside the allowed root"),
    (lambda r: "/etc/passwd", "outside the allowed root"),
    (lambda r: "/", "outside the allowed root"),
    (lambda r: f"/{r}/pods", "outside the allowed root"),  # '//tmp/…' survives normpath on POSIX
    (lambda r: str(r), "the allowed root itself"),
])
def test_malformed_or_outside_paths_are_rejected_naming_the_field(
    tree: tuple[Path, Path, Path], make: Callable[[Path], str], needle: str
) -> None:
    root, state, _ = tree
    value = make(root)
    with pytest.raises(InvalidArgument) as info:
        check(value, root, state)
    message = str(info.value)
    assert "target_path" in message and needle in message
    if value and "\x00" not in value and len(value) < 1000:
        assert repr(value) in message


def test_symlink_escaping_the_root_is_rejected(tree: tuple[Path, Path, Path]) -> None:
    root, state, outside = tree
    (root / "pods" / "evil").symlink_to(outside)
    with pytest.raises(InvalidArgument, match="resolves to .*outside.*not below"):
        check(f"{root}/pods/evil/volume", root, state)
    with pytest.raises(InvalidArgument, match="resolves to"):
        check(f"{root}/pods/evil", root, state)


def test_relative_symlink_escaping_the_root_is_rejected(tree: tuple[Path, Path, Path]) -> None:
    root, state, _ = tree
    (root / "pods" / "up").symlink_to("../../outside")
    with pytest.raises(InvalidArgument, match="resolves to"):
        check(f"{root}/pods/up/x", root, state)


def test_dangling_symlink_pointing_outside_is_rejected(tree: tuple[Path, Path, Path]) -> None:
    """A dangling last component: mkdir/touch/mount through it would create the outside target."""
    root, state, outside = tree
    (root / "pods" / "p1" / "volume").symlink_to(outside / "not-yet")
    with pytest.raises(InvalidArgument, match="resolves to"):
        check(f"{root}/pods/p1/volume", root, state)
    assert not (outside / "not-yet").exists()


def test_symlink_to_the_root_itself_is_rejected(tree: tuple[Path, Path, Path]) -> None:
    root, state, _ = tree
    (root / "pods" / "top").symlink_to(root)
    with pytest.raises(InvalidArgument, match="not below"):
        check(f"{root}/pods/top", root, state)


def test_symlink_loop_is_invalid_argument_not_a_crash(tree: tuple[Path, Path, Path]) -> None:
    root, state, _ = tree
    (root / "l1").symlink_to(root / "l2")
    (root / "l2").symlink_to(root / "l1")
    with pytest.raises(InvalidArgument, match="cannot be resolved"):
        check(f"{root}/l1/volume", root, state)


def test_paths_into_or_above_forbidden_directories_are_rejected(tmp_path: Path) -> None:
    """With the state dir inside the root, neither it, anything in it, nor a parent of it may be used."""
    root = tmp_path / "kubelet"
    state = root / "plugins" / "csi-qsd"
    pool = tmp_path / "elsewhere" / "pool"
    state.mkdir(parents=True)
    for value in (str(state), f"{state}/exports/x", f"{root}/plugins"):
        with pytest.raises(InvalidArgument, match="overlaps the driver's own directory"):
            check(value, root, state, pool)
    (root / "pods").mkdir()
    (root / "pods" / "sneaky").symlink_to(state)
    with pytest.raises(InvalidArgument, match="overlaps"):
        check(f"{root}/pods/sneaky/x", root, state, pool)
    assert check(f"{root}/plugins/other-driver/x", root, state, pool)


def test_request_path_touches_nothing(tree: tuple[Path, Path, Path]) -> None:
    root, state, outside = tree
    (root / "pods" / "evil").symlink_to(outside)
    before = sorted(os.walk(outside)), os.stat(outside).st_mtime_ns
    for value in (f"{root}/pods/evil/a/b", f"{root}/pods/p1/new/deep/path"):
        try:
            check(value, root, state)
        except InvalidArgument:
            pass
    assert (sorted(os.walk(outside)), os.stat(outside).st_mtime_ns) == before
    assert not (root / "pods" / "p1" / "new").exists()


# mount flags -------------------------------------------------------------


@pytest.mark.parametrize("flags", [[], ["ro"], ["noatime", "nodiratime", "discard"], ["commit=60", "data=ordered"],
                                   ["context=system_u:object_r:container_file_t:s0"], ["uid=1000", "x-gvfs-hide"]])
def test_good_mount_flags_pass_through(flags: list[str]) -> None:
    assert validate.mount_flags(flags) == flags


@pytest.mark.parametrize("flag", ["bind", "rbind", "remount", "move", "loop", "defaults", "loop=0",
                                  "bind=x"])
def test_forbidden_mount_flags_are_named(flag: str) -> None:
    with pytest.raises(InvalidArgument, match="not allowed") as info:
        validate.mount_flags(["noatime", flag])
    assert repr(flag) in str(info.value)


@pytest.mark.parametrize("flag", ["", "ro,bind", "a b", "-o", "=x", "x;reboot", "ro\n", "$(id)", "a" * 200,
                                  "über", "x\x00y", "`id`", "ro,"])
def test_malformed_mount_flags_are_named(flag: str) -> None:
    with pytest.raises(InvalidArgument, match="malformed") as info:
        validate.mount_flags([flag])
    assert repr(flag) in str(info.value)


def test_ids_end_at_the_end_of_the_string_not_before_a_newline() -> None:
    """`$` also matches before a trailing newline; every ID pattern must use \\Z."""
    for pattern, good in ((validate.VOLUME_ID_RE, "vol-" + "a" * 24), (validate.SNAPSHOT_ID_RE, "snap-" + "a" * 24),
                          (validate.GROUP_ID_RE, "group-" + "a" * 24)):
        assert pattern.match(good)
        assert not pattern.match(good + "\n"), pattern.pattern
