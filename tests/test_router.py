"""`kiln router` over real HTTP: a real router in front of fake engines (router_fakes),
driven by a real client. Each fake engine follows a script named in the request body.
EndpointSlice discovery is in test_router_cluster.py."""
from __future__ import annotations

import asyncio
import errno
import gzip
import json
import socket
import time
from types import SimpleNamespace

import aiohttp
import pytest

from kiln.cli import main as kiln_main
from kiln.listening import listening_sockets
from kiln.local.testing import loopback_hosts
from kiln.router.endpoints import Endpoint, ReadyEndpoints, StaticEndpoints, parse_endpoints
from kiln.operator.render import ROUTER_GRACE_PERIOD_S, ROUTER_PRESTOP_SLEEP_S
from kiln.router import main as router_main
from kiln.router import metrics as router_metrics
from kiln.router import retries
from kiln.router.holding import Holding
from kiln.router.main import serving
from kiln.router.proxy import Limits, build_app
from router_fakes import (
    ChangingEndpoints,
    CrashesOnPoison,
    DropsReusedConnections,
    FakeEngine,
    FirstRefuses,
    has_series,
    metric,
    none_ready,
    on_event_loop,
    raw_replica,
    raw_post,
    refusing,
    service,
    sse,
    until,
    until_held,
)

pytestmark = pytest.mark.timeout(60)


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
async def test_metrics_follow_revisions_and_a_gone_replica_leaves_no_series(monkeypatch) -> None:
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
        svc.source.set(ReadyEndpoints.of([green], revisions=["blue"]))
        assert (await svc.complete()).status == 200 and svc.hits() == [2, 3]
        samples = await svc.metrics()
        assert not [name for name, labels in samples if ("endpoint", str(blue)) in labels]
        assert has_series(samples, "kiln_router_ready_endpoints", revision="blue")
        assert metric(samples, "kiln_router_ready_endpoints", revision="blue") == 0
        assert metric(samples, "kiln_router_requests_total", revision="blue", code="200") == 2
        # The blue revision is gone altogether: so are its gauges.
        svc.source.set(ReadyEndpoints.of([green]))
        samples = await svc.metrics()
        assert not has_series(samples, "kiln_router_ready_endpoints", revision="blue")
        assert not has_series(samples, "kiln_router_in_flight_requests", revision="blue")
        assert has_series(samples, "kiln_router_in_flight_requests", revision="green")
        # Its counts stay for RETIRED_AFTER_S (Prometheus reads the last of them), then they go too.
        assert metric(samples, "kiln_router_requests_total", revision="blue", code="200") == 2
        assert has_series(samples, "kiln_router_request_duration_seconds_count", revision="blue")
        monkeypatch.setattr(router_metrics, "RETIRED_AFTER_S", 0.0)
        samples = await svc.metrics()
        assert not [name for name, labels in samples if ("revision", "blue") in labels]
        assert metric(samples, "kiln_router_requests_total", revision="green", code="200") == 3
        assert has_series(samples, "kiln_router_request_duration_seconds_count", revision="green")


@on_event_loop
@pytest.mark.parametrize("host", [None, "::", "loopbacks.test"])
async def test_a_host_is_served_on_every_address_it_names_on_one_port(monkeypatch, host: str | None) -> None:
    # A pod's IP may be of either family (IPv6 and dual-stack clusters): its probes and its clients
    # come there. No host, as `--host ::` (as uvicorn and Go take it on Linux), is every address of
    # both families on one port (asyncio's own host=None gives each family a port of its own). A name
    # (`localhost` is ::1 and 127.0.0.1 on most machines) is each address it names, and a client may
    # try either. A stand-in for such a name, as this machine's /etc/hosts may give localhost one
    # address: its resolution is mocked.
    hosts = loopback_hosts()
    resolve_as(monkeypatch, "loopbacks.test", [h.strip("[]") for h in hosts])
    async with serving(build_app(StaticEndpoints(parse_endpoints("127.0.0.1:9"))), host, 0) as port, \
            aiohttp.ClientSession() as client:
        for address in hosts:
            async with client.get(f"http://{address}:{port}/health") as response:
                assert response.status == 200, address


