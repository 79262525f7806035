"""`kiln operator` against the real local control plane.

The operator runs as a local process authenticated with the kiln-operator ServiceAccount's
token (TokenRequest), so the RBAC in manifests/ is what it gets. kwok plays the kubelets:
pods bound to its GPU nodes turn Running and Ready. (The router and engines as real
processes: e2e/. Autoscaling modes: test_operator_scaling.py.)"""
from __future__ import annotations

import json
import os
import signal
import socket
import time

import kubernetes
import yaml

from kiln.local.cluster import free_port
from kiln.local.testing import OperatorProcess, eventually, loopback_hosts, service_account_kubeconfig
from kiln.operator.reconcile import CHILD_KINDS
from kiln_process import get
from operator_support import (GROUP, PLURAL, REPO, VERSION, a_pass_ran, absent, apply, condition, engine_deployments,
                              engines, event_reasons, events, history, isvc, ready, smollm2, until)

SA = "system:serviceaccount:kiln-system:kiln-operator"


def test_install_grants_the_operator_only_what_it_uses(kiln_installed, kubectl):
    assert "customresourcedefinition.apiextensions.k8s.io/inferenceservices.kiln.dev" in kiln_installed.stdout
    again = kubectl("apply", "-k", str(REPO / "manifests"))  # installing twice is harmless
    assert "unchanged" in again.stdout

    def can(verb: str, resource: str, namespace: str = "default") -> bool:
        done = kubectl("auth", "can-i", verb, resource, f"--as={SA}", "-n", namespace, check=False)
        return done.stdout.strip() == "yes"

    assert can("patch", "deployments.apps") and can("patch", "inferenceservices.kiln.dev/status")
    assert can("patch", "inferenceservices.kiln.dev/scale")  # the hand-over from builtin to an HPA
    assert can("watch", "pods") and can("delete", "services") and can("create", "events")
    assert can("bind", "clusterroles.rbac.authorization.k8s.io/kiln-router")
    # The plan deletes any child it owns and no longer wants, of every kind it observes.
    resources = {"Deployment": "deployments.apps", "Service": "services",
                 "PodDisruptionBudget": "poddisruptionbudgets.policy", "ServiceAccount": "serviceaccounts",
                 "RoleBinding": "rolebindings.rbac.authorization.k8s.io",
                 "HorizontalPodAutoscaler": "horizontalpodautoscalers.autoscaling",
                 "NetworkPolicy": "networkpolicies.networking.k8s.io"}  # (KEDA's CRD is not installed here)
    assert set(resources) == set(CHILD_KINDS)
    for kind, resource in resources.items():
        for verb in ("list", "create", "patch", "delete"):
            assert can(verb, resource), f"the operator cannot {verb} the {kind} children it manages"
    for verb, resource in [("get", "secrets"), ("delete", "inferenceservices.kiln.dev"), ("create", "pods"),
                           ("list", "configmaps"), ("update", "inferenceservices.kiln.dev"),
                           ("create", "roles.rbac.authorization.k8s.io"), ("list", "endpointslices.discovery.k8s.io"),
                           ("bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin")]:
        assert not can(verb, resource), f"the operator should not be able to {verb} {resource}"


