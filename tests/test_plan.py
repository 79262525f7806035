"""plan(desired, observed) on cluster states: a recorded one (what the real API server stored for
a serving InferenceService, tests/data/observed-serving.json, written by
tests/test_operator.py::test_record_a_serving_state) and edits of it."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kiln.operator.desired import desired
from kiln.operator.models import InferenceServiceSpec
from kiln.operator.observed import Observed
from kiln.operator.plan import CREATE, DELETE, PATCH, SCALE, contains, plan, stamped
from kiln.operator.quantity import canonical
from kiln.operator.render import Owner
from kiln.operator.scaling import render_hpa, render_scaled_object

RECORDED = Path(__file__).parent / "data" / "observed-serving.json"


@pytest.fixture(scope="module")
def recording() -> dict:
    """{"owner": {...}, "spec": {...}, "image": ..., "pod_annotations": {...}, "objects": [...]}"""
    return json.loads(RECORDED.read_text())


def replay(recording: dict, spec: dict | None = None, edit=None):
    objects = copy.deepcopy(recording["objects"])
    if edit is not None:
        objects = edit(objects)
    observed = Observed.of(*objects)
    owner = Owner(**recording["owner"])
    parsed = InferenceServiceSpec.model_validate(spec or recording["spec"])
    wanted = desired(owner, parsed, observed, recording["image"], recording["pod_annotations"])
    return wanted, [(a.verb, a.kind, a.name, a.replicas) for a in plan(wanted, observed)]


def named(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if (o["kind"], o["metadata"]["name"]) == (kind, name))


def test_a_steady_state_plans_nothing(recording):
    # The API server adds defaults (probes' successThreshold, the pod's dnsPolicy...) and
    # bookkeeping; none of it is a difference.
    assert replay(recording) == (replay(recording)[0], [])


def test_a_missing_child_is_created_in_place(recording):
    name = recording["owner"]["name"]
    dropped = [o for o in recording["objects"] if (o["kind"], o["metadata"]["name"]) != ("Service", name)]
    _, actions = replay(recording, edit=lambda _: dropped)
    assert actions == [(CREATE, "Service", name, None)]


def test_a_hand_edit_is_patched_back(recording):
    wanted, _ = replay(recording)
    revision = wanted.stable.name

    def edit(objects):
        dep = named(objects, "Deployment", revision)
        dep["spec"]["template"]["spec"]["containers"][0]["image"] = "evil/engine:latest"
        dep["metadata"]["labels"]["extra"] = "kept"  # a label we never set is not our business
        return objects
    assert replay(recording, edit=edit)[1] == [(PATCH, "Deployment", revision, None)]


def applied(recording: dict, spec: dict):
    """An edit of the recorded objects: as an apply of `spec`'s objects leaves them (its fields
    added or replaced, lists whole; the API server's defaults kept)."""
    wanted, _ = replay(recording, spec)

    def merge(stored: dict, obj: dict) -> None:
        for key, value in obj.items():
            if isinstance(value, dict) and isinstance(stored.get(key), dict):
                merge(stored[key], value)
            else:
                stored[key] = copy.deepcopy(value)

    def edit(objects):
        for obj in map(stamped, wanted.objects()):
            merge(named(objects, obj["kind"], obj["metadata"]["name"]), obj)
        return objects
    return edit


def test_an_env_entry_someone_added_is_no_reason_to_apply_every_pass(recording):
    """`kubectl set env deploy/<revision> FOO=1`: server-side apply keeps another manager's entry,
    so a plan that counted it applied the Deployment again on every pass, for ever."""
    wanted, _ = replay(recording)

    def set_env(objects):
        container = named(objects, "Deployment", wanted.stable.name)["spec"]["template"]["spec"]["containers"][0]
        container["env"] = [*container.get("env", []), {"name": "FOO", "value": "1"}]
        return objects
    assert replay(recording, edit=set_env)[1] == []


