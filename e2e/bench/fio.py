"""fio jobs on files or devices, one JSON report each: MiB/s for sequential jobs, IOPS for random ones.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from e2e.bench.shell import output
from e2e.bench.sizes import MIB


@dataclasses.dataclass(frozen=True)
class Job:
    """One fio job: its name, I/O pattern, block size and queue depth."""

    name: str
    rw: str
    bs: str
    iodepth: int

    @property
    def sequential(self) -> bool:
        return self.rw in ("read", "write")

    @property
    def writes(self) -> bool:
        return "write" in self.rw

    @property
    def label(self) -> str:
        return f"{self.name} ({'MiB/s' if self.sequential else 'IOPS'})"



async def fio(job: Job, *files: Path, runtime: float = 0, size: int = 0, offset: int = 0,
              extra: Sequence[str] = ()) -> float:
    """`job` on every file at once (O_DIRECT, libaio, a job per file, one report): MiB/s if sequential, else IOPS.

    `runtime` seconds (0: until `size` bytes are done, the whole file if 0),
    from `offset`. Raises HostCommandError if fio fails, RuntimeError if a job did.
    """
    argv = ["fio", "--output-format=json", "--group_reporting", "--direct=1", "--ioengine=libaio",
            f"--rw={job.rw}", f"--bs={job.bs}", f"--iodepth={job.iodepth}", "--randrepeat=0", "--norandommap",
            f"--offset={offset}", *([f"--size={size}"] if size else []), *extra]
    if runtime:
        argv += ["--time_based", f"--runtime={round(runtime * 1000)}ms"]
    for index, path in enumerate(files):
        argv += [f"--name=j{index}", f"--filename={path}"]
    report = json.loads(await output(*argv))["jobs"][0]
    if report.get("error"):
        raise RuntimeError(f"fio {job.name} on {', '.join(map(str, files))} failed with error {report['error']}")
    read, write = report["read"], report["write"]
    if job.sequential:
        return float(read["bw_bytes"] + write["bw_bytes"]) / MIB
    return float(read["iops"] + write["iops"])



LAY_OUT = Job("lay out", "write", "1M", 8)



async def lay_out(path: Path, size: int, offset: int = 0) -> None:
    """Write [offset, offset+size) of `path` once, 1 MiB at a time, and flush: later jobs measure allocated data."""
    await fio(LAY_OUT, path, size=size, offset=offset, extra=["--end_fsync=1"])
