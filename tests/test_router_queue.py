"""The router's line (`--max-queue`): past `--max-in-flight`, requests wait first come first
served for a place, and past the line they get a 429 with Retry-After. A real router in front
of fake engines (router_fakes); the real engine behind a real router is in test_overload.py."""
from __future__ import annotations

import asyncio
import gzip
import json
import re
import tracemalloc

import aiohttp
import pytest

from kiln.cli import main as kiln_main
from kiln.router.endpoints import Endpoint, StaticEndpoints
from kiln.router.main import serving
from kiln.router.proxy import Limits, build_app
from router_fakes import FakeEngine, metric, on_event_loop, parse_metrics, raw_replica, service, until

pytestmark = pytest.mark.timeout(60)


async def queued(router: aiohttp.ClientSession) -> float:
    page = await (await router.get("/metrics")).text()
    return metric(parse_metrics(page), "kiln_router_queued_requests")


async def until_queued(router: aiohttp.ClientSession, count: int) -> None:
    while await queued(router) != count:  # bounded by the test timeout, not timed
        await asyncio.sleep(0.01)


@on_event_loop
async def test_requests_past_max_in_flight_wait_in_line_then_get_429_with_retry_after() -> None:
    async with service(1, limits=Limits(max_in_flight=1, max_queue=2)) as svc:
        first = asyncio.create_task(svc.complete("hold"))
        await until(lambda: svc.hits() == [1])
        line = [asyncio.create_task(svc.complete("hold")) for _ in range(2)]
        await until_queued(svc.client, 2)
        response = await svc.complete()
        assert response.status == 429 and response.headers["Retry-After"] == "1"
        assert await response.json() == {"error": {
            "message": "the router is at its limit of 1 requests in flight and 2 waiting",
            "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
        assert svc.hits() == [1]  # the line never reached the engine
        svc.engines[0].release.set()
        assert [r.status for r in await asyncio.gather(first, *line)] == [200, 200, 200]
        assert svc.hits() == [3] and await queued(svc.client) == 0
        assert (await svc.complete()).status == 200  # places free again
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="429") == 1
        assert metric(samples, "kiln_router_requests_total", revision="", code="200") == 4


@on_event_loop
async def test_request_bodies_held_at_once_are_bounded() -> None:
    """Each request's body stays in memory until its answer ends: past --max-body-bytes-in-flight
    a 429 (declared, chunked alike), and one request alone always goes."""
    padding = "x" * 600
    async with service(1, limits=Limits(max_body_bytes_in_flight=1000)) as svc:
        held = asyncio.create_task(svc.client.post("/v1/completions", json={"fake": "hold", "p": padding}))
        await until(lambda: svc.hits() == [1])
        refused = await svc.client.post("/v1/completions", json={"p": padding})
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        assert "--max-body-bytes-in-flight" in (await refused.json())["error"]["message"]

        async def chunked():
            yield json.dumps({"p": padding}).encode()
        assert (await svc.client.post("/v1/completions", data=chunked())).status == 429
        assert (await svc.client.post("/v1/completions", json={"p": "small"})).status == 200  # room for that
        assert svc.hits() == [2]
        svc.engines[0].release.set()
        assert (await held).status == 200
        assert (await svc.client.post("/v1/completions", json={"p": padding * 3})).status == 200  # alone: goes
    assert kiln_main(["router", "--endpoints", "127.0.0.1:1", "--max-body-bytes-in-flight", "0"]) == 2


async def head_of(port: int, request: bytes) -> bytes:
    """Send these bytes and never the rest of the body; the answer's status line and headers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    try:
        async with asyncio.timeout(20):  # body_timeout is 60 s: an answer in time came before it
            return await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


@on_event_loop
async def test_body_bytes_are_counted_as_they_arrive_not_once_read_whole() -> None:
    """A chunked or gzip body past its declared length is counted as it arrives: a client stalling
    its last bytes held memory no limit saw (a gzip bomb inflates in the reader). A declared
    length over --max-body-bytes is a 413 at once, before it counts against the others."""
    chunked = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with service(1, limits=Limits(max_body_bytes=1 << 20, max_body_bytes_in_flight=4000,
                                         body_timeout=60)) as svc:
        held = asyncio.create_task(svc.client.post("/v1/completions", json={"fake": "hold", "p": "x" * 100}))
        await until(lambda: svc.hits() == [1])
        head = await head_of(svc.port, chunked + b"1388\r\n" + b"x" * 5000 + b"\r\n")  # and no last chunk
        assert head.split()[1] == b"429", head
        bomb = gzip.compress(b" " * 200_000)
        head = await head_of(svc.port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Encoding: gzip\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(bomb), bomb[:-8]))
        assert head.split()[1] == b"429", head
        head = await head_of(svc.port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
                             b"Content-Length: 100000000000\r\n\r\n{")
        assert head.split()[1] == b"413", head
        assert (await svc.client.post("/v1/completions", json={"p": "small"})).status == 200  # nothing left held
        svc.engines[0].release.set()
        assert (await held).status == 200


@on_event_loop
async def test_requests_in_line_when_the_router_shuts_down_get_a_503_to_retry() -> None:
    """SIGTERM with requests waiting in line: they are answered at once, to retry through another
    router, rather than wait out the drain behind the streams in flight and be cut off."""
    engine = FakeEngine("engine-0")
    async with serving(engine.app, "127.0.0.1", 0) as engine_port:
        endpoints = StaticEndpoints([Endpoint("127.0.0.1", engine_port, "")])
        router = serving(build_app(endpoints, Limits(max_in_flight=1, max_queue=2)), "127.0.0.1", 0)
        port = await router.__aenter__()
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
            body = {"prompt": "x", "fake": "hold"}
            first = asyncio.create_task(client.post("/v1/completions", json=body))
            await until(lambda: engine.hits == 1)
            line = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
            await until_queued(client, 2)
            stopping = asyncio.create_task(router.__aexit__(None, None, None))  # as SIGTERM starts it
            for response in await asyncio.gather(*line):
                assert response.status == 503 and response.headers["Retry-After"] == "1"
                assert (await response.json())["error"]["code"] == "router_shutting_down"
            engine.release.set()  # the one in flight finishes
            assert (await first).status == 200
            await stopping
    assert engine.hits == 1


@on_event_loop
async def test_a_client_leaving_the_line_is_never_forwarded_and_frees_its_spot() -> None:
    async with service(1, limits=Limits(max_in_flight=1, max_queue=1)) as svc:
        first = asyncio.create_task(svc.complete("hold"))
        await until(lambda: svc.hits() == [1])
        gone = asyncio.create_task(svc.complete("hold"))
        await until_queued(svc.client, 1)
        gone.cancel()  # the client gives up; its connection closes
        await until_queued(svc.client, 0)
        stays = asyncio.create_task(svc.complete("hold"))  # the spot it left is free
        await until_queued(svc.client, 1)
        svc.engines[0].release.set()
        assert [r.status for r in await asyncio.gather(first, stays)] == [200, 200]
        assert svc.hits() == [2]
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="none", code="499") == 1


@on_event_loop
async def test_without_a_line_the_429_comes_at_once_with_retry_after() -> None:
    async with service(1, limits=Limits(max_in_flight=1)) as svc:
        held = asyncio.create_task(svc.complete("hold"))
        await until(lambda: svc.hits() == [1])
        response = await svc.complete()
        assert response.status == 429 and response.headers["Retry-After"] == "1"
        assert (await response.json())["error"]["message"] == "the router is at its limit of 1 requests in flight"
        svc.engines[0].release.set()
        assert (await held).status == 200


def test_cli_rejects_a_negative_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert kiln_main(["router", "--endpoints", "a:1", "--max-queue", "-1"]) == 2
    assert "--max-queue must be 0 or more" in capsys.readouterr().err


@on_event_loop
@pytest.mark.parametrize("ends", ["", "eof", "silence"],
                         ids=["endless stream", "stream ending as the client stops",
                              "engine going silent as the client stops"])
async def test_a_client_that_stops_reading_gives_its_place_back_after_the_idle_timeout(ends: str) -> None:
    """A client whose receive window stays shut never hangs up: the router's writes to it wait
    for ever, with its place in flight and the engine's generation held, unless the stream's idle
    timeout counts the client's side too (as Envoy's does), its end included: a stream that ends
    just as the client stops reading waits on the client in its last write. An engine that goes
    silent then breaks the stream off, and the router lets go of the stalled client then too."""
    import socket

    from aiohttp import web

    from kiln.router.endpoints import Endpoint, StaticEndpoints
    from kiln.router.main import serving
    from kiln.router.proxy import build_app

    streaming, end = asyncio.Event(), asyncio.Event()
    protocols = []  # the router's side of each client connection

    async def engine(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.json_response({"choices": [{"text": "ok"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        streaming.set()
        while not end.is_set():  # endless, as fast as it can be taken, or small events until told to end
            await response.write(b"data: " + b"x" * (1000 if ends else 65536) + b"\n\n")
            await asyncio.sleep(0.001 if ends else 0)
        if ends == "silence":  # until the router hangs up, which cancels this handler
            await asyncio.Event().wait()
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", engine)
    async with serving(app, "127.0.0.1", 0) as engine_port:
        limits = Limits(max_in_flight=1, max_queue=1, stream_idle_timeout=0.5)
        router = build_app(StaticEndpoints([Endpoint("127.0.0.1", engine_port)]), limits)

        async def note_protocol(request: web.Request, _: web.StreamResponse) -> None:
            protocols.append(request.protocol)
        router.on_response_prepare.append(note_protocol)
        async with serving(router, "127.0.0.1", 0) as port, aiohttp.ClientSession() as client:
            with socket.socket() as stalled:
                stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                stalled.connect(("127.0.0.1", port))
                body = b'{"prompt": "x", "stream": true}'
                stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await streaming.wait()
                if ends:  # the router's writes to it paused: the engine ends its stream, or stops sending
                    await until(lambda: bool(protocols) and protocols[0].writing_paused)
                    end.set()
                # It never reads. The next request waits in line for its place (bounded by the
                # test's timeout), and gets it once the router gave up on the stalled client.
                answer = await client.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "y"})
                assert answer.status == 200 and (await answer.json())["choices"][0]["text"] == "ok"
                # The router let go of its socket (aborted, not closed: a close waits for it to
                # take what the router still queues, keeping the socket and those bytes for as
                # long as it does not): read without the router's loop running, it ends.
                stalled.settimeout(5)
                while stalled.recv(1 << 20):
                    pass


@on_event_loop
async def test_a_body_is_held_once_while_its_answer_comes() -> None:
    """--max-body-bytes-in-flight counts each body once: the chunks it was read in, kept beside
    the joined body while the replica answered, made the memory held twice what the limit saw."""
    size = 8 << 20
    body = b"x" * size
    read, release = asyncio.Event(), asyncio.Event()

    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        left = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
        while left:  # read and dropped: what stays is the router's
            left -= len(await reader.read(min(left, 1 << 16)))
        read.set()
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    async with raw_replica(replica) as endpoint, service(0, also=[endpoint]) as svc:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            pending = asyncio.create_task(svc.client.post("/v1/completions", data=body))
            await read.wait()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        release.set()
        assert (await pending).status == 200
        assert held < 1.5 * size, f"the router holds {held / size:.2f} copies of the body"


@on_event_loop
async def test_a_declared_length_reserves_nothing_until_its_bytes_arrive() -> None:
    """Clients that declare a large body and send next to none of it (a slowloris) hold no
    budget: counted as declared, a few of them took all of --max-body-bytes-in-flight, and every
    other request got a 429 while the router held a few bytes. Each gets its 408 in the end."""
    async with service(1, limits=Limits(max_body_bytes=4000, max_body_bytes_in_flight=4000,
                                         body_timeout=2)) as svc:
        slow = [await asyncio.open_connection("127.0.0.1", svc.port) for _ in range(3)]
        for _, writer in slow:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 4000\r\n\r\n{")
        # One after another: the slow heads, sent first, were read by the second one at the latest.
        for _ in range(3):
            assert (await svc.client.post("/v1/completions", json={"p": "x" * 500})).status == 200
        for reader, writer in slow:
            async with asyncio.timeout(20):  # body_timeout (2 s) ends each well before
                head = await reader.readuntil(b"\r\n\r\n")
            writer.close()
            assert head.split()[1] == b"408", head
        assert svc.hits() == [3]
