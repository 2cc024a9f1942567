#!/usr/bin/env bash
# Try csi-qsd in a one-node Kubernetes cluster on this machine, as root (README.md, "Try it").
#
#   scripts/cluster.sh up        install what it needs (scripts/install.sh), build Kubernetes, etcd, the
#                                sidecars and the images (first run only; later runs reuse ~/.cache/csi-qsd),
#                                start the cluster, deploy csi-qsd with `kubectl apply -k`, print KUBECONFIG
#   scripts/cluster.sh status    whether it is up, and the commands to use it
#   scripts/cluster.sh example NAME
#                                deploy/examples/NAME as this cluster runs it (the QEMU one: QEMU image
#                                built here, TCG instead of KVM); pipe it to `kubectl apply -f -`
#   scripts/cluster.sh down      delete every volume, stop everything, check that nothing is left
#
# State (kubeconfig, logs, the node's directories) lives in $CSI_QSD_TRY_DIR, default /var/tmp/csi-qsd-try.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = up ] && [ -z "${CSI_QSD_SKIP_INSTALL:-}" ]; then
  bash scripts/install.sh
fi
exec .venv/bin/python -m testing.cluster.up "$@"
