"""One reconcile pass over one InferenceService: read it afresh, observe its children, work out
what is desired, plan the actions, execute them, then write the status and post an Event for
each condition that changed. controller.py makes sure passes over one object never overlap,
so each pass compares against the status the previous one stored."""
from __future__ import annotations

import datetime
import json
import logging
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kubernetes.client.rest import ApiException

from . import metrics, standby
from .api import Api
from .autoscaler import Sample
from .canary import Baseline, roll, split
from .desired import Desired, Handover, desired, desired_replicas, handover, replicas_writer
from .models import GROUP, KIND, PLURAL, VERSION, InferenceServiceSpec, seconds
from .observed import Observed
from .placement import Placements, placed
from .plan import CREATE, DELETE, PATCH, REPLICAS_MANAGER, SCALE, Action, plan
from .render import LABEL_ISVC, Owner, revision_name, scale_selector, service_url
from .rollout import dump
from .scaling import (KEDA_CRD, Scaling, builtin, capacity, current_replicas, external, manual, metrics_urls,
                      pod_counts)
from .scrape import scrape
from .stored import parse_spec
from .status import deployment_failure, event_type, invalid, summarize, transitions
from .warmpool import ASLEEP, plan_pool, pods_of, pool_status

FIELD_MANAGER = "kiln-operator"
APPLY = "application/apply-patch+yaml"
log = logging.getLogger("kiln.operator")


CHILD_KINDS = ("Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "RoleBinding",
               "HorizontalPodAutoscaler", "NetworkPolicy")
AUTOSCALE_TICK_S = 2.0  # how often the builtin autoscaler decides
# At zero serving replicas the only load is requests the router holds, and a client waits on
# each tick: look more often (one router scrape each time).
AT_ZERO_TICK_S = 0.5
# A timer pass reuses the last pass's read (see reconcile); it reads afresh at least this often,
# for changes no watch reports (the children not watched: PDB, ServiceAccount, RoleBinding, KEDA).
REREAD_S = 30.0
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


@dataclass(frozen=True)
class Settings:
    image: str
    pod_annotations: dict[str, str] = field(default_factory=dict)
    interval: float = 300.0  # the safety-net resync
    prometheus_url: str = DEFAULT_PROMETHEUS  # where KEDA's ScaledObjects read the engines' queue
    # The builtin autoscaler's recent samples, per (namespace, name): memory of this process only.
    samples: dict[tuple[str, str], list[Sample]] = field(default_factory=dict)
    # The resourceVersion of our own last status write per object, so it wakes no pass.
    own_writes: dict[tuple[str, str], str] = field(default_factory=dict)
    # Where each rollout's current analysis interval began (memory of this process only).
    baselines: dict[tuple[str, str], Baseline] = field(default_factory=dict)
    # Where engine pods go unless their spec says otherwise (--gpu-node-selector, ...).
    placements: Placements = field(default_factory=Placements)
    # What each object's last pass read, for timer passes to reuse (memory of this process only).
    reads: dict[tuple[str, str], Read] = field(default_factory=dict)
    # The uid last seen under each name: a deletion of an earlier namesake is not this one's.
    uids: dict[tuple[str, str], str | None] = field(default_factory=dict)
    # The spec fields this operator does not know, as last said in an Event (stored.parse_spec).
    unknown: dict[tuple[str, str], list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Read:
    """What a pass reads from the API server: the InferenceService, its children, and whether
    KEDA is installed."""
    body: dict[str, Any]
    observed: Observed
    keda: bool
    until: float  # the monotonic time after which a timer pass reads afresh


def observe(api: Api, owner: Owner, keda_installed: bool = False) -> Observed:
    """Every child this InferenceService owns (by owner uid: a same-named service deleted and
    recreated must not adopt its predecessor's leftovers)."""
    objects = []
    for kind in CHILD_KINDS + (("ScaledObject",) if keda_installed else ()):
        found = api.client.sanitize_for_serialization(
            api.call("list", kind)(owner.namespace, label_selector=f"{LABEL_ISVC}={owner.name}"))
        for obj in found["items"]:  # items of a list carry no kind or apiVersion of their own
            refs = obj["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") == owner.uid for ref in refs):
                objects.append({**obj, "kind": kind, "apiVersion": found["apiVersion"]})
    # Pods are found by label alone: their owner is a ReplicaSet.
    pods = api.client.sanitize_for_serialization(
        api.core.list_namespaced_pod(owner.namespace, label_selector=f"{LABEL_ISVC}={owner.name}"))
    objects += [{**pod, "kind": "Pod", "apiVersion": "v1"} for pod in pods["items"]]
    return Observed.of(*objects)


