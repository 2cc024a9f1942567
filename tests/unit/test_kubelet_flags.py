"""The kubelet helpers read the upstream sidecars' flags as those Go programs do, and node.yaml's args parse."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from csi_qsd import cli
from csi_qsd.kubelet import flags
from csi_qsd.sys import text_http

NODE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "node.yaml"


@pytest.mark.parametrize("text, seconds", [
    ("3s", 3.0), ("60s", 60.0), ("1m30s", 90.0), ("1h", 3600.0), ("1.5m", 90.0), (".5s", 0.5), ("2.s", 2.0),
    ("500ms", 0.5), ("250us", 250e-6), ("250µs", 250e-6), ("10ns", 10e-9), ("1h2m3s4ms", 3723.004),
    ("0", 0.0), ("+3s", 3.0), ("-1s", -1.0), ("0s", 0.0),
])
def test_go_durations(text: str, seconds: float) -> None:
    assert flags.duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "3", "s", "1x", "1s2", ".s", "3 s", "3S", "1d", "-", "+", "1m-3s", " 3s"])
def test_what_go_refuses_as_a_duration(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        flags.duration(text)


@pytest.mark.parametrize("text", ["0", "0s", "-1s"])
def test_a_timeout_must_be_positive(text: str) -> None:
    with pytest.raises(ValueError, match="positive"):
        flags.timeout(text)
    assert flags.timeout("1m30s") == 90.0


@pytest.mark.parametrize("text, endpoint", [
    ("/csi/csi.sock", "unix:///csi/csi.sock"),
    ("unix:///csi/csi.sock", "unix:///csi/csi.sock"),
    ("unix:/csi/csi.sock", "unix:///csi/csi.sock"),
])
def test_csi_address_is_a_path_or_a_unix_url(text: str, endpoint: str) -> None:
    assert flags.csi_endpoint(text) == endpoint


def test_a_relative_csi_address_is_taken_from_the_working_directory(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert flags.csi_endpoint("csi.sock") == f"unix://{tmp_path}/csi.sock"


@pytest.mark.parametrize("text", ["", "unix://", "tcp://127.0.0.1:10000", "dns:///x:1"])
def test_csi_address_refuses_what_is_no_unix_socket(text: str) -> None:
    with pytest.raises(ValueError):
        flags.csi_endpoint(text)


@pytest.mark.parametrize("text, address", [
    (":9808", (None, 9808)), ("127.0.0.1:9809", ("127.0.0.1", 9809)), ("[::1]:9808", ("::1", 9808)),
    ("[::]:1", ("::", 1)), ("localhost:0", ("localhost", 0)),
])
def test_listen_addresses(text: str, address: tuple[str | None, int]) -> None:
    assert text_http.listen_address(text) == address
    assert flags.http_endpoint(text) == text


@pytest.mark.parametrize("text", ["9808", ":", ":x", ":70000", "host:-1", "[::1]"])
def test_bad_listen_addresses(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        flags.http_endpoint(text)


def test_health_address_from_http_endpoint_or_health_port() -> None:
    assert flags.health_address("", None) == ""
    assert flags.health_address("", None, 9808) == ":9808"
    assert flags.health_address("", 9000, 9808) == ":9000"
    assert flags.health_address("", 0, 9808) == ""
    assert flags.health_address("127.0.0.1:1", None, 9808) == "127.0.0.1:1"
    with pytest.raises(ValueError, match="only one of --health-port and --http-endpoint"):
        flags.health_address(":9809", 9809)


@pytest.mark.parametrize("verbosity, level", [(-1, "info"), (0, "info"), (2, "info"), (3, "info"), (4, "debug"),
                                              (5, "debug"), (10, "debug")])
def test_klog_verbosity_maps_to_a_log_level(verbosity: int, level: str) -> None:
    assert flags.log_level(verbosity) == level


@pytest.mark.parametrize("text", ["x", "", "1.5", "2 "])
def test_klog_verbosity_is_a_whole_number(text: str) -> None:
    with pytest.raises(ValueError):
        flags.verbosity(text)
    assert flags.verbosity("-2") == -2


# --- the command lines -------------------------------------------------------


def _node_container_args(name: str) -> list[str]:
    (daemonset,) = [doc for doc in yaml.safe_load_all(NODE_YAML.read_text()) if doc and doc["kind"] == "DaemonSet"]
    (container,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return [str(arg) for arg in container["args"]]


def test_node_yaml_registrar_args_run_the_registrar() -> None:
    args = cli.build_parser().parse_args(["kubelet-registrar", *_node_container_args("node-driver-registrar")])
    settings = cli.registrar_settings_from(args)
    assert settings.csi_endpoint == "unix:///csi/csi.sock"
    assert settings.kubelet_registration_path == "/var/lib/kubelet/plugins/csi-qsd.io/csi.sock"
    assert settings.registration_dir == Path("/registration")
    assert (settings.health_address, settings.timeout) == (":9809", 1.0)
    assert flags.log_level(args.v) == "info"


def test_node_yaml_liveness_args_run_the_liveness_probe() -> None:
    args = cli.build_parser().parse_args(["liveness-probe", *_node_container_args("liveness-probe")])
    settings = cli.liveness_settings_from(args)
    assert (settings.csi_endpoint, settings.health_address, settings.probe_timeout) == (
        "unix:///csi/csi.sock", ":9808", 3.0)


def test_go_spellings_of_flags() -> None:
    args = cli.build_parser().parse_args([
        "kubelet-registrar", "-v=5", "-csi-address", "/c.sock", "--kubelet-registration-path", "/k.sock",
        "-plugin-registration-path=/reg", "-timeout=1m30s", "-health-port", "9809"])
    settings = cli.registrar_settings_from(args)
    assert (settings.csi_endpoint, settings.kubelet_registration_path, settings.registration_dir) == (
        "unix:///c.sock", "/k.sock", Path("/reg"))
    assert (settings.timeout, settings.health_address, flags.log_level(args.v)) == (90.0, ":9809", "debug")
    liveness = cli.liveness_settings_from(cli.build_parser().parse_args(["liveness-probe"]))
    assert (liveness.csi_endpoint, liveness.health_address, liveness.probe_timeout) == (
        "unix:///run/csi/socket", ":9808", 1.0)


@pytest.mark.parametrize("argv, flag", [
    (["liveness-probe", "--probe-timeout=3"], "--probe-timeout"),
    (["liveness-probe", "--probe-timeout=0s"], "--probe-timeout"),
    (["liveness-probe", "--http-endpoint=9808"], "--http-endpoint"),
    (["liveness-probe", "--health-port=99999"], "--health-port"),
    (["liveness-probe", "--v=high"], "--v"),
    (["kubelet-registrar", "--timeout=soon"], "--timeout"),
    (["kubelet-registrar", "--csi-address=tcp://h:1"], "--csi-address"),
    (["kubelet-registrar", "--csi-addr=/x"], "--csi-addr"),  # Go has no abbreviations
])
def test_a_bad_flag_is_a_usage_error(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_settings_refuse_what_upstream_refuses() -> None:
    parse = cli.build_parser().parse_args
    with pytest.raises(ValueError, match="--kubelet-registration-path is required"):
        cli.registrar_settings_from(parse(["kubelet-registrar"]))
    with pytest.raises(ValueError, match="only one of"):
        cli.registrar_settings_from(parse(["kubelet-registrar", "--kubelet-registration-path=/k",
                                           "--http-endpoint=:1", "--health-port=2"]))
    with pytest.raises(ValueError, match="only one of"):
        cli.liveness_settings_from(parse(["liveness-probe", "--http-endpoint=:1", "--health-port=2"]))
    with pytest.raises(ValueError, match="no port"):
        cli.liveness_settings_from(parse(["liveness-probe", "--health-port=0"]))


def test_main_says_why_it_cannot_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["liveness-probe", "--http-endpoint=:1", "--health-port=2"]) == 1
    assert capsys.readouterr().err == (
        "csi-qsd liveness-probe: cannot start: only one of --health-port and --http-endpoint can be set\n")
