# csi-qsd: the CSI plugin (`csi-qsd serve`) and qemu-storage-daemon
# (`csi-qsd qsd-run`) in one image. Debian 12 (bookworm), Python 3.11.
#
#   docker build -t ghcr.io/csi-qsd/csi-qsd:$(version) .
FROM python:3.11-slim-bookworm

# qemu-system-common: qemu-storage-daemon; qemu-utils: qemu-img;
# fuse3: fusermount3 for FUSE exports; e2fsprogs/xfsprogs: mkfs, resize2fs,
# xfs_growfs; util-linux and mount: blkid, losetup, mount/umount.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        qemu-system-common \
        qemu-utils \
        fuse3 \
        e2fsprogs \
        xfsprogs \
        util-linux \
        mount \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY . /src
RUN pip install /src \
 && rm -rf /src

ENTRYPOINT ["csi-qsd"]
