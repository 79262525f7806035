"""Desired state: which children an InferenceService should have, as a pure function of its
spec and of what was observed. No API calls here; plan.py turns the difference between this
and the cluster into actions.

Revisions are a list with roles: the `stable` one, a `canary` while a rollout runs (the step
machine in rollout.py says which revision is which, as a `Split`), and `old` ones (earlier
specs) kept until the stable one serves at full strength. Without a rollout the stable
revision is the one the spec describes. Each revision is a Deployment plus a headless Service
whose EndpointSlices give the router a per-revision view."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .models import InferenceServiceSpec
from .observed import Observed, deployment_counts, is_ready, live, replicas_of, serves
from .placement import Placement
from .render import (Owner, operator_namespace, pooled, render_deployment, render_network_policies, render_pdbs,
                     render_revision_service, render_router, render_router_account, render_service, revision_name,
                     template_pooled)

STABLE, CANARY, OLD = "stable", "canary", "old"


@dataclass(frozen=True)
class Revision:
    name: str
    role: str
    deployment: dict[str, Any] | None  # None: an observed revision that is left as it is
    service: dict[str, Any]
    # What the operator writes to the Deployment's spec.replicas; None: left as it is (old revisions).
    replicas: int | None
    weight: int | None = None  # percent of requests, when the spec has a rollout; None: no split
    # With a warm pool: how many of its pods serve (the rest of `replicas` are standbys);
    # None: every pod serves.
    serving: int | None = None


@dataclass(frozen=True)
class Split:
    """Which revisions serve while the spec has a rollout, from the step machine."""
    stable: str
    canary: str | None = None
    weight: int = 0  # the canary's percent of requests
    full_size: bool = False  # the canary gets the stable revision's replicas (just before promotion)
    # The rollout ended by dropping its canary (rolled back, or the spec went back to stable):
    # the stable revision never changed, so nothing old has requests to finish.
    dropped: bool = False


@dataclass(frozen=True)
class Desired:
    revisions: list[Revision]  # stable first
    shared: list[dict[str, Any]] = field(default_factory=list)  # router, its account, Service, PDB

    @property
    def stable(self) -> Revision:
        return self.revisions[0]

    def objects(self) -> list[dict[str, Any]]:
        """Every object to apply, in a safe order: the router's identity before the router,
        each revision's Service before its pods."""
        revisions = [obj for r in self.revisions for obj in (r.service, r.deployment) if obj is not None]
        return [*self.shared[:2], *revisions, *self.shared[2:]]


def desired_replicas(spec: InferenceServiceSpec) -> int:
    """spec.replicas (what /scale writes), kept inside the autoscaling bounds when an autoscaler
    uses them. With `mode: none` the bounds (perhaps only their defaults, 1 and 4) mean nothing:
    `kubectl scale isvc` or an outside autoscaler may set any count, zero included."""
    if spec.autoscaling is None or spec.autoscaling.mode == "none":
        return spec.replicas
    return min(max(spec.replicas, spec.autoscaling.floor), spec.autoscaling.maxReplicas)


def replicas_writer(spec: InferenceServiceSpec) -> str:
    """Where the stable revision's replicas come from: `spec` (spec.replicas, which `kubectl
    scale isvc`, an HPA or KEDA set through the /scale subresource) or `builtin` (the builtin
    autoscaler's decision). Either way the operator writes the Deployment, as the only writer."""
    scaling = spec.autoscaling
    return "builtin" if scaling is not None and scaling.mode == "builtin" else "spec"


class Handover(NamedTuple):
    replicas: int  # what spec.replicas becomes
    why: str  # for the Event


def handover(spec: InferenceServiceSpec, previous: dict[str, Any], observed: Observed, name: str,
             keda_installed: bool) -> Handover | None:
    """The spec.replicas to write when the builtin autoscaler hands the replicas to an HPA or KEDA
    (`previous`: the status the builtin mode left, its last decision in it): that decision, within
    the new mode's bounds. Until the new scaler first acts it follows spec.replicas, and the stable
    revision dropped to whatever that was left at. Only while the scaler is not there yet (the
    pass that creates it): once it is, spec.replicas is its count, which a retried hand-over would
    undo. Not to `keda` without KEDA, where nothing takes over (at zero, nothing would wake it).
    And under an HPA, at any time, its floor in place of a spec.replicas of 0 (left by KEDA at zero,
    `none`, or a manifest): an HPA never acts on a target at zero (ScalingDisabled), nor sets 0 itself.
    None: no hand-over, or spec.replicas already says it."""
    decided = (previous.get("autoscaling") or {}).get("replicas")
    mode = spec.autoscaling.mode if spec.autoscaling is not None else "none"
    if mode == "hpa" and spec.replicas == 0:
        return Handover(desired_replicas(spec), "the HPA's floor (an HPA does not scale a target at zero)")
    if decided is None or mode not in ("hpa", "keda") or (mode == "keda" and not keda_installed):
        return None
    if observed.get("HorizontalPodAutoscaler" if mode == "hpa" else "ScaledObject", name) is not None:
        return None
    replicas = desired_replicas(spec.model_copy(update={"replicas": decided}))
    return None if replicas == spec.replicas else Handover(replicas, "the builtin autoscaler's last decision")


