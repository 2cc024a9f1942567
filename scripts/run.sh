#!/usr/bin/env bash
# Install everything, then serve the driver on its embedded default:
# a file pool and catalog under .demo/state, staging/target paths under .demo/kubelet.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
mkdir -p .demo/state .demo/kubelet
exec .venv/bin/csi-qsd serve \
  --state-dir "${CSI_QSD_STATE_DIR:-$PWD/.demo/state}" \
  --target-root "${CSI_QSD_TARGET_ROOT:-$PWD/.demo/kubelet}" \
  --metrics-address "${CSI_QSD_METRICS_ADDRESS:-127.0.0.1:9808}" \
  "$@"
