#!/usr/bin/env bash
# Build main packages of a Go module at a version, cached: a binary already in
# OUTDIR is kept. The module's zip from the Go module proxy leaves out nested
# modules, so a replace pointing into the module (`=> ./client`) is turned
# into the nested module's release at the same version.
#
# Usage: build-go-module.sh MODULE VERSION OUTDIR PACKAGE...   (PACKAGE relative to the module, e.g. cmd/csi-provisioner)
#   GO_EXTRA_LDFLAGS   more -ldflags (e.g. -X for a module that keeps its version elsewhere than main.version)
set -euo pipefail
module=${1:?module} version=${2:?version} out=${3:?output directory}
shift 3
missing=()
for p in "$@"; do [ -x "$out/${p##*/}" ] || missing+=("$p"); done
[ ${#missing[@]} -gt 0 ] || exit 0

export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
work=$(mktemp -d)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
dir=$(cd "$work" && go mod download -json "$module@$version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
cp -r "$dir" "$work/src"
chmod -R u+w "$work/src"
cd "$work/src"
python3 - "$version" <<'PY'
import re, sys
version = sys.argv[1]
text = open("go.mod").read()
text = re.sub(r"^(replace\s+)?(\S+) => \./\S+$", lambda m: f"{m.group(1) or ''}{m.group(2)} => {m.group(2)} {version}", text, flags=re.M)
text = re.sub(r"^(\t)(\S+) => \./\S+$", lambda m: f"\t{m.group(2)} => {m.group(2)} {version}", text, flags=re.M)
open("go.mod", "w").write(text)
PY
mkdir -p "$out"
for p in "${missing[@]}"; do
  go build -trimpath -ldflags "-s -w -X main.version=$version ${GO_EXTRA_LDFLAGS:-}" -o "$out/${p##*/}.tmp" "./$p"
  mv "$out/${p##*/}.tmp" "$out/${p##*/}"
done