def test_smollm2_example_serves_scales_rolls_and_is_collected(operator, apis, ns, kubectl):
    apply(kubectl, ns, smollm2(gpus=1))
    obj = until(lambda: ready(apis, ns, "smollm2"), "smollm2 Ready")
    uid = obj["metadata"]["uid"]
    (dep,) = engine_deployments(apis, ns, "smollm2")
    svc = apis["core"].read_namespaced_service("smollm2", ns)
    pdb = apis["policy"].read_namespaced_pod_disruption_budget("smollm2-engine", ns)
    revision_svc = apis["core"].read_namespaced_service(dep.metadata.name, ns)
    for child in (dep, svc, pdb, revision_svc):
        (ref,) = child.metadata.owner_references
        assert (ref.kind, ref.name, ref.uid, ref.controller) == ("InferenceService", "smollm2", uid, True)
    container = dep.spec.template.spec.containers[0]
    assert container.image == "kiln/engine:test"
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    managers = {f.manager: f.fields_v1 for f in dep.metadata.managed_fields if f.operation == "Apply"}
    assert managers["kiln-replicas"] == {"f:spec": {"f:replicas": {}}}
    # The revision's EndpointSlices carry its labels: the router's per-revision view.
    discovery = kubernetes.client.DiscoveryV1Api(apis["core"].api_client)
    slices = until(lambda: discovery.list_namespaced_endpoint_slice(
        ns, label_selector=f"kiln.dev/revision={dep.metadata.name}").items, "the revision's EndpointSlices")
    assert slices[0].metadata.labels["kiln.dev/inferenceservice"] == "smollm2"
    binding = kubernetes.client.RbacAuthorizationV1Api(apis["core"].api_client).read_namespaced_role_binding(
        "smollm2-router", ns)
    assert (binding.role_ref.kind, binding.role_ref.name) == ("ClusterRole", "kiln-router")

    pods = apis["core"].list_namespaced_pod(ns, label_selector=engines("smollm2")).items
    assert [p.status.phase for p in pods] == ["Running"]
    node = apis["core"].read_node(pods[0].spec.node_name)
    assert "kiln.dev/kwok" in (node.metadata.annotations or {})
    status = obj["status"]
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert status["url"] == f"http://smollm2.{ns}.svc:8000/v1"
    assert all(c["observedGeneration"] == obj["metadata"]["generation"] for c in status["conditions"])
    assert not obj["metadata"].get("finalizers")  # deleting it never waits for the operator
    listing = kubectl("get", "isvc", "-n", ns).stdout
    assert listing.split("\n")[1].split()[:5] == ["smollm2", "True", "Serving", "1", "smollm2-135m"]

    # /scale, as HPA or `kubectl scale` would use it; status follows what the cluster reports.
    kubectl("scale", "isvc/smollm2", "-n", ns, "--replicas=2")
    until(lambda: (ready(apis, ns, "smollm2") or {}).get("status", {}).get("readyReplicas") == 2, "2 ready replicas")
    scale = apis["custom"].get_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, "smollm2")
    assert scale["status"]["replicas"] == 2 and "kiln.dev/inferenceservice=smollm2" in scale["status"]["selector"]

    # An engine change is a new revision; the old one (and its Service) goes once the new one is ready.
    old_name = dep.metadata.name
    kubectl("patch", "isvc/smollm2", "-n", ns, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":16}}}')
    until(lambda: ready(apis, ns, "smollm2") and [d.metadata.name for d in engine_deployments(apis, ns, "smollm2")]
          not in ([old_name], []), "new revision serving, old one retired")
    (new,) = engine_deployments(apis, ns, "smollm2")
    command = new.spec.template.spec.containers[0].command
    assert command[command.index("--max-num-seqs") + 1] == "16" and new.spec.replicas == 2
    until(lambda: absent(lambda: apis["core"].read_namespaced_service(old_name, ns)), "old revision's Service gone")
    until(lambda: {"Serving", "RevisionCreated", "RevisionRetired"} <= event_reasons(apis, ns, "smollm2"), "Events")

    kubectl("delete", "isvc/smollm2", "-n", ns, "--wait=true")
    every = "kiln.dev/inferenceservice=smollm2"
    until(lambda: not apis["apps"].list_namespaced_deployment(ns, label_selector=every).items
          and not apis["core"].list_namespaced_service(ns, label_selector=every).items
          and absent(lambda: apis["policy"].read_namespaced_pod_disruption_budget("smollm2-engine", ns))
          and not apis["core"].list_namespaced_pod(ns, label_selector=every).items,
          "garbage collection of every child")


def test_a_serving_state_plans_nothing(operator, apis, ns, kubectl, local_cluster):
    """plan() over what the real API server stored for a Ready service is empty: server
    defaults are not differences. KILN_RECORD=1 saves that state for tests/test_plan.py."""
    from kiln.operator.desired import desired
    from kiln.operator.models import InferenceServiceSpec
    from kiln.operator.plan import plan
    from kiln.operator.api import Api
    from kiln.operator.reconcile import observe
    from kiln.operator.render import Owner

    body = smollm2("steady")
    body["spec"]["imagePullSecrets"] = [{"name": "regcred"}]  # a private registry's credentials
    # Environment from a value, a Secret (which must exist, or the pod is refused) and a missing
    # optional ConfigMap (the variable is left unset).
    kubectl("create", "secret", "generic", "hf", "--from-literal=token=t0k", "-n", ns)
    body["spec"]["engine"]["env"] = [
        {"name": "OMP_DISPLAY_ENV", "value": "false"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "EXTRA", "valueFrom": {"configMapKeyRef": {"name": "none", "key": "k", "optional": True}}}]
    apply(kubectl, ns, body)
    obj = until(lambda: ready(apis, ns, "steady"), "steady Ready")
    api = Api.of(local_cluster.api_client)
    owner = Owner("steady", ns, obj["metadata"]["uid"])
    observed = observe(api, owner)
    for deployment in (o for (kind, _), o in observed.objects.items() if kind == "Deployment"):
        assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    engine = observed.get("Deployment", obj["status"]["revisions"][0]["name"])
    assert [e["name"] for e in engine["spec"]["template"]["spec"]["containers"][0]["env"]] == \
        ["HOME", "OMP_DISPLAY_ENV", "HF_TOKEN", "EXTRA"]
    assert {kind for kind, _ in observed.objects} == {"Deployment", "Service", "PodDisruptionBudget",
                                                       "ServiceAccount", "RoleBinding", "NetworkPolicy", "Pod"}
    spec = InferenceServiceSpec.model_validate(obj["spec"])
    assert plan(desired(owner, spec, observed, "kiln/engine:test", {}), observed) == []
    if os.environ.get("KILN_RECORD"):
        for o in observed.objects.values():
            o["metadata"].pop("managedFields", None)
        # As stored, in its namespace: the kiln.dev/applied hashes cover it (the Service URL in the
        # router's args, say), so a renamed recording would plan patches.
        recording = {"owner": {"name": "steady", "namespace": ns, "uid": owner.uid}, "spec": obj["spec"],
                     "image": "kiln/engine:test", "pod_annotations": {}, "objects": list(observed.objects.values())}
        (REPO / "tests/data/observed-serving.json").write_text(json.dumps(recording, indent=1, sort_keys=True) + "\n")
    # Credentials dropped from the spec leave both Deployments (the apply removes what it had set).
    del body["spec"]["imagePullSecrets"]
    apply(kubectl, ns, body)
    until(lambda: [d.spec.template.spec.image_pull_secrets for d in
                   [*engine_deployments(apis, ns, "steady"), apis["apps"].read_namespaced_deployment("steady-router", ns)]]
          == [None, None], "imagePullSecrets removed from the Deployments")


def test_tensor_parallelism_with_a_draft_model_and_adapters_is_rendered(operator, apis, ns, kubectl):
    body = smollm2("split", gpus=2)
    body["spec"]["engine"] |= {
        "tensorParallelSize": 2, "adapters": [{"name": "sql", "source": "hostpath:///srv/loras/sql"}],
        "speculative": {"method": "draft", "model": {"name": "draft", "source": "hostpath:///srv/draft"}}}
    apply(kubectl, ns, body)
    until(lambda: ready(apis, ns, "split"), "split Ready")
    (dep,) = engine_deployments(apis, ns, "split")
    (container,) = dep.spec.template.spec.containers
    command = container.command
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert json.loads(command[command.index("--speculative-config") + 1])["model"] == "/srv/draft"
    assert "--enable-lora" in command and command[command.index("--lora-modules") + 1] == "sql=/srv/loras/sql"
    assert {"/srv/draft", "/srv/loras/sql"} <= {m.mount_path for m in container.volume_mounts}


def test_router_pods_go_where_cpu_engines_go(operator, apis, ns, kubectl):
    """The router runs the engine image on the CPU: it takes the operator's CPU placement, not the
    service's own nodeSelector (its GPU engines')."""
    operator.restart("--cpu-node-selector=kubernetes.io/arch=amd64", "--cpu-toleration=kiln.dev/inference:NoSchedule",
                     "--gpu-node-selector=nvidia.com/gpu.present=true")
    try:
        body = smollm2("placed", gpus=1)
        body["spec"]["resources"]["nodeSelector"] = {"pool": "h200"}
        apply(kubectl, ns, body)
        router = until(lambda: apis["apps"].read_namespaced_deployment("placed-router", ns), "the router Deployment")
        assert router.spec.template.spec.node_selector == {"kubernetes.io/arch": "amd64"}
        assert [(t.key, t.operator, t.effect) for t in router.spec.template.spec.tolerations] == \
            [("kiln.dev/inference", "Exists", "NoSchedule")]
        (engine,) = until(lambda: engine_deployments(apis, ns, "placed"), "the engine Deployment")
        assert engine.spec.template.spec.node_selector == {"nvidia.com/gpu.present": "true", "pool": "h200"}
        assert not engine.spec.template.spec.tolerations
    finally:
        kubectl("delete", "inferenceservice", "placed", "-n", ns, "--wait=false")
        operator.restart()


def test_an_older_releases_engine_pdb_is_deleted_for_the_renamed_one(operator, apis, ns, kubectl):
    """The engine's budget was <name> before it became <name>-engine: the operator, with its own
    ServiceAccount's rights, deletes the one it owns by the old name."""
    apply(kubectl, ns, smollm2("renamed"))
    until(lambda: apis["policy"].read_namespaced_pod_disruption_budget("renamed-engine", ns), "the engine PDB")
    owner = isvc(apis, ns, "renamed")["metadata"]
    old = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {
        "name": "renamed", "labels": {"kiln.dev/inferenceservice": "renamed", "kiln.dev/component": "engine"},
        "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "name": "renamed",
                             "uid": owner["uid"], "controller": True}]},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"kiln.dev/inferenceservice": "renamed"}}}}
    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(old))
    operator.restart()  # a fresh read at start finds it (budgets are not watched)
    until(lambda: absent(lambda: apis["policy"].read_namespaced_pod_disruption_budget("renamed", ns)),
          "the old PDB deleted")
    assert "is forbidden" not in operator.log.read_text()
    kubectl("delete", "inferenceservice", "renamed", "-n", ns, "--wait=false")


