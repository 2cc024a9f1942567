# csi-qsd: the CSI plugin (`csi-qsd serve`) and qemu-storage-daemon
# (`csi-qsd qsd-run`) in one image. Debian 13 (trixie), Python 3.13.
#
#   docker build -t ghcr.io/csi-qsd/csi-qsd:$(version) .
#   scripts/build-image.sh         (podman, with a base image made locally)
#
# Debian 13 because its QEMU (1:10.0.x, and 11.1 in its trixie-backports,
# the one installed below) carries "fuse: Copy write buffer content before
# polling" (10.0.8): older FUSE exports corrupt parallel writes, and the
# driver then falls back to the slow buffered loop device.
# BASE_IMAGE lets a build without a registry start from a Debian 13 root
# filesystem imported under another name; it must be Debian 13 all the same.
# Spelled out in full so podman, which refuses ambiguous short names, takes
# Docker Hub's like docker does.
ARG BASE_IMAGE=docker.io/library/debian:trixie-slim

FROM ${BASE_IMAGE} AS runtime

# qemu-utils: qemu-storage-daemon and qemu-img (in Debian 12 QSD was in
# qemu-system-common; in 13 it moved here); fuse3: fusermount3 and the FUSE
# library for exports; e2fsprogs/xfsprogs: mkfs, resize2fs, xfs_growfs;
# util-linux and mount: blkid, losetup, fsfreeze, mount/umount;
# python3-venv: the driver lives in its own venv, not in Debian's Python
# (which refuses `pip install` into it, PEP 668).
# QEMU_SUITE: where qemu-utils comes from. trixie-backports (QEMU 11.1) by
# default: its FUSE export, made growable, asks the kernel for
# FUSE_ASYNC_DIO and takes parallel direct writes, which doubles pods'
# random writes over 10.0 (docs/benchmarks.md, "Pods on the default
# configuration"). `trixie` gives Debian 13's own 10.0. The backports line
# is made from the image's own Debian source, so a build uses the mirror
# the base image was made with.
ARG QEMU_SUITE=trixie-backports
RUN set -eu; \
    if [ "$QEMU_SUITE" != trixie ]; then \
      uri=$(awk '$1 == "deb" && $3 == "trixie" { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true); \
      [ -n "$uri" ] || uri=$(awk '$1 == "URIs:" { print $2; exit }' /etc/apt/sources.list.d/debian.sources); \
      echo "deb $uri $QEMU_SUITE main" > /etc/apt/sources.list.d/qemu-suite.list; \
    fi; \
    apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends -t "$QEMU_SUITE" \
        qemu-utils \
        fuse3 \
        python3 \
        python3-venv \
        e2fsprogs \
        xfsprogs \
        util-linux \
        mount \
 && rm -rf /var/lib/apt/lists/* \
 && rm -f /etc/mtab

# No /etc/mtab: libfuse then skips recording each FUSE mount in it, which it
# does by forking QSD to run `/bin/mount -f` (and `/bin/umount` on removal)
# inside QSD's main loop. Measured with QSD 10.0.13: block-export-add of a
# FUSE export 2.1-2.3 ms with the file, 0.5-0.8 ms without (removal 2.4 ms,
# 0.8 ms), and a fork of a busy QSD stalled every volume's I/O up to 28 ms.
# Nothing in the image reads the file: mount, df and findmnt read
# /proc/self/mountinfo.

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Built in a throw-away stage, so the source tree never becomes a layer of
# the final image; only the venv is copied over.
FROM runtime AS build
# pip fetches the dependencies from PyPI over TLS. A build behind a
# TLS-inspecting proxy passes that proxy's CA bundle as PIP_CERT (as
# scripts/build-image.sh does with the host's); unset, pip trusts its own.
ARG PIP_CERT
COPY . /src
RUN python3 -m venv /opt/csi-qsd \
 && /opt/csi-qsd/bin/pip install /src

FROM runtime
COPY --from=build /opt/csi-qsd /opt/csi-qsd
# The venv first, so `csi-qsd` is found; QEMU and the host tools stay Debian's.
ENV PATH=/opt/csi-qsd/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

ENTRYPOINT ["csi-qsd"]
