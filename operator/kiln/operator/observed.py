"""What one reconcile pass saw of an InferenceService's children: every object it owns, as
the API server stored it. A plain value, so plan() and the status functions are pure and
tests can feed them recorded cluster states."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .render import LABEL_COMPONENT, LABEL_REVISION, LABEL_SERVING

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


def live(pod: dict[str, Any]) -> bool:
    """A pod that still counts, as a ReplicaSet counts them: not terminating, and not ended for
    good (an evicted pod is Failed, with no deletionTimestamp, until it is garbage collected; its
    replacement is already made)."""
    return not pod["metadata"].get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") not in ("Failed", "Succeeded")


def serves(pod: dict[str, Any]) -> bool:
    """Whether a pod is capacity: every pod of a revision without a warm pool (unlabelled), and
    of one with a pool those not labelled standby. An unlabelled pod of a pooled revision (made
    before the pool was added; its Service routes only "true") counts too: the pool promotes
    such pods first (they are its oldest) and the Deployment's rollout replaces them."""
    return (pod["metadata"].get("labels") or {}).get(LABEL_SERVING) != "false"


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


# A log line's leading timestamp, which would make each restart's message new.
LOG_TIME = re.compile(r"^\[?\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?)?\]?\s+")


def engine_failure(pods: list[dict[str, Any]], min_restarts: int = 0) -> str | None:
    """The first failed exit of an unready engine container (restarted at least `min_restarts`
    times), as its pod's status tells it: the code, the kubelet's reason (Error, OOMKilled) and the
    last line of its termination message (the engine's log, FallbackToLogsOnError) without its
    time. No restart count either: a Warning Event is posted per distinct message, so a crash loop
    posts one, not one per restart. A pod being deleted tells nothing: an old crash-looping one
    still terminating would fail a retried canary's new pods at once."""
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            state, last = container.get("state") or {}, container.get("lastState") or {}
            exit_ = state.get("terminated") or last.get("terminated")
            if container.get("ready") or not exit_ or exit_.get("exitCode") == 0 \
                    or container.get("restartCount", 0) < min_restarts:
                continue
            lines = [line.strip() for line in (exit_.get("message") or "").splitlines() if line.strip()]
            said = f": {LOG_TIME.sub('', lines[-1])[:400]}" if lines else ""
            return (f"pod {pod['metadata']['name']}: the engine exited with code {exit_.get('exitCode')} "
                    f"({exit_.get('reason') or 'Error'}){said}")
    return None


# A container waiting for one of these is failing, not loading: it may never start.
FAILING = {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "ErrImageNeverPull", "InvalidImageName",
           "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
PULLING = {"ErrImagePull", "ImagePullBackOff"}


def engine_waiting(pods: list[dict[str, Any]]) -> str | None:
    """The first engine container that cannot start, as its kubelet says it: an image that cannot
    be pulled, a Secret or ConfigMap its env names that is missing. (A crash loop is told by
    engine_failure, from the exit.)"""
    for pod in pods:
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            name = pod["metadata"]["name"]
            if waiting.get("reason") in PULLING:
                # One message for both: the kubelet alternates them (only ErrImagePull says the
                # registry's error), and each new message of a Warning condition is an Event.
                return (f"pod {name}: the engine cannot start: image {container.get('image')} cannot be pulled "
                        f"(kubectl describe pod {name} shows the registry's error)")
            if waiting.get("reason") in FAILING - {"CrashLoopBackOff"}:
                said = f": {waiting['message'][:400]}" if waiting.get("message") else ""
                return f"pod {name}: the engine cannot start: {waiting['reason']}{said}"
    return None

