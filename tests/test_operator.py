"""`kiln operator` against the real local control plane.

The operator runs as a local process authenticated with the kiln-operator ServiceAccount's
token (TokenRequest), so the RBAC in manifests/ is what it gets. kwok plays the kubelets:
pods bound to its GPU nodes turn Running and Ready."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parents[1]
GROUP, VERSION, PLURAL = "kiln.dev", "v1alpha1", "inferenceservices"
SA = "system:serviceaccount:kiln-system:kiln-operator"


def eventually(check: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    """Poll until check() returns something truthy; fail with what was last seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except ApiException as err:
            last = f"{err.status} {err.reason}"
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last seen: {last!r}")


def absent(read: Callable[[], Any]) -> bool:
    try:
        read()
    except ApiException as err:
        return err.status == 404
    return False


class OperatorProcess:
    """`kiln operator` as a subprocess, with a kubeconfig holding only the SA token."""

    def __init__(self, kubeconfig: Path, log: Path) -> None:
        self.kubeconfig, self.log = kubeconfig, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "KILN_ENGINE_IMAGE": "kiln/engine:test"}
        with self.log.open("a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "operator", "--interval", "1"],
                                         env=env, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def service_account_kubeconfig(local_cluster, path: Path) -> Path:
    """A kubeconfig for the operator's ServiceAccount, from a TokenRequest."""
    core = kubernetes.client.CoreV1Api(local_cluster.api_client)
    request = {"spec": {"expirationSeconds": 3600}}
    token = core.create_namespaced_service_account_token("kiln-operator", "kiln-system", request).status.token
    admin = yaml.safe_load(Path(local_cluster.kubeconfig).read_text())
    cluster = admin["clusters"][0]["cluster"]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kiln-operator",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": "kiln-operator", "user": {"token": token}}],
        "contexts": [{"name": "kiln-operator", "context": {"cluster": "local", "user": "kiln-operator"}}],
    }))
    return path


@pytest.fixture(scope="module")
def operator(local_cluster, kiln_installed, tmp_path_factory):
    work = tmp_path_factory.mktemp("operator")
    proc = OperatorProcess(service_account_kubeconfig(local_cluster, work / "kubeconfig"), work / "operator.log")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        print("---- operator log (tail) ----\n" + "\n".join(proc.text().splitlines()[-60:]))


@pytest.fixture(scope="module")
def apis(local_cluster):
    client = local_cluster.api_client
    return {"custom": kubernetes.client.CustomObjectsApi(client), "apps": kubernetes.client.AppsV1Api(client),
            "core": kubernetes.client.CoreV1Api(client), "policy": kubernetes.client.PolicyV1Api(client)}


@pytest.fixture(scope="module")
def ns(namespace, apis, operator):
    # Pods need the namespace's default ServiceAccount, which the controller-manager makes.
    eventually(lambda: apis["core"].read_namespaced_service_account("default", namespace), "default SA")
    not_ready = [n.metadata.name for n in apis["core"].list_node().items
                 if not any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])]
    assert not not_ready, f"nodes {not_ready} are NotReady: kwok must keep their heartbeats (node leases)"
    yield namespace
    # The operator's finalizer (kopf timers need one) goes only while the operator runs.
    apis["custom"].delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    eventually(lambda: not apis["custom"].list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"],
               "InferenceServices to be deleted")


def smollm2(name: str = "smollm2") -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
    body["metadata"]["name"] = name
    return body


def isvc(apis, ns: str, name: str) -> dict[str, Any]:
    return apis["custom"].get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def ready(apis, ns: str, name: str) -> dict[str, Any] | None:
    """The isvc once Ready is True for its current generation."""
    obj = isvc(apis, ns, name)
    status = obj.get("status") or {}
    current = status.get("observedGeneration") == obj["metadata"]["generation"]
    return obj if current and condition(obj, "Ready").get("status") == "True" else None


