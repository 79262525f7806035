"""Status from what the cluster reports: Deployment statuses in, InferenceService status out.
Pure functions; reconcile.py feeds them the objects it read from the API server."""
from __future__ import annotations

from typing import Any

from .desired import ANNOTATION_QUANTIZATION, desired_replicas
from .models import InferenceServiceSpec


def unimplemented(spec: InferenceServiceSpec) -> list[str]:
    """Fields this operator version accepts but does not act on yet, and what happens instead."""
    found = []
    scaling = spec.autoscaling
    if scaling is not None and scaling.mode != "none":
        found.append(f"autoscaling.mode={scaling.mode} (replicas follow spec.replicas within "
                     f"min/max)")
    if spec.warmPool is not None and spec.warmPool.size > 0:
        found.append("warmPool (no standby replicas)")
    if spec.rollout is not None:
        found.append("rollout (a new revision replaces the old one once all its replicas are ready)")
    if spec.engine.speculative is not None:
        found.append("engine.speculative (engines decode without it)")
    if spec.engine.tensorParallelSize > 1:
        found.append(f"engine.tensorParallelSize={spec.engine.tensorParallelSize} (each replica "
                     f"runs one unsharded engine on its GPUs)")
    if spec.engine.quantization != "none":
        found.append(f"engine.quantization={spec.engine.quantization} (engines serve unquantized "
                     f"weights)")
    return found


def condition(type_: str, ok: bool | None, reason: str, message: str) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": type_, "status": status, "reason": reason, "message": message}


def deployment_counts(deployment: dict[str, Any]) -> tuple[int, int]:
    status = deployment.get("status") or {}
    return status.get("replicas") or 0, status.get("readyReplicas") or 0


def workload_condition(current: dict[str, Any] | None, desired: int) -> dict[str, Any]:
    if current is None:
        return condition("WorkloadReady", False, "Creating", "the revision's Deployment does not exist yet")
    name = current["metadata"]["name"]
    status = current.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return condition("WorkloadReady", False, "ProgressDeadlineExceeded",
                             f"{name}: {cond.get('message', '')}")
    settled = (status.get("observedGeneration") or 0) >= (current["metadata"].get("generation") or 0)
    ready = status.get("readyReplicas") or 0
    updated = status.get("updatedReplicas") or 0
    message = f"{ready}/{desired} replicas of {name} ready"
    if desired == 0:
        return condition("WorkloadReady", True, "ScaledToZero", f"{name} is scaled to zero")
    if settled and ready >= desired and updated >= desired:
        return condition("WorkloadReady", True, "ReplicasReady", message)
    return condition("WorkloadReady", False, "ReplicasNotReady", message)


def model_condition(current: dict[str, Any] | None, desired: int) -> dict[str, Any]:
    ready = deployment_counts(current)[1] if current else 0
    if ready > 0:  # /ready answers only after weights load and kernels warm up
        return condition("ModelLoaded", True, "Loaded", f"the model is loaded on {ready} replica(s)")
    if desired == 0:
        return condition("ModelLoaded", None, "ScaledToZero", "no replica is running")
    return condition("ModelLoaded", False, "Loading", "no replica has loaded the model yet")


def route_condition(router: dict[str, Any] | None) -> dict[str, Any]:
    """The router answers only once it knows a ready engine (its readiness probe)."""
    if router is None:
        return condition("RouteReady", False, "Creating", "the router's Deployment does not exist yet")
    ready = deployment_counts(router)[1]
    if ready > 0:
        return condition("RouteReady", True, "RouterReady", f"{ready} router replica(s) ready")
    return condition("RouteReady", False, "RouterNotReady", "no router replica is ready yet")


def ready_condition(workload: dict[str, Any], model: dict[str, Any], route: dict[str, Any]) -> dict[str, Any]:
    blocker = next((c for c in (workload, model, route) if c["status"] != "True"), None)
    if blocker is None:
        return condition("Ready", True, "Serving", workload["message"])
    return condition("Ready", False, blocker["reason"], blocker["message"])


def spec_condition(spec: InferenceServiceSpec) -> dict[str, Any]:
    missing = unimplemented(spec)
    if not missing:
        return condition("SpecImplemented", True, "AllImplemented", "every field in spec is acted on")
    return condition("SpecImplemented", False, "NotImplemented",
                     "accepted but not implemented yet: " + "; ".join(missing))


def stamp(conditions: list[dict[str, Any]], previous: list[dict[str, Any]], generation: int,
          now: str) -> list[dict[str, Any]]:
    """Add observedGeneration, and keep lastTransitionTime while a condition's status holds."""
    before = {c.get("type"): c for c in previous}
    out = []
    for cond in conditions:
        old = before.get(cond["type"])
        since = old["lastTransitionTime"] if old and old.get("status") == cond["status"] \
            and old.get("lastTransitionTime") else now
        out.append({**cond, "lastTransitionTime": since, "observedGeneration": generation})
    return out


def summarize(*, spec: InferenceServiceSpec, generation: int, revision: str,
              deployments: list[dict[str, Any]], previous: dict[str, Any], url: str,
              selector: str, now: str, router: dict[str, Any] | None) -> dict[str, Any]:
    """The whole status of an InferenceService, from its spec, its revisions' Deployments and
    its router's Deployment."""
    desired = desired_replicas(spec)
    current = next((d for d in deployments if d["metadata"]["name"] == revision), None)
    workload = workload_condition(current, desired)
    model = model_condition(current, desired)
    route = route_condition(router)
    conditions = [ready_condition(workload, model, route), workload, model, route, spec_condition(spec)]
    revisions = []
    for dep in sorted(deployments, key=lambda d: d["metadata"]["name"] != revision):
        replicas, ready = deployment_counts(dep)
        annotations = dep["metadata"].get("annotations") or {}
        revisions.append({"name": dep["metadata"]["name"],
                          "role": "stable" if dep["metadata"]["name"] == revision else "old",
                          "quantization": annotations.get(ANNOTATION_QUANTIZATION, "none"),
                          "replicas": replicas, "ready": ready})
    return {
        "observedGeneration": generation,
        "url": url,
        "replicas": sum(r["replicas"] for r in revisions),
        "readyReplicas": sum(r["ready"] for r in revisions),
        "desiredReplicas": desired,
        "selector": selector,
        "revisions": revisions,
        "conditions": stamp(conditions, previous.get("conditions") or [], generation, now),
    }


def stale_revisions(revision: str, deployments: list[dict[str, Any]], desired: int) -> list[str]:
    """Old revisions go once the current one serves at full strength (no canary yet)."""
    current = next((d for d in deployments if d["metadata"]["name"] == revision), None)
    if workload_condition(current, desired)["status"] != "True":
        return []
    return [d["metadata"]["name"] for d in deployments if d["metadata"]["name"] != revision]


def transitions(previous: dict[str, Any], status: dict[str, Any]) -> list[dict[str, Any]]:
    """Conditions whose status changed since the last written status (for Events)."""
    before = {c.get("type"): c.get("status") for c in previous.get("conditions") or []}
    return [c for c in status["conditions"] if before.get(c["type"]) != c["status"]]
