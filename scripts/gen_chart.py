#!/usr/bin/env python3
"""Generate the Helm chart charts/csi-qsd/ from the manifests in deploy/: one source, no second copy to drift.

deploy/ is what `kubectl apply -k deploy/` applies, and the only place the
objects are written. This script reads its kustomization's resources and
writes each file again as a chart template, with a few fields made values:
the namespace, the images and their pull policy, the state and pool
directories, the QSD shards, the peers, the plugin's extra flags, the
StorageClasses and the VolumeSnapshotClass. With the default values
(values.yaml, written here from deploy/ too) `helm template` renders the
very objects `kubectl kustomize deploy/` does; the cluster tier checks that
(e2e/cluster/test_helm.py) and tests/deploy/test_chart.py checks that the
committed chart is this script's output. A change to deploy/ that moves a
field this script turns into a value stops it with an error naming the
field.

Usage (from the repository root): python scripts/gen_chart.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
DEPLOY = REPO_ROOT / "deploy"
CHART = REPO_ROOT / "charts" / "csi-qsd"
DRIVER_IMAGE = "ghcr.io/csi-qsd/csi-qsd"
NAMESPACE = "csi-qsd"
STATE_DIR = "/var/lib/csi-qsd"
NS = "{{ .Values.namespace.name }}"
IMAGE = '{{ printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}'

Obj = dict[str, Any]


class Holes:
    """Template text standing for parts of the objects: a token in the dumped YAML, replaced after the dump.

    `inline` text replaces the token where it stands (a scalar); a `block` replaces the whole line holding
    the token (a key or a list item), each of its lines indented as that line was.
    """

    def __init__(self) -> None:
        self.inline: dict[str, str] = {}
        self.blocks: dict[str, str] = {}

    def value(self, text: str) -> str:
        token = f"helm-hole-{len(self.inline) + len(self.blocks)}"
        self.inline[token] = text
        return token

    def block(self, text: str) -> str:
        token = f"helm-hole-{len(self.inline) + len(self.blocks)}"
        self.blocks[token] = text.strip("\n")
        return token

    def fill(self, dumped: str) -> str:
        lines = []
        for line in dumped.splitlines():
            token = next((t for t in self.blocks if re.search(rf"\b{t}\b", line)), None)
            if token is None:
                lines.append(line)
                continue
            indent = line[:len(line) - len(line.lstrip())]
            lines += [indent + part if part else part for part in self.blocks[token].splitlines()]
        text = "\n".join(lines) + "\n"
        for token, expression in self.inline.items():
            text = re.sub(rf"\b{token}\b", lambda _: expression, text)
        return text


def _fail(where: str, what: str) -> None:
    raise SystemExit(f"gen_chart: {where}: {what}; deploy/ changed shape: update scripts/gen_chart.py")


def _load(name: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def resources() -> list[str]:
    """deploy/kustomization.yaml's resources (files only, as this script renders them)."""
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "images"}
    if unknown:
        _fail("kustomization.yaml", f"keys this script does not render: {sorted(unknown)}")
    return list(kustomization["resources"])


def driver_tag() -> str:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    [rule] = [r for r in kustomization["images"] if r["name"] == DRIVER_IMAGE]
    if set(rule) != {"name", "newTag"}:
        _fail("kustomization.yaml", f"the image rule {rule} is not a newTag")
    return str(rule["newTag"])


def _camel(name: str) -> str:
    head, *rest = name.split("-")
    return head + "".join(part.capitalize() for part in rest)


def _namespaced(obj: Obj, holes: Holes) -> None:
    """The driver's namespace, wherever deploy/ names it, made `namespace.name`."""
    metadata = obj["metadata"]
    if obj["kind"] == "Namespace":
        metadata["name"] = holes.value(NS)
    if metadata.get("namespace") == NAMESPACE:
        metadata["namespace"] = holes.value(NS)
    for subject in obj.get("subjects") or []:
        if subject.get("namespace") == NAMESPACE:
            subject["namespace"] = holes.value(NS)


def _with_key_after(mapping: Obj, after: str, key: str, value: Any) -> Obj:
    out: Obj = {}
    for k, v in mapping.items():
        out[k] = v
        if k == after:
            out[key] = value
    return out


def _arg(container: Obj, prefix: str, where: str) -> int:
    found = [i for i, a in enumerate(container["args"]) if a.startswith(prefix)]
    if len(found) != 1:
        _fail(where, f"container {container['name']} has {len(found)} args starting {prefix!r}")
    return found[0]


