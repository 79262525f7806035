"""Status from what the cluster reports: the pass's observed children in, InferenceService
status out. Pure functions; reconcile.py feeds them what it read from the API server."""
from __future__ import annotations

from typing import Any

from .desired import Desired, fully_ready
from .observed import Observed, deployment_counts, engine_failure, engine_waiting, is_ready, live, serves
from .render import ANNOTATION_QUANTIZATION

# Reasons that are Warnings; for these a new message is news too (another error).
WARNING_REASONS = {"EngineFailing", "ProgressDeadlineExceeded", "FailedCreate", "InvalidSpec", "Rejected",
                   "InsufficientCapacity", "MetricsUnavailable", "KEDANotInstalled", "RolledBack"}


def event_type(cond: dict[str, Any]) -> str:
    """The Event type of a condition's change: Warning for our failure reasons, and for the
    `Failed...` reasons an HPA passes on through ScalingReady (FailedGetPodsMetric: no adapter)."""
    failed = cond.get("status") == "False" and cond.get("reason", "").startswith("Failed")
    return "Warning" if cond.get("reason") in WARNING_REASONS or failed else "Normal"


# status.rollout.phase -> the CanaryReady condition (status, reason); its changes are the
# rollout's Events (a rollback is a Warning, naming the failed check and its figures).
CANARY = {"Progressing": (None, "Progressing"), "Paused": (None, "Paused"), "Promoted": (True, "Promoted"),
          "RolledBack": (False, "RolledBack")}


def condition(type_: str, ok: bool | None, reason: str, message: str) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": type_, "status": status, "reason": reason, "message": message}


def workload_condition(current: dict[str, Any] | None, desired: int, ready: int) -> dict[str, Any]:
    """`ready`: the revision's ready replicas that serve (a warm pool's standbys left out)."""
    if current is None:
        return condition("WorkloadReady", False, "Creating", "the revision's Deployment does not exist yet")
    name = current["metadata"]["name"]
    message = f"{ready}/{desired} replicas of {name} ready"
    # Before the Deployment's failures: with every serving replica ready, those are a warm pool's
    # standbys that cannot be made or scheduled, which WarmPoolReady reports; nothing is kept from serving.
    if desired == 0:
        return condition("WorkloadReady", True, "ScaledToZero", f"{name} is scaled to zero")
    if ready >= desired and fully_ready(current, desired):
        return condition("WorkloadReady", True, "ReplicasReady", message)
    failure = deployment_failure(current)
    if failure is not None:
        return condition("WorkloadReady", False, *failure)
    return condition("WorkloadReady", False, "ReplicasNotReady", message)