def fully_ready(deployment: dict[str, Any] | None, replicas: int) -> bool:
    """The Deployment has settled on its latest template with `replicas` ready and updated."""
    if deployment is None:
        return False
    status = deployment.get("status") or {}
    settled = (status.get("observedGeneration") or 0) >= (deployment["metadata"].get("generation") or 0)
    return settled and deployment_counts(deployment)[1] >= replicas \
        and (status.get("updatedReplicas") or 0) >= replicas


def old_replicas(deployment: dict[str, Any], observed: Observed) -> int | None:
    """An old revision is left at its size (None), but its warm pool goes: no standby of it is
    ever promoted, and their GPUs may be what the new revision's pods wait for. Scaled to its
    serving pods, the ReplicaSet takes the standbys first (their lower pod-deletion-cost), but it
    takes pods not ready before it weighs costs: while a serving one is not ready, it waits."""
    if not template_pooled(deployment):
        return None
    pods = [p for p in observed.pods(deployment["metadata"]["name"]) if live(p)]
    if any(serves(p) and not is_ready(p) for p in pods):
        return None
    return sum(1 for p in pods if serves(p))


def canary_size(stable_replicas: int, weight: int) -> int:
    """The replicas a step of `weight` percent sizes the canary for, beside the stable revision's:
    at least one."""
    return max(1, math.ceil(stable_replicas * weight / 100))


def routed_weight(split: Split, observed: Observed, size: int) -> int:
    """The canary's share of requests: its step's weight in proportion to how many of the `size`
    replicas the step sized it for are ready. New ones load for minutes, and the few ready ones
    took the whole share meanwhile; with none ready (a 100% step's canary lost) the stable
    revision serves, where at weight 0 it served nobody."""
    ready = sum(1 for p in observed.pods(split.canary) if is_ready(p) and serves(p))
    return split.weight * min(ready, size) // size


def desired(owner: Owner, spec: InferenceServiceSpec, observed: Observed, image: str,
            pod_annotations: dict[str, str] | None = None, autoscaled: int | None = None,
            scalers: list[dict[str, Any]] | None = None, split: Split | None = None,
            router_placement: Placement = Placement()) -> Desired:
    """`pod_annotations` go on every pod template (e.g. the local test runtime's opt-in);
    `autoscaled`: the builtin autoscaler's decision, when it decides; `scalers`: the HPA or
    KEDA ScaledObject that scales the InferenceService, when one does; `split`: the rollout's
    stable and canary revisions (None: the spec's revision is stable and replaces the others);
    `router_placement`: where the router pods go (the operator's CPU engine defaults)."""
    target = revision_name(owner.name, spec)
    name = split.stable if split else target
    current = observed.engine(name)
    olds = [d for d in observed.engines() if d["metadata"]["name"] not in (name, split and split.canary)]
    # A stable revision the spec no longer describes (a rollout runs) is left as it is, but
    # scaled; whether its pods are born standbys is its template's to say.
    stable_pooled = pooled(spec) if name == target else current is not None and template_pooled(current)
    pool = spec.warmPool.size if stable_pooled and spec.warmPool else 0
    if replicas_writer(spec) == "spec":
        replicas = desired_replicas(spec)
    elif autoscaled is not None:
        replicas = autoscaled
    else:  # no decision yet: keep what serves, or start with the capacity the service has now
        replicas = max(replicas_of(current) - pool, 0) if current else max((replicas_of(d) for d in olds),
                                                                            default=desired_replicas(spec))
    # Old revisions keep serving until the stable one is at full serving strength (its pool may
    # need the GPUs they hold); during a rollout (a canary replaced by a newer one) and after one
    # dropped its canary, they go at once: a rolled-back canary kept its replicas, GPUs and all,
    # while the stable revision was short.
    keep = [] if fully_ready(current, replicas) or (split and (split.canary or split.dropped)) else olds
    # While they serve (a plain replacement the spec's new rollout waits for), requests go to every
    # ready replica alike: weighted, the old revisions' 0 held them until the stable one was ready.
    weighted = split is not None and not keep
    canary_weight = size = 0
    if split and split.canary:
        size = replicas if split.full_size else canary_size(replicas, split.weight)
        size = max(size, 1)  # even when the stable revision is at zero: promotion waits on a ready canary
        canary_weight = routed_weight(split, observed, size)
    deployment = render_deployment(owner, spec, image, pod_annotations) if name == target else None
    revisions = [Revision(name, STABLE, deployment, render_revision_service(owner, name, stable_pooled),
                          replicas + pool, 100 - canary_weight if weighted else None,
                          replicas if stable_pooled else None)]
    if split and split.canary:
        revisions.append(Revision(split.canary, CANARY, render_deployment(owner, spec, image, pod_annotations),
                                  render_revision_service(owner, split.canary, pooled(spec)), size, canary_weight,
                                  size if pooled(spec) else None))
    revisions += [Revision(d["metadata"]["name"], OLD, None,
                           render_revision_service(owner, d["metadata"]["name"], template_pooled(d)),
                           old_replicas(d, observed)) for d in keep]
    router = render_router(owner, spec, image, pod_annotations, router_placement)
    return Desired(revisions, [*render_router_account(owner), router, render_service(owner), *render_pdbs(owner),
                               *render_network_policies(owner, operator_namespace()), *(scalers or [])])