def events_match_status(apis, ns: str, name: str) -> list[str] | None:
    """The Event history once each stored condition's latest Event says what the status says
    (the operator posts Events after its status write, so Ready=True alone is too early)."""
    seen = history(apis, ns, name)
    latest = {h.split("=")[0]: h for h in seen}
    stored = {c["type"]: f"{c['type']}={c['status']} {c['reason']}"
              for c in (isvc(apis, ns, name).get("status") or {}).get("conditions", [])}
    return seen if stored and latest == stored else None


def test_each_condition_change_is_one_event(operator, apis, ns, kubectl):
    port = free_port()
    operator.restart(f"--metrics-port={port}", interval=1)  # a resync tick every second, passes counted
    apply(kubectl, ns, smollm2("counted"))
    until(lambda: ready(apis, ns, "counted"), "counted Ready")
    seen = until(lambda: events_match_status(apis, ns, "counted"), "an Event for each stored condition")
    for type_ in ("Ready", "WorkloadReady", "ModelLoaded", "RouteReady"):
        mine = [h for h in seen if h.startswith(type_ + "=")]
        assert mine and all(a != b for a, b in zip(mine, mine[1:])), f"{type_} repeated itself: {mine}"
    # Resync ticks and a restart change nothing, so they post nothing.
    a_pass_ran(port, ns, "counted")
    assert history(apis, ns, "counted") == seen
    port = free_port()
    operator.restart(f"--metrics-port={port}", interval=1)
    a_pass_ran(port, ns, "counted", since=0)  # the new process's first pass (a fresh read), ended
    assert history(apis, ns, "counted") == seen

    # One spec change that adds one condition: exactly one Event, and no more on later ticks.
    kubectl("patch", "isvc/counted", "-n", ns, "--type=merge", "-p", '{"spec":{"rollout":{"steps":[{"weight":50}]}}}')
    until(lambda: len(history(apis, ns, "counted")) > len(seen), "an Event for the change")
    a_pass_ran(port, ns, "counted")
    assert history(apis, ns, "counted")[len(seen):] == ["CanaryReady=True Promoted"]
    operator.restart()


