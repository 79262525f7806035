"""`kiln router` over real HTTP: a real router in front of fake engines (small aiohttp apps
on 127.0.0.1 standing in for engine pods, which would need the model to start), driven by
a real client. Each fake engine follows a script named in the request body."""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from kiln.cli import main as kiln_main
from kiln.router.endpoints import Endpoint, StaticEndpoints
from kiln.router.endpointslices import SERVICE_LABEL, EndpointSliceSource, ready_endpoints
from kiln.router.proxy import build_app

pytestmark = pytest.mark.timeout(60)


def on_event_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())
    return run


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class FakeEngine:
    """Stands in for an engine pod. Scripts: answer; hold (answer once `release` is set);
    stream (one SSE event, then the rest once `release` is set); endless (SSE events until
    the client goes away); break (one SSE event, then drop the connection); hang_up (drop
    the connection without answering)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hits = 0
        self.streams_finished = 0
        self.clients_gone = 0
        self.release = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        script = (await request.json()).get("fake", "answer")
        return await getattr(self, f"_{script}")(request)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"engine": self.name})

    async def _hold(self, request: web.Request) -> web.StreamResponse:
        await self.release.wait()
        return await self._answer(request)

    async def _first_event(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse({"engine": self.name, "token": 0}))
        return response

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = await self._first_event(request)
        await self.release.wait()
        for token in (1, 2):
            await response.write(sse({"engine": self.name, "token": token}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self.streams_finished += 1
        return response

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        response = await self._first_event(request)
        try:
            for token in itertools.count(1):
                await asyncio.sleep(0.01)
                await response.write(sse({"engine": self.name, "token": token}))
        except ConnectionResetError:  # what a real engine sees, and aborts the request on
            self.clients_gone += 1
        return response

    async def _break(self, request: web.Request) -> web.StreamResponse:
        response = await self._first_event(request)
        request.transport.close()  # flushes the first event, never ends the chunked body
        return response

    async def _hang_up(self, request: web.Request) -> web.StreamResponse:
        request.transport.close()
        return web.Response()


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def closed_port() -> int:
    """A port nobody listens on: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Service:
    client: aiohttp.ClientSession  # talks to the router
    engines: list[FakeEngine]
    labels: list[str]  # the router's endpoint label of each engine

    def hits(self) -> list[int]:
        return [engine.hits for engine in self.engines]

    async def complete(self, script: str = "answer") -> aiohttp.ClientResponse:
        return await self.client.post("/v1/completions", json={"prompt": "hi", "fake": script})

    async def metrics(self) -> dict[tuple[str, frozenset], float]:
        text = await (await self.client.get("/metrics")).text()
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@asynccontextmanager
async def service(engines: int, dead: int = 0) -> AsyncIterator[Service]:
    """A router over `dead` unreachable endpoints (listed first) and `engines` fake engines."""
    fakes = [FakeEngine(f"engine-{i}") for i in range(engines)]
    async with AsyncExitStack() as stack:
        ports = [await stack.enter_async_context(serving(fake.app)) for fake in fakes]
        endpoints = [Endpoint("127.0.0.1", port) for port in
                     [*(closed_port() for _ in range(dead)), *ports]]
        router_port = await stack.enter_async_context(
            serving(build_app(StaticEndpoints(endpoints), connect_timeout=5.0)))
        session = await stack.enter_async_context(
            aiohttp.ClientSession(f"http://127.0.0.1:{router_port}"))
        stack.callback(lambda: [fake.release.set() for fake in fakes])  # unblock before cleanup
        yield Service(session, fakes, [str(e) for e in endpoints[dead:]])


async def until(condition: Callable[[], bool]) -> None:
    while not condition():  # bounded by the test timeout, not timed
        await asyncio.sleep(0.01)


@on_event_loop
async def test_concurrent_slow_requests_spread_evenly() -> None:
    async with service(3) as svc:
        pending = [asyncio.create_task(svc.complete("hold")) for _ in range(6)]
        await until(lambda: sum(svc.hits()) == 6)
        assert svc.hits() == [2, 2, 2]
        held = await svc.metrics()
        assert [metric(held, "kiln_router_in_flight_requests", endpoint=label)
                for label in svc.labels] == [2, 2, 2]
        for engine in svc.engines:
            engine.release.set()
        responses = await asyncio.gather(*pending)
        assert [r.status for r in responses] == [200] * 6
        after = await svc.metrics()
        assert [metric(after, "kiln_router_in_flight_requests", endpoint=label)
                for label in svc.labels] == [0, 0, 0]


@on_event_loop
async def test_busy_replica_gets_no_new_requests_while_another_is_idle() -> None:
    async with service(2) as svc:
        slow = asyncio.create_task(svc.complete("hold"))
        await until(lambda: sum(svc.hits()) == 1)
        busy = svc.hits().index(1)
        # Round-robin would send one of these to the busy replica; least-in-flight sends none.
        answered_by = [(await (await svc.complete()).json())["engine"] for _ in range(3)]
        assert answered_by == [svc.engines[1 - busy].name] * 3
        svc.engines[busy].release.set()
        assert (await slow).status == 200


@on_event_loop
async def test_idle_requests_rotate_and_metrics_count_them() -> None:
    async with service(2) as svc:
        statuses = [(await svc.complete()).status for _ in range(4)]
        assert statuses == [200] * 4
        assert svc.hits() == [2, 2]
        samples = await svc.metrics()
        assert [metric(samples, "kiln_router_requests_total", endpoint=label, code="200")
                for label in svc.labels] == svc.hits()
        assert metric(samples, "kiln_router_retries_total") == 0
        assert metric(samples, "kiln_router_ready_endpoints") == 2
        ready = await svc.client.get("/ready")
        assert ready.status == 200 and (await ready.json())["endpoints"] == 2


@on_event_loop
async def test_stream_chunks_reach_client_while_engine_still_generating() -> None:
    async with service(1) as svc:
        engine = svc.engines[0]
        response = await svc.complete("stream")
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        first = await response.content.readuntil(b"\n\n")
        assert first == sse({"engine": engine.name, "token": 0})
        assert engine.streams_finished == 0 and not engine.release.is_set()
        engine.release.set()
        rest = await response.read()
        assert rest == sse({"engine": engine.name, "token": 1}) + \
            sse({"engine": engine.name, "token": 2}) + b"data: [DONE]\n\n"
        assert engine.streams_finished == 1


@on_event_loop
async def test_client_going_away_reaches_the_engine() -> None:
    async with service(1) as svc:
        response = await svc.complete("endless")
        await response.content.readuntil(b"\n\n")
        response.close()
        await until(lambda: svc.engines[0].clients_gone == 1)
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total",
                      endpoint=svc.labels[0], code="499") == 1
        assert metric(samples, "kiln_router_in_flight_requests", endpoint=svc.labels[0]) == 0


@on_event_loop
async def test_connect_failure_is_retried_on_another_replica() -> None:
    async with service(1, dead=1) as svc:
        answered_by = [(await (await svc.complete()).json())["engine"] for _ in range(3)]
        assert answered_by == ["engine-0"] * 3
        samples = await svc.metrics()
        connect_errors = sum(value for (name, labels), value in samples.items()
                             if name == "kiln_router_errors_total"
                             and ("reason", "connect") in labels)
        assert connect_errors >= 1
        assert metric(samples, "kiln_router_retries_total") == connect_errors
        assert metric(samples, "kiln_router_requests_total",
                      endpoint=svc.labels[0], code="200") == 3


@on_event_loop
async def test_all_replicas_refusing_connections_is_503() -> None:
    async with service(0, dead=2) as svc:
        response = await svc.complete()
        assert response.status == 503
        error = (await response.json())["error"]
        assert error["code"] == "no_ready_endpoint" and "2 ready replicas" in error["message"]


@on_event_loop
async def test_no_retry_when_engine_hangs_up_after_receiving_request() -> None:
    async with service(2) as svc:
        response = await svc.complete("hang_up")
        assert response.status == 502
        error = (await response.json())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "upstream_error"
        assert sum(svc.hits()) == 1
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_retries_total") == 0
        assert sum(metric(samples, "kiln_router_errors_total", endpoint=label,
                          reason="upstream_error") for label in svc.labels) == 1


@on_event_loop
async def test_no_retry_after_partial_stream_and_client_sees_it_broken() -> None:
    async with service(2) as svc:
        response = await svc.complete("break")
        assert response.status == 200
        first = await response.content.readuntil(b"\n\n")
        assert json.loads(first.removeprefix(b"data: "))["token"] == 0
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
        assert sum(svc.hits()) == 1
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_retries_total") == 0
        assert sum(metric(samples, "kiln_router_errors_total", endpoint=label,
                          reason="upstream_broken") for label in svc.labels) == 1


@on_event_loop
async def test_no_endpoints_is_503_with_openai_error_and_not_ready() -> None:
    async with service(0) as svc:
        response = await svc.complete()
        assert response.status == 503
        body = await response.json()
        assert body == {"error": {"message": "no ready replica for this service yet",
                                  "type": "service_unavailable", "param": None,
                                  "code": "no_ready_endpoint"}}
        assert (await svc.client.get("/ready")).status == 503
        assert (await svc.client.get("/health")).status == 200
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", endpoint="none", code="503") == 1
        assert metric(samples, "kiln_router_ready_endpoints") == 0


@pytest.mark.parametrize("argv, message", [
    (["--endpoints", "engine-0"], "'engine-0' is not host:port"),
    (["--endpoints", "a:1,a:1"], "duplicate endpoint"),
    (["--endpoints", "a:99999"], "is not host:port"),
    (["--endpoints", "a:1", "--connect-timeout", "0"], "--connect-timeout must be positive"),
    (["--service", "chat", "--kubeconfig", "/nonexistent/kubeconfig"],
     "cannot load Kubernetes config"),
])
def test_cli_rejects_bad_input(argv: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert kiln_main(["router", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_requires_a_source_of_endpoints(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        kiln_main(["router"])
    assert exit_.value.code == 2
    assert "--endpoints --service is required" in capsys.readouterr().err


def endpoint_slice(name: str, port_name: str | None, port: int,
                   ready: dict[str, bool | None]) -> client.V1EndpointSlice:
    return client.V1EndpointSlice(
        address_type="IPv4", metadata=client.V1ObjectMeta(name=name),
        ports=[client.DiscoveryV1EndpointPort(name=port_name, port=port)],
        endpoints=[client.V1Endpoint(addresses=[ip], conditions=client.V1EndpointConditions(
            ready=state)) for ip, state in ready.items()])


def test_ready_endpoints_follow_conditions_and_port_name() -> None:
    slices = [
        endpoint_slice("a", "http", 8000, {"10.0.0.2": True, "10.0.0.3": False,
                                           "10.0.0.4": None}),
        # Overlaps "a" while the controller moves an endpoint between slices.
        endpoint_slice("b", "http", 8000, {"10.0.0.2": True, "10.0.0.1": True}),
        endpoint_slice("c", "metrics", 9000, {"10.0.0.9": True}),
    ]
    assert ready_endpoints(slices, "http") == (
        Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000), Endpoint("10.0.0.4", 8000))
    assert ready_endpoints(slices, "grpc") == ()
    unnamed = endpoint_slice("d", None, 8080, {"10.0.0.5": True})
    assert ready_endpoints([unnamed], "") == (Endpoint("10.0.0.5", 8080),)


# ---------------------------------------------------------------------------
# EndpointSlice discovery against the local cluster: the real API server writes the
# slices (kube-controller-manager) from pods that kwok runs and marks Ready.
# ---------------------------------------------------------------------------
EXTERNAL_READINESS = "kiln.dev/readiness"  # kwok leaves such pods unready (see kiln.local.kwok)


def engine_pod(name: str, ready: bool) -> dict:
    annotations = {} if ready else {EXTERNAL_READINESS: "external"}
    return {"metadata": {"name": name, "labels": {"app": "router-test"},
                         "annotations": annotations},
            "spec": {"containers": [{"name": "engine", "image": "kiln/engine:test",
                                     "ports": [{"name": "http", "containerPort": 8000}]}]}}


def wait_until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 120  # a bound to fail with a message, not a speed check
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def slice_endpoints(api_client: client.ApiClient, namespace: str, service: str
                    ) -> tuple[list[client.V1EndpointSlice], dict[str, client.V1Endpoint]]:
    """The Service's slices as stored, and their endpoints by pod name."""
    slices = client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice(
        namespace, label_selector=f"{SERVICE_LABEL}={service}").items
    return slices, {e.target_ref.name: e for s in slices for e in s.endpoints or ()
                    if e.target_ref is not None}


def engine_service(api_client: client.ApiClient, namespace: str) -> client.CoreV1Api:
    """Service "engines" over pods labelled app=router-test, ready to take pods."""
    core = client.CoreV1Api(api_client)
    core.create_namespaced_service(namespace, {
        "metadata": {"name": "engines"},
        "spec": {"selector": {"app": "router-test"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8000},
                           {"name": "metrics", "port": 9090}]}})
    # Pods are refused until the controller-manager has made the namespace's ServiceAccount.
    wait_until(lambda: core.list_namespaced_service_account(
        namespace, field_selector="metadata.name=default").items, "the default ServiceAccount")
    return core


@pytest.fixture
def router_namespace(local_cluster: Any) -> Iterator[str]:
    core = client.CoreV1Api(local_cluster.api_client)
    name = f"kiln-router-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)  # its Service and pods go with it


@pytest.mark.timeout(1800)  # the session's cluster may have to be built and started first
def test_endpointslice_discovery_follows_ready_pods_of_a_real_service(
        local_cluster: Any, router_namespace: str) -> None:
    namespace = router_namespace
    core = engine_service(local_cluster.api_client, namespace)
    for name, ready in (("engine-0", True), ("engine-1", True), ("engine-unready", False)):
        core.create_namespaced_pod(namespace, engine_pod(name, ready))
    source = EndpointSliceSource(local_cluster.api_client, namespace, "engines", "http",
                                 resync_seconds=5)
    asyncio.run(source.start())
    try:
        wait_until(lambda: len(source.endpoints()) >= 2, "two ready endpoints")
        ips = {name: core.read_namespaced_pod(name, namespace).status.pod_ip
               for name in ("engine-0", "engine-1")}
        # The slices carry the pods' target port under the Service port's name.
        assert source.endpoints() == tuple(sorted(Endpoint(ips[n], 8000) for n in ips))
        core.delete_namespaced_pod("engine-0", namespace, grace_period_seconds=0)
        wait_until(lambda: Endpoint(ips["engine-0"], 8000) not in source.endpoints(),
                   "the deleted pod to leave the endpoints")
        assert source.endpoints() == (Endpoint(ips["engine-1"], 8000),)
        # kwok may give the unready pod its IP (and so its slice entry) a moment later.
        wait_until(lambda: "engine-unready" in slice_endpoints(
            local_cluster.api_client, namespace, "engines")[1], "the unready pod in a slice")
        slices, by_pod = slice_endpoints(local_cluster.api_client, namespace, "engines")
        # Known to Kubernetes, yet not routed to.
        assert by_pod["engine-unready"].conditions.ready is False
        assert ready_endpoints(slices, "http") == source.endpoints()
    finally:
        asyncio.run(source.stop())


def accepts_connections(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.timeout(1800)  # the session's cluster may have to be built and started first
def test_router_reaches_a_ready_pod_over_the_pod_network(
        local_cluster: Any, router_namespace: str, tmp_path: Any) -> None:
    """Slices -> pod IP -> a process in the pod's network namespace, as in a real cluster.
    `python -m http.server` stands in for the engine: it serves a canned /v1/models."""
    core = engine_service(local_cluster.api_client, router_namespace)
    core.create_namespaced_pod(router_namespace, engine_pod("engine-0", ready=True))
    wait_until(lambda: core.read_namespaced_pod("engine-0", router_namespace).status.pod_ip,
               "a pod IP")
    pod_ip = core.read_namespaced_pod("engine-0", router_namespace).status.pod_ip
    models = {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text(json.dumps(models))
    netns_name = f"rt-{router_namespace.removeprefix('kiln-router-')}"
    netns = local_cluster.network.create_namespace(netns_name, pod_ip)
    stand_in = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "http.server", "8000",
         "--bind", pod_ip, "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: accepts_connections(pod_ip, 8000), "the stand-in engine to listen")
        asyncio.run(route_one_request(local_cluster.api_client, router_namespace, pod_ip, models))
    finally:
        stand_in.terminate()
        stand_in.wait()
        local_cluster.network.delete_namespace(netns_name)


async def route_one_request(api_client: client.ApiClient, namespace: str, pod_ip: str,
                            models: dict) -> None:
    source = EndpointSliceSource(api_client, namespace, "engines", "http", resync_seconds=5)
    async with serving(build_app(source)) as port, \
            aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        await until(lambda: source.endpoints() == (Endpoint(pod_ip, 8000),))
        response = await session.get("/v1/models")
        assert response.status == 200 and json.loads(await response.text()) == models
        text = await (await session.get("/metrics")).text()
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert metric(samples, "kiln_router_requests_total", endpoint=f"{pod_ip}:8000",
                  code="200") == 1
