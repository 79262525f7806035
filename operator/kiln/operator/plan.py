"""Plan: the actions that take the cluster from what was observed to what is desired. Pure, so
tests run it on recorded cluster states; reconcile.py executes the actions it returns.

An object is patched only when something we set differs from what is stored (defaults the
API server adds are not differences), so a steady state plans nothing at all. Each applied object
carries a hash of what was applied (APPLIED): a field the spec no longer asks for changes it, so
the object is applied again and the apply removes the field, which `contains` alone would not see
(stored maps may hold more keys: defaults, others' labels)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .desired import Desired
from .observed import Observed, replicas_of

CREATE, PATCH, SCALE, DELETE = "create", "patch", "scale", "delete"


@dataclass(frozen=True)
class Action:
    verb: str  # create | patch | scale | delete
    kind: str
    name: str
    body: dict[str, Any] | None = None  # create, patch: the object to apply
    replicas: int | None = None  # scale

    def __str__(self) -> str:
        return f"{self.verb} {self.kind}/{self.name}" + (f" to {self.replicas}" if self.verb == SCALE else "")


def contains(stored: Any, wanted: Any) -> bool:
    """Every field of `wanted` is in `stored` with the same value (maps may have more keys, and so
    may lists of named entries)."""
    if isinstance(wanted, dict):
        return isinstance(stored, dict) and all(k in stored and contains(stored[k], v) for k, v in wanted.items())
    if isinstance(wanted, list) and wanted and all(isinstance(w, dict) and "name" in w for w in wanted):
        # Keyed by name (containers, env, volumes, ports): server-side apply merges such a list by
        # key and keeps an entry another manager added (`kubectl set env`). Counted as a difference,
        # it was applied again on every pass, and stayed.
        named = {s.get("name"): s for s in stored if isinstance(s, dict)} if isinstance(stored, list) else {}
        return all(w["name"] in named and contains(named[w["name"]], w) for w in wanted)
    if isinstance(wanted, list):
        return isinstance(stored, list) and len(stored) == len(wanted) \
            and all(contains(s, w) for s, w in zip(stored, wanted))
    return stored == wanted


# spec.replicas of engine Deployments has a field manager of its own, so the operator's main
# apply can leave the field out without resetting it (see docs/architecture.md, "One writer").
REPLICAS_MANAGER = "kiln-replicas"
APPLIED = "kiln.dev/applied"  # annotation: the hash of the object as the operator last applied it


def stamped(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with the hash of its own content in its annotations."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    meta = obj["metadata"]
    return {**obj, "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), APPLIED: digest}}}


# Objects that scale the InferenceService: one at a time. The one a mode switch leaves goes before
# the next is created: KEDA's admission webhook refuses a ScaledObject whose target an HPA scales,
# and two scalers on one /scale would fight.
SCALER_KINDS = ("HorizontalPodAutoscaler", "ScaledObject")


def plan(desired: Desired, observed: Observed) -> list[Action]:
    actions = []
    for obj in map(stamped, desired.objects()):
        kind, name = obj["kind"], obj["metadata"]["name"]
        stored = observed.get(kind, name)
        if stored is None:
            actions.append(Action(CREATE, kind, name, with_initial_replicas(obj, desired)))
        elif not contains(stored, obj):
            actions.append(Action(PATCH, kind, name, obj))
    for revision in desired.revisions:
        stored = observed.engine(revision.name)
        if revision.replicas is not None and (stored is None or replicas_of(stored) != revision.replicas
                                              or not replicas_handed_over(stored)):
            actions.append(Action(SCALE, "Deployment", revision.name, replicas=revision.replicas))
    # Whatever we own and no longer want goes: retired revisions and their Services, an HPA
    # after a switch of autoscaling mode. (Old revisions still serving are wanted as they are.)
    wanted = {(o["kind"], o["metadata"]["name"]) for o in desired.objects()}
    wanted |= {("Deployment", r.name) for r in desired.revisions}
    actions += [Action(DELETE, kind, name) for kind, name in sorted(observed.objects)
                if kind != "Pod" and (kind, name) not in wanted]
    return sorted(actions, key=lambda a: not (a.verb == DELETE and a.kind in SCALER_KINDS))  # stable: else as is


def replicas_handed_over(stored: dict[str, Any]) -> bool:
    """Whether REPLICAS_MANAGER owns the Deployment's spec.replicas. Not when a pass ended between
    the create, which sets them, and the scale that takes them over: the next template apply,
    which leaves them out, would then reset them to 1. (An object without managedFields, as in
    recordings, tells nothing: taken as handed over.)"""
    managers = stored["metadata"].get("managedFields")
    return not managers or any(m.get("manager") == REPLICAS_MANAGER
                               and "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec") or {}) for m in managers)


def with_initial_replicas(obj: dict[str, Any], desired: Desired) -> dict[str, Any]:
    """A new engine Deployment is created at its first replica count (not the API default of 1,
    which would start a pod for a revision meant to be at zero); the scale action that follows
    hands the field to its own field manager, so later applies without it do not reset it."""
    revision = next((r for r in desired.revisions if r.deployment is not None and obj["kind"] == "Deployment"
                     and r.name == obj["metadata"]["name"]), None)
    if revision is None or revision.replicas is None:
        return obj
    return {**obj, "spec": {**obj["spec"], "replicas": revision.replicas}}