def test_liveness_and_metrics_answer_on_every_address_of_both_families(operator):
    """The kubelet probes, and Prometheus scrapes, the operator pod's IP: IPv4, IPv6 or either on a
    dual-stack cluster. Without a host both endpoints take them all on one port."""
    live, scrape = free_port(), free_port()
    operator.restart(f"--liveness=http://:{live}/healthz", f"--metrics-port={scrape}")
    try:
        for host in loopback_hosts():
            status, health = eventually(lambda: (answer := get(f"http://{host}:{live}/healthz"))[0] and answer,
                                        f"liveness on {host}")
            assert status == 200 and json.loads(health) == {"status": "ok"}
            status, page = get(f"http://{host}:{scrape}/metrics")
            assert status == 200 and "# TYPE kiln_operator_reconcile_passes_total counter" in page
        assert get(f"http://127.0.0.1:{live}/other")[0] == 404
        # No connection is kept open after its answer: kopf waits 5 s at its stop for each one.
        with socket.create_connection(("127.0.0.1", scrape), timeout=10) as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: operator\r\n\r\n")  # HTTP/1.1: kept alive unless closed
            answer = b""
            while chunk := conn.recv(1 << 16):  # ends when the operator closes it, or times out
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and b"kiln_operator_reconcile_passes" in answer
    finally:
        operator.restart()


