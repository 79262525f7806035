"""Who sets the stable revision's replicas in this pass, and what status says about it: the
`ScalingReady` condition and, for the builtin autoscaler, `status.autoscaling` (which is also
where the autoscaler's state survives an operator restart). Pure: reconcile.py brings the
samples it scraped and the time."""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace
from typing import Any

from .autoscaler import Sample, ScalerState, decide
from .models import GROUP, KIND, VERSION, InferenceServiceSpec, seconds
from .observed import FAILING, Observed, engine_failure, is_ready, live, replicas_of, serves
from .quantity import canonical
from .render import LABEL_ISVC, LOAD_DEADLINE_S, PORT, ROUTER_PORT, Owner, metadata, template_pooled
from .status import condition


@dataclass(frozen=True)
class Scaling:
    replicas: int | None  # what the builtin autoscaler decided for the stable revision; None: not builtin
    condition: dict[str, Any]
    status: dict[str, Any] = field(default_factory=dict)  # status.autoscaling
    changed_from: int | None = None  # the replicas before a decision that changed them
    objects: list[dict[str, Any]] = field(default_factory=list)  # an HPA or ScaledObject to keep


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def epoch(text: str | None) -> float | None:
    """An RFC 3339 time as our status writes it (`...Z`) or as the Kubernetes client serializes
    a stored object's (`...+00:00`, pods' condition times)."""
    if not text:
        return None
    parsed = datetime.datetime.fromisoformat(text)
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)).timestamp()


