"""The local control plane (kiln.local) against itself: real etcd, apiserver, controllers,
scheduler and kwok, checked through the objects the apiserver actually stores."""
from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import urllib.request
import uuid

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from kiln.local import build, cluster, kwok, processes
from kiln.local.network import PodNetwork
from kiln.local.testing import api_client, eventually, kubectl, service_account_kubeconfig

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def namespace(local_cluster):
    core = kubernetes.client.CoreV1Api(local_cluster.api_client)
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def test_apiserver_reports_the_pinned_version(local_cluster):
    info = kubernetes.client.VersionApi(local_cluster.api_client).get_code()
    assert info.git_version == build.KUBE_VERSION
    assert (info.major, info.minor) == ("1", build.KUBE_VERSION.split(".")[1])
    versions = json.loads(kubectl(local_cluster.kubeconfig, "version", "-o", "json").stdout)
    assert versions["serverVersion"]["gitVersion"] == versions["clientVersion"]["gitVersion"] == build.KUBE_VERSION


def test_rbac_denies_a_service_account_until_a_role_allows_it(local_cluster, namespace, tmp_path):
    admin = local_cluster.api_client
    kubernetes.client.CoreV1Api(admin).create_namespaced_service_account(namespace, {"metadata": {"name": "bot"}})
    bot = kubernetes.client.CoreV1Api(api_client(
        service_account_kubeconfig(admin, namespace, "bot", tmp_path / "bot.kubeconfig", expiration_s=600)))
    with pytest.raises(ApiException) as denied:
        bot.list_namespaced_pod(namespace)
    assert denied.value.status == 403
    assert f"system:serviceaccount:{namespace}:bot" in denied.value.body

    rbac = kubernetes.client.RbacAuthorizationV1Api(local_cluster.api_client)
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "pod-reader"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "bot-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "bot", "namespace": namespace}]})

    def allowed() -> bool:
        try:
            return bot.list_namespaced_pod(namespace).items == []
        except ApiException as exc:
            assert exc.status == 403
            return False
    eventually(allowed, "the RoleBinding to take effect", 30)
    with pytest.raises(ApiException) as still_denied:  # the role grants pods, nothing else
        bot.list_namespaced_secret(namespace)
    assert still_denied.value.status == 403


def deployment(name: str, replicas: int, annotations: dict | None = None) -> dict:
    labels = {"app": name}
    return {"metadata": {"name": name}, "spec": {
        "replicas": replicas, "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels, "annotations": annotations or {}}, "spec": {
            "containers": [{"name": "engine", "image": "kiln.invalid/engine:test",
                            "ports": [{"containerPort": 8000, "name": "http"}]}]}}}}


def running_pods(core, namespace: str, app: str, count: int) -> list:
    def ready():
        pods = core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
        running = [p for p in pods if p.status.phase == "Running" and p.status.pod_ip]
        return running if len(running) == count == len(pods) else None
    return eventually(ready, f"{count} running pods of {app}", 90)


