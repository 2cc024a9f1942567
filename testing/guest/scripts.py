"""Guest shell snippets for block I/O jobs, plus the host-side view of their output.

The guest userland is busybox 1.35, whose ``dd`` supports ``iflag=direct`` /
``oflag=direct`` (O_DIRECT) and ``conv=fsync``; with ``bs=1M`` it issues one
aligned 1 MiB request per block, which is what these helpers rely on.

Data pattern: every 512-byte sector of block ``index`` is one text record,
``"csi-qsd seed=<seed> block=<index> sector=<n>\\n"`` padded with a letter
that depends on (seed, index, n) and ended by ``"\\n"``. Every sector on the
disk is therefore unique and self-describing (a misdirected, stale, torn or
zeroed sector is detectable and readable in a hex dump), the host computes it
with :func:`pattern_block`, and the guest generates the same bytes with one
busybox ``awk`` call per block, so no payload has to be shipped in the initrd.

Console protocol (one line per event; ``dev=`` names the guest device):

* ``WROTE <block> dev=<dev>``: the block's O_DIRECT write and the following
  fsync (a device cache flush) both completed, i.e. the write was acknowledged;
* ``WRITE_ERROR <block> dev=<dev> <dd message>``;
* ``WRITE_SUMMARY dev=<dev> wrote=<n> errors=<n>``;
* ``READ_ERROR <block> dev=<dev> <dd message>`` / ``MISMATCH <block> dev=<dev>``;
* ``VERIFY_SUMMARY dev=<dev> ok=<n> mismatch=<n> ioerrors=<n>``;
* ``IOSTAT dev=<dev> read_sectors=<n> write_sectors=<n>``: device counters;
* ``KERNEL_IO_ERRORS <n>``: ``I/O error`` lines in the guest kernel log;
* ``FAILURES <n>``: total of the above errors, printed by :func:`guest_script`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

BLOCK_SIZE = 1024 * 1024
SECTOR_SIZE = 512
_MAX_ID = 2**31 - 1  # keeps awk's double arithmetic and number printing exact

_PATTERN_AWK = r"""
BEGIN {
    letters = "abcdefghijklmnopqrstuvwxyz"
    for (i = 0; i < 26; i++) {
        f = substr(letters, i + 1, 1)
        while (length(f) < 512) f = f f
        fill[i] = f
    }
    for (s = 0; s < n; s++) {
        h = "csi-qsd seed=" seed " block=" blk " sector=" s "\n"
        printf "%s%s\n", h, substr(fill[(seed + blk + s) % 26], 1, 511 - length(h))
    }
}
"""

# Shell functions shared by the snippets. `failures` accumulates every error
# so that guest_script() can turn it into the script's exit status.
_FUNCTIONS = f"""
failures=${{failures:-0}}
csi_qsd_pattern() {{ # seed block sectors > file
    awk -v seed="$1" -v blk="$2" -v n="$3" '{_PATTERN_AWK}'
}}
csi_qsd_write_pattern() {{ # dev seed first count bs
    _dev=$1; _seed=$2; _i=$3; _end=$(($3 + $4)); _bs=$5; _ok=0; _err=0
    while [ "$_i" -lt "$_end" ]; do
        csi_qsd_pattern "$_seed" "$_i" $((_bs / {SECTOR_SIZE})) > /tmp/csi_qsd_blk
        if dd if=/tmp/csi_qsd_blk of="$_dev" bs="$_bs" seek="$_i" count=1 \\
                oflag=direct conv=notrunc,fsync 2>/tmp/csi_qsd_dd; then
            echo "WROTE $_i dev=$_dev"; _ok=$((_ok + 1))
        else
            echo "WRITE_ERROR $_i dev=$_dev $(tr '\\n' ' ' < /tmp/csi_qsd_dd)"; _err=$((_err + 1))
        fi
        _i=$((_i + 1))
    done
    echo "WRITE_SUMMARY dev=$_dev wrote=$_ok errors=$_err"
    failures=$((failures + _err))
}}
csi_qsd_verify_pattern() {{ # dev seed first count bs
    _dev=$1; _seed=$2; _i=$3; _end=$(($3 + $4)); _bs=$5; _ok=0; _bad=0; _err=0
    while [ "$_i" -lt "$_end" ]; do
        if dd if="$_dev" of=/tmp/csi_qsd_rd bs="$_bs" skip="$_i" count=1 \\
                iflag=direct 2>/tmp/csi_qsd_dd; then
            csi_qsd_pattern "$_seed" "$_i" $((_bs / {SECTOR_SIZE})) > /tmp/csi_qsd_blk
            if cmp -s /tmp/csi_qsd_blk /tmp/csi_qsd_rd; then
                _ok=$((_ok + 1))
            else
                echo "MISMATCH $_i dev=$_dev"; _bad=$((_bad + 1))
            fi
        else
            echo "READ_ERROR $_i dev=$_dev $(tr '\\n' ' ' < /tmp/csi_qsd_dd)"; _err=$((_err + 1))
        fi
        _i=$((_i + 1))
    done
    echo "VERIFY_SUMMARY dev=$_dev ok=$_ok mismatch=$_bad ioerrors=$_err"
    failures=$((failures + _bad + _err))
}}
"""


def _check_ids(seed: int, *numbers: int) -> None:
    for value in (seed, *numbers):
        if not 0 <= value <= _MAX_ID:
            raise ValueError(f"pattern ids must be in [0, {_MAX_ID}], got {value}")


def _check_size(size: int) -> None:
    if size <= 0 or size % SECTOR_SIZE:
        raise ValueError(f"block size must be a positive multiple of {SECTOR_SIZE}")


def pattern_block(seed: int, index: int, size: int = BLOCK_SIZE) -> bytes:
    """The bytes the guest writes as block ``index`` for ``seed`` (see module doc)."""
    _check_ids(seed, index)
    _check_size(size)
    records = []
    for sector in range(size // SECTOR_SIZE):
        header = f"csi-qsd seed={seed} block={index} sector={sector}\n".encode()
        fill = bytes([ord("a") + (seed + index + sector) % 26])
        records.append(header + fill * (SECTOR_SIZE - 1 - len(header)) + b"\n")
    return b"".join(records)


def write_pattern(device: str, seed: int, blocks: int, *, start: int = 0, block_size: int = BLOCK_SIZE) -> str:
    """Shell text writing blocks ``start..start+blocks-1`` with O_DIRECT + fsync each."""
    _check_ids(seed, start, blocks)
    _check_size(block_size)
    return _FUNCTIONS + (
        f"csi_qsd_write_pattern {shlex.quote(device)} {seed} {start} {blocks} {block_size}\n"
    )


def verify_pattern(device: str, seed: int, blocks: int, *, start: int = 0, block_size: int = BLOCK_SIZE) -> str:
    """Shell text reading the blocks back with O_DIRECT and comparing with the pattern."""
    _check_ids(seed, start, blocks)
    _check_size(block_size)
    return _FUNCTIONS + (
        f"csi_qsd_verify_pattern {shlex.quote(device)} {seed} {start} {blocks} {block_size}\n"
    )


def count_kernel_io_errors() -> str:
    """Shell text printing how many ``I/O error`` lines the guest kernel logged."""
    return 'echo "KERNEL_IO_ERRORS $(dmesg | grep -c \'I/O error\')"\n'


def device_stats(device: str) -> str:
    """Shell text printing ``IOSTAT dev=<dev> read_sectors=<n> write_sectors=<n>``.

    Lets a test prove I/O really reached the device: busybox dd silently
    retries *without* O_DIRECT when a direct transfer fails with EINVAL
    (misaligned size or offset), so "dd oflag=direct succeeded" alone does
    not prove the page cache was bypassed.
    """
    name = shlex.quote(device.rsplit("/", 1)[-1])
    return (
        f"read _r1 _r2 _rs _r4 _w1 _w2 _ws _rest < /sys/block/{name}/stat\n"
        f'echo "IOSTAT dev={device} read_sectors=$_rs write_sectors=$_ws"\n'
    )


def guest_script(*snippets: str) -> str:
    """Joins snippets into a ``/run.sh`` that exits non-zero if any of them counted an error."""
    body = "".join(s if s.endswith("\n") else s + "\n" for s in snippets)
    return "failures=0\n" + body + 'echo "FAILURES $failures"\n[ "$failures" -eq 0 ]\n'


# --- host-side parsing of the console protocol -------------------------------

_WROTE = re.compile(r"^WROTE (\d+) dev=(\S+)")
_VERIFY = re.compile(r"^VERIFY_SUMMARY dev=(\S+) ok=(\d+) mismatch=(\d+) ioerrors=(\d+)")
_WRITE = re.compile(r"^WRITE_SUMMARY dev=(\S+) wrote=(\d+) errors=(\d+)")
_IOSTAT = re.compile(r"^IOSTAT dev=(\S+) read_sectors=(\d+) write_sectors=(\d+)")


@dataclass(frozen=True)
class WriteSummary:
    device: str
    wrote: int
    errors: int


@dataclass(frozen=True)
class VerifySummary:
    device: str
    ok: int
    mismatch: int
    ioerrors: int


def acknowledged_blocks(output: str, device: str | None = None) -> list[int]:
    """Block indexes with a ``WROTE`` line (optionally only for ``device``), in order."""
    acked = []
    for line in output.splitlines():
        m = _WROTE.match(line.strip())
        if m and (device is None or m.group(2) == device):
            acked.append(int(m.group(1)))
    return acked


def write_summaries(output: str) -> list[WriteSummary]:
    return [
        WriteSummary(m.group(1), int(m.group(2)), int(m.group(3)))
        for line in output.splitlines()
        if (m := _WRITE.match(line.strip()))
    ]


def verify_summaries(output: str) -> list[VerifySummary]:
    return [
        VerifySummary(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))
        for line in output.splitlines()
        if (m := _VERIFY.match(line.strip()))
    ]


def device_stat_samples(output: str, device: str) -> list[tuple[int, int]]:
    """(read_sectors, write_sectors) of each ``IOSTAT`` line for ``device``, in order."""
    return [
        (int(m.group(2)), int(m.group(3)))
        for line in output.splitlines()
        if (m := _IOSTAT.match(line.strip())) and m.group(1) == device
    ]