def execute(api: Api, owner: Owner, action: Action) -> dict[str, Any] | None:
    """Carry out one action; the object as stored after it (None for a delete)."""
    api.fence()
    ns = owner.namespace
    if action.verb == DELETE:
        try:
            api.call("delete", action.kind)(action.name, ns)
        except ApiException as err:
            if err.status != 404:
                raise
        return None
    if action.verb == CREATE:
        refuse_foreign(api, owner, action)
    # Server-side apply, forcing ownership back from anyone who hand-edited our fields.
    body, manager = action.body, FIELD_MANAGER
    if action.verb == SCALE:
        body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": action.name, "namespace": ns},
                "spec": {"replicas": action.replicas}}
        manager = REPLICAS_MANAGER
    stored = api.call("patch", action.kind)(action.name, ns, body, field_manager=manager, force=True,
                                            _content_type=APPLY)
    return stored if isinstance(stored, dict) else api.client.sanitize_for_serialization(stored)


class NotOurs(Exception):
    """A child's name is taken by an object this InferenceService does not own."""


def refuse_foreign(api: Api, owner: Owner, action: Action) -> None:
    """A create is planned for what observe() did not find as ours; an object of that name that
    exists anyway is someone else's (a Service left from a former install, say): a forced apply
    would take it over, and garbage collection would delete it with the InferenceService."""
    # A list by name, not a get: the operator's role lists its children (observe) and needs no more.
    found = api.client.sanitize_for_serialization(api.call("list", action.kind)(
        owner.namespace, field_selector=f"metadata.name={action.name}"))["items"]
    if found and not any(ref.get("uid") == owner.uid for ref in found[0]["metadata"].get("ownerReferences") or []):
        raise NotOurs(f"a {action.kind} named {action.name} already exists and this InferenceService does not "
                      "own it: delete or rename it (it is left untouched)")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def post_event(api: Api, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    api.fence()
    meta = body["metadata"]
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat()
    api.core.create_namespaced_event(meta["namespace"], {
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta["uid"]},
        "type": type_, "reason": reason, "message": message[:1024], "count": 1,
        "firstTimestamp": stamp, "lastTimestamp": stamp,
        "source": {"component": FIELD_MANAGER, "host": socket.gethostname()},
        "reportingComponent": FIELD_MANAGER, "reportingInstance": socket.gethostname()})


def autoscale(spec: InferenceServiceSpec, observed: Observed, owner: Owner, previous: dict[str, Any],
              settings: Settings, keda_installed: bool, stable: str) -> Scaling:
    """Who scales the `stable` revision, and what it says: for the builtin autoscaler, scrape
    one sample and decide."""
    mode = "none" if spec.autoscaling is None else spec.autoscaling.mode
    if mode != "builtin":
        settings.samples.pop((owner.namespace, owner.name), None)
        scaling = manual() if mode == "none" else external(owner, spec, observed, keda_installed,
                                                            settings.prometheus_url)
        return capacity(scaling, observed, stable, spec, desired_replicas(spec))
    assert spec.autoscaling is not None
    at = time.time()
    engines, routers = metrics_urls(observed)
    window = settings.samples.setdefault((owner.namespace, owner.name), [])
    taken = scrape(engines, routers, at)
    if taken.sample is not None:
        window.append(taken.sample)
    window[:] = [s for s in window if s.time >= at - seconds(spec.autoscaling.stableWindow)]
    initial = current_replicas(spec, observed, stable, desired_replicas(spec))
    return builtin(spec, observed, stable, previous, list(window), at, initial, taken.cold_start)


