"""What the router relays as it came, and what it times: a replica's redirect goes to the
client unfollowed, the replica gets only the headers the client sent, and time to first token
counts the replica's wait alone. A real router in front of fake engines (router_fakes)."""
from __future__ import annotations

import asyncio
import json
import re
import tracemalloc

import aiohttp
import pytest
from aiohttp import web

from kiln.router.affinity import MAX_BODY
from kiln.router.endpoints import ReadyEndpoints
from kiln.router.main import serving
from router_fakes import (ChangingEndpoints, Samples, Service, metric, none_ready, on_event_loop, raw_post, raw_replica,
                          service, until_held)

pytestmark = pytest.mark.timeout(60)

AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")  # a client library's own


async def until_answered(svc: Service, code: str, revision: str) -> Samples:
    """The metrics once the router has counted a `code` answer for `revision` (after the client's end)."""
    while not metric(samples := await svc.metrics(), "kiln_router_requests_total", revision=revision, code=code):
        await asyncio.sleep(0.01)  # bounded by the test timeout, not timed
    return samples


@pytest.mark.parametrize("status", [302, 307])
@on_event_loop
async def test_a_replicas_redirect_reaches_the_client_unfollowed(status: int) -> None:
    """Followed, a 302 fetched another URL for the client, and a 307 posted its body there."""
    reached: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        reached.append(request.method)
        return web.json_response({"engine": "elsewhere"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", elsewhere)
    async with service(1) as svc, serving(app, "127.0.0.1", 0) as port:
        to = f"http://127.0.0.1:{port}/v1/completions"
        response = await svc.client.post("/v1/completions", allow_redirects=False,
                                         json={"fake": "redirect", "status": status, "to": to})
        assert response.status == status and response.headers["Location"] == to
        assert svc.hits() == [1] and reached == []


@on_event_loop
async def test_the_replica_gets_only_the_headers_the_client_sent() -> None:
    """aiohttp's own would ask for gzip the client never asked for, and label a JSON body
    application/octet-stream, which vLLM refuses."""
    async with service(1) as svc:
        engine, body = svc.engines[0], json.dumps({"prompt": "hi"}).encode()
        assert (await raw_post(svc.port, b"/v1/completions", body))[0] == 200
        assert [name for name in AUTO_HEADERS if name in engine.headers] == []
        mine = b"User-Agent: my-client/1\r\nContent-Type: application/json\r\n"
        assert (await raw_post(svc.port, b"/v1/completions", body, mine))[0] == 200
        assert (engine.headers["User-Agent"], engine.headers["Content-Type"]) == ("my-client/1", "application/json")
        assert "Accept-Encoding" not in engine.headers


@on_event_loop
async def test_time_to_first_token_counts_from_the_sending_not_the_routers_wait() -> None:
    """The same wait (held at zero replicas here; the line, an upload) added to canary and
    stable alike pulls their p95 ratio toward 1: a regression would pass under load."""
    async with service(1, revisions=["blue"], source=none_ready) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        pending = asyncio.create_task(svc.complete("stream"))  # its first event at once
        await until_held(svc.client, 1)
        await asyncio.sleep(1)
        svc.source.set(ReadyEndpoints.of(svc.endpoints))
        response = await pending
        await response.content.readuntil(b"\n\n")
        svc.engines[0].release.set()
        await response.read()
        samples = await until_answered(svc, "200", "blue")
        assert metric(samples, "kiln_router_time_to_first_token_seconds_count", revision="blue") == 1
        assert metric(samples, "kiln_router_time_to_first_token_seconds_sum", revision="blue") < 0.5
        assert metric(samples, "kiln_router_request_duration_seconds_sum", revision="blue") >= 1  # as before


@pytest.mark.parametrize("stream", [True, False])
@on_event_loop
async def test_a_replica_silent_until_a_streaming_client_leaves_counts_the_wait_as_first_token(stream: bool) -> None:
    """No status line ever came, so no chunk was timed: a canary that stalls until its clients
    give up (499s, nobody's failure) showed nothing wrong. A non-streaming request has no first token."""
    async with service(1, revisions=["canary"]) as svc:
        with pytest.raises(TimeoutError):
            await svc.client.post("/v1/completions", json={"prompt": "hi", "fake": "hold", "stream": stream},
                                  timeout=aiohttp.ClientTimeout(total=0.5))
        samples = await until_answered(svc, "499", "canary")
        assert metric(samples, "kiln_router_time_to_first_token_seconds_count", revision="canary") == stream
        if stream:
            assert 0.5 <= metric(samples, "kiln_router_time_to_first_token_seconds_sum", revision="canary") < 2


@on_event_loop
async def test_a_client_leaving_a_large_streaming_request_costs_no_parse_of_its_body() -> None:
    """Whether it asked to stream was read by parsing the whole body on the event loop: 16 MiB of
    [{}, ...] took ~400 MiB and ~0.6 s, with every stream stalled, at each such hang-up (the OOM
    the router avoids elsewhere: prefix hashing and the mirror leave a body over MAX_BODY unparsed)."""
    body = b'{"stream": true, "prompt": [' + b",".join([b"{}"] * (MAX_BODY + 1)) + b"]}"
    read = asyncio.Event()

    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        left = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
        while left:
            left -= len(await reader.read(min(left, 1 << 16)))
        read.set()
        await reader.read()  # no status line, until the router hangs up

    async with raw_replica(replica) as endpoint, service(0, also=[endpoint._replace(revision="canary")]) as svc:
        client = asyncio.create_task(svc.client.post("/v1/completions", data=body))
        await read.wait()
        tracemalloc.start()
        try:
            client.cancel()
            await until_answered(svc, "499", "canary")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < len(body), f"{peak / len(body):.1f} times the body's size taken on a hang-up"


@on_event_loop
async def test_header_bytes_that_are_not_utf8_are_refused_or_left_out_never_changed() -> None:
    """Header values are bytes; aiohttp reads those that are not UTF-8 as surrogates, which its
    writer drops (its C one: an X-Request-Id came to the replica changed) or cannot write (its
    Python one: a 500). UTF-8 goes through as it came; a request with other bytes is a 400, and a
    replica's header with them is left out of its answer."""
    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1)))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Utf8: caf\xc3\xa9\r\n"
                     b"X-Latin: caf\xe9\r\nContent-Length: 2\r\n\r\n{}")
        writer.close()

    async with service(1) as svc:
        status, _ = await raw_post(svc.port, b"/v1/completions", b"{}", b"X-Request-Id: caf\xc3\xa9\r\n")
        assert status == 200 and svc.engines[0].headers["X-Request-Id"] == "caf\u00e9"
        for header in (b"X-Request-Id: caf\xe9", b"Authorization: Bearer \xff\xfe"):
            status, body = await raw_post(svc.port, b"/v1/completions", b"{}", header + b"\r\n")
            error = json.loads(body)["error"]
            assert status == 400 and error["code"] == "invalid_header", header
            assert header.split(b":")[0].decode().lower() in error["message"].lower()
        assert svc.hits() == [1]
    async with raw_replica(replica) as endpoint, service(0, also=[endpoint]) as svc:
        response = await svc.client.post("/v1/completions", json={})
        assert response.status == 200 and await response.json() == {}
        assert (b"X-Utf8", b"caf\xc3\xa9") in response.raw_headers
        assert not any(name == b"X-Latin" for name, _ in response.raw_headers)
