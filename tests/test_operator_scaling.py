"""`kiln operator`'s autoscaling modes against the real local control plane: replicas through
the /scale subresource (hpa, keda), an HPA the real controller-manager acts on, a stand-in for
KEDA's CRD, and nodes out of GPUs. (The builtin autoscaler on real engines: e2e/test_autoscaling.py;
its decisions: test_autoscaler.py.)"""
from __future__ import annotations

import json

import kubernetes

from operator_support import (GROUP, PLURAL, VERSION, absent, apply, condition, engine_deployments, event_reasons,
                              isvc, ready, smollm2, until)


def test_an_external_scaler_writes_the_scale_subresource_and_stays_the_one_writer(operator, apis, ns, kubectl):
    body = smollm2("scaled")
    body["spec"]["autoscaling"] = {"mode": "keda", "minReplicas": 1, "maxReplicas": 4}
    apply(kubectl, ns, body)
    until(lambda: ready(apis, ns, "scaled"), "scaled Ready")
    # No KEDA in this cluster: said so, once, and replicas follow spec.replicas meanwhile.
    cond = condition(isvc(apis, ns, "scaled"), "ScalingReady")
    assert (cond["status"], cond["reason"]) == ("False", "KEDANotInstalled")
    assert "scaledobjects.keda.sh" in cond["message"]
    until(lambda: "KEDANotInstalled" in event_reasons(apis, ns, "scaled", "Warning"), "a Warning Event")
    (dep,) = engine_deployments(apis, ns, "scaled")
    name = dep.metadata.name
    # An HPA or KEDA (here: a field manager of its own) writes the InferenceService's /scale ...
    apis["custom"].patch_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, "scaled",
                                                        {"spec": {"replicas": 3}}, field_manager="test-hpa")
    until(lambda: (ready(apis, ns, "scaled") or {}).get("status", {}).get("readyReplicas") == 3, "3 ready")
    # ... its value survives reconciles (spec changes that start no rollout), and a hand edit of
    # the Deployment, a second writer, is put back.
    kubectl("scale", f"deployment/{name}", "-n", ns, "--replicas=1")
    for size in (1, 2):
        kubectl("patch", "isvc/scaled", "-n", ns, "--type=merge", "-p",
                json.dumps({"spec": {"rollout": {"steps": [{"weight": 10 * size}]}}}))
        until(lambda: ready(apis, ns, "scaled"), "the change observed")
    until(lambda: apis["apps"].read_namespaced_deployment(name, ns).spec.replicas == 3, "the HPA's 3 put back")
    obj = isvc(apis, ns, "scaled")
    assert obj["spec"]["replicas"] == 3 and obj["status"]["desiredReplicas"] == 3
    owners = {f.get("manager") for f in obj["metadata"]["managedFields"]
              if "f:replicas" in (f.get("fieldsV1") or {}).get("f:spec", {})}
    assert owners == {"test-hpa"}, owners  # the operator wrote no spec (it hands over only from builtin)


def test_hpa_mode_makes_an_hpa_that_the_controller_manager_acts_on(operator, apis, ns, kubectl):
    body = smollm2("hpa")
    body["spec"]["autoscaling"] = {"mode": "hpa", "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 2,
                                   "scaleDownDelay": "2m"}
    apply(kubectl, ns, body)
    hpas = kubernetes.client.AutoscalingV2Api(apis["core"].api_client)
    hpa = until(lambda: hpas.read_namespaced_horizontal_pod_autoscaler("hpa", ns), "the HPA")
    ref = hpa.spec.scale_target_ref
    assert (ref.api_version, ref.kind, ref.name) == (f"{GROUP}/{VERSION}", "InferenceService", "hpa")
    (metric,) = hpa.spec.metrics
    assert (metric.pods.metric.name, metric.pods.target.average_value) == ("kiln:num_requests_load", "2")
    assert hpa.spec.behavior.scale_down.stabilization_window_seconds == 120
    # The real HPA controller reads the InferenceService's /scale and asks for the metric; with no
    # custom metrics API in this cluster it says so, and the InferenceService passes that on.
    cond = until(lambda: condition(isvc(apis, ns, "hpa"), "ScalingReady").get("reason") == "FailedGetPodsMetric"
                 and condition(isvc(apis, ns, "hpa"), "ScalingReady"), "the HPA's verdict", timeout=120)
    assert cond["status"] == "False" and "kiln:num_requests_load" in cond["message"], cond
    # Another mode: the HPA goes (one writer of spec.replicas at a time).
    kubectl("patch", "isvc/hpa", "-n", ns, "--type=merge", "-p", '{"spec":{"autoscaling":{"mode":"none"}}}')
    until(lambda: absent(lambda: hpas.read_namespaced_horizontal_pod_autoscaler("hpa", ns)), "the HPA deleted")
    assert condition(isvc(apis, ns, "hpa"), "ScalingReady")["reason"] == "Manual"


