"""Warm pools: replicas with the model loaded and warmed that take no traffic, promoted to
serving in a metadata change when demand rises. Pure: reconcile.py applies the plan.

With `spec.warmPool.size > 0` every engine pod is born a standby (its template carries
`kiln.dev/serving: "false"`) and each revision's Service selects only `kiln.dev/serving:
"true"` pods, so the router never sees a standby: promotion and demotion are pod label
changes that the EndpointSlice controller carries to the router in about a second, with no
restart. The revision's Deployment asks for serving + pool replicas and is never fought: the
operator only relabels the pods its ReplicaSet made. Scale-down first demotes serving pods
(they stop taking requests and finish what they run); standbys carry a lower
pod-deletion-cost than serving pods, so the ReplicaSet removes standbys, never a serving pod.

With `sleep` (off by default) a ready standby is put to sleep (the engine's POST /sleep releases its
KV cache) and woken (POST /wake_up) just before its promotion; a request reaching it first wakes
it too. The `kiln.dev/asleep` annotation records the engine's restart count when it fell asleep,
so an engine restarted since (awake again) is put back to sleep."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .observed import is_ready, live
from .render import LABEL_SERVING
from .scaling import epoch, iso
from .status import condition

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
ASLEEP = "kiln.dev/asleep"
# The pool's cost is brought up to date this often, or when its count changes: accounting every
# pass (each 0.5-2 s) would write the status each time.
ACCOUNT_EVERY_S = 30.0
SERVING_COST, STANDBY_COST = "100", "0"


@dataclass(frozen=True)
class Pod:
    name: str
    ready: bool
    serving: bool
    since: str  # creation time (RFC 3339, so it sorts): the oldest standby is promoted first
    ip: str = ""
    asleep: bool = False  # its engine was put to sleep and has not restarted since
    restarts: int = 0
    template: str = ""  # its pod-template-hash: pods of two mean the Deployment is rolling


@dataclass(frozen=True)
class PoolPlan:
    promote: list[Pod] = field(default_factory=list)
    demote: list[Pod] = field(default_factory=list)
    sleep: list[Pod] = field(default_factory=list)  # ready standbys to put to sleep

    def patches(self) -> dict[str, dict[str, Any]]:
        """Pod name -> the metadata merge patch that promotes or demotes it."""
        def patch(serving: bool) -> dict[str, Any]:
            annotations = {DELETION_COST: SERVING_COST if serving else STANDBY_COST}
            return {"metadata": {"labels": {LABEL_SERVING: str(serving).lower()},
                                 "annotations": {**annotations, **({ASLEEP: None} if serving else {})}}}
        return {**{p.name: patch(True) for p in self.promote}, **{p.name: patch(False) for p in self.demote}}


def plan_pool(serving_wanted: int, pods: list[Pod], sleep: bool = False) -> PoolPlan:
    """Which pods of one revision change role so that `serving_wanted` of them serve: ready
    standbys are promoted (oldest first; a pod still loading is never promoted), serving pods
    beyond the number wanted are demoted (not ready ones first, then the newest). The
    Deployment's replicas (serving + pool) are desired.py's; the ReplicaSet creates the rest as
    standbys or removes standbys. With `sleep`, the ready standbys that stay standbys and are
    awake are put to sleep (one demoted this pass waits for the next: it may still finish
    requests)."""
    if len({p.template for p in pods}) > 1:
        return plan_roll(serving_wanted, pods, sleep)
    serving = [p for p in pods if p.serving]
    standby = sorted((p for p in pods if not p.serving and p.ready), key=lambda p: p.since)
    # A serving pod that stopped being ready (crashed, failing its probe) serves nobody: a ready
    # standby takes its place now, and the demotion below sends it back to the pool, where it is
    # a standby again once it recovers. With no standby to replace it, it stays: it may recover.
    promote = standby[:max(serving_wanted - sum(p.ready for p in serving), 0)]
    # Not ready first, then the newest (the sorts are stable).
    by_demotion = sorted(sorted(serving, key=lambda p: p.since, reverse=True), key=lambda p: p.ready)
    demote = by_demotion[:max(len(serving) + len(promote) - serving_wanted, 0)]
    return PoolPlan(promote, demote, [p for p in standby[len(promote):] if sleep and not p.asleep])


def plan_roll(serving_wanted: int, pods: list[Pod], sleep: bool) -> PoolPlan:
    """plan_pool while the Deployment rolls to a new template (an operator upgrade, new resources):
    the newest template's ready pods serve first. Its new pods are born standbys and count as
    available, so the old ReplicaSet removes its serving pods next; each is replaced by a ready new
    standby in the pass that sees one (promoted, then the old pod demoted: patched in that order,
    the Service never has fewer), not once it is gone, which left nothing serving meanwhile."""
    newest = max(pods, key=lambda p: p.since).template
    # Within a template those serving stay first: a ready pod swapped for another of its own
    # template is a demotion mid-request (and a wake) that brings the roll no nearer.
    ready = sorted((p for p in pods if p.ready), key=lambda p: (p.template == newest, p.serving, p.since),
                   reverse=True)
    keep = ready[:serving_wanted]
    # One not ready keeps its place while too few are ready to replace it: it may recover.
    demote = [p for p in pods if p.serving and p not in keep and (p.ready or len(keep) >= serving_wanted)]
    return PoolPlan([p for p in keep if not p.serving], demote,
                    [p for p in ready if sleep and not p.serving and p not in keep and not p.asleep])


def pods_of(observed_pods: list[dict[str, Any]]) -> list[Pod]:
    """The live pods of a revision (observed.live) as the pool sees them."""
    def pod(p: dict[str, Any]) -> Pod:
        meta, status = p["metadata"], p.get("status") or {}
        restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
        labels = meta.get("labels") or {}
        return Pod(meta["name"], is_ready(p), labels.get(LABEL_SERVING) == "true",
                   meta.get("creationTimestamp") or "", status.get("podIP") or "",
                   (meta.get("annotations") or {}).get(ASLEEP) == str(restarts), restarts,
                   labels.get("pod-template-hash", ""))
    return [pod(p) for p in observed_pods if live(p)]


def pool_status(size: int, pods: list[Pod], unschedulable: str | None, promoted: int, previous: dict[str, Any],
                gpus: int, now: float, failure: tuple[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(status.warmPool, the WarmPoolReady condition) for the stable revision's pool. The pool's
    cost is kept visible: replica- and GPU-seconds spent ready and idle, accumulated from pass
    to pass at the count the previous pass saw. `failure`: the Deployment's (reason, message)
    when it cannot make pods (status.deployment_failure), e.g. a quota short of the standbys.
    `pods` as read before this pass's `promoted` standbys (each one ready) were promoted."""
    # Counted as read, the standbys a scale-up just took said the pool Filled (and idle) for a pass.
    ready = max(sum(1 for p in pods if p.ready and not p.serving) - promoted, 0)
    now = float(int(now))  # accountedAt keeps whole seconds: the fraction would be counted twice
    since = epoch(previous.get("accountedAt"))
    if since is not None and 0 <= now - since < ACCOUNT_EVERY_S and ready == previous.get("ready") and not promoted:
        now = since  # nothing to account yet: the status stays as it is, and is not written
    idle = max(now - since, 0.0) * previous.get("ready", 0) if since is not None else 0.0
    block = {"size": size, "ready": ready, "promotions": previous.get("promotions", 0) + promoted,
             "idleReplicaSeconds": round(previous.get("idleReplicaSeconds", 0.0) + idle, 1),
             "idleGPUSeconds": round(previous.get("idleGPUSeconds", 0.0) + idle * gpus, 1),
             "accountedAt": iso(now)}
    if previous.get("lastPromotion") or promoted:
        block["lastPromotion"] = iso(now) if promoted else previous["lastPromotion"]
    if ready >= size:
        cond = condition("WarmPoolReady", True, "Filled", f"{ready} standby replica(s) loaded and warm")
    elif unschedulable:  # what a progress deadline past Pending standbys would say less well
        cond = condition("WarmPoolReady", False, "InsufficientCapacity",
                         f"{ready}/{size} standby replicas ready; no node fits the rest: {unschedulable}")
    elif failure is not None:
        cond = condition("WarmPoolReady", False, failure[0], f"{ready}/{size} standby replicas ready; {failure[1]}")
    else:
        cond = condition("WarmPoolReady", False, "Filling", f"{ready}/{size} standby replicas ready")
    return block, cond
