#!/usr/bin/env bash
# Install everything, then run the whole test suite: type checks, unit, integration, e2e.
# Integration and e2e tests need root (mounts, loop devices, FUSE) and boot a real guest.
# The suite runs on the QEMU 10 the install provides; the lifecycle and integrity tests run
# a second time on the host's own QSD (7.2 on Debian 12), which must stay supported on the
# safe buffered data path.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m mypy
.venv/bin/python -m ruff check csi_qsd tests e2e scripts
.venv/bin/python -m pytest -p no:cacheprovider -ra "$@"
if [ "$#" -eq 0 ] && [ -x /usr/bin/qemu-storage-daemon ]; then
  echo "== again on the host's $(/usr/bin/qemu-storage-daemon --version | head -1)"
  CSI_QSD_HOST_QEMU=1 .venv/bin/python -m pytest -p no:cacheprovider -ra \
    tests/integration/test_lifecycle.py tests/integration/test_integrity.py
fi
