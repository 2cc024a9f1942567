#!/usr/bin/env bash
# Provide qemu-storage-daemon and qemu-img >= 10.0.8 on a Debian 12 host without touching the host's QEMU,
# and QEMU 11 beside it.
#
# Debian 12's QEMU 7.2 has a FUSE export that corrupts parallel writes; Debian 13's 10.0.13 carries the
# fix. Debian 13's trixie-backports has QEMU 11.1.3, whose vhost-user-blk exports live through VMs coming
# and going in an iothread (10.0.13 aborts there) and whose FUSE export serves from a list of iothreads.
# Each is unpacked with mmdebstrap into its own root (.runtime/qemu: trixie, .runtime/qemu11: trixie with
# trixie-backports preferred) and run with its own loader and libraries. Wrappers go into the venv's bin
# directory, where csi-qsd looks first: `qemu-storage-daemon`, `qemu-img`, ... run the default runtime
# (CSI_QSD_QEMU_RUNTIME, 10 or 11; 11 unless set: its growable FUSE export takes pods' writes about twice as fast,
# docs/benchmarks.md), and `qemu-storage-daemon-10`, `qemu-img-11`, ... name one for the
# benches that measure both. qemu-block-extra brings libblkio's virtio-blk-vhost-user driver: the benches'
# userspace vhost-user-blk client (qemu-img bench on a VM volume's socket).
# On a host whose own QEMU is new enough (a Debian 13 image), its own serves as the 10 runtime.
# Safe to run again: a root that is there is kept (delete it to make it anew).
# Usage: install-qemu.sh VENV_BIN_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$1"
DEFAULT="${CSI_QSD_QEMU_RUNTIME:-11}"
SUITE="${CSI_QSD_QEMU_SUITE:-trixie}"
MIRROR="$(bash scripts/debian-mirror.sh)"
TOOLS=(qemu-storage-daemon qemu-img qemu-io qemu-nbd)

case "$DEFAULT" in 10|11) ;; *) echo "install-qemu: CSI_QSD_QEMU_RUNTIME must be 10 or 11, not $DEFAULT" >&2; exit 2;; esac

host_version() {
  command -v /usr/bin/qemu-storage-daemon >/dev/null 2>&1 || { echo 0; return; }
  /usr/bin/qemu-storage-daemon --version | sed -n '1s/.*version \([0-9.]*\).*/\1/p'
}

# unpack ROOT SUITE [--mmdebstrap-options...] [sources...]: Debian's qemu-utils and qemu-block-extra in ROOT.
# mmdebstrap takes its options first and its sources after the target: SUITE TARGET [MIRROR...].
unpack() {
  local root="$1" suite="$2" options=() sources=()
  shift 2
  for arg in "$@"; do
    case "$arg" in --*) options+=("$arg") ;; *) sources+=("$arg") ;; esac
  done
  if [ -x "$root/usr/bin/qemu-storage-daemon" ] && [ -e "$root/usr/lib/x86_64-linux-gnu/qemu/block-blkio.so" ]; then
    return
  fi
  if ! command -v mmdebstrap >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive ${SUDO:-} apt-get install -y -q --no-install-recommends mmdebstrap
  fi
  echo "qemu: unpacking Debian ${suite}'s qemu-utils and qemu-block-extra into $root"
  rm -rf "$root.tmp"
  mkdir -p "$(dirname "$root")"
  mmdebstrap --quiet --variant=apt --include=qemu-utils,qemu-block-extra "${options[@]}" "$suite" "$root.tmp" \
    "${sources[@]}"
  rm -rf "$root"
  mv "$root.tmp" "$root"
}

# wrap ROOT NAME_SUFFIX LABEL: wrappers for the root's tools, named TOOL + NAME_SUFFIX.
wrap() {
  local root="$1" suffix="$2" label="$3" libs="$1/usr/lib/x86_64-linux-gnu:$1/lib/x86_64-linux-gnu"
  for tool in "${TOOLS[@]}"; do
    cat > "$BIN/$tool$suffix.tmp" <<WRAPPER
#!/bin/sh
# $tool from Debian ${label}, run with its own loader and libraries (scripts/install-qemu.sh).
QEMU_MODULE_DIR="$root/usr/lib/x86_64-linux-gnu/qemu" exec "$root/lib64/ld-linux-x86-64.so.2" \\
  --argv0 "\$0" --library-path "$libs" "$root/usr/bin/$tool" "\$@"
WRAPPER
    chmod 0755 "$BIN/$tool$suffix.tmp"
    mv "$BIN/$tool$suffix.tmp" "$BIN/$tool$suffix"
  done
}

# host_wrap: the -10 names for the host's own tools.
host_wrap() {
  for tool in "${TOOLS[@]}"; do
    printf '#!/bin/sh\n# the host'"'"'s own %s (scripts/install-qemu.sh)\nexec /usr/bin/%s "$@"\n' "$tool" "$tool" \
      > "$BIN/$tool-10.tmp"
    chmod 0755 "$BIN/$tool-10.tmp"
    mv "$BIN/$tool-10.tmp" "$BIN/$tool-10"
  done
}

ROOT10="$PWD/.runtime/qemu"
ROOT11="$PWD/.runtime/qemu11"
if dpkg --compare-versions "$(host_version)" ge 10.0.8; then
  host_wrap
  echo "qemu: the host's own $(host_version) is new enough for the 10 runtime"
else
  unpack "$ROOT10" "$SUITE" "deb $MIRROR $SUITE main"
  wrap "$ROOT10" -10 "$SUITE"
fi
# trixie-backports preferred for every package it has: QEMU 11 needs its newer libraries too.
unpack "$ROOT11" trixie-backports --aptopt='APT::Default-Release "trixie-backports"' \
  "deb $MIRROR trixie main" "deb $MIRROR trixie-backports main"
wrap "$ROOT11" -11 trixie-backports

for tool in "${TOOLS[@]}"; do
  ln -sfn "$tool-$DEFAULT" "$BIN/$tool.tmp"
  mv -T "$BIN/$tool.tmp" "$BIN/$tool"
done
echo "qemu: default $("$BIN/qemu-storage-daemon" --version | head -1); also $("$BIN/qemu-storage-daemon-11" --version | head -1)"