def test_leaving_builtin_for_hpa_hands_the_decision_over_and_nothing_drops(operator, apis, ns, kubectl):
    body = smollm2("handover")  # spec.replicas: 1
    body["spec"]["autoscaling"] = {"mode": "builtin", "minReplicas": 2, "maxReplicas": 3}
    apply(kubectl, ns, body)
    until(lambda: (ready(apis, ns, "handover") or {}).get("status", {}).get("readyReplicas") == 2, "2 ready")
    assert isvc(apis, ns, "handover")["status"]["autoscaling"]["replicas"] == 2
    (dep,) = engine_deployments(apis, ns, "handover")
    body["spec"]["autoscaling"].update(mode="hpa", minReplicas=1)
    apply(kubectl, ns, body)
    hpas = kubernetes.client.AutoscalingV2Api(apis["core"].api_client)
    until(lambda: hpas.read_namespaced_horizontal_pod_autoscaler("handover", ns), "the HPA")
    obj = until(lambda: ready(apis, ns, "handover"), "the switch observed")
    # The builtin's 2 went to spec.replicas, written by the operator, where the HPA starts from ...
    assert obj["spec"]["replicas"] == 2 and "autoscaling" not in obj["status"], obj["status"]
    owners = {f.get("manager") for f in obj["metadata"]["managedFields"]
              if "f:replicas" in (f.get("fieldsV1") or {}).get("f:spec", {})}
    assert owners == {"kiln-operator"}, owners
    assert "ScalingHandedOver" in event_reasons(apis, ns, "handover", "Normal")
    # ... and the Deployment was never scaled: no new generation, 2 replicas throughout.
    now = apis["apps"].read_namespaced_deployment(dep.metadata.name, ns)
    assert (now.metadata.generation, now.spec.replicas) == (dep.metadata.generation, 2)
    # From then on spec.replicas is the scaler's (here a field manager of this test's): its count stands.
    apis["custom"].patch_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, "handover",
                                                        {"spec": {"replicas": 3}}, field_manager="test-hpa")
    until(lambda: apis["apps"].read_namespaced_deployment(dep.metadata.name, ns).spec.replicas == 3, "the HPA's 3")
    assert isvc(apis, ns, "handover")["spec"]["replicas"] == 3


