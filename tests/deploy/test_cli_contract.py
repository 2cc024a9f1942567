"""The flags and environment the manifests give the driver exist in
`csi_qsd.cli.build_parser()`, and parse.

These tests import the driver's CLI; they fail with ImportError until it exists.
"""

from __future__ import annotations

import argparse
import os
import re

import pytest

from testing.manifests.objects import VAR_REF, Obj, container, one

SERVE_FLAGS = (
    "--endpoint",
    "--node-id",
    "--driver-name",
    "--state-dir",
    "--pool-dir",
    "--target-root",
    "--log-level",
    "--metrics-address",
    "--qsd-mode",
    "--max-volumes",
)
ENV_PREFIX = "CSI_QSD_"
SAMPLE_FIELD_VALUES = {"spec.nodeName": "node-1", "metadata.namespace": "csi-qsd", "metadata.name": "pod-1",
                       "status.podIP": "10.244.1.7"}


def build_parser() -> argparse.ArgumentParser:
    from csi_qsd.cli import build_parser as build

    parser = build()
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            sub = action.choices[name]
            assert isinstance(sub, argparse.ArgumentParser)
            return sub
    raise AssertionError(f"csi-qsd has no subcommand {name!r}")


def env_flag(name: str) -> str:
    """CSI_QSD_NODE_ID -> --node-id"""
    assert name.startswith(ENV_PREFIX)
    return "--" + name[len(ENV_PREFIX) :].lower().replace("_", "-")


def given_flags(args: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in args if arg.startswith("-")]


def container_env(spec: Obj) -> dict[str, str]:
    """The container's environment as the driver would see it."""
    env: dict[str, str] = {}
    for item in spec.get("env") or []:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "configMapKeyRef" in item["valueFrom"]:  # an optional ConfigMap the base does not ship: unset
            assert item["valueFrom"]["configMapKeyRef"].get("optional") is True, item
        else:
            env[item["name"]] = SAMPLE_FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expanded_args(spec: Obj, env: dict[str, str]) -> list[str]:
    return [VAR_REF.sub(lambda m: env[m.group(1)], arg) for arg in spec["args"]]


@pytest.fixture
def pod(base: list[Obj]) -> Obj:
    spec: Obj = one(base, "DaemonSet", "csi-qsd-node")["spec"]["template"]["spec"]
    return spec


def test_contract_flags_exist() -> None:
    serve = subcommand(build_parser(), "serve")
    missing = [flag for flag in SERVE_FLAGS if flag not in serve._option_string_actions]
    assert not missing, f"csi-qsd serve lacks {missing}"
    qsd_run = subcommand(build_parser(), "qsd-run")
    assert "--state-dir" in qsd_run._option_string_actions
    mode = serve._option_string_actions["--qsd-mode"]
    if mode.choices is not None:
        assert {"managed", "external"} <= {str(choice) for choice in mode.choices}


@pytest.mark.parametrize(("name", "command"), [("csi-qsd", "serve"), ("qsd", "qsd-run")])
def test_manifest_flags_exist(pod: Obj, name: str, command: str) -> None:
    spec = container(pod, name)
    assert "command" not in spec, "the image's ENTRYPOINT is csi-qsd; give only args"
    assert spec["args"][0] == command
    sub = subcommand(build_parser(), command)
    unknown = [flag for flag in given_flags(spec["args"][1:]) if flag not in sub._option_string_actions]
    assert not unknown, f"csi-qsd {command} has no {unknown}"


@pytest.mark.parametrize(("name", "command"), [("csi-qsd", "serve"), ("qsd", "qsd-run")])
def test_manifest_env_maps_to_flags(pod: Obj, name: str, command: str) -> None:
    spec = container(pod, name)
    sub = subcommand(build_parser(), command)
    for item in spec.get("env") or []:
        if item["name"].startswith(ENV_PREFIX):
            flag = env_flag(item["name"])
            assert flag in sub._option_string_actions, f"{item['name']} names no flag of {command} ({flag})"
    # The plugin's node id comes from the environment, not from a flag.
    if command == "serve":
        assert "CSI_QSD_NODE_ID" in {item["name"] for item in spec.get("env") or []}