def test_a_name_is_bound_on_the_addresses_this_machine_has(monkeypatch) -> None:
    # A pod's /etc/hosts names ::1 localhost also where IPv6 is off: the name still binds.
    resolve_as(monkeypatch, "partly.test", ["192.0.2.1", "127.0.0.1"])  # TEST-NET-1: no address of this machine
    (sock,) = listening_sockets("partly.test", 0)
    with sock:
        assert sock.getsockname()[0] == "127.0.0.1"
    resolve_as(monkeypatch, "nowhere.test", ["192.0.2.1"])
    with pytest.raises(OSError) as refused:
        listening_sockets("nowhere.test", 0)
    assert refused.value.errno == errno.EADDRNOTAVAIL


def resolve_as(monkeypatch, name: str, addresses: list[str]) -> None:
    """Name resolution mocked for one name: this machine's /etc/hosts has no such names."""
    resolve = socket.getaddrinfo

    def fake(host, *args, **kwargs):
        if host != name:
            return resolve(host, *args, **kwargs)
        return [info for address in addresses for info in resolve(address, *args, **kwargs)]
    monkeypatch.setattr(socket, "getaddrinfo", fake)


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
async def test_a_stream_that_stalls_until_the_client_leaves_still_counts_its_wait() -> None:
    """A canary that sends its headers and then nothing: every client gave up (499, nobody's
    failure) and no chunk came to time, so the canary analysis saw nothing wrong at all."""
    async with service(1, revisions=["canary"]) as svc:
        response = await svc.complete("paced")  # headers, then a token only per step: none comes
        await asyncio.sleep(0.6)
        response.close()
        await until(lambda: svc.hits() == [1])
        for _ in range(200):
            samples = await svc.metrics()
            if metric(samples, "kiln_router_requests_total", revision="canary", code="499") == 1:
                break
            await asyncio.sleep(0.02)
        assert metric(samples, "kiln_router_time_to_first_token_seconds_count", revision="canary") == 1
        assert metric(samples, "kiln_router_time_to_first_token_seconds_sum", revision="canary") >= 0.5


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
async def test_dead_keep_alive_connection_is_retried_on_the_same_replica() -> None:
    dropper = DropsReusedConnections()
    async with raw_replica(dropper.handle) as replica, service(1, also=[replica]) as svc:
        # Idle requests alternate, so two of these four go to the dropper: the second
        # one on the connection pooled after the first, which the dropper then closes
        # and answers on a fresh connection.
        assert [(await svc.complete()).status for _ in range(4)] == [200] * 4
        assert (dropper.dropped, dropper.answered, svc.hits()) == (1, 2, [2])
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_errors_total", revision="",
                      reason="stale_connection") == 1
        assert metric(samples, "kiln_router_retries_total", revision="") == 0  # the connection's fault, not its


@on_event_loop
async def test_a_shutdown_in_the_pass_a_held_requests_wait_runs_out_still_answers_it() -> None:
    """SIGTERM handled in the very loop pass where a held request's activation timeout fires:
    ending that expiring wait raised, which cut the shutdown short (no drain, a traceback)."""
    holding = Holding(StaticEndpoints([]), max_held=10, activation_timeout=0.2)
    waiter = asyncio.create_task(holding.wait(SimpleNamespace(held=None), lambda: False, False))
    await until(lambda: bool(holding._waits))
    stopped = asyncio.get_running_loop().create_future()

    def shut_down() -> None:  # at the wait's own deadline: the same pass as its timeout
        try:
            holding.stop(None).send(None)
        except StopIteration:
            stopped.set_result(None)
        except Exception as e:  # noqa: BLE001 -- what the test is for
            stopped.set_exception(e)
    asyncio.get_running_loop().call_at(next(iter(holding._waits)).when(), shut_down)
    await stopped
    assert (await waiter).status == 503


@on_event_loop
async def test_a_pooled_connection_that_breaks_while_the_replica_works_is_not_resent(monkeypatch) -> None:
    """A connection found closed fails at once; one that breaks after the replica read the request
    and worked on it is not the race of an idle close: resent, the generation would run twice."""
    monkeypatch.setattr(retries, "STALE_WITHIN_S", 0.2)
    dropper = DropsReusedConnections(after=0.5)
    async with raw_replica(dropper.handle) as replica, service(0, also=[replica]) as svc:
        assert [(await svc.complete()).status for _ in range(2)] == [200, 502]
        assert (dropper.answered, dropper.dropped) == (1, 1)  # the second ran once, never resent
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_errors_total", revision="", reason="upstream_error") == 1
        assert metric(samples, "kiln_router_retries_total", revision="") == 0