def test_a_field_the_spec_no_longer_asks_for_is_applied_away(recording):
    """A key dropped from a map of ours (a node selector's label, a pod label, a Service's selector)
    or a pod field dropped whole: the stored objects still carry it, which `contains` (stored maps
    may hold more) would accept; the hash of what was applied tells."""
    wanted, _ = replay(recording)
    revision, router = wanted.stable.name, f"{recording['owner']['name']}-router"
    # The recorded spec asks for regcred alone: a second secret is one it no longer asks for.
    spec, resources = recording["spec"], recording["spec"]["resources"]
    secrets = {**spec, "imagePullSecrets": [{"name": "regcred"}, {"name": "retired"}]}
    assert sorted(replay(recording, edit=applied(recording, secrets))[1]) == \
        [(PATCH, "Deployment", revision, None), (PATCH, "Deployment", router, None)]
    two_labels = {**spec, "resources": {**resources, "nodeSelector": {"pool": "gpu", "zone": "b"}}}
    tolerating = {**spec, "resources": {**resources, "tolerations": [{"key": "gpu", "operator": "Exists"}]}}
    one_label = {**spec, "resources": {**resources, "nodeSelector": {"zone": "b"}}}  # one key dropped, the map kept
    for now, before in ((spec, two_labels), (spec, tolerating), (one_label, two_labels)):
        assert replay(recording, now, edit=applied(recording, before))[1] == [(PATCH, "Deployment", revision, None)]
    # Removing a warm pool (not part of the revision): its serving label leaves the pod template
    # and the revision Service's selector, or new pods would never be routed.
    pooled = {**recording["spec"], "warmPool": {"size": 1}}
    assert replay(recording, pooled)[0].stable.name == revision
    assert sorted(replay(recording, edit=applied(recording, pooled))[1]) == \
        [(PATCH, "Deployment", revision, None), (PATCH, "Service", revision, None)]
    # What someone else added to a map of ours is theirs: no patch (the apply would not remove it).
    assert replay(recording, edit=applied(recording, recording["spec"]))[1] == []

    def hand_added(objects):
        named(objects, "Deployment", revision)["spec"]["template"]["spec"]["nodeSelector"] = {"zone": "b"}
        return objects
    assert replay(recording, edit=hand_added)[1] == []


def test_quantities_stored_in_canonical_form_are_no_difference(recording):
    # The API server stores a quantity canonically (1.5Gi as 1536Mi, 0.5 as 500m, 2000 as 2k;
    # these pairs are what apimachinery's Quantity stores): rendered as the user wrote them,
    # every pass would patch the Deployment again.
    assert [canonical(q) for q in ("1.5Gi", "0.5", "2000", "2e3", "1024Ki", "0.5Ki", "16Gi", "1e-4", 4)] == \
        ["1536Mi", "500m", "2k", "2e3", "1Mi", "512", "16Gi", "100e-6", "4"]
    spec = copy.deepcopy(recording["spec"])
    spec["resources"].update({"cpu": "0.5", "memory": "1.5Gi"})
    wanted, _ = replay(recording, spec)

    def stored(objects):
        objects = applied(recording, spec)(objects)
        container = named(objects, "Deployment", wanted.stable.name)["spec"]["template"]["spec"]["containers"][0]
        container["resources"] = {"requests": {"cpu": "500m", "memory": "1536Mi"}, "limits": {"memory": "1536Mi"}}
        return objects
    assert replay(recording, spec, edit=stored)[1] == []