def test_a_deleted_engine_deployment_comes_back_without_waiting_for_resync(operator, apis, ns, kubectl):
    operator.restart(interval=300)
    apply(kubectl, ns, smollm2("repair"))
    until(lambda: ready(apis, ns, "repair"), "repair Ready")
    (dep,) = engine_deployments(apis, ns, "repair")
    # Events follow the status write: counted once they say what the status says.
    before = len(until(lambda: events_match_status(apis, ns, "repair"), "the Events settled"))
    apis["apps"].delete_namespaced_deployment(dep.metadata.name, ns)
    until(lambda: [d for d in engine_deployments(apis, ns, "repair") if d.metadata.uid != dep.metadata.uid]
          and ready(apis, ns, "repair"), "the Deployment back and Ready", timeout=30)
    after = until(lambda: [h for h in history(apis, ns, "repair")[before:] if h.startswith("Ready=True")]
                  and history(apis, ns, "repair")[before:], "Ready=True again", timeout=30)
    ready_events = [h for h in after if h.startswith("Ready=")]
    assert ready_events[0].startswith("Ready=False") and ready_events[-1] == "Ready=True Serving", after


def refusing_policy(ns: str, prefix: str) -> list[dict]:
    """A ValidatingAdmissionPolicy (as a cluster's Kyverno or Gatekeeper rules would) refusing the
    Deployments in `ns` whose names start with `prefix`, and its binding."""
    name = f"refuse-{ns}"
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": name},
              "spec": {"failurePolicy": "Fail",
                       "matchConstraints": {"resourceRules": [{"apiGroups": ["apps"], "apiVersions": ["v1"],
                                                               "operations": ["CREATE", "UPDATE"],
                                                               "resources": ["deployments"]}]},
                       "validations": [{"expression": f"!object.metadata.name.startsWith('{prefix}')",
                                        "message": "this cluster's policy refuses these Deployments"}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": name},
               "spec": {"policyName": name, "validationActions": ["Deny"],
                        "matchResources": {"namespaceSelector": {"matchLabels": {
                            "kubernetes.io/metadata.name": ns}}}}}
    return [policy, binding]


def test_a_child_the_api_server_refuses_is_a_condition_and_one_event(operator, apis, ns, kubectl):
    port = free_port()
    operator.restart(f"--metrics-port={port}", interval=1)
    policy, binding = refusing_policy(ns, "refused-")
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all([policy, binding]))
    probe = yaml.safe_dump({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "refused-probe"},
                            "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
                                "metadata": {"labels": {"a": "b"}}, "spec": {"containers": [
                                    {"name": "c", "image": "x"}]}}}})
    # The API server enforces a new policy once its informer has it: wait for that before applying.
    until(lambda: kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input=probe,
                          check=False).returncode != 0, "the policy enforced")
    try:
        apply(kubectl, ns, smollm2("refused"))
        cond = until(lambda: condition(isvc(apis, ns, "refused"), "Ready").get("reason") == "Rejected"
                     and condition(isvc(apis, ns, "refused"), "Ready"), "Ready=False Rejected")
        assert "this cluster's policy refuses these Deployments" in cond["message"] and cond["status"] == "False"
        until(lambda: "Rejected" in event_reasons(apis, ns, "refused", "Warning"), "the Warning")
        a_pass_ran(port, ns, "refused")  # resync ticks retry it and fail the same way: no new Event
        assert [e.reason for e in events(apis, ns, "refused")].count("Rejected") == 1
    finally:
        kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", binding["metadata"]["name"],
                check=False)
    until(lambda: ready(apis, ns, "refused"), "refused Ready once the policy is gone")
    operator.restart()


