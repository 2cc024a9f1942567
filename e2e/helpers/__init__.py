"""Shared by the e2e tests, so that no test module imports another: the served driver and a guest's writes.

* `served`: `Served`, the driver under test in a sandbox of its own with a
  CSI client (as a `csi-qsd serve` process, or in the test's event loop
  where the test asks QSD through the driver's own client); `provision` and
  `release`, a VM volume staged and published as the provisioner and
  kubelet do it; an image's guest-visible bytes read by qemu-img, never
  through QSD.
* `shared_bin`: where the CSI community's prebuilt binaries are
  (`../shared/bin`, or `$CSI_QSD_SHARED_BIN`).
* `writes`: a guest writing paced, acknowledged blocks to its disk, and the
  checks of what it acknowledged, on the guest and from the host.

The guest itself (kernel, initramfs, QEMU, scripts) is `e2e.guest`.
"""