def engines(name: str) -> str:
    """Label selector of an InferenceService's engine pods (its router's pods are not engines)."""
    return f"kiln.dev/inferenceservice={name},kiln.dev/component=engine"


def engine_deployments(apis, ns: str, name: str) -> list:
    return apis["apps"].list_namespaced_deployment(ns, label_selector=engines(name)).items


def event_reasons(apis, ns: str, name: str, type_: str | None = None) -> set[str]:
    """Reasons of the Events about an InferenceService (kopf posts them asynchronously)."""
    found = apis["core"].list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    return {e.reason for e in found if e.involved_object.kind == "InferenceService" and type_ in (None, e.type)}


def test_install_grants_the_operator_only_what_it_uses(kiln_installed, kubectl):
    assert "customresourcedefinition.apiextensions.k8s.io/inferenceservices.kiln.dev" in kiln_installed.stdout
    again = kubectl("apply", "-k", str(REPO / "manifests"))  # installing twice is harmless
    assert "unchanged" in again.stdout

    def can(verb: str, resource: str, namespace: str = "default") -> bool:
        done = kubectl("auth", "can-i", verb, resource, f"--as={SA}", "-n", namespace, check=False)
        return done.stdout.strip() == "yes"

    assert can("patch", "deployments.apps") and can("patch", "inferenceservices.kiln.dev/status")
    assert can("delete", "deployments.apps") and can("create", "events")
    for verb, resource in [("get", "secrets"), ("delete", "services"), ("delete", "inferenceservices.kiln.dev"),
                           ("create", "pods"), ("list", "configmaps"), ("update", "inferenceservices.kiln.dev")]:
        assert not can(verb, resource), f"the operator should not be able to {verb} {resource}"


