"""`--managed-pool KIND:SIZE[,sparse]`: what is accepted and refused, where it may mount, and a plain pool's guard."""

from __future__ import annotations

from pathlib import Path

import pytest

from csi_qsd import cli
from csi_qsd.config import Config
from csi_qsd.errors import StartupError
from csi_qsd.pool_specs import managed_spec
from csi_qsd.pool_specs.managed_spec import ManagedPoolSpec
from csi_qsd.pools import managed
from csi_qsd.pools.managed_xfs import ManagedXfs
from csi_qsd.pools.pool_dirs import PlainDirectory

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CSI_QSD_MANAGED_POOL", raising=False)


@pytest.mark.parametrize("text,spec", [
    ("xfs:200Gi", ManagedPoolSpec("xfs", 200 << 30)),
    ("xfs:512Mi,sparse", ManagedPoolSpec("xfs", 512 * MIB, sparse=True)),
    ("xfs:1Ti", ManagedPoolSpec("xfs", 1 << 40)),
    (f"xfs:{300 * MIB}", ManagedPoolSpec("xfs", 300 * MIB)),
])
def test_accepted(text: str, spec: ManagedPoolSpec) -> None:
    assert ManagedPoolSpec.parse(text) == spec
    assert ManagedPoolSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text,says", [
    ("ext4:10Gi", "KIND one of xfs"),
    ("xfs", "KIND one of xfs"),
    ("xfs:10G", "SIZE must be bytes or a number with Ki, Mi, Gi or Ti"),
    ("xfs:-1Gi", "SIZE must be bytes"),
    ("xfs:10Gi,preallocate", "unknown option 'preallocate'"),
    ("xfs:299Mi", "at least 300Mi"),
    ("xfs:1048577000", "whole number of MiB"),
])
def test_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ManagedPoolSpec.parse(text)


def test_every_kind_spelled_has_a_pool_directory() -> None:
    assert set(managed.KINDS) == set(managed_spec.KINDS)


def test_flag_and_environment_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.config_from(cli.build_parser().parse_args(["serve"])).managed_pool is None
    args = cli.build_parser().parse_args(["serve", "--managed-pool", "xfs:1Gi,sparse"])
    assert cli.config_from(args).managed_pool == ManagedPoolSpec("xfs", 1 << 30, sparse=True)
    monkeypatch.setenv("CSI_QSD_MANAGED_POOL", "xfs:2Gi")
    assert cli.config_from(cli.build_parser().parse_args(["serve"])).managed_pool == ManagedPoolSpec("xfs", 2 << 30)


def test_bad_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--managed-pool", "xfs:1G"])
    assert "--managed-pool 'xfs:1G'" in capsys.readouterr().err


@pytest.mark.parametrize("pool_dir,hidden", [("state", "--state-dir"), ("", "--state-dir"), ("kubelet", "--target-root")])
def test_it_never_mounts_over_the_drivers_other_directories(tmp_path: Path, pool_dir: str, hidden: str) -> None:
    spec = ManagedPoolSpec("xfs", 1 << 30)
    with pytest.raises(ValueError, match=f"would hide {hidden}"):
        Config(state_dir=tmp_path / "state", pool_dir=tmp_path / pool_dir, target_root=tmp_path / "kubelet",
               runtime_dir=Path("/run/csi-qsd-test"), managed_pool=spec)
    config = Config(state_dir=tmp_path / "state", target_root=tmp_path / "kubelet",
                    runtime_dir=Path("/run/csi-qsd-test"), managed_pool=spec)
    assert config.pool == tmp_path / "state" / "pool"


def test_chooses_plain_or_managed(tmp_path: Path) -> None:
    assert isinstance(managed.pool_directory(None, tmp_path / "pool", tmp_path), PlainDirectory)
    chosen = managed.pool_directory(ManagedPoolSpec("xfs", 1 << 30), tmp_path / "pool", tmp_path)
    assert isinstance(chosen, ManagedXfs) and chosen.image == tmp_path / "managed-pool" / "xfs.img"
    assert chosen.image.is_relative_to(tmp_path), "every file under the state dir"


async def test_plain_directory_refuses_while_a_managed_pool_file_exists(tmp_path: Path) -> None:
    plain = PlainDirectory(tmp_path / "pool", tmp_path)
    await plain.ready()
    assert (tmp_path / "pool").is_dir()
    (tmp_path / "managed-pool").mkdir()
    (tmp_path / "managed-pool" / "xfs.img.tmp").write_bytes(b"")  # a creation a crash cut off: not a pool
    await plain.ready()
    (tmp_path / "managed-pool" / "xfs.img").write_bytes(b"x" * 4096)
    with pytest.raises(StartupError, match="holds a managed xfs pool, but --managed-pool is not given"):
        await plain.ready()
