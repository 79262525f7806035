"""Fakes for the router's tests: fake engines (small aiohttp apps on 127.0.0.1 standing in
for engine pods, which would need the model to start), an endpoint source the test changes,
a real router in front of them, and its metrics read back."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import re
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kiln.router.auth import ApiKeys
from kiln.router.endpoints import Changes, Endpoint, EndpointSource, ReadyEndpoints, StaticEndpoints
from kiln.router.main import serving
from kiln.router.proxy import Limits, build_app
from kiln.router.traffic import TrafficSource


def on_event_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))
    return run


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class FakeEngine:
    """Stands in for an engine pod, served like the router (as `kiln serve` is, a client
    hanging up cancels its handler). Scripts: answer; hold (answer once `release` is set);
    stream (one SSE event, then the rest once `release` is set); paced (three SSE events,
    one per item put in `steps`); endless (SSE events until the client goes away); break
    (one SSE event, then drop the connection); hang_up (drop the connection unanswered);
    cut_error (a JSON 503 whose body breaks off); stall_error (a JSON 503 whose body never
    comes); redirect (the "status" its body names, with Location its "to").
    It keeps the last request's body and headers, and has the engine's POST /sleep, a route
    no client of the router may reach. With `serves`, a request naming another model gets the
    engine's 404 (code model_not_found)."""
    serves: set[str] | None = None

    def __init__(self, name: str) -> None:
        self.name = name
        self.hits = 0
        self.slept = 0
        self.body = b""
        self.headers: Mapping[str, str] = {}
        self.streams_finished = 0
        self.clients_gone = 0
        self.release = asyncio.Event()
        self.steps: asyncio.Queue[None] = asyncio.Queue()
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/sleep", self.sleep)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.body, self.headers = await request.read(), request.headers
        try:
            payload = json.loads(self.body)
            script, model = payload.get("fake", "answer"), payload.get("model")
        except (ValueError, RecursionError, AttributeError):
            script, model = "answer", None
        if self.serves is not None and model not in self.serves:
            return self._not_found(f"model {model!r} does not exist", "model_not_found")
        try:
            return await getattr(self, f"_{script}")(request)
        except asyncio.CancelledError:  # the client hung up; a real engine aborts the request
            self.clients_gone += 1
            raise

    async def sleep(self, request: web.Request) -> web.StreamResponse:
        self.slept += 1
        return web.json_response({"is_sleeping": True})

    def _not_found(self, message: str, code: str) -> web.Response:
        """The engine's JSON 404, with a header of its own (which the router must pass on)."""
        return web.json_response({"error": {"message": message, "type": "x", "param": "model", "code": code}},
                                 status=404, headers={"X-Engine": self.name})

    async def _missing(self, request: web.Request) -> web.StreamResponse:
        return self._not_found("no such thing", "not_found")

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

    async def _error_head(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=503, headers={"Content-Type": "application/json",
                                                           "Content-Length": "100"})
        await response.prepare(request)
        return response

    async def _cut_error(self, request: web.Request) -> web.StreamResponse:
        response = await self._error_head(request)
        await response.write(b'{"error": ')
        request.transport.close()
        return response

    async def _stall_error(self, request: web.Request) -> web.StreamResponse:
        response = await self._error_head(request)
        await self.release.wait()
        request.transport.close()
        return response

    async def _redirect(self, request: web.Request) -> web.StreamResponse:
        payload = json.loads(self.body)
        return web.Response(status=payload["status"], headers={"Location": payload["to"]})

    async def _hang_up(self, request: web.Request) -> web.StreamResponse:
        request.transport.close()
        return web.Response()


class DropsReusedConnections:
    """A raw HTTP/1.1 engine: it answers the first request on a connection and keeps it
    open, then closes it unanswered when another request comes on it. That is what the
    router meets when an engine's idle timeout closes a pooled connection just as a request
    goes out on it. With `after`, it works on that request so long before the close: it died of
    it, or of something else, after reading it."""

    def __init__(self, after: float = 0.0) -> None:
        self.answered = 0
        self.dropped = 0
        self.after = after

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
            await asyncio.sleep(self.after)
        writer.close()