def test_deployment_pods_run_on_kwok_nodes_with_bridge_ips_and_are_collected(local_cluster, namespace):
    api = local_cluster.api_client
    apps, core = kubernetes.client.AppsV1Api(api), kubernetes.client.CoreV1Api(api)
    discovery = kubernetes.client.DiscoveryV1Api(api)
    created = apps.create_namespaced_deployment(namespace, deployment("web", 3))
    core.create_namespaced_service(namespace, {"metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8000}]}})

    pods = running_pods(core, namespace, "web", 3)
    replica_sets = apps.list_namespaced_replica_set(namespace).items
    assert len(replica_sets) == 1
    assert [o.uid for o in replica_sets[0].metadata.owner_references] == [created.metadata.uid]
    node_cidrs = {n.metadata.name: ipaddress.ip_network(n.spec.pod_cidr)
                  for n in core.list_node().items}
    for pod in pods:
        assert [o.uid for o in pod.metadata.owner_references] == [replica_sets[0].metadata.uid]
        assert pod.spec.node_name in cluster.NODES
        address = ipaddress.ip_address(pod.status.pod_ip)
        assert address in local_cluster.network.subnet and address in node_cidrs[pod.spec.node_name]
        assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "True"
    pod_ips = {p.status.pod_ip for p in pods}
    assert len(pod_ips) == 3

    def slice_addresses():
        slices = discovery.list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=web").items
        found = {a for s in slices for e in (s.endpoints or []) if e.conditions.ready for a in e.addresses}
        return found if found == pod_ips else None
    eventually(slice_addresses, "EndpointSlices listing the pod IPs", 60)

    apps.delete_namespaced_deployment("web", namespace, propagation_policy="Background")
    eventually(lambda: not apps.list_namespaced_replica_set(namespace).items
               and not core.list_namespaced_pod(namespace).items, "garbage collection of ReplicaSet and pods", 90)


def test_gpu_capacity_is_scheduled(local_cluster, namespace):
    core = kubernetes.client.CoreV1Api(local_cluster.api_client)
    for node in core.list_node().items:
        assert node.status.allocatable["nvidia.com/gpu"] == kwok.NODE_CAPACITY["nvidia.com/gpu"]

    def gpu_pod(name: str, gpus: int) -> dict:
        limits = {"nvidia.com/gpu": str(gpus)}
        return {"metadata": {"name": name}, "spec": {"containers": [
            {"name": "engine", "image": "kiln.invalid/engine:test", "resources": {"limits": limits}}]}}
    core.create_namespaced_pod(namespace, gpu_pod("fits", int(kwok.NODE_CAPACITY["nvidia.com/gpu"])))
    core.create_namespaced_pod(namespace, gpu_pod("too-big", int(kwok.NODE_CAPACITY["nvidia.com/gpu"]) + 1))
    eventually(lambda: core.read_namespaced_pod("fits", namespace).status.phase == "Running", "the fitting pod to run")

    def unschedulable():
        conditions = core.read_namespaced_pod("too-big", namespace).status.conditions or []
        return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conditions)
    eventually(unschedulable, "the oversized pod to be reported unschedulable")
    assert core.read_namespaced_pod("too-big", namespace).spec.node_name is None


def test_external_readiness_pod_is_served_from_its_own_namespace(local_cluster, namespace):
    """What the pod test runtime does: run the pod's process in a namespace holding its IP."""
    core = kubernetes.client.CoreV1Api(local_cluster.api_client)
    apps = kubernetes.client.AppsV1Api(local_cluster.api_client)
    apps.create_namespaced_deployment(namespace, deployment("ext", 1, {kwok.EXTERNAL_READINESS: "external"}))
    (pod,) = running_pods(core, namespace, "ext", 1)
    assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "False"

    net: PodNetwork = local_cluster.network
    netns = net.create_namespace(pod.metadata.name, pod.status.pod_ip)
    server = subprocess.Popen([*net.exec_prefix(pod.metadata.name), sys.executable, "-m", "http.server",
                               "--bind", pod.status.pod_ip, "8000"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        def served() -> bool:
            with urllib.request.urlopen(f"http://{pod.status.pod_ip}:8000/", timeout=2) as resp:
                return resp.status == 200
        eventually(served, "the process in the pod namespace to answer on the pod IP", 30, ignore=(OSError,))
        assert netns in PodNetwork.system_namespaces()
    finally:
        server.terminate()
        server.wait()
        net.delete_namespace(pod.metadata.name)
    assert netns not in PodNetwork.system_namespaces()


def kiln_local(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", "local", *args], capture_output=True, text=True,
                          timeout=600)


def test_bad_network_arguments_are_refused():
    out = kiln_local("up", "--subnet", "127.0.0.0/24")
    assert out.returncode == 2 and "non-loopback" in out.stderr
    out = kiln_local("up", "--bridge", "a-very-long-bridge")
    assert out.returncode == 2 and "--bridge" in out.stderr
    out = kiln_local("build", "--jobs", "0")
    assert out.returncode == 2 and "--jobs: must be at least 1, got 0" in out.stderr


@pytest.mark.parametrize("text", ["{bad", json.dumps({"processes": {"etcd": {"pid": 1}}}),
                                  json.dumps({"processes": {"etcd": {"pid": 1, "start": 2}}})],
                         ids=["not JSON", "no start", "no network"])
def test_a_damaged_state_file_is_named_not_a_traceback(tmp_path, text):
    (tmp_path / "state.json").write_text(text)
    for action in ("status", "down"):
        out = kiln_local(action, "--dir", str(tmp_path))
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"kiln local {action}: {tmp_path / 'state.json'}: "), out.stderr


def test_up_is_idempotent_and_down_leaves_nothing_behind(tmp_path):
    """A second, independent cluster (own directory, bridge and subnet) from the CLI."""
    directory = tmp_path / "second"
    args = ("--dir", str(directory), "--bridge", "kilntest", "--subnet", "10.213.1.0/24")
    try:
        first = kiln_local("up", *args)
        assert first.returncode == 0 and first.stdout.startswith("started"), first.stderr
        check_second_cluster(directory, args)
    finally:  # a failed check must not leave a cluster behind
        kiln_local("down", "--force", "--dir", str(directory))


def check_second_cluster(directory, args: tuple[str, ...]) -> None:
    again = kiln_local("up", *args)
    assert again.returncode == 0 and again.stdout.startswith("already up"), again.stderr
    assert kiln_local("up", "--dir", str(directory)).returncode == 0  # no network asked: its own
    other = kiln_local("up", "--dir", str(directory), "--subnet", "10.213.2.0/24")  # kept its own, silently
    assert other.returncode == 2 and "up with --subnet 10.213.1.0/24: `kiln local down` first" in other.stderr
    assert kiln_local("status", "--dir", str(directory)).returncode == 0

    c = cluster.Cluster(directory)
    records = c.state()["processes"]
    assert set(records) == {*cluster.ORDER, cluster.RUNTIME}
    assert all(processes.alive(r) for r in records.values())
    c.network().create_namespace("probe", "10.213.1.9")
    assert "kilntest-probe" in PodNetwork.system_namespaces()

    # A test session using the cluster blocks `down`; leaving does not stop a cluster the CLI started.
    cluster.up(directory, "kilntest", "10.213.1.0/24", user=os.getpid())
    refused = kiln_local("down", "--dir", str(directory))
    assert refused.returncode == 1 and "still use the cluster" in refused.stderr
    assert cluster.leave(c, os.getpid()) is False and c.is_up()

    assert kiln_local("down", "--dir", str(directory)).returncode == 0
    assert not any(processes.alive(r) for r in records.values())
    assert subprocess.run(["ip", "link", "show", "kilntest"], capture_output=True).returncode != 0
    assert not [n for n in PodNetwork.system_namespaces() if n.startswith("kilntest-")]
    assert not directory.exists()
    assert kiln_local("status", "--dir", str(directory)).returncode == 3


def test_a_reused_pod_address_reaches_the_new_pod_at_once(tmp_path):
    """A pod's address goes to a later pod: a neighbour that talked to the old one must reach
    the new one now, not after its cached MAC expires (connects used to hang for seconds,
    which held requests at a replica that was already Ready)."""
    network = PodNetwork("kilnarp", ipaddress.IPv4Network("10.213.2.0/24"), tmp_path)
    network.check_free()
    network.create_bridge()

    def connect(to: str) -> int:
        """errno of a TCP connect from pod `a` to a closed port: 111 (refused) once it got there."""
        code = f"import socket; s = socket.socket(); s.settimeout(2); print(s.connect_ex(({to!r}, 9)))"
        out = subprocess.run([*network.exec_prefix("a"), sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=30)
        return int(out.stdout)
    try:
        network.create_namespace("a", "10.213.2.2")
        network.create_namespace("b", "10.213.2.3")
        assert connect("10.213.2.3") == 111  # `a` caches b's MAC
        network.delete_namespace("b")
        network.create_namespace("c", "10.213.2.3")
        assert connect("10.213.2.3") == 111  # not a timeout (11): c answered
    finally:
        for name in network.namespaces():
            network.delete_namespace(name)
        network.delete_bridge()
