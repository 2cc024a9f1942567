"""The userspace NVMe way into a device pool: how it is spelt, and the QSD nodes it opens.

No VFIO here: what can be checked without a device is checked here (the
address format, the nvme node, windows sharing it, the export refusal);
tests/integration/test_nvme_vfio.py drives a real controller where one is
bound to vfio-pci.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from csi_qsd.cli import build_parser, config_from
from csi_qsd.errors import InvalidArgument, StartupError
from csi_qsd.params import ExportKind, ImageFormat, VolumeParameters
from csi_qsd.pool_specs.device_spec import DevicePoolSpec
from csi_qsd.pool_specs.nvme_address import NvmeAddress
from csi_qsd.pools import device
from csi_qsd.pools.device import DevicePool
from csi_qsd.pools.nvme import NvmeDevicePool, base_node_name, vfio_problem
from csi_qsd.pools.remote import RemotePool
from csi_qsd.pools.through_qsd import DevicePoolThroughQSD
from csi_qsd.qsd import graph
from csi_qsd.qsd.storage import ExtentOnDevice, HostDevice, NvmeNamespace

VOLUME = "vol-0123456789abcdef01234567"


@pytest.mark.parametrize(("text", "pci", "namespace"), [
    ("nvme://0000:01:00.0", "0000:01:00.0", 1),
    ("nvme://0000:01:00.0/2", "0000:01:00.0", 2),
    ("nvme://0000:5E:1F.7/4294967294", "0000:5e:1f.7", 4294967294),
])
def test_address_parses(text: str, pci: str, namespace: int) -> None:
    address = NvmeAddress.parse(text)
    assert (address.pci, address.namespace) == (pci, namespace)
    assert NvmeAddress.parse(str(address)) == address


@pytest.mark.parametrize(("text", "says"), [
    ("0000:01:00.0", "starts with nvme://"),
    ("nvme://01:00.0", "DOMAIN:BUS:DEVICE.FUNCTION"),
    ("nvme://0000:01:20.0", "DOMAIN:BUS:DEVICE.FUNCTION"),  # device numbers end at 1f
    ("nvme://0000:01:00.8", "DOMAIN:BUS:DEVICE.FUNCTION"),  # functions end at 7
    ("nvme://0000:01:00.0/0", "namespace"),
    ("nvme://0000:01:00.0/4294967295", "namespace"),  # the broadcast NSID
    ("nvme://0000:01:00.0/x", "namespace"),
    ("nvme://0000:01:00.0/", "namespace"),
    ("nvme:///dev/nvme0n1", "DOMAIN:BUS:DEVICE.FUNCTION"),
])
def test_address_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        NvmeAddress.parse(text)


def test_device_pool_spelling() -> None:
    spec = DevicePoolSpec.parse("fast=nvme://0000:01:00.0/2,force")
    assert (spec.name, spec.force, spec.nvme) == ("fast", True, NvmeAddress("0000:01:00.0", 2))
    assert spec.source == "nvme://0000:01:00.0/2"
    host = DevicePoolSpec.parse("slow=/dev/disk/by-id/nvme-X")
    assert host.nvme is None and host.source == "/dev/disk/by-id/nvme-X"
    with pytest.raises(ValueError, match="--device-pool 'fast=nvme://0000:01:00.0/0'"):
        DevicePoolSpec.parse("fast=nvme://0000:01:00.0/0")
    with pytest.raises(ValueError, match="unknown option"):
        DevicePoolSpec.parse("fast=nvme://0000:01:00.0,wipe")


def test_namespace_node() -> None:
    namespace = NvmeNamespace("0000:01:00.0", 2, base_node_name("fast"))
    assert namespace.base_blockdev() == {"driver": "nvme", "node-name": "d-fast", "device": "0000:01:00.0",
                                         "namespace": 2, "discard": "unmap"}
    assert len(base_node_name("a" * 28)) <= 31  # QEMU's limit on node names, with the longest pool name


def test_windows_share_the_namespace_node() -> None:
    """Every volume's window names the one nvme node (VFIO hands a controller to QSD once)."""
    namespace = NvmeNamespace("0000:01:00.0", 1, "d-fast")
    nodes = graph.nodes_for(VOLUME)
    spec = ExtentOnDevice(namespace, 64 << 20, 1 << 30).protocol_blockdev(
        nodes, VolumeParameters(format=ImageFormat.RAW), read_only=False)
    assert spec == {"driver": "raw", "node-name": nodes.file, "file": "d-fast", "offset": 64 << 20,
                    "size": 1 << 30, "discard": "unmap", "read-only": False}


def test_host_windows_keep_their_own_node() -> None:
    spec = ExtentOnDevice(HostDevice(Path("/dev/x")), 0, 1 << 20).protocol_blockdev(
        graph.nodes_for(VOLUME), VolumeParameters(format=ImageFormat.RAW), read_only=True)
    assert spec["file"]["driver"] == "host_device" and spec["file"]["read-only"] is True


def test_missing_controller_is_named() -> None:
    assert vfio_problem(NvmeAddress("ffff:ff:1f.7")) == "PCI device ffff:ff:1f.7 is not present"


def test_only_vm_volumes() -> None:
    """Filesystem and block volumes need a FUSE export, which a shared nvme node cannot carry twice."""
    pool = NvmeDevicePool(DevicePoolSpec.parse("fast=nvme://0000:01:00.0"), catalog=None,  # type: ignore[arg-type]
                          view_dir=Path("/nonexistent"))
    pool.check_parameters(VolumeParameters(format=ImageFormat.RAW, export=ExportKind.VHOST_USER_BLK))
    with pytest.raises(InvalidArgument, match="pool 'fast'.*vhost-user-blk"):
        pool.check_parameters(VolumeParameters(format=ImageFormat.RAW, export=ExportKind.FILESYSTEM))


async def test_startup_names_a_missing_controller() -> None:
    pool = NvmeDevicePool(DevicePoolSpec.parse("fast=nvme://ffff:ff:1f.7/3"), catalog=None,  # type: ignore[arg-type]
                          view_dir=Path("/nonexistent"))
    with pytest.raises(StartupError, match=r"device pool fast \(nvme://ffff:ff:1f.7/3\): PCI device .* not present"):
        await pool.open()


def test_serve_takes_the_nvme_spelling(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CSI_QSD_DEVICE_POOL", "vm=nvme://0000:01:00.0/2 slow=/dev/disk/by-id/x")
    args = build_parser().parse_args(["serve", "--device-pool", "fast=nvme://0000:02:00.0"])
    assert [spec.source for spec in config_from(args).device_pools] == [
        "nvme://0000:01:00.0/2", "/dev/disk/by-id/x", "nvme://0000:02:00.0/1"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--device-pool", "fast=nvme://0000:02:00.0/0"])
    assert "namespace must be a number" in capsys.readouterr().err
    monkeypatch.setenv("CSI_QSD_DEVICE_POOL", "vm=nvme://0000:01:00")
    with pytest.raises(SystemExit):
        build_parser()
    assert "CSI_QSD_DEVICE_POOL: --device-pool 'vm=nvme://0000:01:00'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", [DevicePoolThroughQSD, NvmeDevicePool, RemotePool])
def test_the_device_pool_docstring_names_every_hook_the_other_ways_in_override(kind: type[DevicePool]) -> None:
    overridden = {name for name, value in vars(kind).items()
                  if callable(value) and not name.startswith("__") and hasattr(DevicePool, name)}
    assert overridden and not {name for name in overridden if f"`{name}`" not in (device.__doc__ or "")}
