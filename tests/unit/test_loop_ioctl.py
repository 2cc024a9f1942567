"""The LOOP_CONFIGURE argument laid out as the kernel's struct loop_config (include/uapi/linux/loop.h)."""

from __future__ import annotations

import struct

from csi_qsd.sys import loop_ioctl


def test_loop_config_matches_the_kernel_layout() -> None:
    raw = loop_ioctl.config(7, loop_ioctl.LO_FLAGS_READ_ONLY | loop_ioctl.LO_FLAGS_DIRECT_IO, "/x/export")
    assert len(raw) == 304  # 4 + 4 + sizeof(struct loop_info64) 232 + 8 * 8
    assert struct.unpack_from("=II", raw, 0) == (7, 0)  # fd, block_size (0: the backing file's)
    assert struct.unpack_from("=I", raw, 8 + 5 * 8 + 3 * 4)[0] == 17  # info.lo_flags
    assert raw[64:64 + 10] == b"/x/export\0"  # info.lo_file_name


def test_a_long_name_is_cut_to_fit_with_its_terminator() -> None:
    raw = loop_ioctl.config(3, 0, "/" + "a" * 200)
    assert raw[64 + 63] == 0 and raw[64:64 + 63] == b"/" + b"a" * 62