def test_a_name_taken_by_someone_elses_object_is_refused_not_taken_over(operator, apis, ns, kubectl):
    operator.restart(interval=1)
    apis["core"].create_namespaced_service(ns, {"metadata": {"name": "taken"},
                                                "spec": {"selector": {"app": "legacy"}, "ports": [{"port": 80}]}})
    apply(kubectl, ns, smollm2("taken"))
    cond = until(lambda: condition(isvc(apis, ns, "taken"), "Ready").get("reason") == "Rejected"
                 and condition(isvc(apis, ns, "taken"), "Ready"), "Ready=False Rejected")
    assert "Service named taken already exists" in cond["message"], cond
    svc = apis["core"].read_namespaced_service("taken", ns)
    assert svc.metadata.owner_references is None and svc.spec.selector == {"app": "legacy"}
    assert engine_deployments(apis, ns, "taken")  # the rest is made
    apis["core"].delete_namespaced_service("taken", ns)
    until(lambda: ready(apis, ns, "taken"), "taken Ready once the name is free")
    (ref,) = apis["core"].read_namespaced_service("taken", ns).metadata.owner_references
    assert ref.name == "taken"
    operator.restart()


def test_a_service_deleted_in_the_foreground_says_so_while_its_children_go(operator, apis, ns, kubectl):
    """Argo CD deletes in the foreground: the object stays until its children are gone, and it
    said Ready=True Serving all the while."""
    operator.restart(interval=1)
    body = smollm2("leaving")
    del body["spec"]["model"]["name"]  # served as the source's last part
    apply(kubectl, ns, body)
    until(lambda: ready(apis, ns, "leaving"), "leaving Ready")
    # (`kubectl get`'s Model column showed the spec's name: empty when left out.)
    listing = kubectl("get", "isvc", "leaving", "-n", ns).stdout
    assert listing.split("\n")[1].split()[:5] == ["leaving", "True", "Serving", "1", "smollm2-135m"]
    (dep,) = engine_deployments(apis, ns, "leaving")
    hold = [{"op": "add", "path": "/metadata/finalizers", "value": ["kiln.dev/test-hold"]}]
    apis["apps"].patch_namespaced_deployment(dep.metadata.name, ns, hold)
    try:
        apis["custom"].delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "leaving",
                                                       propagation_policy="Foreground")
        cond = until(lambda: condition(isvc(apis, ns, "leaving"), "Ready").get("reason") == "Terminating"
                     and condition(isvc(apis, ns, "leaving"), "Ready"), "Ready=False Terminating")
        assert cond["status"] == "False"
    finally:
        apis["apps"].patch_namespaced_deployment(dep.metadata.name, ns, [{"op": "remove", "path": "/metadata/finalizers"}])
    until(lambda: absent(lambda: isvc(apis, ns, "leaving")), "leaving gone")
    operator.restart()


