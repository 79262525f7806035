"""The local cluster's TEST pod runtime (kiln.local.runtime) against the real control plane.

A `kiln router` pod with static endpoints stands in for a workload: it starts in a second,
needs no model and has a real readiness endpoint. The whole system (engines, operator) is
exercised in e2e/."""
from __future__ import annotations

import urllib.request

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from kiln.local import processes
from kiln.local.kwok import EXTERNAL_READINESS
from kiln.local.testing import eventually

pytestmark = pytest.mark.timeout(1800)  # the session's cluster may have to be built and started first


def pod(name: str, command: list[str], env: list[dict] | None = None) -> dict:
    return {"metadata": {"name": name, "annotations": {EXTERNAL_READINESS: "runtime"}},
            "spec": {"automountServiceAccountToken": False, "terminationGracePeriodSeconds": 5,
                     "containers": [{"name": "router", "image": "unused", "command": command, "env": env or [],
                                     "ports": [{"name": "http", "containerPort": 8080}],
                                     "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"},
                                                        "periodSeconds": 1}}]}}


def ready(core: kubernetes.client.CoreV1Api, name: str, namespace: str) -> str | None:
    status = core.read_namespaced_pod(name, namespace).status
    return next((c.status for c in status.conditions or [] if c.type == "Ready"), None)


def gone(core: kubernetes.client.CoreV1Api, name: str, namespace: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except ApiException as exc:
        return exc.status == 404
    return False


@pytest.fixture(scope="module")
def core(local_cluster, namespace: str) -> kubernetes.client.CoreV1Api:
    api = kubernetes.client.CoreV1Api(local_cluster.api_client)
    eventually(lambda: api.list_namespaced_service_account(namespace, field_selector="metadata.name=default").items,
               "the default ServiceAccount")
    return api


def test_runs_a_pod_in_a_namespace_holding_its_ip_and_stops_it_on_deletion(local_cluster, core, namespace):
    core.create_namespaced_pod(namespace, pod("web", ["kiln", "router", "--endpoints", "127.0.0.1:9",
                                                      "--port", "8080"]))
    eventually(lambda: ready(core, "web", namespace) == "True", "the runtime to report Ready")
    found = core.read_namespaced_pod("web", namespace)
    ip, uid = found.status.pod_ip, found.metadata.uid
    with urllib.request.urlopen(f"http://{ip}:8080/health", timeout=5) as resp:  # from the host, over the bridge
        assert resp.status == 200
    net = local_cluster.network
    assert f"p{uid[:8]}" in net.namespaces()
    runtime_log = local_cluster.cluster.dir / "logs" / "runtime.log"
    started = [line for line in runtime_log.read_text().splitlines() if f"started {namespace}/web " in line]
    pid = int(started[-1].split("(pid ")[1].split(")")[0])
    assert processes.start_ticks(pid) is not None
    core.delete_namespaced_pod("web", namespace)
    eventually(lambda: gone(core, "web", namespace), "the pod to be removed once its process stopped")
    assert processes.start_ticks(pid) is None
    assert f"p{uid[:8]}" not in net.namespaces()


def waiting(core: kubernetes.client.CoreV1Api, name: str, namespace: str) -> tuple[str, str] | None:
    """The pod's container's waiting (reason, message), as `kubectl describe` shows it."""
    for status in core.read_namespaced_pod(name, namespace).status.container_statuses or []:
        if status.state and status.state.waiting:
            return status.state.waiting.reason, status.state.waiting.message
    return None


def test_says_on_the_pod_why_it_cannot_run_it_and_still_removes_it(local_cluster, core, namespace):
    resource = {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}
    config = {"name": "TOKEN", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
    for name, env, reason, why in (
            ("bad-env", resource, "CreateContainerError",
             "the local test runtime cannot run this pod: env CPUS: only value, fieldRef, secretKeyRef and "
             "configMapKeyRef are supported"),
            ("no-configmap", config, "CreateContainerConfigError", "configmap c not found")):
        core.create_namespaced_pod(namespace, pod(name, ["kiln", "router", "--endpoints", "127.0.0.1:9"], [env]))
        eventually(lambda: waiting(core, name, namespace) == (reason, why), f"the pod to say {reason}: {why}")
        assert ready(core, name, namespace) == "False"
        core.delete_namespaced_pod(name, namespace)
        eventually(lambda: gone(core, name, namespace), "the pod that never ran to be removed")


def test_a_pod_waits_for_its_secret_and_starts_once_it_is_there(local_cluster, core, namespace):
    """As a kubelet: the pod is not refused for good; it starts when the Secret comes."""
    secret = {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "late", "key": "k"}}}
    core.create_namespaced_pod(namespace, pod("patient", ["kiln", "router", "--endpoints", "127.0.0.1:9"], [secret]))
    eventually(lambda: waiting(core, "patient", namespace) == ("CreateContainerConfigError", "secret late not found"),
               "the pod to say which Secret it waits for")
    core.create_namespaced_secret(namespace, {"metadata": {"name": "late"}, "stringData": {"k": "v"}})
    eventually(lambda: ready(core, "patient", namespace) == "True", "the pod to start once its Secret is there")
    core.delete_namespaced_pod("patient", namespace)
    eventually(lambda: gone(core, "patient", namespace), "the pod to be removed")