KEDA_STAND_IN = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh"},
    "spec": {"group": "keda.sh", "scope": "Namespaced",
             "names": {"plural": "scaledobjects", "singular": "scaledobject", "kind": "ScaledObject"},
             "versions": [{"name": "v1alpha1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_keda_mode_makes_a_scaled_object_once_keda_is_there(operator, apis, ns, kubectl):
    """KEDA itself cannot run here (no images). A STAND-IN for its CRD (its name, group and kind,
    an open schema) plays KEDA's API: the operator's object, its RBAC and its reading of the
    ScaledObject's status are real; KEDA's own validation and scaling are not exercised."""
    kubectl("apply", "-f", "-", input=json.dumps(KEDA_STAND_IN))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/scaledobjects.keda.sh")
    operator.restart(interval=1)  # ScaledObjects are not watched: the resync picks up their status
    try:
        body = smollm2("keda")
        body["spec"]["autoscaling"] = {"mode": "keda", "minReplicas": 0, "maxReplicas": 3, "targetQueueDepth": 4,
                                       "scaleDownDelay": "90s"}
        apply(kubectl, ns, body)
        read = lambda: apis["custom"].get_namespaced_custom_object("keda.sh", "v1alpha1", ns, "scaledobjects", "keda")  # noqa: E731
        scaled = until(read, "the ScaledObject")
        assert scaled["metadata"]["ownerReferences"][0]["name"] == "keda"
        spec = scaled["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "name": "keda"}
        assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["cooldownPeriod"]) == (0, 3, 90)
        # A new ScaledObject holds its replicas that long too: KEDA's cooldown counts from a first activation.
        assert spec["initialCooldownPeriod"] == 90
        # cooldownPeriod is the step to zero only: the steps above it take the window of KEDA's HPA.
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior == {"scaleDown": {"stabilizationWindowSeconds": 90}}
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "4"
        assert f'namespace="{ns}"' in trigger["metadata"]["query"] and '="keda"' in trigger["metadata"]["query"]
        # The load as builtin counts it, waiting + running: running requests keep a busy service
        # active (at waiting 0 KEDA took it to zero); from zero only the router's held requests
        # can activate it, as no engine reports any.
        for metric in ("kiln:num_requests_waiting{", "kiln:num_requests_running{", "kiln_router_held_requests{"):
            assert metric in trigger["metadata"]["query"], metric
        # KEDA's verdict is passed on as ScalingReady.
        apis["custom"].patch_namespaced_custom_object_status(
            "keda.sh", "v1alpha1", ns, "scaledobjects", "keda", {"status": {"conditions": [
                {"type": "Ready", "status": "False", "reason": "ScaledObjectCheckFailed",
                 "message": "prometheus query failed"}]}})
        cond = until(lambda: condition(isvc(apis, ns, "keda"), "ScalingReady").get("reason") == "ScaledObjectCheckFailed"
                     and condition(isvc(apis, ns, "keda"), "ScalingReady"), "KEDA's verdict")
        assert cond["status"] == "False" and "prometheus query failed" in cond["message"]
        kubectl("patch", "isvc/keda", "-n", ns, "--type=merge", "-p", '{"spec":{"autoscaling":{"mode":"none"}}}')
        until(lambda: absent(read), "the ScaledObject deleted with the mode")
    finally:
        kubectl("delete", "crd", "scaledobjects.keda.sh", "--wait=true")
        operator.restart()


def test_nodes_out_of_gpus_say_insufficient_capacity(operator, apis, ns, kubectl):
    body = smollm2("greedy", gpus=4)
    body["spec"]["replicas"] = 3  # 12 GPUs; the two kwok nodes have 4 each
    apply(kubectl, ns, body)
    cond = until(lambda: condition(isvc(apis, ns, "greedy"), "ScalingReady").get("reason") == "InsufficientCapacity"
                 and condition(isvc(apis, ns, "greedy"), "ScalingReady"), "ScalingReady=False InsufficientCapacity")
    assert cond["status"] == "False" and "nvidia.com/gpu" in cond["message"]
    until(lambda: "InsufficientCapacity" in event_reasons(apis, ns, "greedy", "Warning"), "a Warning Event")
    kubectl("delete", "isvc/greedy", "-n", ns)


def test_pods_a_quota_forbids_say_why(operator, apis, ns, kubectl):
    """No pod is ever made, so none can report: the Deployment's ReplicaFailure says why."""
    apis["core"].create_namespaced_resource_quota(ns, {"metadata": {"name": "no-gpus"},
                                                       "spec": {"hard": {"requests.nvidia.com/gpu": "0"}}})
    try:
        apply(kubectl, ns, smollm2("quota", gpus=1))
        cond = until(lambda: condition(isvc(apis, ns, "quota"), "Ready").get("reason") == "FailedCreate"
                     and condition(isvc(apis, ns, "quota"), "Ready"), "Ready=False FailedCreate")
        assert cond["status"] == "False" and "quota" in cond["message"], cond
        assert condition(isvc(apis, ns, "quota"), "WorkloadReady")["reason"] == "FailedCreate"
        until(lambda: "FailedCreate" in event_reasons(apis, ns, "quota", "Warning"), "a Warning Event")
    finally:
        apis["core"].delete_namespaced_resource_quota("no-gpus", ns)
        kubectl("delete", "isvc/quota", "-n", ns, "--ignore-not-found")