@on_event_loop
@pytest.mark.parametrize("process_dies", [False, True])
async def test_a_request_that_crashes_a_replica_is_not_passed_on_to_the_next(process_dies: bool) -> None:
    """An engine closing a reused connection on reading a request looks like one that closed
    it idle; the free retry stays on that replica, so one request cannot crash them all. Where
    the process died of it (the retry's connection refused), it is not passed on either."""
    crashers = [CrashesOnPoison(), CrashesOnPoison()]
    servers = [await asyncio.start_server(c.handle, "127.0.0.1", 0) for c in crashers]
    if process_dies:
        for crasher, server in zip(crashers, servers):
            crasher.server = server
    try:
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        async with service(0, also=[Endpoint("127.0.0.1", p) for p in ports]) as svc:
            # Several pooled connections to each: at once, each request needs one of its own.
            first = await asyncio.gather(*(svc.client.post("/v1/completions", json={"fake": "answer"})
                                           for _ in range(8)))
            assert [r.status for r in first] == [200] * 8 and sum(c.answered for c in crashers) == 8
            assert min(c.connections for c in crashers) >= 2
            response = await svc.client.post("/v1/completions", json={"prompt": "poison"})
            assert response.status == 502
            # Its pooled connection, then one new one: never once per pooled connection.
            assert sorted(c.poisoned for c in crashers) == ([0, 1] if process_dies else [0, 2])
            samples = await svc.metrics()
            assert metric(samples, "kiln_router_errors_total", revision="", reason="stale_connection") == 1
            assert metric(samples, "kiln_router_errors_total", revision="", reason="connect") == process_dies
            assert metric(samples, "kiln_router_retries_total", revision="") == 0  # the same replica again
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


@pytest.mark.parametrize("code", ["engine_dead", "not_ready"])
def test_a_replica_refusing_a_request_unread_passes_it_to_another(code: str) -> None:
    """A dead or draining engine still in the EndpointSlice refuses at admission (503, its code):
    the request never ran there, so another replica takes it; alone, its refusal is the answer."""
    async def run() -> None:
        async with service(2, fake=FirstRefuses) as svc:
            answers = [await svc.client.post("/v1/completions", json={"refuse_code": code}) for _ in range(4)]
            assert [(r.status, (await r.json())["engine"]) for r in answers] == [(200, "engine-1")] * 4
            refusals = svc.engines[0].hits
            assert refusals >= 1 and svc.hits() == [refusals, 4]
            samples = await svc.metrics()
            assert metric(samples, "kiln_router_errors_total", revision="", reason="refused") == refusals
        async with service(1, fake=FirstRefuses) as svc:
            response = await svc.client.post("/v1/completions", json={"refuse_code": code})
            assert response.status == 503 and (await response.json())["error"]["message"] == f"engine-0 says {code}"
            assert svc.hits() == [1]
    asyncio.run(run())


@on_event_loop
async def test_a_refusal_answered_after_a_failed_retry_counts_against_the_refusing_revision() -> None:
    """Refused by revision a, then no connection to revision b: the client gets a's refusal, and
    the metrics must say so; counted as b's 503s, they failed a canary that never saw the requests."""
    b = Endpoint("127.0.0.1", refusing(1)[0].port, "b")
    async with service(1, also=[b], revisions=["a"], fake=FirstRefuses) as svc:
        for _ in range(2):  # whichever revision each asks first
            answer = await svc.client.post("/v1/completions", json={"refuse_code": "not_ready"})
            assert answer.status == 503 and (await answer.json())["error"]["code"] == "not_ready"
        samples = await svc.metrics()
        assert svc.hits() == [2] and metric(samples, "kiln_router_errors_total", revision="b", reason="connect") == 2
        assert metric(samples, "kiln_router_requests_total", revision="a", code="503") == 2
        assert not has_series(samples, "kiln_router_requests_total", revision="b", code="503")


@on_event_loop
async def test_a_replicas_other_503s_are_its_answer_not_retried() -> None:
    async with service(2, fake=FirstRefuses) as svc:
        answers = [await svc.client.post("/v1/completions", json={"refuse_code": "overloaded"}) for _ in range(4)]
        assert sorted(r.status for r in answers) == [200, 200, 503, 503]
        assert svc.hits() == [2, 2]


