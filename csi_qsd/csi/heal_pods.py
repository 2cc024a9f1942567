"""After a rebuild cut pods off a volume: tell them, and delete those a controller makes again.

A QSD crash leaves each container that had a filesystem or block volume
holding the dead mount or device (`csi_qsd.node.cut_off`); kubelet restarts
a container only when it exits, and the container's process may just keep
failing. Like other node-local drivers that delete workload pods on an
unexpected detach, the plugin asks the API server (with its service
account, `csi_qsd.transport.kube_api.InCluster`) for the pods on this node, decides with
`heal_plan.decide`, posts an event on each pod naming the volume and the
crash, and deletes (with the pod's UID as a precondition, so a pod made
again under the same name is never hit) those owned by a controller that
makes them again. Runs in the background: the rebuild never waits for the
API. A failed API call is retried a few times, then logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import urllib.parse
from collections.abc import Mapping
from typing import Any

from csi_qsd.csi.heal_plan import EVENT_REASON, Action, Decision, claims_of, decide, pod_target
from csi_qsd.node.cut_off import CutOff
from csi_qsd.transport.kube_api import InCluster

log = logging.getLogger(__name__)

ATTEMPTS = 5
RETRY_SECONDS = 2.0


class PodHealer:
    """Heals the pods of this node that a rebuild cut off, one background task per rebuilt volume."""

    def __init__(self, api: InCluster, node: str, driver_name: str, *, delete: bool) -> None:
        self._api = api
        self._node = node
        self._component = driver_name
        self._delete = delete
        self._tasks: set[asyncio.Task[None]] = set()

    def heal_later(self, cut: CutOff) -> None:
        """Start healing `cut`'s pods; returns at once (a `CutOffTargets` listener)."""
        task = asyncio.get_running_loop().create_task(self._heal_retrying(cut), name=f"heal-{cut.volume_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """On driver shutdown: stop healing (a pod not yet told is told by nobody; its condition stays abnormal)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _heal_retrying(self, cut: CutOff) -> None:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                await self.heal(cut)
                return
            except (OSError, ValueError) as exc:
                log.warning("event=heal_failed volume_id=%s attempt=%d/%d error=%s", cut.volume_id, attempt,
                            ATTEMPTS, exc)
                await asyncio.sleep(RETRY_SECONDS * attempt)
            except Exception:
                log.exception("event=heal_failed volume_id=%s", cut.volume_id)
                return

    async def heal(self, cut: CutOff) -> list[Decision]:
        """Decide for each cut-off pod, post its event, delete those to delete. Raises OSError, ValueError."""
        uids = {t.pod_uid for t in map(pod_target, cut.targets) if t is not None}
        pods = [p for p in await asyncio.to_thread(self._pods_on_node) if p["metadata"].get("uid") in uids]
        pv_of_claim: dict[tuple[str, str], str] = {}
        for pod in pods:
            namespace = pod["metadata"]["namespace"]
            for claim in claims_of(pod).values():
                if (namespace, claim) not in pv_of_claim:
                    pv = await asyncio.to_thread(self._pv_of, namespace, claim)
                    if pv:
                        pv_of_claim[namespace, claim] = pv
        decisions = decide(pods, cut.targets, cut.block, pv_of_claim, self._delete)
        for decision in decisions:
            await asyncio.to_thread(self._event, decision, cut)
            if decision.action is Action.DELETE:
                await asyncio.to_thread(self._delete_pod, decision)
            log.warning("event=pod_healed volume_id=%s pod=%s/%s action=%s", cut.volume_id, decision.namespace,
                        decision.name, decision.action.value)
        return decisions

    def _pods_on_node(self) -> list[Mapping[str, Any]]:
        query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={self._node}"})
        return list(self._api.call("GET", f"/api/v1/pods?{query}").get("items") or [])

    def _pv_of(self, namespace: str, claim: str) -> str:
        try:
            found = self._api.call("GET", f"/api/v1/namespaces/{_q(namespace)}/persistentvolumeclaims/{_q(claim)}")
        except OSError as exc:
            log.warning("event=heal_claim_unknown claim=%s/%s error=%s", namespace, claim, exc)
            return ""
        return str((found.get("spec") or {}).get("volumeName") or "")

    def _event(self, decision: Decision, cut: CutOff) -> None:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{decision.name}.", "namespace": decision.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": decision.namespace,
                               "name": decision.name, "uid": decision.uid},
            "reason": EVENT_REASON, "type": "Warning", "message": f"{cut.message()}: {decision.why}",
            "source": {"component": self._component, "host": self._node},
            "reportingComponent": self._component, "reportingInstance": self._node,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self._api.call("POST", f"/api/v1/namespaces/{_q(decision.namespace)}/events", body=event)

    def _delete_pod(self, decision: Decision) -> None:
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": decision.uid}}
        try:
            self._api.call("DELETE", f"/api/v1/namespaces/{_q(decision.namespace)}/pods/{_q(decision.name)}",
                           body=options)
        except OSError as exc:
            if getattr(exc, "code", None) in (404, 409):  # gone already, or another pod now has the name
                return
            raise


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")