@asynccontextmanager
async def raw_replica(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]
                      ) -> AsyncIterator[Endpoint]:
    """A replica speaking raw HTTP/1.1 (`handle`, as DropsReusedConnections'), on a free port."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield Endpoint("127.0.0.1", server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


class FirstRefuses(FakeEngine):
    """engine-0 refuses every request as a dead, loading or draining engine does at admission:
    a 503 with the code its request body names ("refuse_code"); the others answer."""

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if self.name != "engine-0":
            return await super()._answer(request)
        code = json.loads(self.body).get("refuse_code", "engine_dead")
        return web.json_response({"error": {"message": f"{self.name} says {code}", "type": "server_error",
                                            "param": None, "code": code}}, status=503)


class CrashesOnPoison:
    """A raw HTTP/1.1 engine that keeps connections open between requests and closes one,
    unanswered, on a request whose body holds b"poison": an engine crashing on what it read.
    `server` set: its process dies of it too, and the port refuses connections from then on."""

    def __init__(self) -> None:
        self.answered = 0
        self.poisoned = 0
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                body = await reader.readexactly(int(length.group(1)) if length else 0)
                if b"poison" in body:
                    self.poisoned += 1
                    if self.server is not None:
                        self.server.close()
                    break
                answer = b'{"engine": "crasher"}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
                self.answered += 1
        writer.close()


class ChangingEndpoints:
    """An EndpointSource the test changes, as EndpointSlice updates would, from any thread."""

    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self._ready = ReadyEndpoints.of(endpoints)
        self._changes = Changes()

    def ready(self) -> ReadyEndpoints:
        return self._ready

    def set(self, ready: ReadyEndpoints) -> None:
        self._ready = ready
        self._changes.notify()

    async def changed(self) -> None:
        await self._changes.wait()

    async def start(self) -> None:
        self._changes.bind(asyncio.get_running_loop())

    async def stop(self) -> None:
        pass


def none_ready(endpoints: list[Endpoint]) -> ChangingEndpoints:
    """Scaled to zero: the engines are there, none ready yet; the test makes them ready."""
    return ChangingEndpoints([])


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
    port: int  # the router's

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
                  traffic: TrafficSource | None = None, fake: type[FakeEngine] = FakeEngine,
                  api_keys: ApiKeys | None = None) -> AsyncIterator[Service]:
    """A router over the endpoints `also` and `engines` fake engines (of `revisions`, one
    each, if given), splitting by `traffic` if given, demanding `api_keys` if given."""
    fakes = [fake(f"engine-{i}") for i in range(engines)]
    async with AsyncExitStack() as stack:
        ports = [await stack.enter_async_context(serving(f.app, "127.0.0.1", 0)) for f in fakes]
        mine = [Endpoint("127.0.0.1", port, revision)
                for port, revision in zip(ports, revisions or [""] * engines)]
        endpoints = source([*also, *mine])
        router_port = await stack.enter_async_context(
            serving(build_app(endpoints, limits, traffic, api_keys), "127.0.0.1", 0))
        session = await stack.enter_async_context(
            aiohttp.ClientSession(f"http://127.0.0.1:{router_port}"))
        stack.callback(lambda: [fake.release.set() for fake in fakes])  # unblock before cleanup
        yield Service(session, fakes, mine, endpoints, router_port)


async def until(condition: Callable[[], bool]) -> None:
    while not condition():  # bounded by the test timeout, not timed
        await asyncio.sleep(0.01)


async def until_held(router: aiohttp.ClientSession, count: int) -> None:
    """Until the router says it holds `count` requests (waiting for a ready replica)."""
    async def held() -> float:
        page = await (await router.get("/metrics")).text()
        return metric(parse_metrics(page), "kiln_router_held_requests")
    while await held() != count:  # bounded by the test timeout, not timed
        await asyncio.sleep(0.01)


async def raw_post(port: int, path: bytes, body: bytes, headers: bytes = b"") -> tuple[int, bytes]:
    """POST exactly these bytes to 127.0.0.1:`port`, where a client library would resolve '..'
    in the path and encode the headers itself; the status and the (unchunked) body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: router\r\nConnection: close\r\n%sContent-Length: %d"
                 b"\r\n\r\n%s" % (path, headers, len(body), body))
    answer = await reader.read()  # until the server closes, as asked
    writer.close()
    await writer.wait_closed()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload
