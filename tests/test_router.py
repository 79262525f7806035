"""`kiln router` over real HTTP: a real router in front of fake engines (small aiohttp apps
on 127.0.0.1 standing in for engine pods, which would need the model to start), driven by
a real client. Each fake engine follows a script named in the request body."""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from kiln.cli import main as kiln_main
from kiln.router.endpoints import Endpoint, EndpointSource, ReadyEndpoints, StaticEndpoints
from kiln.router.endpointslices import EndpointSliceSource, ready_endpoints
from kiln.router.main import serving
from kiln.router.proxy import Limits, build_app

pytestmark = pytest.mark.timeout(60)


def on_event_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())
    return run


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class FakeEngine:
    """Stands in for an engine pod, served like the router (as `kiln serve` is, a client
    hanging up cancels its handler). Scripts: answer; hold (answer once `release` is set);
    stream (one SSE event, then the rest once `release` is set); paced (three SSE events,
    one per item put in `steps`); endless (SSE events until the client goes away); break
    (one SSE event, then drop the connection); hang_up (drop the connection unanswered)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hits = 0
        self.streams_finished = 0
        self.clients_gone = 0
        self.release = asyncio.Event()
        self.steps: asyncio.Queue[None] = asyncio.Queue()
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        script = (await request.json()).get("fake", "answer")
        try:
            return await getattr(self, f"_{script}")(request)
        except asyncio.CancelledError:  # the client hung up; a real engine aborts the request
            self.clients_gone += 1
            raise

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"engine": self.name})

    async def _hold(self, request: web.Request) -> web.StreamResponse:
        await self.release.wait()
        return await self._answer(request)

    async def _event_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        return response

    async def _first_event(self, request: web.Request) -> web.StreamResponse:
        response = await self._event_stream(request)
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

    async def _paced(self, request: web.Request) -> web.StreamResponse:
        response = await self._event_stream(request)
        for token in range(3):
            await self.steps.get()
            await response.write(sse({"engine": self.name, "token": token}))
        await response.write_eof()
        return response

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        response = await self._first_event(request)
        try:
            for token in itertools.count(1):
                await asyncio.sleep(0.01)
                await response.write(sse({"engine": self.name, "token": token}))
        except ConnectionResetError:  # a write after the client went away
            self.clients_gone += 1
        return response

    async def _break(self, request: web.Request) -> web.StreamResponse:
        response = await self._first_event(request)
        request.transport.close()  # flushes the first event, never ends the chunked body
        return response

    async def _hang_up(self, request: web.Request) -> web.StreamResponse:
        request.transport.close()
        return web.Response()


class DropsReusedConnections:
    """A raw HTTP/1.1 engine: it answers the first request on a connection and keeps it
    open, then closes it unanswered when another request comes on it. That is what the
    router meets when an engine's idle timeout closes a pooled connection just as a request
    goes out on it."""

    def __init__(self) -> None:
        self.answered = 0
        self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        await reader.readexactly(int(length.group(1)) if length else 0)
        body = b'{"engine": "dropper"}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.answered += 1
        if await reader.read(1):  # the next request on this connection
            self.dropped += 1
        writer.close()


class ChangingEndpoints:
    """An EndpointSource the test changes, as EndpointSlice updates would."""

    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self.now = ReadyEndpoints.of(endpoints)

    def ready(self) -> ReadyEndpoints:
        return self.now

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def refusing(count: int) -> list[Endpoint]:
    """Endpoints nobody listens on: connecting to them is refused."""
    ports = []
    for _ in range(count):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return [Endpoint("127.0.0.1", port) for port in ports]


Samples = dict[tuple[str, frozenset], float]


@dataclass
class Service:
    client: aiohttp.ClientSession  # talks to the router
    engines: list[FakeEngine]
    endpoints: list[Endpoint]  # the router's endpoint of each engine
    source: EndpointSource

    def hits(self) -> list[int]:
        return [engine.hits for engine in self.engines]

    async def complete(self, script: str = "answer") -> aiohttp.ClientResponse:
        return await self.client.post("/v1/completions", json={"prompt": "hi", "fake": script})

    async def metrics(self) -> Samples:
        return parse_metrics(await (await self.client.get("/metrics")).text())


def parse_metrics(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def has_series(samples: Samples, name: str, **labels: str) -> bool:
    return (name, frozenset(labels.items())) in samples


@asynccontextmanager
async def service(engines: int, also: Sequence[Endpoint] = (), revisions: Sequence[str] = (),
                  limits: Limits = Limits(),
                  source: Callable[[list[Endpoint]], EndpointSource] = StaticEndpoints,
                  ) -> AsyncIterator[Service]:
    """A router over the endpoints `also` and `engines` fake engines (of `revisions`, one
    each, if given)."""
    fakes = [FakeEngine(f"engine-{i}") for i in range(engines)]
    async with AsyncExitStack() as stack:
        ports = [await stack.enter_async_context(serving(f.app, "127.0.0.1", 0)) for f in fakes]
        mine = [Endpoint("127.0.0.1", port, revision)
                for port, revision in zip(ports, revisions or [""] * engines)]
        endpoints = source([*also, *mine])
        router_port = await stack.enter_async_context(
            serving(build_app(endpoints, limits), "127.0.0.1", 0))
        session = await stack.enter_async_context(
            aiohttp.ClientSession(f"http://127.0.0.1:{router_port}"))
        stack.callback(lambda: [fake.release.set() for fake in fakes])  # unblock before cleanup
        yield Service(session, fakes, mine, endpoints)


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
        assert [metric(held, "kiln_router_endpoint_in_flight_requests", revision="",
                       endpoint=str(e)) for e in svc.endpoints] == [2, 2, 2]
        assert metric(held, "kiln_router_in_flight_requests", revision="") == 6
        for engine in svc.engines:
            engine.release.set()
        responses = await asyncio.gather(*pending)
        assert [r.status for r in responses] == [200] * 6
        after = await svc.metrics()
        assert metric(after, "kiln_router_in_flight_requests", revision="") == 0
        assert has_series(after, "kiln_router_in_flight_requests", revision="")


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
        assert metric(samples, "kiln_router_requests_total", revision="", code="200") == 4
        assert metric(samples, "kiln_router_request_duration_seconds_count", revision="") == 4
        assert metric(samples, "kiln_router_retries_total", revision="") == 0
        assert metric(samples, "kiln_router_ready_endpoints", revision="") == 2
        ready = await svc.client.get("/ready")
        assert ready.status == 200
        assert await ready.json() == {"status": "ready", "endpoints": 2, "revisions": {"": 2}}


@on_event_loop
async def test_metrics_follow_revisions_and_a_gone_replica_leaves_no_series() -> None:
    async with service(2, revisions=["blue", "green"], source=ChangingEndpoints) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        blue, green = svc.endpoints
        assert [(await svc.complete()).status for _ in range(4)] == [200] * 4
        samples = await svc.metrics()
        assert [metric(samples, "kiln_router_requests_total", revision=r, code="200")
                for r in ("blue", "green")] == [2, 2]
        assert [metric(samples, "kiln_router_ready_endpoints", revision=r)
                for r in ("blue", "green")] == [1, 1]
        assert has_series(samples, "kiln_router_endpoint_in_flight_requests", revision="blue",
                          endpoint=str(blue))
        # Blue's pod goes unready: the revision is still known, with no replica ready.
        svc.source.now = ReadyEndpoints.of([green], revisions=["blue"])
        assert (await svc.complete()).status == 200 and svc.hits() == [2, 3]
        samples = await svc.metrics()
        assert not [name for name, labels in samples if ("endpoint", str(blue)) in labels]
        assert has_series(samples, "kiln_router_ready_endpoints", revision="blue")
        assert metric(samples, "kiln_router_ready_endpoints", revision="blue") == 0
        assert metric(samples, "kiln_router_requests_total", revision="blue", code="200") == 2
        # The blue revision is gone altogether: so are its gauges.
        svc.source.now = ReadyEndpoints.of([green])
        samples = await svc.metrics()
        assert not has_series(samples, "kiln_router_ready_endpoints", revision="blue")
        assert not has_series(samples, "kiln_router_in_flight_requests", revision="blue")
        assert has_series(samples, "kiln_router_in_flight_requests", revision="green")


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
async def test_latency_histograms_count_stream_chunks_per_revision() -> None:
    async with service(1, revisions=["blue"]) as svc:
        engine = svc.engines[0]
        engine.steps.put_nowait(None)
        response = await svc.complete("paced")
        for token in range(3):
            if token:  # the next token only once the client has this one: three chunks
                engine.steps.put_nowait(None)
            event = await response.content.readuntil(b"\n\n")
            assert event == sse({"engine": engine.name, "token": token})
        assert await response.read() == b""
        assert (await svc.complete()).status == 200  # not streamed: no token timings
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_time_to_first_token_seconds_count",
                      revision="blue") == 1
        assert metric(samples, "kiln_router_inter_token_latency_seconds_count",
                      revision="blue") == 2
        assert metric(samples, "kiln_router_request_duration_seconds_count",
                      revision="blue") == 2


@on_event_loop
async def test_client_going_away_mid_stream_reaches_the_engine() -> None:
    async with service(1) as svc:
        response = await svc.complete("endless")
        await response.content.readuntil(b"\n\n")
        response.close()
        await until(lambda: svc.engines[0].clients_gone == 1)
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="", code="499") == 1
        assert metric(samples, "kiln_router_in_flight_requests", revision="") == 0


@on_event_loop
async def test_client_hanging_up_before_the_answer_cancels_the_engine_request() -> None:
    async with service(1) as svc:
        request = asyncio.create_task(svc.complete("hold"))  # not streamed: no byte yet
        await until(lambda: svc.hits() == [1])
        request.cancel()  # the client gives up; its connection closes
        await until(lambda: svc.engines[0].clients_gone == 1)
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="", code="499") == 1
        assert metric(samples, "kiln_router_in_flight_requests", revision="") == 0


@on_event_loop
async def test_connect_failure_is_retried_on_another_replica() -> None:
    async with service(1, also=refusing(1)) as svc:
        answered_by = [(await (await svc.complete()).json())["engine"] for _ in range(3)]
        assert answered_by == ["engine-0"] * 3
        samples = await svc.metrics()
        connect_errors = metric(samples, "kiln_router_errors_total", revision="",
                                reason="connect")
        assert connect_errors >= 1
        assert metric(samples, "kiln_router_retries_total", revision="") == connect_errors
        assert metric(samples, "kiln_router_requests_total", revision="", code="200") == 3


@on_event_loop
async def test_dead_keep_alive_connection_is_retried_on_another_replica() -> None:
    dropper = DropsReusedConnections()
    server = await asyncio.start_server(dropper.handle, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        async with service(1, also=[Endpoint("127.0.0.1", port)]) as svc:
            # Idle requests alternate, so two of these four go to the dropper: the second
            # one on the connection pooled after the first, which the dropper then closes.
            assert [(await svc.complete()).status for _ in range(4)] == [200] * 4
            assert dropper.dropped == 1
            assert dropper.answered + svc.hits()[0] == 4  # each request answered once
            samples = await svc.metrics()
            assert metric(samples, "kiln_router_errors_total", revision="",
                          reason="stale_connection") == 1
            assert metric(samples, "kiln_router_retries_total", revision="") == 1
    finally:
        server.close()
        await server.wait_closed()


@on_event_loop
async def test_replicas_refusing_connections_are_tried_twice_then_503() -> None:
    async with service(0, also=refusing(3)) as svc:
        response = await svc.complete()
        assert response.status == 503
        error = (await response.json())["error"]
        assert error["code"] == "no_ready_endpoint" and "(2 tried)" in error["message"]
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_errors_total", revision="", reason="connect") == 2
        assert metric(samples, "kiln_router_retries_total", revision="") == 1


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
        assert metric(samples, "kiln_router_retries_total", revision="") == 0
        assert metric(samples, "kiln_router_errors_total", revision="",
                      reason="upstream_error") == 1


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
        assert metric(samples, "kiln_router_retries_total", revision="") == 0
        assert metric(samples, "kiln_router_errors_total", revision="",
                      reason="upstream_broken") == 1


@on_event_loop
async def test_first_byte_timeout_is_504_not_retried_and_drops_the_engine_request() -> None:
    async with service(2, limits=Limits(first_byte_timeout=0.1)) as svc:
        response = await svc.complete("hold")  # the engine never answers by itself
        assert response.status == 504
        assert (await response.json())["error"]["code"] == "upstream_timeout"
        assert sum(svc.hits()) == 1
        await until(lambda: sum(e.clients_gone for e in svc.engines) == 1)
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_retries_total", revision="") == 0
        assert metric(samples, "kiln_router_errors_total", revision="",
                      reason="first_byte_timeout") == 1


@on_event_loop
async def test_requests_over_max_in_flight_get_429() -> None:
    async with service(1, limits=Limits(max_in_flight=1)) as svc:
        held = asyncio.create_task(svc.complete("hold"))
        await until(lambda: svc.hits() == [1])
        response = await svc.complete()
        assert response.status == 429
        assert (await response.json())["error"]["code"] == "rate_limit_exceeded"
        assert svc.hits() == [1]
        svc.engines[0].release.set()
        assert (await held).status == 200
        assert (await svc.complete()).status == 200  # room again
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="429") == 1


@on_event_loop
async def test_body_over_max_body_bytes_gets_413() -> None:
    async with service(1, limits=Limits(max_body_bytes=1000)) as svc:
        response = await svc.client.post("/v1/completions", json={"prompt": "x" * 1000})
        assert response.status == 413
        error = (await response.json())["error"]
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]
        assert svc.hits() == [0]
        assert (await svc.complete()).status == 200
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="413") == 1


@on_event_loop
async def test_no_endpoints_is_503_with_openai_error_while_router_is_ready() -> None:
    async with service(0) as svc:
        response = await svc.complete()
        assert response.status == 503
        body = await response.json()
        assert body == {"error": {"message": "no ready replica for this service yet",
                                  "type": "service_unavailable", "param": None,
                                  "code": "no_ready_endpoint"}}
        ready = await svc.client.get("/ready")  # it can take requests: it answers them
        assert ready.status == 200 and (await ready.json())["endpoints"] == 0
        assert (await svc.client.get("/health")).status == 200
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="503") == 1
        assert metric(samples, "kiln_router_errors_total", revision="none",
                      reason="no_endpoint") == 1


@pytest.mark.parametrize("argv, message", [
    (["--endpoints", "engine-0"], "'engine-0' is not host:port"),
    (["--endpoints", "a:1,a:1"], "duplicate endpoint"),
    (["--endpoints", "a:99999"], "is not host:port"),
    (["--endpoints", "a:1", "--connect-timeout", "0"], "--connect-timeout must be positive"),
    (["--endpoints", "a:1", "--connect-timeout", "nan"], "--connect-timeout must be positive"),
    (["--endpoints", "a:1", "--first-byte-timeout", "-1"],
     "--first-byte-timeout must be positive seconds, or 0"),
    (["--endpoints", "a:1", "--first-byte-timeout", "inf"], "--first-byte-timeout must be"),
    (["--endpoints", "a:1", "--max-in-flight", "0"], "--max-in-flight must be at least 1"),
    (["--endpoints", "a:1", "--max-body-bytes", "-5"], "--max-body-bytes must be at least 1"),
    (["--selector", " "], "--selector must not be empty"),
    (["--selector", "app=chat", "--kubeconfig", "/nonexistent/kubeconfig"],
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
    assert "--endpoints --selector is required" in capsys.readouterr().err


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


# ---------------------------------------------------------------------------
# EndpointSlice discovery against the local cluster: the real API server writes the
# slices (kube-controller-manager) from pods that kwok runs and marks Ready.
# ---------------------------------------------------------------------------
EXTERNAL_READINESS = "kiln.dev/readiness"  # kwok leaves such pods unready (see kiln.local.kwok)
SERVICE_LABEL = "kubernetes.io/service-name"  # Kubernetes sets it on each slice
ISVC = "router-test"
SELECTOR = f"kiln.dev/inferenceservice={ISVC},kiln.dev/component=engine"  # as the operator
REVISION = f"{ISVC}-1a2b3c4d"


def engine_pod(name: str, ready: bool, app: str = "router-test") -> dict:
    annotations = {} if ready else {EXTERNAL_READINESS: "external"}
    return {"metadata": {"name": name, "labels": {"app": app}, "annotations": annotations},
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


@pytest.mark.timeout(1800)  # the session's cluster may have to be built and started first
def test_router_reaches_a_ready_pod_over_the_pod_network(
        local_cluster: Any, router_namespace: str, tmp_path: Any) -> None:
    """Slices -> pod IP -> a process in the pod's network namespace, as in a real cluster.
    `python -m http.server` stands in for the engine: it serves a canned /v1/models."""
    core = engine_service(local_cluster.api_client, router_namespace)
    core.create_namespaced_pod(router_namespace, engine_pod("engine-0", ready=True))
    ip = pod_ip(core, router_namespace, "engine-0")
    models = {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text(json.dumps(models))
    netns_name = f"rt-{router_namespace.removeprefix('kiln-router-')}"
    netns = local_cluster.network.create_namespace(netns_name, ip)
    stand_in = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "http.server", "8000",
         "--bind", ip, "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: accepts_connections(ip, 8000), "the stand-in engine to listen")
        asyncio.run(route_one_request(local_cluster.api_client, router_namespace, ip, models))
    finally:
        stand_in.terminate()
        stand_in.wait()
        local_cluster.network.delete_namespace(netns_name)


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