def test_a_template_change_is_not_ready_for_its_generation_before_it_rolls_out(operator, apis, ns, kubectl):
    """A change that patches the stable Deployment's template (resources: no new revision) was
    judged on the Deployment as read before the patch: the first status of the new generation said
    Ready=True, and `kubectl wait --for=condition=Ready` right after `kubectl apply` returned at once."""
    operator.restart(interval=300)
    apply(kubectl, ns, smollm2("rolling"))
    until(lambda: ready(apis, ns, "rolling"), "rolling Ready")
    since = isvc(apis, ns, "rolling")["metadata"]["resourceVersion"]
    kubectl("patch", "isvc/rolling", "-n", ns, "--type=merge", "-p", '{"spec":{"resources":{"cpu":"3"}}}')
    generation = isvc(apis, ns, "rolling")["metadata"]["generation"]
    watch = kubernetes.watch.Watch()
    first = None
    for event in watch.stream(apis["custom"].list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL,
                              field_selector="metadata.name=rolling", resource_version=since, timeout_seconds=60):
        if (event["object"].get("status") or {}).get("observedGeneration") == generation:
            first = event["object"]
            break
    watch.stop()
    assert first is not None, "no status for the new generation"
    assert condition(first, "Ready")["status"] != "True", condition(first, "Ready")
    until(lambda: ready(apis, ns, "rolling"), "rolling Ready once rolled out")
    (dep,) = engine_deployments(apis, ns, "rolling")
    assert dep.spec.template.spec.containers[0].resources.requests["cpu"] == "3"
    operator.restart()


def test_killed_operator_converges_and_repairs_drift(operator, apis, ns, kubectl):
    apply(kubectl, ns, smollm2("drift"))
    # Kill it hard in the middle of its first pass, right as the first child appears.
    until(lambda: engine_deployments(apis, ns, "drift"), "the first child")
    operator.restart(sig=signal.SIGKILL)
    obj = until(lambda: ready(apis, ns, "drift"), "drift Ready after restart")
    assert condition(obj, "Ready")["reason"] == "Serving"

    old_uid = apis["core"].read_namespaced_service("drift", ns).metadata.uid
    apis["core"].delete_namespaced_service("drift", ns)
    until(lambda: apis["core"].read_namespaced_service("drift", ns).metadata.uid != old_uid,
          "the deleted Service to come back", timeout=30)

    (dep,) = engine_deployments(apis, ns, "drift")
    image = dep.spec.template.spec.containers[0].image
    kubectl("scale", f"deployment/{dep.metadata.name}", "-n", ns, "--replicas=3")
    kubectl("set", "image", f"deployment/{dep.metadata.name}", "-n", ns, "engine=evil/engine:latest")

    def restored() -> bool:
        now = apis["apps"].read_namespaced_deployment(dep.metadata.name, ns)
        return now.spec.replicas == 1 and now.spec.template.spec.containers[0].image == image
    until(restored, "hand edits to the Deployment to be undone", timeout=30)


def test_delete_finishes_while_the_operator_is_down(operator, apis, ns, kubectl):
    apply(kubectl, ns, smollm2("orphan"))
    until(lambda: ready(apis, ns, "orphan"), "orphan Ready")
    operator.stop()
    try:
        kubectl("delete", "isvc/orphan", "-n", ns, "--wait=true", "--timeout=60s")
        until(lambda: not apis["apps"].list_namespaced_deployment(
            ns, label_selector="kiln.dev/inferenceservice=orphan").items, "children collected")
    finally:
        operator.start()


