"""EndpointSlice discovery: slices read into ready endpoints, and the source against the
local cluster, where the real API server writes the slices (kube-controller-manager) from
pods that kwok runs and marks Ready."""
from __future__ import annotations


import asyncio
import functools
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from kiln.local.kwok import EXTERNAL_READINESS  # kwok leaves such pods unready
from kiln.local.testing import eventually
from kiln.router.endpoints import Endpoint
from kiln.router.endpointslices import EndpointSliceSource, ready_endpoints
from kiln.router.main import serving
from kiln.router.proxy import build_app
from router_fakes import metric, parse_metrics, until, until_held

pytestmark = pytest.mark.timeout(60)


def endpoint_slice(name: str, port_name: str | None, port: int, ready: dict[str, bool | None],
                   revision: str | None = "rev-a") -> client.V1EndpointSlice:
    labels = {} if revision is None else {"kiln.dev/revision": revision}
    return client.V1EndpointSlice(
        address_type="IPv4", metadata=client.V1ObjectMeta(name=name, labels=labels),
        ports=[client.DiscoveryV1EndpointPort(name=port_name, port=port)],
        endpoints=[client.V1Endpoint(addresses=[ip], conditions=client.V1EndpointConditions(
            ready=state)) for ip, state in ready.items()])


def test_ready_endpoints_follow_conditions_port_name_and_revision() -> None:
    slices = [
        endpoint_slice("a", "http", 8000, {"10.0.0.2": True, "10.0.0.3": False,
                                           "10.0.0.4": None}),
        # Overlaps "a" while the controller moves an endpoint between slices.
        endpoint_slice("b", "http", 8000, {"10.0.0.2": True, "10.0.0.1": True}),
        endpoint_slice("c", "metrics", 9000, {"10.0.0.9": True}),
        endpoint_slice("d", "http", 8000, {"10.0.1.1": True}, revision="rev-b"),
        endpoint_slice("e", "http", 8000, {"10.0.2.1": False}, revision="rev-c"),
    ]
    ready = ready_endpoints(slices, "http")
    assert ready.by_revision == {
        "rev-a": tuple(Endpoint(ip, 8000, "rev-a") for ip in ("10.0.0.1", "10.0.0.2",
                                                              "10.0.0.4")),
        "rev-b": (Endpoint("10.0.1.1", 8000, "rev-b"),),
        "rev-c": ()}  # known, nobody ready
    assert ready.all == (*ready.by_revision["rev-a"], *ready.by_revision["rev-b"])
    assert ready_endpoints(slices, "grpc").all == ()
    unnamed = endpoint_slice("d", None, 8080, {"10.0.0.5": True}, revision=None)
    assert ready_endpoints([unnamed], "").by_revision == {"": (Endpoint("10.0.0.5", 8080),)}


# The local cluster from here on.

SERVICE_LABEL = "kubernetes.io/service-name"  # Kubernetes sets it on each slice
ISVC = "router-test"
SELECTOR = f"kiln.dev/inferenceservice={ISVC},kiln.dev/component=engine"  # as the operator
REVISION = f"{ISVC}-1a2b3c4d"


def engine_pod(name: str, ready: bool, app: str = "router-test") -> dict:
    annotations = {} if ready else {EXTERNAL_READINESS: "external"}
    return {"metadata": {"name": name, "labels": {"app": app}, "annotations": annotations},
            "spec": {"containers": [{"name": "engine", "image": "kiln/engine:test",
                                     "ports": [{"name": "http", "containerPort": 8000}]}]}}


# A bound to fail with a message, not a speed check.
wait_until = functools.partial(eventually, timeout=120, interval=0.1)


def slice_endpoints(api_client: client.ApiClient, namespace: str, service: str
                    ) -> tuple[list[client.V1EndpointSlice], dict[str, client.V1Endpoint]]:
    """The Service's slices as stored, and their endpoints by pod name."""
    slices = client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice(
        namespace, label_selector=f"{SERVICE_LABEL}={service}").items
    return slices, {e.target_ref.name: e for s in slices for e in s.endpoints or ()
                    if e.target_ref is not None}


def engine_service(api_client: client.ApiClient, namespace: str, name: str = "engines",
                   revision: str = REVISION, app: str = "router-test",
                   component: str = "engine") -> client.CoreV1Api:
    """A Service over pods labelled app=`app`, labelled like the operator's per-revision
    Services; ready to take pods."""
    core = client.CoreV1Api(api_client)
    labels = {"kiln.dev/inferenceservice": ISVC, "kiln.dev/component": component,
              "kiln.dev/revision": revision}
    core.create_namespaced_service(namespace, {
        "metadata": {"name": name, "labels": labels},
        "spec": {"selector": {"app": app},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8000},
                           {"name": "metrics", "port": 9090}]}})
    # Pods are refused until the controller-manager has made the namespace's ServiceAccount.
    wait_until(lambda: core.list_namespaced_service_account(
        namespace, field_selector="metadata.name=default").items, "the default ServiceAccount")
    return core


def pod_ip(core: client.CoreV1Api, namespace: str, name: str) -> str:
    wait_until(lambda: core.read_namespaced_pod(name, namespace).status.pod_ip,
               f"an IP for {name}")
    return core.read_namespaced_pod(name, namespace).status.pod_ip


@pytest.fixture
def router_namespace(local_cluster: Any) -> Iterator[str]:
    core = client.CoreV1Api(local_cluster.api_client)
    name = f"kiln-router-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)  # its Services and pods go with it


@pytest.mark.timeout(1800)  # the session's cluster may have to be built and started first
def test_endpointslice_discovery_follows_ready_pods_of_a_real_service(
        local_cluster: Any, router_namespace: str) -> None:
    namespace = router_namespace
    core = engine_service(local_cluster.api_client, namespace)
    for name, ready in (("engine-0", True), ("engine-1", True), ("engine-unready", False)):
        core.create_namespaced_pod(namespace, engine_pod(name, ready))
    source = EndpointSliceSource(local_cluster.api_client, namespace, SELECTOR, "http",
                                 resync_seconds=5)
    asyncio.run(source.start())
    try:
        wait_until(lambda: len(source.ready().all) >= 2, "two ready endpoints")
        ips = {name: pod_ip(core, namespace, name) for name in ("engine-0", "engine-1")}
        # The slices carry the pods' target port under the Service port's name, and the
        # Service's revision label.
        assert source.ready().all == tuple(sorted(Endpoint(ips[n], 8000, REVISION)
                                                  for n in ips))
        core.delete_namespaced_pod("engine-0", namespace, grace_period_seconds=0)
        wait_until(lambda: Endpoint(ips["engine-0"], 8000, REVISION) not in source.ready().all,
                   "the deleted pod to leave the endpoints")
        assert source.ready().all == (Endpoint(ips["engine-1"], 8000, REVISION),)
        # kwok may give the unready pod its IP (and so its slice entry) a moment later.
        wait_until(lambda: "engine-unready" in slice_endpoints(
            local_cluster.api_client, namespace, "engines")[1], "the unready pod in a slice")
        slices, by_pod = slice_endpoints(local_cluster.api_client, namespace, "engines")
        # Known to Kubernetes, yet not routed to.
        assert by_pod["engine-unready"].conditions.ready is False
        assert ready_endpoints(slices, "http") == source.ready()
    finally:
        asyncio.run(source.stop())


@pytest.mark.timeout(1800)  # the session's cluster may have to be built and started first
def test_endpointslice_discovery_groups_revisions_and_skips_other_services(
        local_cluster: Any, router_namespace: str) -> None:
    namespace = router_namespace
    api = local_cluster.api_client
    for revision in ("blue", "green"):
        core = engine_service(api, namespace, revision, f"{ISVC}-{revision}", app=revision)
        core.create_namespaced_pod(namespace, engine_pod(f"{revision}-0", True, app=revision))
    # The InferenceService's user-facing Service selects the routers: not an engine.
    engine_service(api, namespace, "front", "", app="front", component="router")
    core.create_namespaced_pod(namespace, engine_pod("front-0", True, app="front"))
    source = EndpointSliceSource(api, namespace, SELECTOR, "http", resync_seconds=5)
    asyncio.run(source.start())
    try:
        ips = {name: pod_ip(core, namespace, f"{name}-0") for name in ("blue", "green", "front")}
        wait_until(lambda: "front-0" in slice_endpoints(api, namespace, "front")[1],
                   "the router pod in its Service's slice")
        wait_until(lambda: len(source.ready().all) == 2, "a ready endpoint per revision")
        assert source.ready().by_revision == {
            f"{ISVC}-{name}": (Endpoint(ips[name], 8000, f"{ISVC}-{name}"),)
            for name in ("blue", "green")}
        # A router starting now serves only once it has listed them: no 503 meanwhile.
        restarted = EndpointSliceSource(api, namespace, SELECTOR, "http")
        asyncio.run(restarted.start())
        try:
            assert restarted.ready() == source.ready()
        finally:
            asyncio.run(restarted.stop())
    finally:
        asyncio.run(source.stop())


