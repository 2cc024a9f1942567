#!/usr/bin/env bash
# Install everything, then run the whole test suite: type checks, unit, integration, e2e.
# Integration and e2e tests need root (mounts, loop devices, FUSE) and boot a real guest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m mypy
.venv/bin/python -m ruff check csi_qsd tests e2e scripts
exec .venv/bin/python -m pytest -p no:cacheprovider -ra "$@"
