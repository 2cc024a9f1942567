#!/usr/bin/env bash
# Build the csi-qsd image with podman, without pulling from any image registry.
#
# The Dockerfile starts FROM debian:trixie-slim; where no registry can be
# reached, the same Debian 13 root filesystem is made from Debian's package
# archive with mmdebstrap, imported as a local base image and passed in as
# BASE_IMAGE. The build runs with `--isolation chroot`, which needs no user
# namespaces or setrlimit rights that a locked-down host may refuse.
#
# Usage: scripts/build-image.sh [TAG]
#   TAG                   default ghcr.io/csi-qsd/csi-qsd:<version in pyproject.toml>
#   CSI_QSD_BASE_IMAGE    base image to build on instead of making one (e.g. docker.io/library/debian:trixie-slim)
#   CSI_QSD_CACHE_DIR     where the base tarball is kept, default ~/.cache/csi-qsd
#                         (delete image/debian-trixie-minbase.tar to make a fresh one)
#   CSI_QSD_BUILD_CA      CA bundle pip trusts in the build (it fetches from PyPI over TLS),
#                         default the host's /etc/ssl/certs/ca-certificates.crt, so a build
#                         behind a TLS-inspecting proxy works; "none" for pip's own
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)"
TAG="${1:-ghcr.io/csi-qsd/csi-qsd:$VERSION}"
CACHE="${CSI_QSD_CACHE_DIR:-${HOME}/.cache/csi-qsd}/image"
BASE_TAR="$CACHE/debian-trixie-minbase.tar"
BASE="${CSI_QSD_BASE_IMAGE:-localhost/csi-qsd-base:trixie}"
CA="${CSI_QSD_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}"

for tool in podman mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "build-image: $tool is missing (scripts/install.sh installs it)" >&2; exit 1; }
done
work="$(mktemp -d)"
partial="$BASE_TAR.$$.tmp"  # per process: two builds may make the base at once
trap 'rm -rf "$work" "$partial"' EXIT

if [ -z "${CSI_QSD_BASE_IMAGE:-}" ] && ! podman image exists "$BASE"; then
  if [ ! -s "$BASE_TAR" ]; then
    echo "build-image: making the Debian 13 base $BASE_TAR"
    mkdir -p "$CACHE"
    # minbase: the essential packages and apt, as in debian:trixie-slim; the
    # sources list mmdebstrap writes includes trixie-updates and -security.
    mmdebstrap --quiet --variant=minbase --format=tar trixie "$partial"
    mv "$partial" "$BASE_TAR"
  fi
  echo "build-image: importing $BASE_TAR as $BASE"
  podman import --quiet "$BASE_TAR" "$BASE" >/dev/null
fi

args=(--isolation chroot --build-arg "BASE_IMAGE=$BASE" --tag "$TAG" --file Dockerfile)
if [ "$CA" != none ] && [ -s "$CA" ]; then
  # Mounted during RUN steps only, on /mnt (an empty directory in every
  # Debian image): a file mount would leave an empty mount point in a layer.
  mkdir "$work/ca"
  cp "$CA" "$work/ca/ca.crt"
  args+=(--volume "$work/ca:/mnt:ro" --build-arg PIP_CERT=/mnt/ca.crt)
fi
echo "build-image: building $TAG on $BASE"
podman build "${args[@]}" .
echo "build-image: $TAG: $(podman image inspect --format '{{.Id}}' "$TAG" | cut -c1-12)"