@pytest.mark.parametrize(("name", "command"), [("csi-qsd", "serve"), ("qsd", "qsd-run")])
def test_manifest_command_line_parses(
    pod: Obj, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, command: str
) -> None:
    spec = container(pod, name)
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    env = container_env(spec)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = build_parser()  # after the environment is set: env may supply defaults
    try:
        namespace = parser.parse_args(expanded_args(spec, env))
    except SystemExit:
        pytest.fail(f"csi-qsd rejects the {name} container's arguments: {capsys.readouterr().err}")
    assert isinstance(namespace, argparse.Namespace)


def test_flag_check_would_notice_an_unknown_flag() -> None:
    serve = subcommand(build_parser(), "serve")
    assert "--no-such-flag" not in serve._option_string_actions
    assert env_flag("CSI_QSD_MAX_VOLUMES") == "--max-volumes"
    assert re.fullmatch(r"--[a-z][a-z-]*", env_flag("CSI_QSD_NODE_ID"))


@pytest.mark.parametrize("pod_ip", ["10.244.1.7", "fd00:10:244::7"])
def test_listeners_bind_the_pod_ip_and_peers_are_the_daemonsets_pods(
    pod: Obj, base: list[Obj], monkeypatch: pytest.MonkeyPatch, pod_ip: str
) -> None:
    """Metrics, the mutual-TLS listener and the copy servers answer on the pod's IP only (none on every
    interface, none on loopback); the peers are this DaemonSet's own pods, found with a selector that matches
    its pod template, which the plugin's service account may list in its namespace."""
    from csi_qsd.cli import config_from

    spec = container(pod, "csi-qsd")
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    env = {**container_env(spec), "POD_IP": pod_ip, "KUBERNETES_SERVICE_HOST": "10.96.0.1",
           "KUBERNETES_SERVICE_PORT": "443"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = config_from(build_parser().parse_args(expanded_args(spec, env)))
    wanted = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    assert config.metadata_address == f"{wanted}:9811"
    assert config.metrics_address.rpartition(":")[0].strip("[]") == pod_ip
    assert config.copy_host == pod_ip
    assert config.copies_with_peers and config.kubernetes_api == "10.96.0.1:443"
    selector = dict(term.split("=") for term in config.peers_from_pods.split(","))
    daemonset = one(base, "DaemonSet", "csi-qsd-node")
    assert selector.items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    account = pod["serviceAccountName"]
    bound = [b["roleRef"]["name"] for b in base if b["kind"] == "RoleBinding"
             and any(s["name"] == account for s in b["subjects"])]
    assert any("list" in rule["verbs"] and "pods" in rule["resources"]
               for r in base if r["kind"] == "Role" and r["metadata"]["name"] in bound for rule in r["rules"])


def test_a_network_policy_guards_every_port_of_the_node_pod(base: list[Obj], pod: Obj) -> None:
    """Every declared port is in the node pods' NetworkPolicy: the listener for the router and the node pods,
    the copy ports for node pods only, metrics for labelled namespaces; nothing open to all but /healthz."""
    from csi_qsd.cli import build_parser as parser

    policy = one(base, "NetworkPolicy", "csi-qsd-node")
    daemonset = one(base, "DaemonSet", "csi-qsd-node")
    assert policy["spec"]["podSelector"]["matchLabels"] == daemonset["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules: dict[int, list[Obj]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            for number in range(port["port"], port.get("endPort", port["port"]) + 1):
                rules[number] = rule.get("from", [])
    declared = {p["containerPort"] for c in pod["containers"] for p in c.get("ports") or []}
    assert declared <= set(rules), declared - set(rules)
    copy_ports = subcommand(parser(), "serve")._option_string_actions["--copy-ports"].default
    low, high = map(int, str(copy_ports).split("-"))
    node = {"podSelector": {"matchLabels": daemonset["spec"]["selector"]["matchLabels"]}}
    assert all(rules[port] == [node] for port in (low, high))
    assert node in rules[9811] and len(rules[9811]) == 2
    assert rules[9810] == [{"namespaceSelector": {"matchLabels": {"csi-qsd.io/metrics-scraper": "true"}}}]
    assert sorted(port for port, sources in rules.items() if not sources) == [9808, 9809, 9813]