@on_event_loop
async def test_every_dead_pooled_connection_to_a_lone_replica_is_passed_over() -> None:
    """Several pooled connections to one address all dead (a pod gone, its IP reused by the
    next): each is dropped as it fails and is not a try; that request goes on a new connection."""
    dropper = DropsReusedConnections()
    async with raw_replica(dropper.handle) as replica, service(0, also=[replica]) as svc:
        first = await asyncio.gather(*(svc.complete() for _ in range(3)))  # 3 connections pooled
        assert [r.status for r in first] == [200] * 3
        assert [(await svc.complete()).status for _ in range(3)] == [200] * 3
        assert (dropper.answered, dropper.dropped) == (6, 3)
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_errors_total", revision="", reason="stale_connection") == 3
        assert metric(samples, "kiln_router_retries_total", revision="") == 0  # no replica could not take one


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
async def test_a_lone_replica_refusing_the_connection_means_wait_for_the_next_one() -> None:
    """The only ready replica is gone before its EndpointSlice says so: the request is held
    (the engine cannot have seen it) and goes to the next replica, even one that comes back
    at the same address (pod IPs are reused)."""
    gone = refusing(1)
    async with service(0, source=lambda endpoints: ChangingEndpoints(gone)) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        pending = asyncio.create_task(svc.complete())
        await until_held(svc.client, 1)
        reborn = FakeEngine("reborn")
        async with serving(reborn.app, "127.0.0.1", gone[0].port):
            svc.source.set(ReadyEndpoints.of(gone))
            assert (await pending).status == 200 and reborn.hits == 1
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_errors_total", revision="", reason="connect") == 1
        assert metric(samples, "kiln_router_retries_total", revision="") == 1
        # A replica was ready when it came: not a cold start (which the autoscaler reports).
        assert metric(samples, "kiln_router_cold_start_seconds_count") == 0


@on_event_loop
async def test_a_refused_lone_replica_is_tried_again_after_a_moment_even_without_a_change() -> None:
    """The replica was listed ready a moment before it listened (or its EndpointSlice update
    came before the request looked): no change will come, so the request tries again anyway."""
    late = refusing(1)
    async with service(0, also=late) as svc:
        pending = asyncio.create_task(svc.complete())
        while metric(await svc.metrics(), "kiln_router_errors_total", revision="", reason="connect") < 1:
            await asyncio.sleep(0.01)  # bounded by the test timeout, not timed
        engine = FakeEngine("late")
        async with serving(engine.app, "127.0.0.1", late[0].port):
            assert (await pending).status == 200 and engine.hits == 1


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
        # A failure where it counts (the canary analysis reads 5xx), whatever the status line said.
        assert metric(samples, "kiln_router_requests_total", revision="", code="502") == 1
        assert not has_series(samples, "kiln_router_requests_total", revision="", code="200")


@on_event_loop
async def test_a_stream_gone_silent_is_broken_off_and_frees_its_place() -> None:
    """A replica whose node vanished sends no reset: after stream_idle_timeout without a byte
    the client sees the stream broken, the engine's request is dropped, the place is free."""
    async with service(1, limits=Limits(stream_idle_timeout=0.2, max_in_flight=1)) as svc:
        response = await svc.complete("stream")  # one event, then nothing until `release`
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
        await until(lambda: svc.engines[0].clients_gone == 1)
        assert (await svc.complete()).status == 200  # its one place was given back
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_errors_total", revision="", reason="upstream_broken") == 1
        assert metric(samples, "kiln_router_requests_total", revision="", code="502") == 1


@on_event_loop
async def test_an_error_body_cut_off_or_stalled_is_an_openai_502_or_504() -> None:
    async with service(1, limits=Limits(first_byte_timeout=1.0)) as svc:
        response = await svc.complete("cut_error")
        assert response.status == 502 and (await response.json())["error"]["code"] == "upstream_error"
        response = await svc.complete("stall_error")
        assert response.status == 504 and (await response.json())["error"]["code"] == "upstream_timeout"
        samples = await svc.metrics()
        assert not has_series(samples, "kiln_router_requests_total", revision="", code="500")
        assert svc.hits() == [2]  # neither is retried: the engine may have acted on it