def hand_over(api: Api, body: Mapping[str, Any], spec: InferenceServiceSpec, handed: Handover) -> InferenceServiceSpec:
    """Write the count an HPA or KEDA starts from (desired.handover) to spec.replicas through
    /scale, where it reads it; the spec as it now is."""
    meta = body["metadata"]
    api.fence()
    api.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, meta["namespace"], PLURAL, meta["name"],
                                                    {"spec": {"replicas": handed.replicas}},
                                                    field_manager=FIELD_MANAGER,
                                                    _content_type="application/merge-patch+json")
    assert spec.autoscaling is not None
    post_event(api, body, "Normal", "ScalingHandedOver",
               f"spec.replicas set from {spec.replicas} to {handed.replicas}, {handed.why}: "
               f"autoscaling.mode {spec.autoscaling.mode} scales on from there")
    return spec.model_copy(update={"replicas": handed.replicas})


def forget(settings: Settings, key: tuple[str, str]) -> None:
    """Drop what passes kept for an InferenceService that is gone (after its last pass: one still
    running when the deletion was seen would keep them again)."""
    for kept in (settings.own_writes, settings.samples, settings.reads, settings.baselines, settings.uids,
                 settings.unknown):
        kept.pop(key, None)
    metrics.forget(*key)


def reconcile(api: Api, namespace: str, name: str, settings: Settings, woken: bool = True) -> float | None:
    """One pass; returns the seconds until the next pass is due (the autoscaler's tick or the
    resync), None when the InferenceService is gone (its children go by garbage collection).

    `woken`: a watch event asked for it, not the timer. What a pass reads (ten API calls) changes
    only with an event, and every event wakes a pass that reads afresh; so a timer pass (the
    autoscaler's tick: every 0.5 s at zero) reuses the last read, with the status that pass left,
    and calls the API server only to write. A pass that wrote anything but status is not reused."""
    key = (namespace, name)
    read = settings.reads.pop(key, None)  # kept again only by a pass that ends well
    if woken or read is None or time.monotonic() >= read.until:
        read = None
        try:
            body = api.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
    else:
        body = read.body
    metrics.PASSES.labels(namespace, name, "reused" if read else "fresh").inc()
    meta = body["metadata"]
    previous = dict(body.get("status") or {})
    generation = meta.get("generation") or 0
    if meta.get("deletionTimestamp"):
        # Foreground deletion (Argo CD's default) keeps it while its children drain: not Serving.
        report(api, body, previous, invalid(previous, generation, "Terminating",
                                            "being deleted: its children and their pods go first", now()), settings)
        return settings.interval
    owner = Owner(name, namespace, meta["uid"])
    try:
        parsed, unknown = parse_spec(body)
    except ValueError as err:
        report(api, body, previous, invalid(previous, generation, "InvalidSpec", str(err), now()), settings)
        return settings.interval
    spec = placed(parsed, settings.placements)
    if unknown and settings.unknown.get((namespace, name)) != unknown:  # said once, not every pass
        settings.unknown[(namespace, name)] = unknown
        post_event(api, body, "Warning", "UnknownFields", f"ignored: {', '.join(unknown)}, which this operator "
                   "does not know (a CRD newer than the operator?): upgrade the operator to use them")
    if read is None:
        keda = api.installed(KEDA_CRD)
        # Never past the next resync: that one reads afresh, as a safety net should.
        read = Read(body, observe(api, owner, keda), keda, time.monotonic() + min(REREAD_S, settings.interval))
    observed, keda = read.observed, read.keda
    handed = handover(spec, previous, observed, name, keda)
    if handed is not None:
        spec = hand_over(api, body, spec, handed)
    rollout = roll(owner, spec, observed, meta.get("annotations") or {}, previous, settings.baselines, time.time())
    serving = split(spec, rollout)
    stable = serving.stable if serving else revision_name(name, spec)
    scaling = autoscale(spec, observed, owner, previous, settings, keda, stable)
    want = desired(owner, spec, observed, settings.image, settings.pod_annotations, scaling.replicas,
                   scaling.objects, serving, settings.placements.cpu)
    rendered = {r.name for r in want.revisions if r.deployment is not None}
    rejected = []
    actions = plan(want, observed)
    # Pods change roles before the Deployments change size: a scale-down larger than the pool then
    # finds the pods it demotes already at the standbys' deletion cost, and the ReplicaSet removes
    # no serving pod; a scale-up's promotions serve at once, not after the new pods are created.
    promoted, relabelled = relabel(api, body, owner, want, observed, spec.warmPool is not None and spec.warmPool.sleep)
    applied: dict[tuple[str, str], dict[str, Any]] = {}  # Deployments written in this pass, as stored
    for action in actions:
        log.info("%s/%s: %s", namespace, name, action)
        try:
            stored = execute(api, owner, action)
        except ApiException as err:
            if err.status not in (400, 422):  # not a verdict on what we sent: try again later
                raise
            rejected.append(f"{action}: {err.reason}: {api_message(err)}")
            continue
        except NotOurs as err:
            rejected.append(f"{action}: {err}")
            continue
        if action.kind == "Deployment" and action.verb in (CREATE, PATCH) and stored is not None:
            applied[(action.kind, action.name)] = stored
        if action.kind == "Deployment" and action.verb == CREATE and action.name in rendered:
            post_event(api, body, "Normal", "RevisionCreated", f"created revision {action.name}")
        if action.kind == "Deployment" and action.verb == DELETE:  # only revisions are ever deleted
            post_event(api, body, "Normal", "RevisionRetired", f"deleted old revision {action.name}")
        if action.verb == SCALE and scaling.changed_from is not None and action.name == want.stable.name:
            post_event(api, body, "Normal", "Scaled", f"{action.name} from {scaling.changed_from} to "
                       f"{scaling.replicas} serving replica(s): {scaling.condition['message']}")
    warm = None
    if want.stable.serving is not None and spec.warmPool is not None:
        engine = observed.engine(want.stable.name)
        warm = pool_status(spec.warmPool.size, pods_of(observed.pods(want.stable.name)),
                           pod_counts(observed, want.stable.name)[3], promoted, previous.get("warmPool") or {},
                           spec.resources.gpus, time.time(), deployment_failure(engine) if engine else None)
        idle = warm[0]["idleGPUSeconds"] - (previous.get("warmPool") or {}).get("idleGPUSeconds", 0.0)
        metrics.IDLE_GPU_SECONDS.labels(namespace, name).inc(max(idle, 0.0))
    # A template this pass changed is not rolled out yet: judged as read before the patch, it was
    # Ready for the new generation at once (`kubectl wait` right after `apply` returned at once).
    settling = Observed({**observed.objects, **applied})
    status = summarize(generation=generation, desired=want, observed=settling, previous=previous,
                       url=service_url(owner), selector=scale_selector(name), now=now(),
                       served_model=spec.model.served_name,
                       scaling=scaling.condition, autoscaling=scaling.status,
                       rollout=dump(rollout.state, spec.rollout) if rollout else None, warm=warm)
    if rejected:  # e.g. a value the CRD schema let through but a child's schema refuses
        status = invalid(status, generation, "Rejected", "; ".join(rejected), now(), stored=previous)
    report(api, body, previous, status, settings)
    for event in rollout.events if rollout else []:
        post_event(api, body, event.type, event.reason, event.message)
    if not actions and not relabelled and handed is None:  # else what it read is out of date
        settings.reads[key] = replace(read, body={**body, "status": status})
    builtin_scaler = replicas_writer(spec) == "builtin"
    if builtin_scaler and scaling.replicas == 0:
        return AT_ZERO_TICK_S
    busy = builtin_scaler or (rollout is not None and rollout.state.active)
    return AUTOSCALE_TICK_S if busy else settings.interval


