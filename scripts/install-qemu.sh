#!/usr/bin/env bash
# Provide qemu-storage-daemon and qemu-img >= 10.0.8 on a Debian 12 host without touching the host's QEMU.
#
# Debian 12's QEMU 7.2 has a FUSE export that corrupts parallel writes; Debian 13's 10.0.13 carries the
# fix. Its packages are unpacked with mmdebstrap into .runtime/qemu and run with their own loader and
# libraries; wrappers named like the tools go into the venv's bin directory, where csi-qsd looks first.
# qemu-block-extra brings libblkio's virtio-blk-vhost-user driver: the benches' userspace vhost-user-blk
# client (qemu-img bench on a VM volume's socket).
# On a host whose own QEMU is new enough (a Debian 13 image), nothing is done.
# Usage: install-qemu.sh VENV_BIN_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$1"
ROOT="$PWD/.runtime/qemu"
SUITE="${CSI_QSD_QEMU_SUITE:-trixie}"
TOOLS=(qemu-storage-daemon qemu-img qemu-io qemu-nbd)

host_version() {
  command -v /usr/bin/qemu-storage-daemon >/dev/null 2>&1 || { echo 0; return; }
  /usr/bin/qemu-storage-daemon --version | sed -n '1s/.*version \([0-9.]*\).*/\1/p'
}

if dpkg --compare-versions "$(host_version)" ge 10.0.8; then
  for tool in "${TOOLS[@]}"; do rm -f "$BIN/$tool"; done
  echo "qemu: the host's own $(host_version) is new enough"
  exit 0
fi

if [ ! -x "$ROOT/usr/bin/qemu-storage-daemon" ] || [ ! -e "$ROOT/usr/lib/x86_64-linux-gnu/qemu/block-blkio.so" ]; then
  if ! command -v mmdebstrap >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive ${SUDO:-} apt-get install -y -q --no-install-recommends mmdebstrap
  fi
  echo "qemu: unpacking Debian ${SUITE}'s qemu-utils and qemu-block-extra into $ROOT"
  rm -rf "$ROOT.tmp"
  mkdir -p "$(dirname "$ROOT")"
  mmdebstrap --quiet --variant=apt --include=qemu-utils,qemu-block-extra "$SUITE" "$ROOT.tmp"
  rm -rf "$ROOT"
  mv "$ROOT.tmp" "$ROOT"
fi

LIBS="$ROOT/usr/lib/x86_64-linux-gnu:$ROOT/lib/x86_64-linux-gnu"
for tool in "${TOOLS[@]}"; do
  cat > "$BIN/$tool.tmp" <<WRAPPER
#!/bin/sh
# $tool from Debian ${SUITE}, run with its own loader and libraries (scripts/install-qemu.sh).
QEMU_MODULE_DIR="$ROOT/usr/lib/x86_64-linux-gnu/qemu" exec "$ROOT/lib64/ld-linux-x86-64.so.2" \\
  --argv0 "\$0" --library-path "$LIBS" "$ROOT/usr/bin/$tool" "\$@"
WRAPPER
  chmod 0755 "$BIN/$tool.tmp"
  mv "$BIN/$tool.tmp" "$BIN/$tool"
done
echo "qemu: $("$BIN/qemu-storage-daemon" --version | head -1)"