def failing(pod: dict[str, Any]) -> bool:
    """A pod whose engine failed (exited with an error, or cannot be started): not on its way."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return engine_failure([pod]) is not None or any(
        ((c.get("state") or {}).get("waiting") or {}).get("reason") in FAILING for c in statuses)


def stuck(pod: dict[str, Any], now: float) -> bool:
    started = epoch((pod.get("status") or {}).get("startTime"))
    return started is not None and now - started > LOAD_DEADLINE_S


# PodScheduled=False reasons of a pod that is not on its way: no node fits it, or a scheduling gate
# holds it until something (a quota's admission) lifts the gate, which may never happen.
NOT_SCHEDULED = ("Unschedulable", "SchedulingGated")


def pod_counts(observed: Observed, revision: str, now: float | None = None) -> tuple[int, int, int, str | None]:
    """(ready, loading, unschedulable, why they cannot be scheduled) for a revision's pods;
    terminating pods are neither capacity nor on their way, a warm pool's ready standbys serve
    nobody yet, and neither a pod no node fits (or that a scheduling gate holds) nor one whose
    engine fails (a crash loop, an image that cannot be pulled) is loading: it must not hold a
    scale-down, even to zero (it may never start, and holding it would keep a cluster autoscaler
    adding nodes for no load). Given `now`, nor is one started LOAD_DEADLINE_S ago and still not
    ready (a load hung on its storage)."""
    ready = loading = unschedulable = 0
    why = None
    for pod in observed.pods(revision):
        if not live(pod):  # terminating or ended: not loading, so not holding a scale-down
            continue
        if is_ready(pod):
            ready += serves(pod)
            continue
        conditions = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
        scheduled = conditions.get("PodScheduled", {})
        if scheduled.get("status") == "False" and scheduled.get("reason") in NOT_SCHEDULED:
            unschedulable += 1
            why = scheduled.get("message", "no node fits the pod")
        elif not failing(pod) and not (now is not None and stuck(pod, now)):
            loading += 1
    return ready, loading, unschedulable, why


def metrics_urls(observed: Observed) -> tuple[list[str], list[str]]:
    """The /metrics of the ready engine pods that serve (every revision's) and of the ready routers.
    A warm pool's standbys serve nobody: counted, their zeros would pull the average down that
    stands in for a serving pod that did not answer."""
    engines = [f"http://{p['status']['podIP']}:{PORT}/metrics" for p in observed.pods()
               if is_ready(p) and serves(p)]
    routers = [f"http://{p['status']['podIP']}:{ROUTER_PORT}/metrics"
               for p in observed.pods(component="router") if is_ready(p)]
    return engines, routers


def scaler_state(previous: dict[str, Any], initial: int) -> ScalerState:
    saved = previous.get("autoscaling") or {}
    if "replicas" not in saved:
        return ScalerState(initial)
    asks = tuple((a["replicas"], epoch(a["time"])) for a in saved.get("scaleDownAsks") or ())
    return ScalerState(saved["replicas"], epoch(saved.get("panicUntil")), epoch(saved.get("scaleDownSince")),
                       asks, epoch(saved.get("lastScaleTime")))


# How often the load alone is written to status (the HPA's sync period).
LOAD_EVERY_S = 15.0


def builtin(spec: InferenceServiceSpec, observed: Observed, stable: str, previous: dict[str, Any],
            samples: list[Sample], now: float, initial: int, cold_start: float | None = None) -> Scaling:
    """One decision of the builtin autoscaler for the stable revision; `cold_start`: the
    routers' latest held-to-first-byte time, if they saw one."""
    assert spec.autoscaling is not None
    state = scaler_state(previous, initial)
    saved = previous.get("autoscaling") or {}  # the last pass's status.autoscaling
    ready, loading, _, _ = pod_counts(observed, stable, now)
    elsewhere = sum(1 for p in observed.pods() if is_ready(p) and serves(p)) - ready
    decision, new = decide(samples, spec.autoscaling, state, ready, loading, now, elsewhere)
    status = {"replicas": new.replicas, "mode": decision.mode,
              "load": None if decision.load is None else round(decision.load, 1),
              "panicUntil": iso(new.panic_until), "scaleDownSince": iso(new.lower_since),
              "scaleDownAsks": [{"replicas": ask, "time": iso(at)} for ask, at in new.lower_asks] or None,
              "lastScaleTime": iso(new.last_scale)}
    last_cold = cold_start
    if last_cold is None:
        last_cold = saved.get("lastColdStartSeconds")
    if last_cold is not None:
        status["lastColdStartSeconds"] = round(last_cold, 2)
    cond = unschedulable(observed, stable, spec, new.replicas) or condition("ScalingReady", decision.ok, decision.reason, decision.message)
    changed = state.replicas if new.replicas != state.replicas else None
    # The load, and the message that quotes it, move on every pass: while the decision holds they
    # are rewritten only every LOAD_EVERY_S, or status was PATCHed (and every router watching it
    # woken) every 2 s for as long as a service had traffic.
    shown = next((c for c in previous.get("conditions") or [] if c.get("type") == "ScalingReady"), {})
    written = epoch(saved.get("loadTime"))
    # (Compared with the condition as written: InsufficientCapacity, not the decision's reason,
    # while pods wait for a node, or every pass rewrote it.)
    if changed is None and shown.get("reason") == cond["reason"] and written is not None \
            and 0 <= now - written < LOAD_EVERY_S:
        status["load"], status["loadTime"] = saved.get("load"), saved["loadTime"]
        if cond["reason"] != "InsufficientCapacity":  # its message moves with the pods, not the load
            cond = {**cond, "message": shown.get("message", cond["message"])}
    else:
        status["loadTime"] = iso(now)
    return Scaling(decision.replicas, cond, {k: v for k, v in status.items() if v is not None}, changed)


def manual() -> Scaling:
    """Autoscaling off: replicas follow spec.replicas (`kubectl scale isvc`)."""
    return Scaling(None, condition("ScalingReady", True, "Manual", "replicas follow spec.replicas "
                                   "(kubectl scale isvc/<name> --replicas=N)"))


def unschedulable(observed: Observed, stable: str, spec: InferenceServiceSpec, wanted: int) -> dict[str, Any] | None:
    """ScalingReady for pods the scheduler cannot place, if any: it overrides any other report,
    being what a cluster autoscaler acts on. With a warm pool every pod is born a standby, so only
    those short of the `wanted` serving replicas count (ready standbys and loading pods will serve):
    the pool's own wait for a node is WarmPoolReady's to report."""
    ready, loading, count, why = pod_counts(observed, stable)
    if why is not None and spec.warmPool is not None:
        standbys = sum(1 for p in observed.pods(stable) if live(p) and is_ready(p) and not serves(p))
        count = min(count, wanted - ready - standbys - loading)
    if why is None or count <= 0:
        return None
    return condition("ScalingReady", False, "InsufficientCapacity", f"{count} replica(s) cannot be scheduled: {why}")


def capacity(scaling: Scaling, observed: Observed, stable: str, spec: InferenceServiceSpec, wanted: int) -> Scaling:
    """`scaling`, its condition InsufficientCapacity while serving replicas cannot be scheduled."""
    cond = unschedulable(observed, stable, spec, wanted)
    return scaling if cond is None else replace(scaling, condition=cond)


def serving_replicas(spec: InferenceServiceSpec, deployment: dict[str, Any] | None) -> int:
    """The replicas of a revision's Deployment that serve (its warm pool's standbys left out)."""
    pool = spec.warmPool.size if spec.warmPool and deployment and template_pooled(deployment) else 0
    return max(replicas_of(deployment) - pool, 0)


def current_replicas(spec: InferenceServiceSpec, observed: Observed, stable: str, fallback: int) -> int:
    """The stable revision's serving replicas now, else `fallback`: where the builtin autoscaler
    starts without a saved decision (a switch from another mode, a status lost)."""
    found = observed.engine(stable)
    return serving_replicas(spec, found) if found is not None else fallback


KEDA_CRD = "scaledobjects.keda.sh"
# A replica's load, as the builtin autoscaler counts it: the requests it runs and those waiting
# for a seat. Waiting alone is 0 whenever the batches hold everything, which scaled a busy service
# down to minReplicas (and KEDA, inactive at 0, to zero) until a queue formed again.
LOAD_METRICS = ("kiln:num_requests_waiting", "kiln:num_requests_running")
# What prometheus-adapter serves their sum per pod as (README, the rule for `mode: hpa`).
HPA_METRIC = "kiln:num_requests_load"
HELD_METRIC = "kiln_router_held_requests"  # the router's (kiln.router.metrics)


def render_hpa(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """An HPA on the InferenceService's /scale: it writes spec.replicas, the operator the rest."""
    assert spec.autoscaling is not None
    scaling = spec.autoscaling
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": metadata(owner, owner.name),
        "spec": {
            "scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner.name},
            # An HPA cannot go to zero (unless the HPAScaleToZero feature gate is on): use builtin for that.
            "minReplicas": scaling.floor, "maxReplicas": scaling.maxReplicas,
            "metrics": [{"type": "Pods", "pods": {"metric": {"name": HPA_METRIC},
                                                  "target": {"type": "AverageValue",
                                                             "averageValue": canonical(scaling.targetQueueDepth)}}}],
            # An hour at most, as the API server takes it (an object stored before the CRD said so).
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": min(int(seconds(scaling.scaleDownDelay)), 3600)}},
        },
    }


def render_scaled_object(owner: Owner, spec: InferenceServiceSpec, prometheus_url: str) -> dict[str, Any]:
    """A KEDA ScaledObject on the InferenceService's /scale, from the engines' queue in Prometheus."""
    assert spec.autoscaling is not None
    scaling = spec.autoscaling
    selector = f'{{namespace="{owner.namespace}",{LABEL_ISVC.replace(".", "_").replace("/", "_")}="{owner.name}"}}'
    # At zero there are no engines, hence no load: the requests the router holds are what
    # activates the ScaledObject (its activation threshold is 0).
    query = " + ".join(f"(sum({metric}{selector}) or vector(0))" for metric in (*LOAD_METRICS, HELD_METRIC))
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": metadata(owner, owner.name),
        "spec": {
            "scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner.name},
            "minReplicaCount": scaling.minReplicas, "maxReplicaCount": scaling.maxReplicas,
            # cooldownPeriod is only the last step, to zero; the steps above it are the HPA's that
            # KEDA makes, whose window is an hour at most (an object stored before the CRD said so).
            "cooldownPeriod": int(seconds(scaling.scaleDownDelay)),
            # KEDA skips cooldownPeriod until its first activation: a new ScaledObject (a new service,
            # or one handed over from builtin during a lull) would drop to minReplicas at once.
            "initialCooldownPeriod": int(seconds(scaling.scaleDownDelay)),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
                "stabilizationWindowSeconds": min(int(seconds(scaling.scaleDownDelay)), 3600)}}}},
            "triggers": [{"type": "prometheus", "metadata": {
                "serverAddress": prometheus_url, "query": query, "threshold": str(scaling.targetQueueDepth)}}],
        },
    }


