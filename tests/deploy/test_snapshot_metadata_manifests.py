"""deploy/snapshot-metadata/ fits together: sidecar ↔ router socket, router ↔ node listeners, Secrets,
certificate names, the SnapshotMetadataService and the sidecar's RBAC, and the per-node identities of
node-identity/ with the flags of the containers they serve."""

from __future__ import annotations

import argparse
import re

import pytest

from testing.manifests.kustomize import load_yaml_documents
from testing.manifests.objects import (
    DRIVER_NAME,
    NAMESPACE,
    SNAPSHOT_METADATA_DIR,
    SNAPSHOT_METADATA_SERVICE,
    Obj,
    container,
    flag_value,
    one,
)

SIDECAR = "csi-snapshot-metadata"


@pytest.fixture
def pod(snapshot_metadata: list[Obj]) -> Obj:
    spec: Obj = one(snapshot_metadata, "Deployment", "csi-qsd-snapshot-metadata")["spec"]["template"]["spec"]
    return spec


@pytest.fixture
def router_args(pod: Obj) -> list[str]:
    args: list[str] = container(pod, "router")["args"]
    return args


def _mounts(pod: Obj, name: str) -> dict[str, str]:
    """mountPath -> volume name, of one container."""
    return {m["mountPath"]: m["name"] for m in container(pod, name).get("volumeMounts") or []}


def _secret_of(pod: Obj, name: str, path: str) -> str:
    """The Secret mounted in container `name` at the directory holding `path`."""
    directory = path.rsplit("/", 1)[0]
    volume = _mounts(pod, name)[directory]
    secret: str = next(v for v in pod["volumes"] if v["name"] == volume)["secret"]["secretName"]
    return secret


def test_router_command_line_parses(router_args: list[str]) -> None:
    from csi_qsd.cli import build_parser, router_config_from

    try:
        args = build_parser().parse_args(router_args)
    except SystemExit:
        pytest.fail(f"csi-qsd rejects the router's arguments {router_args}")
    assert isinstance(args, argparse.Namespace)
    config = router_config_from(args)
    assert config.driver_name == DRIVER_NAME and config.nodes_dns and not config.nodes


def test_sidecar_reaches_the_router_socket(pod: Obj, router_args: list[str]) -> None:
    endpoint = flag_value(router_args, "--endpoint")
    assert endpoint.startswith("unix://")
    socket = flag_value(container(pod, SIDECAR)["args"], "--csi-address")
    assert endpoint == f"unix://{socket}"
    directory = socket.rsplit("/", 1)[0]
    volume = _mounts(pod, SIDECAR)[directory]
    assert _mounts(pod, "router")[directory] == volume
    assert next(v for v in pod["volumes"] if v["name"] == volume) == {"name": volume, "emptyDir": {}}


def test_both_containers_share_one_unprivileged_user(pod: Obj) -> None:
    context = pod["securityContext"]
    assert context["runAsNonRoot"] and context["runAsUser"] == context["runAsGroup"] == context["fsGroup"]
    for spec in pod["containers"]:
        assert "runAsUser" not in (spec.get("securityContext") or {})
        assert spec["securityContext"]["allowPrivilegeEscalation"] is False


def test_router_finds_every_node_listener(
    snapshot_metadata: list[Obj], base: list[Obj], router_args: list[str]
) -> None:
    host, port = flag_value(router_args, "--nodes-dns").rsplit(":", 1)
    name, namespace, svc = host.split(".")
    assert (namespace, svc) == (NAMESPACE, "svc")
    service = one(snapshot_metadata, "Service", name)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    daemonset = one(base, "DaemonSet", "csi-qsd-node")
    assert service["spec"]["selector"] == daemonset["spec"]["selector"]["matchLabels"]
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == int(port)
    plugin = container(daemonset["spec"]["template"]["spec"], "csi-qsd")
    listener_port = next(p["containerPort"] for p in plugin["ports"] if p["name"] == service_port["targetPort"])
    assert flag_value(plugin["args"], "--metadata-address").rsplit(":", 1)[1] == str(listener_port) == port


def test_secrets_and_certificate_names_agree(
    pod: Obj, router_args: list[str], base: list[Obj], cert_manager: list[Obj]
) -> None:
    certificates = {c["spec"]["secretName"]: c["spec"] for c in cert_manager if c["kind"] == "Certificate"}
    node_pod = one(base, "DaemonSet", "csi-qsd-node")["spec"]["template"]["spec"]
    node_args = container(node_pod, "csi-qsd")["args"]
    node_secret = _secret_of(node_pod, "csi-qsd", flag_value(node_args, "--metadata-cert"))
    assert flag_value(router_args, "--tls-server-name") in certificates[node_secret]["dnsNames"]
    assert "server auth" in certificates[node_secret]["usages"]
    # Shared by every node, it names none: no client use, so it cannot pass for a node (or the router).
    assert "client auth" not in certificates[node_secret]["usages"] and "commonName" not in certificates[node_secret]
    router_secret = _secret_of(pod, "router", flag_value(router_args, "--tls-cert"))
    assert "client auth" in certificates[router_secret]["usages"]
    sidecar_secret = _secret_of(pod, SIDECAR, flag_value(container(pod, SIDECAR)["args"], "--tls-cert"))
    (service,) = load_yaml_documents(SNAPSHOT_METADATA_SERVICE)
    assert service["spec"]["address"].rsplit(":", 1)[0] in certificates[sidecar_secret]["dnsNames"]
    # Node and router certificates come from one CA: each side trusts the other's issuer (ca.crt).
    issuers = {certificates[s]["issuerRef"]["name"] for s in (node_secret, router_secret, sidecar_secret)}
    assert len(issuers) == 1
    for flag, secret in (("--tls-key", router_secret), ("--tls-ca", router_secret)):
        assert _secret_of(pod, "router", flag_value(router_args, flag)) == secret
    for flag in ("--metadata-key", "--metadata-client-ca"):
        assert _secret_of(node_pod, "csi-qsd", flag_value(node_args, flag)) == node_secret