@on_event_loop
async def test_first_byte_timeout_is_504_not_retried_and_drops_the_engine_request() -> None:
    # A second for the engine to get the request on a busy machine: at 0.1 s it timed out first.
    async with service(2, limits=Limits(first_byte_timeout=1.0)) as svc:
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
async def test_a_stalled_upload_gets_408_and_frees_its_place() -> None:
    async with service(1, limits=Limits(max_in_flight=1, body_timeout=0.3)) as svc:
        reader, writer = await asyncio.open_connection("127.0.0.1", svc.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: 100\r\n\r\n{")
        async with asyncio.timeout(30):  # the rest of the body never comes; without the limit, neither would this
            head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        assert head.split()[1] == b"408", head
        assert svc.hits() == [0]
        assert (await svc.complete()).status == 200  # its one place is free again
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="408") == 1


@on_event_loop
async def test_a_path_with_dot_segments_is_refused_not_resolved_to_an_engine_route() -> None:
    async with service(1) as svc:
        for path in (b"/v1/../sleep", b"/v1/%2e%2E/sleep", b"/v1/./completions"):
            status, body = await raw_post(svc.port, path, b"{}")
            assert status == 400 and json.loads(body)["error"]["code"] == "invalid_path", path
        assert svc.engines[0].slept == 0 and svc.hits() == [0]


@on_event_loop
async def test_adapters_are_never_loaded_into_one_replica_through_the_router() -> None:
    async with service(2) as svc:
        for path in (b"/v1/load_lora_adapter", b"/v1/unload_lora_adapter"):
            status, body = await raw_post(svc.port, path, b'{"lora_name": "a", "lora_path": "/x"}')
            error = json.loads(body)["error"]
            assert status == 403 and error["code"] == "adapters_in_spec" and "engine.adapters" in error["message"]
        assert svc.hits() == [0, 0]


@on_event_loop
async def test_a_gzip_body_reaches_the_engine_decoded_and_a_corrupt_one_is_a_400() -> None:
    async with service(1) as svc:
        body = json.dumps({"prompt": "hi"}).encode()
        gzipped = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        response = await svc.client.post("/v1/completions", data=gzip.compress(body),
                                         headers=gzipped)
        assert response.status == 200
        engine = svc.engines[0]
        assert engine.body == body and "Content-Encoding" not in engine.headers
        response = await svc.client.post("/v1/completions", data=b"\x1f\x8bnot gzip",
                                         headers=gzipped)
        assert response.status == 400
        assert (await response.json())["error"]["code"] == "invalid_body"
        assert svc.hits() == [1]
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="400") == 1


@on_event_loop
async def test_a_path_or_method_the_router_lacks_gets_an_openai_error() -> None:
    async with service(1) as svc:
        missing = await svc.client.get("/v2/models")
        assert missing.status == 404
        assert (await missing.json())["error"]["code"] == "not_found"
        wrong = await svc.client.post("/health")
        assert wrong.status == 405 and wrong.headers["Allow"] == "GET,HEAD"
        assert (await wrong.json())["error"]["code"] == "method_not_allowed"


@on_event_loop
async def test_requests_held_at_zero_replicas_go_to_the_first_ready_ones_once_each() -> None:
    async with service(2, source=none_ready) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        pending = [asyncio.create_task(svc.complete("hold")) for _ in range(4)]
        await until_held(svc.client, 4)
        assert svc.hits() == [0, 0]
        ready = await svc.client.get("/ready")  # stays in its Service: the requests wait here
        assert ready.status == 200 and (await ready.json())["endpoints"] == 0
        assert (await svc.client.get("/health")).status == 200
        before = await svc.metrics()
        assert metric(before, "kiln_router_last_cold_start_seconds") == 0  # none yet
        # From another thread, as the EndpointSlice watch does.
        await asyncio.to_thread(svc.source.set, ReadyEndpoints.of(svc.endpoints))
        await until(lambda: sum(svc.hits()) == 4)
        assert svc.hits() == [2, 2]  # released through the balancer, not all to one
        for engine in svc.engines:
            engine.release.set()
        assert [r.status for r in await asyncio.gather(*pending)] == [200] * 4
        assert svc.hits() == [2, 2]  # each forwarded exactly once
        assert (await svc.complete()).status == 200  # a replica is ready: not held
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_held_requests") == 0
        assert metric(samples, "kiln_router_cold_start_seconds_count") == 4
        last = metric(samples, "kiln_router_last_cold_start_seconds")
        assert 0 < last <= metric(samples, "kiln_router_cold_start_seconds_sum")
        assert abs(metric(samples, "kiln_router_last_cold_start_timestamp_seconds") - time.time()) < 60
        assert metric(samples, "kiln_router_requests_total", revision="", code="200") == 5


