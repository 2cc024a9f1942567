#!/usr/bin/env bash
# Build the Kubernetes binaries the cluster tier runs, from the k8s.io/kubernetes
# Go module, cached by version. The module requires its staging modules at
# v0.0.0 and replaces them with ./staging/..., which Go ignores for a
# dependency: a wrapper module replaces each with its v0.<minor>.<patch> release.
#
# etcd is built at the version the API server's own module requires (the one
# it is tested with).
#
# Usage: build-kubernetes.sh VERSION OUTDIR [TARGET...]   (TARGET: a cmd/ name, etcd, agnhost, e2e.test or
# ginkgo: the Ginkgo CLI at the version e2e.test is built with, which runs it in parallel processes)
set -euo pipefail
version=${1:?version, e.g. v1.34.4}
out=${2:?output directory}
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)

missing=()
for t in "${targets[@]}"; do [ -x "$out/$t" ] || missing+=("$t"); done
[ ${#missing[@]} -gt 0 ] || exit 0

staging_version="v0.${version#v1.}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
go mod init csi-qsd.test/kubernetes-build >/dev/null 2>&1
go mod download -json "k8s.io/kubernetes@$version" >/dev/null
dir=$(go mod download -json "k8s.io/kubernetes@$version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
{
  echo "module csi-qsd.test/kubernetes-build"
  echo
  sed -n 's/^go \([0-9.]*\)$/go \1/p' "$dir/go.mod" | head -1
  echo
  echo "require k8s.io/kubernetes $version"
  echo
  echo "replace ("
  sed -n 's#^\t\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\t\1 => \1 '"$staging_version"'#p' "$dir/go.mod"
  echo ")"
} > go.mod
# Every main package is a blank import, so `go mod tidy` keeps their dependencies.
{
  echo "//go:build tools"
  echo "package tools"
  echo "import ("
  for t in "${missing[@]}"; do
    case $t in
      e2e.test) echo "	_ \"k8s.io/kubernetes/test/e2e\"" ;;
      etcd) echo "	_ \"go.etcd.io/etcd/server/v3\"" ;;
      agnhost) echo "	_ \"k8s.io/kubernetes/test/images/agnhost\"" ;;
      ginkgo) echo "	_ \"github.com/onsi/ginkgo/v2/ginkgo\"" ;;
      *) echo "	_ \"k8s.io/kubernetes/cmd/$t\"" ;;
    esac
  done
  echo ")"
} > tools.go
go mod tidy >/dev/null
mkdir -p "$out"
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$version" | cut -d. -f2) -X k8s.io/client-go/pkg/version.gitVersion=$version -X k8s.io/component-base/version.gitTreeState=clean"
pkgs=()
for t in "${missing[@]}"; do
  case $t in
    agnhost) go build -trimpath -ldflags "-s -w" -o "$out/agnhost.tmp" k8s.io/kubernetes/test/images/agnhost && mv "$out/agnhost.tmp" "$out/agnhost" ;;
    etcd) go build -trimpath -ldflags "-s -w" -o "$out/etcd.tmp" go.etcd.io/etcd/server/v3 && mv "$out/etcd.tmp" "$out/etcd" ;;
    ginkgo) go build -trimpath -ldflags "-s -w" -o "$out/ginkgo.tmp" github.com/onsi/ginkgo/v2/ginkgo && mv "$out/ginkgo.tmp" "$out/ginkgo" ;;
    e2e.test) go test -c -trimpath -tags selinux,notest -ldflags "$ldflags" -o "$out/e2e.test.tmp" k8s.io/kubernetes/test/e2e && mv "$out/e2e.test.tmp" "$out/e2e.test" ;;
    *) pkgs+=("k8s.io/kubernetes/cmd/$t") ;;
  esac
done
if [ ${#pkgs[@]} -gt 0 ]; then
  tmp=$(mktemp -d "$out/.build.XXXXXX")
  go build -trimpath -tags selinux,notest -ldflags "$ldflags" -o "$tmp/" "${pkgs[@]}"
  for p in "${pkgs[@]}"; do mv "$tmp/${p##*/}" "$out/"; done
  rmdir "$tmp"
fi
