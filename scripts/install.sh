#!/usr/bin/env bash
# Install everything csi-qsd needs on Debian 12: system packages, a virtualenv in .venv, the QEMU it
# runs (scripts/install-qemu.sh) and a Go new enough for the cluster tier (scripts/install-go.sh).
# Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

PACKAGES=(
  python3 python3-venv python3-dev
  qemu-system-common qemu-utils qemu-system-x86
  fuse3 e2fsprogs xfsprogs util-linux mount
  fio curl ca-certificates mmdebstrap podman buildah
  tgt
  # the cluster tier (e2e/cluster/): its node's runtime and network, the static pause binary
  # (gcc -static needs libc6-dev), busybox's image from /bin/busybox, the driver image's digest (git)
  containerd runc containernetworking-plugins iptables conntrack iproute2 busybox-static gcc libc6-dev git
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
# The e2e guest is built from Debian's kernel and busybox-static packages with
# `apt-get download`, which needs current package lists.
if [ "${#missing[@]}" -gt 0 ] || ! apt-cache show linux-image-amd64 busybox-static >/dev/null 2>&1; then
  $SUDO apt-get update -q
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing system packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
SUDO="$SUDO" bash scripts/install-qemu.sh .venv/bin
bash scripts/install-go.sh .venv/bin
echo "csi-qsd installed: $(.venv/bin/csi-qsd --version)"