def test_operator_serving_one_namespace_needs_a_rolebinding_there_only(local_cluster, operator, apis, namespace,
                                                                         kubectl, tmp_path):
    rendered = list(yaml.safe_load_all(kubectl("kustomize", str(REPO / "manifests/namespaced")).stdout))
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert ("RoleBinding", "kiln-operator") in kinds and ("ClusterRoleBinding", "kiln-operator") not in kinds
    deployment = next(d for d in rendered if d["kind"] == "Deployment")
    assert "--namespace=default" in deployment["spec"]["template"]["spec"]["containers"][0]["command"]

    # The same grant for a ServiceAccount of its own, in a namespace of its own.
    scoped = f"kiln-scoped-{namespace[-6:]}"
    kubectl("create", "namespace", scoped)
    kubectl("create", "serviceaccount", "scoped-operator", "-n", "kiln-system")
    kubectl("create", "clusterrolebinding", scoped, "--clusterrole=kiln-operator-cluster",
            "--serviceaccount=kiln-system:scoped-operator")
    kubectl("create", "rolebinding", "kiln-operator", "-n", scoped, "--clusterrole=kiln-operator",
            "--serviceaccount=kiln-system:scoped-operator")
    who = "system:serviceaccount:kiln-system:scoped-operator"
    assert kubectl("auth", "can-i", "list", "deployments", f"--as={who}", "-n", namespace,
                   check=False).stdout.strip() == "no"
    scoped_operator = OperatorProcess(
        service_account_kubeconfig(local_cluster.api_client, "kiln-system", "scoped-operator", tmp_path / "kubeconfig"),
        tmp_path / "operator.log", env={"KILN_ENGINE_IMAGE": "kiln/engine:test"})
    operator.stop()  # the cluster-wide one would serve the namespace too
    try:  # from here on: a failure left the module's operator stopped for every later test
        scoped_operator.start("--namespace", scoped)
        until(lambda: apis["core"].read_namespaced_service_account("default", scoped), "default SA")
        apply(kubectl, scoped, smollm2("scoped"))
        until(lambda: ready(apis, scoped, "scoped"), "scoped Ready")
        log = scoped_operator.text()
        assert "Forbidden" not in log and "Traceback" not in log, log[-3000:]
    finally:
        scoped_operator.stop()
        operator.start()
        kubectl("delete", "namespace", scoped, "--wait=false")
        kubectl("delete", "clusterrolebinding", scoped)
        kubectl("delete", "serviceaccount", "scoped-operator", "-n", "kiln-system")


def test_operator_never_hit_a_permission_error(operator):
    log = operator.text()
    assert "Forbidden" not in log and "Not enough permissions" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_uninstall_leaves_nothing_behind(operator, apis, ns, kubectl):
    """`kubectl delete -k manifests/` with a service still there (then installed again)."""
    apply(kubectl, ns, smollm2("uninstalled"))
    until(lambda: ready(apis, ns, "uninstalled"), "uninstalled Ready")
    # The garbage collector watches a CRD's kind from its first discovery resync (every 30 s) after
    # the CRD came; an owner it never watched, once gone with its CRD, has no REST mapping left
    # and its children stay. A cluster's CRD is older than that; this session's may not be yet.
    crd = kubernetes.client.ApiextensionsV1Api(apis["core"].api_client).read_custom_resource_definition(
        f"{PLURAL}.{GROUP}")
    age = time.time() - crd.metadata.creation_timestamp.timestamp()
    time.sleep(max(0.0, 35 - age))
    operator.stop()
    try:
        kubectl("delete", "-k", str(REPO / "manifests"), "--wait=true", "--timeout=120s")
        every = "kiln.dev/inferenceservice=uninstalled"
        until(lambda: all(not found(ns, label_selector=every).items for found in (
            apis["apps"].list_namespaced_deployment, apis["core"].list_namespaced_service,
            apis["core"].list_namespaced_pod, apis["core"].list_namespaced_service_account)), "children collected")
        rbac = kubernetes.client.RbacAuthorizationV1Api(apis["core"].api_client)
        assert not [r.metadata.name for r in rbac.list_cluster_role().items if r.metadata.name.startswith("kiln-")]
        until(lambda: absent(lambda: apis["core"].read_namespace("kiln-system")), "kiln-system gone")
    finally:
        kubectl("apply", "-k", str(REPO / "manifests"))
        kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/inferenceservices.kiln.dev")