def scaler_condition(found: dict[str, Any] | None, who: str) -> dict[str, Any]:
    """ScalingReady from the HPA's (AbleToScale, ScalingActive) or the ScaledObject's (Ready)
    own conditions, with their reasons and messages."""
    conditions = ((found or {}).get("status") or {}).get("conditions") or []
    if not conditions:
        return condition("ScalingReady", None, "Pending", f"the {who} reports no conditions yet")
    failing = next((c for c in conditions if c.get("type") in ("AbleToScale", "ScalingActive", "Ready")
                    and c.get("status") == "False"), None)
    if failing is not None:
        return condition("ScalingReady", False, failing.get("reason") or "Failing",
                         f"{who}: {failing.get('message', '')}")
    return condition("ScalingReady", True, "Active", f"the {who} scales spec.replicas")


def external(owner: Owner, spec: InferenceServiceSpec, observed: Observed, keda_installed: bool,
             prometheus_url: str) -> Scaling:
    """`hpa` or `keda`: the object that scales the InferenceService's /scale, and its report."""
    assert spec.autoscaling is not None
    if spec.autoscaling.mode == "keda" and not keda_installed:
        return Scaling(None, condition("ScalingReady", False, "KEDANotInstalled",
                                       f"autoscaling.mode keda needs KEDA ({KEDA_CRD} is not installed); "
                                       "replicas follow spec.replicas meanwhile"))
    if spec.autoscaling.mode == "hpa":
        obj, who = render_hpa(owner, spec), "HorizontalPodAutoscaler"
    else:
        obj, who = render_scaled_object(owner, spec, prometheus_url), "KEDA ScaledObject"
    return Scaling(None, scaler_condition(observed.get(obj["kind"], owner.name), who), objects=[obj])
