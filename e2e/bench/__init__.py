"""Benchmarks: each prints its figures beside baselines measured in the same run.

Run them as modules (`python -m e2e.bench.control_plane`); they are not
tests and pytest does not collect them.

What they share, one job a module: `sizes`; `latencies` (percentiles, a
p50/p99/max summary); `process_usage` (memory, CPU per thread, file
descriptors from /proc); `report_tables` (ratios, tables, a check's
verdict); `shell` (host commands); `fio`; `loop_devices` (the baselines'
loop devices and filesystems); `staged_volumes` (volumes staged and
published through CSI); `served_bench` (the skeleton of a bench against
`csi-qsd serve`); `blkio_client` and `device_pool`.

They use the QEMU tools the install put into the venv (QEMU >= 10.0.8 on a
Debian 12 host) unless CSI_QSD_HOST_QEMU=1 asks for the host's own.
"""

import os
import sys
from pathlib import Path

if os.environ.get("CSI_QSD_HOST_QEMU") == "1":
    os.environ.setdefault("CSI_QSD_QSD_BINARY", "/usr/bin/qemu-storage-daemon")
    os.environ.setdefault("CSI_QSD_QEMU_IMG", "/usr/bin/qemu-img")
else:
    os.environ["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