def test_snapshot_metadata_service_points_at_the_sidecar(snapshot_metadata: list[Obj], pod: Obj) -> None:
    (service,) = load_yaml_documents(SNAPSHOT_METADATA_SERVICE)
    assert service["metadata"]["name"] == DRIVER_NAME
    host, port = service["spec"]["address"].rsplit(":", 1)
    name, namespace = host.split(".")
    assert namespace == NAMESPACE
    (service_port,) = one(snapshot_metadata, "Service", name)["spec"]["ports"]
    assert service_port["port"] == int(port)
    sidecar_ports = {p["name"]: p["containerPort"] for p in container(pod, SIDECAR)["ports"]}
    assert service_port["targetPort"] in sidecar_ports
    assert service["spec"]["audience"]


@pytest.mark.parametrize(("group", "resource", "verbs"), [
    ("authentication.k8s.io", "tokenreviews", {"create"}),
    ("authorization.k8s.io", "subjectaccessreviews", {"create"}),
    ("snapshot.storage.k8s.io", "volumesnapshots", {"get", "list"}),
    ("snapshot.storage.k8s.io", "volumesnapshotcontents", {"get", "list"}),
    ("cbt.storage.k8s.io", "snapshotmetadataservices", {"get", "list"}),
])
def test_sidecar_rbac(snapshot_metadata: list[Obj], pod: Obj, group: str, resource: str, verbs: set[str]) -> None:
    account = pod["serviceAccountName"]
    one(snapshot_metadata, "ServiceAccount", account)
    granted: set[str] = set()
    for binding in snapshot_metadata:
        if binding["kind"] != "ClusterRoleBinding":
            continue
        if {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} not in binding["subjects"]:
            continue
        role = one(snapshot_metadata, "ClusterRole", binding["roleRef"]["name"])
        for rule in role["rules"]:
            if group in rule["apiGroups"] and resource in rule["resources"]:
                granted |= set(rule["verbs"])
    assert verbs <= granted
    for role in (o for o in snapshot_metadata if o["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "secrets" not in rule["resources"]


NODE_IDENTITY_DIR = SNAPSHOT_METADATA_DIR / "node-identity"


def _helper_files(conf: str) -> dict[str, str]:
    """spiffe-helper's HCL settings (one `key = "value"` a line)."""
    return dict(re.findall(r'^\s*(\w+)\s*=\s*"([^"]*)"', conf, re.MULTILINE))


def test_node_identities_name_the_node_first_and_the_router_s_server_name(
        base: list[Obj], snapshot_metadata: list[Obj], router_args: list[str]) -> None:
    """SPIRE makes the first DNS name the common name: it must be the node's name (what the copy service and
    qemu-nbd check); the router's --tls-server-name must be there too; the selectors pick the pods."""
    identities = {o["metadata"]["name"]: o["spec"] for o in load_yaml_documents(NODE_IDENTITY_DIR / "clusterspiffeids.yaml")}
    node, router = identities["csi-qsd-node"], identities["csi-qsd-snapshot-metadata-router"]
    assert node["dnsNameTemplates"][0] == "{{ .PodSpec.NodeName }}"
    assert flag_value(router_args, "--tls-server-name") in node["dnsNameTemplates"]
    assert "NodeName" not in router["dnsNameTemplates"][0]
    daemonset = one(base, "DaemonSet", "csi-qsd-node")
    deployment = one(snapshot_metadata, "Deployment", "csi-qsd-snapshot-metadata")
    for spec, workload in ((node, daemonset), (router, deployment)):
        assert spec["podSelector"]["matchLabels"] == workload["spec"]["template"]["metadata"]["labels"]
        assert spec["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}


def test_spiffe_helper_writes_the_files_the_containers_read(base: list[Obj], pod: Obj, router_args: list[str]) -> None:
    (config_map,) = load_yaml_documents(NODE_IDENTITY_DIR / "spiffe-helper.yaml")
    node_pod = one(base, "DaemonSet", "csi-qsd-node")["spec"]["template"]["spec"]
    node_args = container(node_pod, "csi-qsd")["args"]
    for conf, args, flags in (
            ("node.conf", node_args, ("--metadata-cert", "--metadata-key", "--metadata-client-ca")),
            ("router.conf", router_args, ("--tls-cert", "--tls-key", "--tls-ca"))):
        helper = _helper_files(config_map["data"][conf])
        written = [f"{helper['cert_dir']}/{helper[key]}" for key in (
            "svid_file_name", "svid_key_file_name", "svid_bundle_file_name")]
        assert written == [flag_value(args, flag) for flag in flags], conf
