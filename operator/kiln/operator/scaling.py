"""Who sets the stable revision's replicas in this pass, and what status says about it: the
`ScalingReady` condition and, for the builtin autoscaler, `status.autoscaling` (which is also
where the autoscaler's state survives an operator restart). Pure: reconcile.py brings the
samples it scraped and the time."""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from .autoscaler import Sample, ScalerState, decide
from .models import InferenceServiceSpec
from .observed import Observed, is_ready, replicas_of
from .status import condition


@dataclass(frozen=True)
class Scaling:
    replicas: int | None  # what the builtin autoscaler decided for the stable revision; None: not builtin
    condition: dict[str, Any]
    status: dict[str, Any] = field(default_factory=dict)  # status.autoscaling
    changed_from: int | None = None  # the replicas before a decision that changed them


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def epoch(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def pod_counts(observed: Observed, revision: str) -> tuple[int, int, str | None]:
    """(ready, starting, why pods cannot be scheduled) for a revision's pods; terminating pods
    are neither capacity nor on their way."""
    ready = starting = 0
    unschedulable = None
    for pod in observed.pods(revision):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        if is_ready(pod):
            ready += 1
            continue
        starting += 1
        conditions = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
        scheduled = conditions.get("PodScheduled", {})
        if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
            unschedulable = scheduled.get("message", "no node fits the pod")
    return ready, starting, unschedulable


def scaler_state(previous: dict[str, Any], initial: int) -> ScalerState:
    saved = previous.get("autoscaling") or {}
    if "replicas" not in saved:
        return ScalerState(initial)
    return ScalerState(saved["replicas"], epoch(saved.get("panicUntil")), epoch(saved.get("scaleDownSince")),
                       epoch(saved.get("lastScaleTime")))


def builtin(spec: InferenceServiceSpec, observed: Observed, stable: str, previous: dict[str, Any],
            samples: list[Sample], now: float, initial: int) -> Scaling:
    """One decision of the builtin autoscaler for the stable revision."""
    assert spec.autoscaling is not None
    state = scaler_state(previous, initial)
    ready, starting, unschedulable = pod_counts(observed, stable)
    decision, new = decide(samples, spec.autoscaling, state, ready, starting, now)
    status = {"replicas": new.replicas, "mode": decision.mode,
              "load": None if decision.load is None else round(decision.load, 1),
              "panicUntil": iso(new.panic_until), "scaleDownSince": iso(new.lower_since),
              "lastScaleTime": iso(new.last_scale)}
    saved = previous.get("autoscaling") or {}
    if "lastColdStartSeconds" in saved:
        status["lastColdStartSeconds"] = saved["lastColdStartSeconds"]
    if unschedulable is not None:  # what a cluster autoscaler acts on
        cond = condition("ScalingReady", False, "InsufficientCapacity",
                         f"{starting} replica(s) cannot be scheduled: {unschedulable}")
    else:
        cond = condition("ScalingReady", decision.ok, decision.reason, decision.message)
    changed = state.replicas if new.replicas != state.replicas else None
    return Scaling(decision.replicas, cond, {k: v for k, v in status.items() if v is not None}, changed)


def manual(spec: InferenceServiceSpec, observed: Observed, stable: str) -> Scaling:
    """Replicas follow spec.replicas (autoscaling off, or an HPA/KEDA writing it via /scale)."""
    _, _, unschedulable = pod_counts(observed, stable)
    if unschedulable is not None:
        return Scaling(None, condition("ScalingReady", False, "InsufficientCapacity", unschedulable))
    mode = "none" if spec.autoscaling is None else spec.autoscaling.mode
    return Scaling(None, condition("ScalingReady", True, "Manual" if mode == "none" else "External",
                                   f"replicas follow spec.replicas (autoscaling mode {mode})"))


def current_replicas(observed: Observed, stable: str, fallback: int) -> int:
    found = observed.engine(stable)
    return replicas_of(found) if found is not None else fallback