def relabel(api: Api, body: Mapping[str, Any], owner: Owner, want: Desired, observed: Observed,
            sleep: bool) -> tuple[int, bool]:
    """Promote, demote and put to sleep the pods of revisions with a warm pool (warmpool.py);
    returns how many of the stable revision's standbys were promoted, and whether any pod was
    patched."""
    promoted, patched = 0, False
    for revision in want.revisions:
        if revision.serving is None:
            continue
        pool = plan_pool(revision.serving, pods_of(observed.pods(revision.name)), sleep)
        patches = pool.patches()
        patched = patched or bool(pool.promote or pool.demote)
        for pod in pool.promote + pool.demote:
            started = time.monotonic()
            woke = standby.call(pod, "/wake_up") if pod in pool.promote and pod.asleep else None
            if not patch_pod(api, owner, pod.name, patches[pod.name]):
                continue
            took = (time.monotonic() - started) * 1000
            if pod in pool.promote:
                promoted += revision.name == want.stable.name
                metrics.PROMOTIONS.labels(owner.namespace, owner.name).inc()
                metrics.PROMOTION_SECONDS.observe(took / 1000)
                woken = f", woken in {woke * 1000:.0f} ms" if woke is not None else ""
                post_event(api, body, "Normal", "Promoted", f"standby {pod.name} of {revision.name} promoted to "
                           f"serving in {took:.0f} ms{woken} (routed once its EndpointSlice updates)")
            else:
                post_event(api, body, "Normal", "Demoted", f"{pod.name} of {revision.name} demoted to standby")
        # A /sleep refused (a pod just demoted still finishing requests) wrote nothing: what this
        # pass read stays good, and the next timer pass tries again without reading it all anew.
        for pod in standby.put_to_sleep(pool.sleep):
            if patch_pod(api, owner, pod.name, {"metadata": {"annotations": {ASLEEP: str(pod.restarts)}}}):
                patched = True
    return promoted, patched