def deployment_failure(current: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of a Deployment that cannot make progress: past its progress deadline, or
    its pods cannot even be created (a ResourceQuota, Pod Security admission): the Deployment
    carries its ReplicaSet's FailedCreate, which no pod would ever report."""
    name = current["metadata"]["name"]
    for cond in (current.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return "ProgressDeadlineExceeded", f"{name}: {cond.get('message', '')}"
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return cond.get("reason") or "ReplicaFailure", f"{name}: {cond.get('message', '')}"
    return None


def model_condition(current: dict[str, Any] | None, desired: int, pods: list[dict[str, Any]]) -> dict[str, Any]:
    """pods: the revision's engine pods, whose failed exits say why none has loaded."""
    ready = deployment_counts(current)[1] if current else 0
    if ready == 0:
        # At zero too: a warm pool's standbys load the model, and one that cannot is the failure
        # the first request would meet (pods going away at a scale-down are no such news).
        staying = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        failure = engine_failure(staying) or engine_waiting(staying)
        if failure is not None:
            return condition("ModelLoaded", False, "EngineFailing", failure)
    if desired == 0:
        return condition("ModelLoaded", None, "ScaledToZero", "no replica serves")
    if ready > 0:  # /ready answers only after weights load and kernels warm up
        return condition("ModelLoaded", True, "Loaded", f"the model is loaded on {ready} replica(s)")
    return condition("ModelLoaded", False, "Loading", "no replica has loaded the model yet")


def route_condition(router: dict[str, Any] | None) -> dict[str, Any]:
    """The router is ready once it takes requests, with or without a ready engine."""
    if router is None:
        return condition("RouteReady", False, "Creating", "the router's Deployment does not exist yet")
    ready = deployment_counts(router)[1]
    if ready > 0:
        return condition("RouteReady", True, "RouterReady", f"{ready} router replica(s) ready")
    return condition("RouteReady", False, "RouterNotReady", "no router replica is ready yet")


def ready_condition(workload: dict[str, Any], model: dict[str, Any], route: dict[str, Any]) -> dict[str, Any]:
    # At zero replicas the service still answers: the router holds requests while one starts.
    at_zero = model["reason"] == "ScaledToZero"
    # A failing engine's exit says more than the replicas it leaves unready.
    order = (model, workload, route) if model["reason"] == "EngineFailing" else (workload, model, route)
    blocker = next((c for c in order if c["status"] != "True" and not (at_zero and c is model)), None)
    if blocker is None:
        return condition("Ready", True, "ScaledToZero" if at_zero else "Serving", workload["message"])
    return condition("Ready", False, blocker["reason"], blocker["message"])


def canary_condition(rollout: dict[str, Any], previous: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`previous`: the conditions status had. A spec back to the stable revision forgets the
    revision it rolled back (asked for again, it is a new rollout): after a rollback, that is no
    abort, and the RolledBack reason (with its Event) stays."""
    ok, reason = CANARY[rollout["phase"]]
    was = next((c.get("reason") for c in previous or [] if c.get("type") == "CanaryReady"), None)
    if rollout["phase"] == "RolledBack" and not rollout.get("rolledBack") and was != "RolledBack":
        ok, reason = False, "Aborted"  # the spec went back to the stable revision: nothing failed
    return condition("CanaryReady", ok, reason, rollout.get("message", ""))


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


def summarize(*, generation: int, desired: Desired, observed: Observed, previous: dict[str, Any], url: str,
              selector: str, now: str, served_model: str | None = None, scaling: dict[str, Any] | None = None,
              autoscaling: dict[str, Any] | None = None, rollout: dict[str, Any] | None = None,
              warm: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole status of an InferenceService, from what this pass wants and what it observed;
    `scaling` is the ScalingReady condition, `autoscaling` the builtin autoscaler's block,
    `rollout` the rollout's state (status.rollout), `warm` the warm pool's block and its
    WarmPoolReady condition."""
    stable = desired.stable
    current = observed.engine(stable.name)
    # Ready counts serving replicas only: standbys alone are none (at zero the router holds requests
    # and the first one promotes a standby), and a pool still refilling after a promotion, or one no
    # node has room for, keeps nothing from serving. WarmPoolReady tells how the pool stands.
    target = stable.replicas or 0 if stable.serving is None else stable.serving
    workload = workload_condition(current, target, serving_counts(current, observed)[1] if current else 0)
    model = model_condition(current, target, observed.pods(stable.name))
    route = route_condition(observed.router())
    conditions = [ready_condition(workload, model, route), workload, model, route]
    if scaling is not None:
        conditions.append(scaling)
    if rollout is not None:
        conditions.append(canary_condition(rollout, previous.get("conditions")))
    if warm is not None:
        conditions.append(warm[1])
    revisions = []
    for revision in desired.revisions:
        found = observed.engine(revision.name)
        replicas, ready = serving_counts(found, observed) if found else (0, 0)
        annotations = (found or revision.deployment or {}).get("metadata", {}).get("annotations") or {}
        revisions.append({"name": revision.name, "role": revision.role,
                          "quantization": annotations.get(ANNOTATION_QUANTIZATION, "none"),
                          "replicas": replicas, "ready": ready,
                          **({"weight": revision.weight} if revision.weight is not None else {})})
    return {
        "observedGeneration": generation,
        "url": url,
        **({"model": served_model} if served_model else {}),
        "replicas": sum(r["replicas"] for r in revisions),
        "readyReplicas": sum(r["ready"] for r in revisions),
        "desiredReplicas": target if stable.serving is None else stable.serving,
        "selector": selector,
        "revisions": revisions,
        "conditions": stamp(conditions, previous.get("conditions") or [], generation, now),
        **({"autoscaling": autoscaling} if autoscaling else {}),
        **({"rollout": rollout} if rollout else {}),
        **({"warmReplicas": warm[0]["ready"], "warmPool": warm[0]} if warm else {}),
    }


def serving_counts(deployment: dict[str, Any], observed: Observed) -> tuple[int, int]:
    """(replicas, ready replicas) of a revision that serve: its Deployment's, less a warm pool's
    standbys (observed.live: as a ReplicaSet counts pods). What /scale reports
    back to the HPA or KEDA that set spec.replicas, and what `kubectl get` shows: standbys are
    status.warmReplicas."""
    replicas, ready = deployment_counts(deployment)
    standbys = [p for p in observed.pods(deployment["metadata"]["name"]) if live(p) and not serves(p)]
    return max(replicas - len(standbys), 0), max(ready - sum(map(is_ready, standbys)), 0)


def invalid(current: dict[str, Any], generation: int, reason: str, message: str, now: str,
            stored: dict[str, Any] | None = None) -> dict[str, Any]:
    """`current` with Ready False saying why (a spec this operator cannot act on, or a child the
    API server refused). Ready's transition time is judged against `stored`, the status as
    written (default `current`): against a freshly summarized Ready=True it moved on every pass.
    The other conditions are kept as they are, with the generation they saw."""
    stored = current if stored is None else stored
    others = [c for c in current.get("conditions") or [] if c.get("type") != "Ready"]
    ready = stamp([condition("Ready", False, reason, message)], stored.get("conditions") or [], generation, now)
    return {**current, "observedGeneration": generation, "conditions": [*ready, *others]}


def transitions(previous: dict[str, Any], status: dict[str, Any]) -> list[dict[str, Any]]:
    """Conditions that changed since the stored status (for Events): a new status or reason,
    or, for a Warning, a new message (another error)."""
    def news(c: dict[str, Any]) -> tuple:
        return c.get("status"), c.get("reason"), c.get("message") if c.get("reason") in WARNING_REASONS else None
    before = {c.get("type"): news(c) for c in previous.get("conditions") or []}
    return [c for c in status["conditions"] if before.get(c["type"]) != news(c)]