@on_event_loop
async def test_held_requests_over_max_held_get_429() -> None:
    async with service(1, source=none_ready, limits=Limits(max_held=2)) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        pending = [asyncio.create_task(svc.complete()) for _ in range(2)]
        await until_held(svc.client, 2)
        response = await svc.complete()
        assert response.status == 429
        assert await response.json() == {"error": {
            "message": "2 requests are already waiting for a replica to start; try again later",
            "type": "rate_limit_error", "param": None, "code": "too_many_held_requests"}}
        svc.source.set(ReadyEndpoints.of(svc.endpoints))
        assert [r.status for r in await asyncio.gather(*pending)] == [200, 200]
        assert svc.hits() == [2]
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="429") == 1
        assert metric(samples, "kiln_router_cold_start_seconds_count") == 2


@on_event_loop
async def test_request_held_past_activation_timeout_gets_503_and_is_never_forwarded() -> None:
    async with service(1, source=none_ready, limits=Limits(activation_timeout=0.5)) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        response = await svc.complete()
        assert response.status == 503
        assert await response.json() == {"error": {
            "message": "no replica became ready within 0.5s", "type": "service_unavailable",
            "param": None, "code": "activation_timeout"}}
        svc.source.set(ReadyEndpoints.of(svc.endpoints))
        assert (await svc.complete()).status == 200
        assert svc.hits() == [1]  # the timed-out request did not go too
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="503") == 1
        assert metric(samples, "kiln_router_held_requests") == 0
        assert metric(samples, "kiln_router_cold_start_seconds_count") == 0


@on_event_loop
async def test_client_hanging_up_while_held_is_never_forwarded() -> None:
    async with service(1, source=none_ready) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        gone = asyncio.create_task(svc.complete())
        stays = asyncio.create_task(svc.complete())
        await until_held(svc.client, 2)
        gone.cancel()  # the client gives up; its connection closes
        await until_held(svc.client, 1)
        svc.source.set(ReadyEndpoints.of(svc.endpoints))
        assert (await stays).status == 200
        assert svc.hits() == [1]
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="499") == 1
        assert metric(samples, "kiln_router_cold_start_seconds_count") == 1


@on_event_loop
async def test_requests_held_when_the_router_shuts_down_get_a_503_to_retry_not_a_cut() -> None:
    """SIGTERM while scaled to zero: the held requests are answered at once, for the client to
    retry through another router, instead of waiting out the drain and losing the connection."""
    router = serving(build_app(ChangingEndpoints([])), "127.0.0.1", 0)
    port = await router.__aenter__()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
        held = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"})) for _ in range(2)]
        await until_held(client, 2)
        await router.__aexit__(None, None, None)  # the router's shutdown, as SIGTERM starts it
        for response in await asyncio.gather(*held):
            assert response.status == 503 and response.headers["Retry-After"] == "1"
            assert (await response.json())["error"]["code"] == "router_shutting_down"