def accepts_connections(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


@contextmanager
def stand_in_engine(local_cluster: Any, namespace: str, ip: str, directory: Path
                    ) -> Iterator[dict]:
    """The pod's process, as in a real cluster: `python -m http.server` in a network
    namespace holding the pod's IP stands in for the engine, serving a canned /v1/models
    (which it yields)."""
    models = {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}
    (directory / "v1").mkdir()
    (directory / "v1" / "models").write_text(json.dumps(models))
    netns_name = f"rt-{namespace.removeprefix('kiln-router-')}"
    netns = local_cluster.network.create_namespace(netns_name, ip)
    stand_in = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "http.server", "8000",
         "--bind", ip, "--directory", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: accepts_connections(ip, 8000), "the stand-in engine to listen")
        yield models
    finally:
        stand_in.terminate()
        stand_in.wait()
        local_cluster.network.delete_namespace(netns_name)


@pytest.mark.timeout(1800)  # the session's cluster may have to be built and started first
def test_router_reaches_a_ready_pod_over_the_pod_network(
        local_cluster: Any, router_namespace: str, tmp_path: Path) -> None:
    """Slices -> pod IP -> the pod's process."""
    core = engine_service(local_cluster.api_client, router_namespace)
    core.create_namespaced_pod(router_namespace, engine_pod("engine-0", ready=True))
    ip = pod_ip(core, router_namespace, "engine-0")
    with stand_in_engine(local_cluster, router_namespace, ip, tmp_path) as models:
        asyncio.run(route_one_request(local_cluster.api_client, router_namespace, ip, models))


async def route_one_request(api_client: client.ApiClient, namespace: str, ip: str,
                            models: dict) -> None:
    source = EndpointSliceSource(api_client, namespace, SELECTOR, "http", resync_seconds=5)
    async with serving(build_app(source), "127.0.0.1", 0) as port, \
            aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        await until(lambda: source.ready().all == (Endpoint(ip, 8000, REVISION),))
        response = await session.get("/v1/models")
        assert response.status == 200 and json.loads(await response.text()) == models
        samples = parse_metrics(await (await session.get("/metrics")).text())
    assert metric(samples, "kiln_router_requests_total", revision=REVISION, code="200") == 1


def mark_ready(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """What the kubelet writes once the pod's readiness probe passes."""
    conditions = [{"type": t, "status": "True"} for t in ("Ready", "ContainersReady")]
    core.patch_namespaced_pod_status(name, namespace, {"status": {"conditions": conditions}},
                                     _content_type="application/strategic-merge-patch+json")


@pytest.mark.timeout(1800)  # the session's cluster may have to be built and started first
def test_request_held_while_no_pod_is_ready_goes_to_the_first_that_becomes_ready(
        local_cluster: Any, router_namespace: str, tmp_path: Path) -> None:
    """Scale from zero as the router sees it: the engine pod is running but not Ready."""
    core = engine_service(local_cluster.api_client, router_namespace)
    core.create_namespaced_pod(router_namespace, engine_pod("engine-0", ready=False))
    ip = pod_ip(core, router_namespace, "engine-0")
    with stand_in_engine(local_cluster, router_namespace, ip, tmp_path) as models:
        asyncio.run(release_held_request(local_cluster.api_client, core, router_namespace,
                                         models))


async def release_held_request(api_client: client.ApiClient, core: client.CoreV1Api,
                               namespace: str, models: dict) -> None:
    source = EndpointSliceSource(api_client, namespace, SELECTOR, "http", resync_seconds=5)
    async with serving(build_app(source), "127.0.0.1", 0) as port, \
            aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        held = asyncio.create_task(session.get("/v1/models"))
        await until_held(session, 1)
        assert source.ready().all == ()
        await asyncio.to_thread(mark_ready, core, namespace, "engine-0")
        # The watch thread sees the slice change and wakes the held request.
        response = await held
        assert response.status == 200 and json.loads(await response.text()) == models
        samples = parse_metrics(await (await session.get("/metrics")).text())
    assert metric(samples, "kiln_router_requests_total", revision=REVISION, code="200") == 1
    assert metric(samples, "kiln_router_cold_start_seconds_count") == 1
    assert metric(samples, "kiln_router_held_requests") == 0
