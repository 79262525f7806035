"""What one reconcile pass saw of an InferenceService's children: every object it owns, as
the API server stored it. A plain value, so plan() and the status functions are pure and
tests can feed them recorded cluster states."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .render import LABEL_COMPONENT, LABEL_REVISION

Key = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class Observed:
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, *objects: dict[str, Any]) -> Observed:
        return cls({(o["kind"], o["metadata"]["name"]): o for o in objects})

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    def of_kind(self, kind: str, component: str | None = None) -> list[dict[str, Any]]:
        found = [o for (k, _), o in sorted(self.objects.items()) if k == kind]
        if component is not None:
            found = [o for o in found if (o["metadata"].get("labels") or {}).get(LABEL_COMPONENT) == component]
        return found

    def engines(self) -> list[dict[str, Any]]:
        """The engine Deployments, one per revision."""
        return self.of_kind("Deployment", "engine")

    def engine(self, name: str) -> dict[str, Any] | None:
        return next((d for d in self.engines() if d["metadata"]["name"] == name), None)

    def router(self) -> dict[str, Any] | None:
        return next(iter(self.of_kind("Deployment", "router")), None)

    def pods(self, revision: str | None = None, component: str = "engine") -> list[dict[str, Any]]:
        """Pods by component, and of one revision if given (pods are found by label: their
        owner is a ReplicaSet, not the InferenceService)."""
        return [p for p in self.of_kind("Pod", component)
                if revision is None or (p["metadata"].get("labels") or {}).get(LABEL_REVISION) == revision]


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def deployment_counts(deployment: dict[str, Any]) -> tuple[int, int]:
    """(replicas, ready replicas) as the Deployment's status reports them."""
    status = deployment.get("status") or {}
    return status.get("replicas") or 0, status.get("readyReplicas") or 0


def replicas_of(deployment: dict[str, Any] | None) -> int:
    """The replicas a Deployment asks for (its spec, not what runs)."""
    if deployment is None:
        return 0
    replicas = (deployment.get("spec") or {}).get("replicas")
    return 1 if replicas is None else replicas  # the API server's default
