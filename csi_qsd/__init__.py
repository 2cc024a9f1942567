"""csi-qsd: a CSI driver on qemu-storage-daemon."""

__version__ = "0.1.0"