def patch_pod(api: Api, owner: Owner, name: str, patch: dict[str, Any]) -> bool:
    """False when the pod is gone meanwhile (the next pass sees what replaced it)."""
    api.fence()
    try:
        api.core.patch_namespaced_pod(name, owner.namespace, patch)
    except ApiException as err:
        if err.status == 404:
            return False
        raise
    return True


def api_message(err: ApiException) -> str:
    """The API server's own words (a Status object's message), else the body as it came."""
    try:
        return json.loads(err.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(err.body)[:500]


def merge_patch(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) from `before` to `after`: a key dropped at any depth is
    written as null, or the API server would keep it (a rollout's old canary, say)."""
    patch: dict[str, Any] = {key: None for key in before if key not in after}
    for key, value in after.items():
        old = before.get(key)
        patch[key] = merge_patch(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return patch


def report(api: Api, body: Mapping[str, Any], previous: dict[str, Any], status: dict[str, Any],
           settings: Settings) -> None:
    """Write the status if it changed, then one Event per condition that changed."""
    if all(previous.get(key) == value for key, value in status.items()) and set(previous) <= set(status):
        return
    meta = body["metadata"]
    patch = merge_patch(previous, status)
    api.fence()
    written = api.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], {"status": patch},
        _content_type="application/merge-patch+json")
    settings.own_writes[(meta["namespace"], meta["name"])] = written["metadata"]["resourceVersion"]
    for cond in transitions(previous, status):
        post_event(api, body, event_type(cond), cond["reason"],
                   f"{cond['type']}={cond['status']}: {cond['message']}")