@pytest.mark.parametrize("argv, message", [
    (["--endpoints", "engine-0"], "'engine-0' is not host:port"),
    (["--endpoints", "a:1,a:1"], "duplicate endpoint"),
    (["--endpoints", "a:99999"], "is not host:port"),
    (["--endpoints", "http://127.0.0.1:8000"], "is not host:port"),
    (["--endpoints", "a/v1:8000"], "is not host:port"),
    (["--endpoints", "::1:8000"], "IPv6 in brackets"),
    (["--endpoints", "[::1:8000"], "is not host:port"),
    (["--endpoints", "a:1", "--connect-timeout", "0"], "--connect-timeout must be positive"),
    (["--endpoints", "a:1", "--connect-timeout", "nan"], "--connect-timeout must be positive"),
    (["--endpoints", "a:1", "--first-byte-timeout", "-1"],
     "--first-byte-timeout must be positive seconds, or 0"),
    (["--endpoints", "a:1", "--first-byte-timeout", "inf"], "--first-byte-timeout must be"),
    (["--endpoints", "a:1", "--stream-idle-timeout", "nan"], "--stream-idle-timeout must be positive seconds, or 0"),
    (["--endpoints", "a:1", "--max-in-flight", "0"], "--max-in-flight must be at least 1"),
    (["--endpoints", "a:1", "--max-body-bytes", "-5"], "--max-body-bytes must be at least 1"),
    (["--endpoints", "a:1", "--max-held", "0"], "--max-held must be at least 1"),
    (["--endpoints", "a:1", "--activation-timeout", "0"],
     "--activation-timeout must be positive seconds"),
    (["--endpoints", "a:1", "--activation-timeout", "inf"], "--activation-timeout must be"),
    (["--selector", " "], "--selector must not be empty"),
    (["--endpoints", "a:1", "--inference-service", "chat"], "--inference-service needs --selector"),
    (["--selector", "app=chat", "--kubeconfig", "/nonexistent/kubeconfig"],
     "--kubeconfig /nonexistent/kubeconfig: no such file"),
    (["--endpoints", "a:1", "--kubeconfig", "/tmp"], "--kubeconfig needs --selector"),
    (["--endpoints", "a:1", "--namespace", "x"], "--namespace needs --selector"),  # ignored, and the router ran
    (["--endpoints", "a:1", "--port-name", "grpc"], "--port-name needs --selector"),
    (["--selector", "app=chat", "--kubeconfig", "/dev/null"], "cannot load Kubernetes config"),
    # It said "cannot load Kubernetes config: 'str' object does not support item assignment".
    (["--selector", "app=chat", "--kubeconfig", "/etc/hostname"], "/etc/hostname is not a kubeconfig (TypeError: "),
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


def test_headers_the_connection_header_names_are_not_passed_on() -> None:
    from multidict import CIMultiDict

    from kiln.router.forwarding import request_headers, response_headers
    sent = CIMultiDict([("Connection", "close, X-Debug"), ("Connection", "x-trace"), ("X-Debug", "1"),
                        ("X-Trace", "2"), ("X-Request-Id", "r1"), ("Content-Length", "5")])
    assert request_headers(sent) == [("X-Request-Id", "r1")]
    assert response_headers(sent) == [("X-Request-Id", "r1"), ("Content-Length", "5")]
    assert request_headers({"X-Request-Id": "r1"}) == [("X-Request-Id", "r1")]


def test_endpoints_take_names_ipv4_and_bracketed_ipv6() -> None:
    assert parse_endpoints("engine-0.engines:8000, 10.0.0.7:8000,[::1]:8000") == [
        Endpoint("engine-0.engines", 8000), Endpoint("10.0.0.7", 8000), Endpoint("::1", 8000)]


@on_event_loop
async def test_a_stopping_router_cuts_a_stream_that_never_ends_within_its_shutdown_time(monkeypatch) -> None:
    """The pod's grace period must not run out first (SIGKILL, no stream closed, no metrics):
    aiohttp waits its timeout twice before it cancels a handler still running."""
    # The operator's router pods: preStop pause, then the router's whole shutdown, in the grace period.
    assert ROUTER_PRESTOP_SLEEP_S + router_main.SHUTDOWN_SECONDS < ROUTER_GRACE_PERIOD_S
    monkeypatch.setattr(router_main, "SHUTDOWN_SECONDS", 3.0)

    stopping: list[float] = []  # when the router began to stop
    written_while_stopping: list[float] = []
    cut: list[float] = []  # when the handler was cancelled

    async def endless(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse()
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: {}\n\n")
                if stopping:
                    written_while_stopping.append(time.monotonic())
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            cut.append(time.monotonic())
            raise

    app = aiohttp.web.Application()
    app.router.add_post("/v1/completions", endless)
    async with aiohttp.ClientSession() as client:
        async with serving(app, "127.0.0.1", 0) as port:
            stream = await client.post(f"http://127.0.0.1:{port}/v1/completions")
            assert await stream.content.readline()
            stopping.append(time.monotonic())
        stopped = time.monotonic()
        with pytest.raises(aiohttp.ClientPayloadError):  # the client sees it cut, not ended, nor hanging
            await stream.content.read()
    assert written_while_stopping  # in-flight streams get the grace period, not an immediate cut
    assert len(cut) == 1 and cut[0] <= stopped  # the router cancelled the handler before it returned
    # About SHUTDOWN_SECONDS (3 s); aiohttp's two waits made it twice that. Loose for a slow runner.
    assert stopped - stopping[0] < 2 * router_main.SHUTDOWN_SECONDS - 0.5, stopped - stopping[0]
