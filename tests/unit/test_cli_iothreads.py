"""--iothreads and --poll-max-ns: parsed into the Config, and a bad value is a usage error naming the flag."""

from __future__ import annotations

import pytest

from csi_qsd import cli
from csi_qsd.qsd import iothreads


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CSI_QSD_IOTHREADS", "CSI_QSD_POLL_MAX_NS"):
        monkeypatch.delenv(name, raising=False)


def test_default_is_one_iothread_per_core() -> None:
    args = cli.build_parser().parse_args(["serve"])
    config = cli.config_from(args)
    assert config.iothreads == iothreads.node_cores() and config.poll_max_ns is None


def test_flags_reach_the_config() -> None:
    cores = iothreads.node_cores()
    for command in ("serve", "qsd-run"):
        args = cli.build_parser().parse_args([command, "--iothreads", str(cores * 4), "--poll-max-ns", "0"])
        config = cli.config_from(args)
        assert (config.iothreads, config.poll_max_ns) == (cores * 4, 0)


@pytest.mark.parametrize("value", ["0", str(iothreads.node_cores() * 4 + 1), "-1", "two", ""])
def test_bad_iothreads_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["serve", "--iothreads", value])
    assert info.value.code == 2
    assert "--iothreads" in capsys.readouterr().err


def test_bad_iothreads_from_the_environment_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CSI_QSD_IOTHREADS", "0")
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["serve"])
    assert info.value.code == 2 and "--iothreads" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "1000001", "1e3", "x"])
def test_bad_poll_max_ns_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["serve", "--poll-max-ns", value])
    assert info.value.code == 2 and "--poll-max-ns" in capsys.readouterr().err
