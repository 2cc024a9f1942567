#!/usr/bin/env bash
# Install everything, then run the whole test suite: type checks, unit, integration, e2e.
# Integration and e2e tests need root (mounts, loop devices, FUSE) and boot a real guest.
# The suite runs on the QEMU 11 the install provides by default; the lifecycle, integrity and
# expansion tests run again on its QEMU 10, and the lifecycle and integrity tests on the host's
# own QSD (7.2 on Debian 12), which must stay supported on the safe buffered data path.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# What the cluster tier builds from Go modules (Kubernetes, etcd, the sidecars, their scratch images) is
# built in the background while the tests that mostly wait run; the tier waits for it (a lock on the
# cache). Its podman images come after: a RUN step's mount namespace would hold the tests' mounts.
mkdir -p .runtime
# Every pass appends the tiers it skipped (testing/tiers.py); outside CI they are said again, one line each, at the
# very end (in CI a missing tool fails its tier; CI's last line stays pytest's own).
export CSI_QSD_SKIPPED_TIERS="$PWD/.runtime/skipped-tiers"
: > "$CSI_QSD_SKIPPED_TIERS"
BUILD=""
finish() {
  if [ -n "$BUILD" ]; then kill -- -"$BUILD" 2>/dev/null || true; fi
  if [ "${CI:-}" != true ] && [ -s "$CSI_QSD_SKIPPED_TIERS" ]; then echo "== tiers skipped in this run"; cat "$CSI_QSD_SKIPPED_TIERS"; fi
}
trap finish EXIT
if [ "$#" -eq 0 ] && command -v go >/dev/null 2>&1; then
  setsid nice -n 10 .venv/bin/python -m testing.cluster.build --from-modules > .runtime/cluster-build.log 2>&1 &
  BUILD=$!
  echo "cluster tier: building in the background (.runtime/cluster-build.log)"
fi
.venv/bin/python -m mypy
.venv/bin/python -m ruff check csi_qsd testing tests e2e scripts
# The slowest tests are listed at the end: what to look at first when the run nears its time budget.
.venv/bin/python -m pytest -p no:cacheprovider -ra --durations=30 "$@"
if [ "$#" -eq 0 ] && [ -x .venv/bin/qemu-storage-daemon-10 ] && \
    [ "$(readlink .venv/bin/qemu-storage-daemon)" != qemu-storage-daemon-10 ]; then
  echo "== again on $(.venv/bin/qemu-storage-daemon-10 --version | head -1)"
  CSI_QSD_QSD_BINARY="$PWD/.venv/bin/qemu-storage-daemon-10" CSI_QSD_QEMU_IMG="$PWD/.venv/bin/qemu-img-10" \
    .venv/bin/python -m pytest -p no:cacheprovider -ra \
    tests/integration/test_lifecycle.py tests/integration/test_integrity.py tests/integration/test_expansion.py
fi
if [ "$#" -eq 0 ] && [ -x /usr/bin/qemu-storage-daemon ]; then
  echo "== again on the host's $(/usr/bin/qemu-storage-daemon --version | head -1)"
  CSI_QSD_HOST_QEMU=1 .venv/bin/python -m pytest -p no:cacheprovider -ra \
    tests/integration/test_lifecycle.py tests/integration/test_integrity.py
fi