def test_replicas_follow_their_one_writer(recording):
    wanted, _ = replay(recording)
    revision = wanted.stable.name

    def scaled_by_someone(objects):
        named(objects, "Deployment", revision)["spec"]["replicas"] = 3
        return objects
    # Autoscaling off, or an HPA writing spec.replicas through /scale: spec.replicas is the one
    # source, and a hand scale of the Deployment is put back.
    assert replay(recording, edit=scaled_by_someone)[1] == [(SCALE, "Deployment", revision, 1)]
    hpa = {**recording["spec"], "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 4}}
    assert replay(recording, hpa, edit=scaled_by_someone)[1] == [(SCALE, "Deployment", revision, 1)]
    # The builtin autoscaler: its decision is written; with none yet, what runs stays (and
    # nothing else is planned: autoscaling is not part of the revision).
    builtin = {**recording["spec"], "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 4}}
    assert replay(recording, builtin, edit=scaled_by_someone)[1] == []
    wanted = desired(Owner(**recording["owner"]), InferenceServiceSpec.model_validate(builtin),
                     Observed.of(*scaled_by_someone(copy.deepcopy(recording["objects"]))), recording["image"],
                     recording["pod_annotations"], autoscaled=2)
    assert [str(a) for a in plan(wanted, Observed.of(*scaled_by_someone(copy.deepcopy(recording["objects"]))))] \
        == [f"scale Deployment/{revision} to 2"]


def test_a_new_revision_starts_then_the_old_one_retires(recording):
    old, _ = replay(recording)
    spec = copy.deepcopy(recording["spec"])
    spec.setdefault("engine", {})["maxNumSeqs"] = 7
    wanted, actions = replay(recording, spec)
    new = wanted.stable.name
    assert new != old.stable.name
    assert actions == [(CREATE, "Service", new, None), (CREATE, "Deployment", new, None),
                       (SCALE, "Deployment", new, 1)]
    create = plan(wanted, Observed.of(*recording["objects"]))[1]
    assert create.body["spec"]["replicas"] == 1  # created at its size, not at the API default

    def new_one_serving(objects):
        dep = copy.deepcopy(named(objects, "Deployment", old.stable.name))
        dep["metadata"]["name"] = new
        svc = copy.deepcopy(named(objects, "Service", old.stable.name))
        svc["metadata"]["name"] = new
        return objects + [dep, svc]
    _, actions = replay(recording, spec, edit=new_one_serving)
    assert {(verb, kind, name) for verb, kind, name, _ in actions if verb == DELETE} == \
        {(DELETE, "Deployment", old.stable.name), (DELETE, "Service", old.stable.name)}


def test_contains_compares_what_we_set_only():
    assert contains({"a": 1, "b": {"c": [1, {"d": 2, "e": 3}]}}, {"b": {"c": [1, {"d": 2}]}})
    assert not contains({"a": [1, 2]}, {"a": [1]})  # lists are ours whole: no item is extra
    assert not contains({"a": "1"}, {"a": 1})
    assert not contains({}, {"a": None})
    # Entries of a list keyed by name that another manager added are theirs (an apply keeps them).
    env = [{"name": "A", "value": "1"}]
    assert contains({"env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}]}, {"env": env})
    assert not contains({"env": [{"name": "A", "value": "2"}]}, {"env": env})
    assert not contains({"env": [{"name": "B", "value": "1"}]}, {"env": env}) and not contains({}, {"env": env})


def test_replicas_the_create_set_are_taken_over_even_when_they_match(recording):
    """A pass that ended between a Deployment's create (which sets its replicas under the main
    field manager) and the scale left no scale to do (the count matched), so the next template
    apply, which leaves replicas out, reset them to 1."""
    wanted, _ = replay(recording)
    revision = wanted.stable.name
    replicas = named(recording["objects"], "Deployment", revision)["spec"]["replicas"]
    created_only = [{"manager": "kiln-operator", "operation": "Apply",
                     "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}}}]

    def edit(objects):
        named(objects, "Deployment", revision)["metadata"]["managedFields"] = created_only
        return objects
    assert replay(recording, edit=edit)[1] == [(SCALE, "Deployment", revision, replicas)]
    taken_over = created_only + [{"manager": "kiln-replicas", "operation": "Apply",
                                  "fieldsV1": {"f:spec": {"f:replicas": {}}}}]

    def settled(objects):
        named(objects, "Deployment", revision)["metadata"]["managedFields"] = taken_over
        return objects
    assert replay(recording, edit=settled)[1] == []


def test_a_switch_of_scaler_removes_the_old_one_before_the_new_one_is_made(recording):
    """KEDA's webhook refuses a ScaledObject for a target an HPA scales, and two scalers would fight:
    hpa -> keda deletes the HPA first, and keda -> hpa the ScaledObject."""
    owner = Owner(**recording["owner"])
    kinds = {"hpa": "HorizontalPodAutoscaler", "keda": "ScaledObject"}

    def spec(mode: str) -> InferenceServiceSpec:
        return InferenceServiceSpec.model_validate(
            {**recording["spec"], "autoscaling": {"mode": mode, "minReplicas": 1, "maxReplicas": 4}})

    def scaler(mode: str) -> dict:
        return render_hpa(owner, spec(mode)) if mode == "hpa" else render_scaled_object(owner, spec(mode), "http://p:9090")
    for old, new in (("hpa", "keda"), ("keda", "hpa")):
        observed = Observed.of(*copy.deepcopy(recording["objects"]), stamped(scaler(old)))
        wanted = desired(owner, spec(new), observed, recording["image"], recording["pod_annotations"],
                         scalers=[scaler(new)])
        actions = [(a.verb, a.kind) for a in plan(wanted, observed) if a.kind in kinds.values()]
        assert actions == [(DELETE, kinds[old]), (CREATE, kinds[new])]