POOL_VOLUME = """
{{- with .Values.poolDir }}
- name: pool-dir
  hostPath:
    path: {{ . | quote }}
    type: DirectoryOrCreate
{{- end }}"""
POOL_MOUNT = """
{{- with .Values.poolDir }}
- name: pool-dir
  mountPath: {{ . | quote }}
{{- end }}"""
POOL_ARG = """
{{- with .Values.poolDir }}
- --pool-dir={{ . }}
{{- end }}"""
SHARDS_ARG = """
{{- if ne (int .Values.qsdShards) 1 }}
- --qsd-shards={{ .Values.qsdShards }}
{{- end }}"""
PEER_ARGS = """
{{- range .Values.peers.static }}
- --peer={{ . }}
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}"""
PULL_POLICY = """
{{- with .Values.imagePullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}"""


def _daemonset(ds: Obj, holes: Holes, sidecars: dict[str, str]) -> None:
    where = "node.yaml"
    spec = ds["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in spec["containers"]}
    if set(by_name) - {"csi-qsd", "qsd"} != set(sidecars) and sidecars:
        _fail(where, f"the sidecars are {sorted(set(by_name) - {'csi-qsd', 'qsd'})}")
    for index, container in enumerate(spec["containers"]):
        name = container["name"]
        if name in ("csi-qsd", "qsd"):
            if container["image"] != DRIVER_IMAGE:
                _fail(where, f"container {name} runs {container['image']}, not {DRIVER_IMAGE}")
            container["image"] = holes.value(IMAGE)
        else:
            sidecars[name] = container["image"]
            container["image"] = holes.value(f"{{{{ .Values.sidecars.{_camel(name)}.image }}}}")
        if "imagePullPolicy" in container:
            _fail(where, f"container {name} sets imagePullPolicy")
        spec["containers"][index] = container = _with_key_after(container, "image", holes.block(PULL_POLICY), None)
        by_name[name] = container
    plugin, qsd = by_name["csi-qsd"], by_name["qsd"]
    peers = _arg(plugin, "--peers-from-pods=", where)
    plugin["args"][peers] = holes.block("{{- if .Values.peers.fromPods }}\n- " + plugin["args"][peers] + "\n{{- end }}")
    plugin["args"] += [holes.block(POOL_ARG), holes.block(SHARDS_ARG), holes.block(PEER_ARGS)]
    _arg(qsd, "--state-dir=", where)
    qsd["args"] += [holes.block(POOL_ARG), holes.block(SHARDS_ARG)]
    for container in (plugin, qsd):
        container["volumeMounts"].append(holes.block(POOL_MOUNT))
    [state] = [v for v in spec["volumes"] if v["name"] == "state-dir"]
    if state.get("hostPath", {}).get("path") != STATE_DIR:
        _fail(where, f"the state-dir volume is {state}")
    state["hostPath"]["path"] = holes.value("{{ .Values.stateDir | quote }}")
    spec["volumes"].append(holes.block(POOL_VOLUME))


CLASS_FIELDS = ("parameters", "reclaimPolicy", "allowVolumeExpansion", "volumeBindingMode")


def _storage_class(sc: Obj, holes: Holes, classes: dict[str, Obj]) -> tuple[str, str]:
    name = sc["metadata"]["name"]
    key = _camel(name.removeprefix("csi-qsd-"))
    classes[key] = {"name": name, **{f: sc[f] for f in CLASS_FIELDS if f in sc}}
    values = f".Values.storageClasses.{key}"
    sc["metadata"]["name"] = holes.value(f"{{{{ {values}.name }}}}")
    sc["metadata"]["annotations"] = holes.block(
        f'{{{{- if {values}.default }}}}\nannotations:\n  storageclass.kubernetes.io/is-default-class: "true"\n'
        "{{- end }}")
    for field in CLASS_FIELDS:
        if field not in sc:
            _fail("storageclasses.yaml", f"{name} has no {field}")
    sc["parameters"] = holes.block(f"parameters:\n  {{{{- toYaml {values}.parameters | nindent 2 }}}}")
    for field in CLASS_FIELDS[1:]:
        sc[field] = holes.value(f"{{{{ {values}.{field} }}}}")
    return f"{{{{- if {values}.enabled }}}}", "{{- end }}"


def render_templates() -> tuple[dict[str, str], dict[str, Any]]:
    """Each template file's text, and what values.yaml's defaults take from deploy/."""
    files: dict[str, str] = {}
    sidecars: dict[str, str] = {}
    classes: dict[str, Obj] = {}
    for name in resources():
        docs = _load(name)
        parts = []
        for doc in docs:
            holes = Holes()
            _namespaced(doc, holes)
            guard = ("", "")
            kind = doc["kind"]
            if kind == "Namespace":
                guard = ("{{- if .Values.namespace.create }}", "{{- end }}")
            elif kind == "DaemonSet":
                _daemonset(doc, holes, sidecars)
            elif kind == "StorageClass":
                guard = _storage_class(doc, holes, classes)
            elif kind == "VolumeSnapshotClass":
                guard = ("{{- if .Values.snapshotClass.enabled }}", "{{- end }}")
            body = holes.fill(yaml.safe_dump(doc, sort_keys=False, width=1000, default_flow_style=False))
            parts.append("\n".join(p for p in (guard[0], body.rstrip("\n"), guard[1]) if p) + "\n")
        header = (f"{{{{- /* Generated from deploy/{name} by scripts/gen_chart.py: edit deploy/ and run it again. "
                  "Why each field is what it is: the comments in deploy/. */}}\n")
        files[name] = header + "---\n".join(parts)
    return files, {"tag": driver_tag(), "sidecars": sidecars, "classes": classes}


def _dump_block(value: Any, indent: int) -> str:
    text = yaml.safe_dump(value, sort_keys=False, width=1000, default_flow_style=False)
    return "".join(" " * indent + line + "\n" for line in text.splitlines())


def render_values(defaults: dict[str, Any]) -> str:
    sidecars = "".join(f"  {_camel(name)}:\n    image: {image}\n" for name, image in defaults["sidecars"].items())
    classes = ""
    for key, fields in defaults["classes"].items():
        classes += f"  {key}:\n    enabled: true\n    default: false\n" + _dump_block(fields, 4)
    return f"""# Generated by scripts/gen_chart.py; the defaults are deploy/'s, so that `helm template` with them renders
# what `kubectl kustomize deploy/` does. The reasoning behind each choice: deploy/README.md.

namespace:
  # Every object of the chart lives here (the chart makes it, with the pod-security labels the privileged
  # node plugin needs): install with `helm install csi-qsd charts/csi-qsd`, no --namespace.
  name: {NAMESPACE}
  create: true

# The driver's image: the plugin and qemu-storage-daemon containers. A new tag updates the DaemonSet's
# template only (updateStrategy OnDelete: a rolling update would stop every volume on the node); each
# node's plugin container is then upgraded in place (charts/csi-qsd/README.md, "Upgrading").
image:
  repository: {DRIVER_IMAGE}
  tag: {json.dumps(defaults['tag'])}

# Every container's imagePullPolicy; empty leaves the cluster's default (IfNotPresent for a tagged image).
imagePullPolicy: ""

# The CSI sidecars, at the releases deploy/node.yaml names.
sidecars:
{sidecars}
# The node's directory for the catalog, QSD's sockets and exports, and by default the pool.
stateDir: {STATE_DIR}
# A host directory for the volumes' images instead of <stateDir>/pool (`--pool-dir`); put it on XFS or
# btrfs for the best write throughput (docs/tuning.md).
poolDir: ""

# qemu-storage-daemon processes per node, each serving its volumes from its own main loop (1..8;
# docs/tuning.md, "QSD shards"). Change it only on nodes with no volume staged.
qsdShards: 1

# The other nodes' plugins, for restores and clones onto another node.
peers:
  # Found in the Kubernetes API: this DaemonSet's running pods (`--peers-from-pods`).
  fromPods: true
  # Or named: NAME=HOST:PORT entries (`--peer`).
  static: []

# More flags for `csi-qsd serve` (docs/tuning.md lists them), e.g. ["--iothreads=4"].
extraArgs: []

# The StorageClasses; parameters are strings (quote numbers and "on"/"off"). docs/tuning.md lists them.
storageClasses:
{classes}
# The VolumeSnapshotClass (needs the snapshot CRDs and a snapshot-controller with
# --enable-distributed-snapshotting).
snapshotClass:
  enabled: true
"""


def render_chart_yaml() -> str:
    version = re.search(r'^version = "(.*)"$', (REPO_ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    return f"""# Generated by scripts/gen_chart.py.
apiVersion: v2
name: csi-qsd
description: Node-local volumes served by qemu-storage-daemon, for pods and VMs (vhost-user-blk)
type: application
version: {version.group(1)}
appVersion: {json.dumps(driver_tag())}
home: https://github.com/csi-qsd/csi-qsd
"""


def generate() -> dict[str, str]:
    """Every generated file of the chart, by its path under charts/csi-qsd/."""
    templates, defaults = render_templates()
    out = {f"templates/{name}": text for name, text in templates.items()}
    out["values.yaml"] = render_values(defaults)
    out["Chart.yaml"] = render_chart_yaml()
    return out


def write(chart: Path = CHART) -> None:
    for relative, text in generate().items():
        path = chart / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


if __name__ == "__main__":
    write()
    print(f"wrote {CHART}", file=sys.stderr)
