"""Benchmarks: each prints its figures beside baselines measured in the same run.

Run them as modules (`python -m e2e.bench.control_plane`); they are not
tests and pytest does not collect them.

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
