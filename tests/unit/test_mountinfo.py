"""sys.mounts.parse_mountinfo: /proc/self/mountinfo as the kernel writes it, escapes included.

The kernel escapes space, tab, newline and backslash in paths as 3-digit
octal (\\040, \\011, \\012, \\134); see proc(5) and fs/proc_namespace.c.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from csi_qsd.sys import mounts

# proc(5)'s example line, then real ones with zero, one and two optional fields.
SAMPLE = """\
36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
120 22 7:3 / /var/lib/kubelet/plugins/staging/pv1 ro,nosuid,nodev - xfs /dev/loop3 ro,attr2,inode64
130 22 7:3 / /var/lib/kubelet/pods/p1/volume rw,relatime shared:77 master:12 - xfs /dev/loop3 rw,attr2
"""


def test_fields() -> None:
    entries = mounts.parse_mountinfo(SAMPLE)
    assert [e.mount_point for e in entries] == [
        Path("/mnt2"), Path("/"), Path("/var/lib/kubelet/plugins/staging/pv1"), Path("/var/lib/kubelet/pods/p1/volume"),
    ]
    first = entries[0]
    assert first.root == "/mnt1" and first.fs_type == "ext3" and first.source == "/dev/root"
    assert first.major_minor == "98:0"
    assert first.options == frozenset({"rw", "noatime"})  # per-mount options, not the superblock's
    assert "errors=continue" not in first.options
    assert entries[3].fs_type == "xfs" and entries[3].source == "/dev/loop3"


def test_readonly_comes_from_the_mount_options() -> None:
    entries = mounts.parse_mountinfo(SAMPLE)
    assert [e.readonly for e in entries] == [False, False, True, False]


@pytest.mark.parametrize("escaped, plain", [
    (r"/mnt/with\040space", "/mnt/with space"),
    (r"/mnt/tab\011here", "/mnt/tab\there"),
    (r"/mnt/new\012line", "/mnt/new\nline"),
    (r"/mnt/back\134slash", "/mnt/back\\slash"),
    (r"/mnt/a\040-\040b", "/mnt/a - b"),  # the field separator, escaped inside a path
    (r"/mnt/\040\040lead", "/mnt/  lead"),
    (r"/mnt/end\040", "/mnt/end "),
    (r"/mnt/back\134089", "/mnt/back\\089"),  # an escaped backslash followed by digits stays literal
    (r"/mnt/x\9", "/mnt/x\\9"),  # not an escape: fewer than three digits
    (r"/mnt/x\ab", "/mnt/x\\ab"),
    ("/mnt/ünïcode", "/mnt/ünïcode"),
])
def test_escapes_are_decoded_in_every_path_field(escaped: str, plain: str) -> None:
    line = f"40 22 7:1 {escaped} {escaped} rw shared:3 - ext4 {escaped} rw\n"
    (entry,) = mounts.parse_mountinfo(line)
    assert entry.mount_point == Path(plain)
    assert entry.root == plain and entry.source == plain


def test_separator_is_found_with_an_escaped_dash_in_the_mount_point() -> None:
    (entry,) = mounts.parse_mountinfo(r"40 22 0:50 / /tmp/x\040-\040y rw,nosuid - tmpfs tmp\040fs rw,size=4k" + "\n")
    assert entry.mount_point == Path("/tmp/x - y") and entry.fs_type == "tmpfs" and entry.source == "tmp fs"


@pytest.mark.parametrize("text", ["", "\n", "garbage\n", "1 2 3 4 5\n", "1 2 3:4 / /x rw - \n", "1 2 3:4 / /x rw\n"])
def test_short_or_malformed_lines_are_skipped(text: str) -> None:
    assert mounts.parse_mountinfo(text) == []


def test_malformed_lines_do_not_hide_good_ones() -> None:
    text = "garbage\n" + SAMPLE + "1 2\n"
    assert len(mounts.parse_mountinfo(text)) == 4


def test_this_process_mount_table_parses() -> None:
    entries = mounts.mount_table()
    assert any(e.mount_point == Path("/") for e in entries)
    assert all(e.mount_point.is_absolute() and ":" in e.major_minor for e in entries)


def test_mounted_at_returns_the_topmost_of_stacked_mounts(monkeypatch: pytest.MonkeyPatch) -> None:
    stacked = (
        "50 22 7:1 / /k/t rw - ext4 /dev/loop1 rw\n"
        "51 50 7:2 / /k/t ro - xfs /dev/loop2 ro\n"
        "52 22 7:3 / /k/t2 rw - xfs /dev/loop3 rw\n"
    )
    monkeypatch.setattr(mounts, "read_mountinfo", lambda: stacked)
    monkeypatch.setattr(mounts.mount_calls, "is_mount_root", lambda path: None)  # the table alone decides
    top = mounts.mounted_at(Path("/k/t"))
    assert top is not None and top.source == "/dev/loop2" and top.readonly
    assert mounts.mounted_at(Path("/k")) is None
    assert mounts.mounted_at(Path("/k/t/sub")) is None


def test_filesystem_of_is_the_deepest_mount_above_the_path() -> None:
    table = mounts.parse_mountinfo(SAMPLE)
    assert mounts.filesystem_of(Path("/var/lib/kubelet/plugins/staging/pv1/images"), table) == "xfs"
    assert mounts.filesystem_of(Path("/var/lib/kubelet/plugins/staging/pv10"), table) == "ext4"  # a sibling, not under it
    assert mounts.filesystem_of(Path("/mnt2/pool"), table) == "ext3"


def test_filesystem_of_takes_the_last_of_stacked_mounts() -> None:
    stacked = SAMPLE + "140 36 0:52 / /mnt2 rw - tmpfs tmpfs rw\n"
    assert mounts.filesystem_of(Path("/mnt2/pool"), mounts.parse_mountinfo(stacked)) == "tmpfs"


def test_filesystem_of_is_empty_outside_every_listed_mount() -> None:
    assert mounts.filesystem_of(Path("/srv/pool"), mounts.parse_mountinfo(SAMPLE.splitlines()[0])) == ""