def test_smollm2_example_serves_scales_rolls_and_is_collected(operator, apis, ns, kubectl):
    kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(smollm2()))
    obj = eventually(lambda: ready(apis, ns, "smollm2"), "smollm2 Ready")
    uid = obj["metadata"]["uid"]
    (dep,) = engine_deployments(apis, ns, "smollm2")
    svc = apis["core"].read_namespaced_service("smollm2", ns)
    pdb = apis["policy"].read_namespaced_pod_disruption_budget("smollm2", ns)
    for child in (dep, svc, pdb):
        (ref,) = child.metadata.owner_references
        assert (ref.kind, ref.name, ref.uid, ref.controller) == ("InferenceService", "smollm2", uid, True)
    container = dep.spec.template.spec.containers[0]
    assert container.image == "kiln/engine:test"
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    assert dep.metadata.managed_fields[0].manager == "kiln-operator"

    pods = apis["core"].list_namespaced_pod(ns, label_selector=engines("smollm2")).items
    assert [p.status.phase for p in pods] == ["Running"]
    node = apis["core"].read_node(pods[0].spec.node_name)
    assert "kiln.dev/kwok" in (node.metadata.annotations or {})
    status = obj["status"]
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert status["url"] == f"http://smollm2.{ns}.svc:8000/v1"
    assert condition(obj, "SpecImplemented")["status"] == "True"
    assert all(c["observedGeneration"] == obj["metadata"]["generation"] for c in status["conditions"])
    listing = kubectl("get", "isvc", "-n", ns).stdout
    assert listing.split("\n")[1].split()[:5] == ["smollm2", "True", "Serving", "1", "smollm2-135m"]

    # /scale, as HPA or `kubectl scale` would use it; status follows what the cluster reports.
    kubectl("scale", "isvc/smollm2", "-n", ns, "--replicas=2")
    eventually(lambda: (ready(apis, ns, "smollm2") or {}).get("status", {}).get("readyReplicas") == 2,
               "2 ready replicas")
    scale = apis["custom"].get_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, "smollm2")
    assert scale["status"]["replicas"] == 2 and "kiln.dev/inferenceservice=smollm2" in scale["status"]["selector"]

    # An engine change is a new revision; the old one goes once the new one is fully ready.
    old_name = dep.metadata.name
    kubectl("patch", "isvc/smollm2", "-n", ns, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":16}}}')
    eventually(lambda: [d.metadata.name for d in engine_deployments(apis, ns, "smollm2")] not in ([old_name], []),
               "a new revision")
    eventually(lambda: ready(apis, ns, "smollm2") and old_name not in
               [d.metadata.name for d in engine_deployments(apis, ns, "smollm2")], "old revision retired")
    (new,) = engine_deployments(apis, ns, "smollm2")
    command = new.spec.template.spec.containers[0].command
    assert command[command.index("--max-num-seqs") + 1] == "16" and new.spec.replicas == 2
    eventually(lambda: {"Serving", "RevisionRetired"} <= event_reasons(apis, ns, "smollm2"), "Events")

    kubectl("delete", "isvc/smollm2", "-n", ns, "--wait=true")
    every = "kiln.dev/inferenceservice=smollm2"
    eventually(lambda: not apis["apps"].list_namespaced_deployment(ns, label_selector=every).items
               and absent(lambda: apis["core"].read_namespaced_service("smollm2", ns))
               and absent(lambda: apis["policy"].read_namespaced_pod_disruption_budget("smollm2", ns))
               and not apis["core"].list_namespaced_pod(ns, label_selector=every).items,
               "garbage collection of every child")


def test_later_features_are_reported_as_not_implemented(operator, apis, ns, kubectl):
    body = smollm2("later")
    body["spec"].update({"autoscaling": {"mode": "builtin", "maxReplicas": 3}, "warmPool": {"size": 1}})
    body["spec"]["engine"]["quantization"] = "int4"
    kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))
    obj = eventually(lambda: ready(apis, ns, "later"), "later Ready")
    spec_cond = condition(obj, "SpecImplemented")
    assert (spec_cond["status"], spec_cond["reason"]) == ("False", "NotImplemented")
    for field in ("autoscaling.mode=builtin", "warmPool", "engine.quantization=int4"):
        assert field in spec_cond["message"]
    eventually(lambda: "NotImplemented" in event_reasons(apis, ns, "later", "Warning"), "a Warning Event")
    assert "NotImplemented" in kubectl("describe", "isvc/later", "-n", ns).stdout


def test_killed_operator_converges_and_repairs_drift(operator, apis, ns, kubectl):
    kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(smollm2("drift")))
    # Kill it hard in the middle of its first pass, right as the first child appears.
    eventually(lambda: engine_deployments(apis, ns, "drift"), "the first child")
    operator.stop(signal.SIGKILL)
    operator.start()
    obj = eventually(lambda: ready(apis, ns, "drift"), "drift Ready after restart")
    assert condition(obj, "Ready")["reason"] == "Serving"

    old_uid = apis["core"].read_namespaced_service("drift", ns).metadata.uid
    apis["core"].delete_namespaced_service("drift", ns)
    eventually(lambda: apis["core"].read_namespaced_service("drift", ns).metadata.uid != old_uid,
               "the deleted Service to come back")

    (dep,) = engine_deployments(apis, ns, "drift")
    image = dep.spec.template.spec.containers[0].image
    kubectl("scale", f"deployment/{dep.metadata.name}", "-n", ns, "--replicas=3")
    kubectl("set", "image", f"deployment/{dep.metadata.name}", "-n", ns, "engine=evil/engine:latest")

    def restored() -> bool:
        now = apis["apps"].read_namespaced_deployment(dep.metadata.name, ns)
        return now.spec.replicas == 1 and now.spec.template.spec.containers[0].image == image
    eventually(restored, "hand edits to the Deployment to be undone")


def test_operator_never_hit_a_permission_error(operator):
    log = operator.text()
    assert "Forbidden" not in log and "Not enough permissions" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
