"""The reverse proxy: each /v1 request goes to the least busy ready replica and its
response streams back chunk by chunk, so SSE tokens reach the client as they are made.

A request is sent again to another replica only when the connection could not be made,
because then the replica never saw it. Once bytes went out, a retry could run a
generation twice, so the client gets a 502 (or, mid-stream, a broken stream) instead."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kiln.router.balancer import LeastInFlight
from kiln.router.endpoints import Endpoint, EndpointSource
from kiln.router.metrics import NO_ENDPOINT, RouterMetrics

log = logging.getLogger("kiln.router")

# Raised before a single byte of the request left: safe to send elsewhere.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# Per-connection headers (RFC 9110 7.6.1) and ones the client library sets itself.
HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
    "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length"))
CLIENT_GONE = 499  # nginx's code for "client closed the request"


def error_response(status: int, message: str, type_: str, code: str) -> web.Response:
    """An error shaped like OpenAI's, so OpenAI clients show the message."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _end_to_end(headers: Mapping[str, str], keep_length: bool) -> list[tuple[str, str]]:
    """Pairs, not a dict: a header may repeat."""
    return [(k, v) for k, v in headers.items()
            if k.lower() not in HOP_BY_HOP or (keep_length and k.lower() == "content-length")]


class Router:
    def __init__(self, source: EndpointSource, connect_timeout: float = 5.0) -> None:
        self.source = source
        self.balancer = LeastInFlight(source)
        self.metrics = RouterMetrics(source)
        self._connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: follow the endpoints and hold one pooled session."""
        self._session = aiohttp.ClientSession(
            # No total/read timeout: a long generation is not a failure.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout),
            connector=aiohttp.TCPConnector(limit=0),  # the default 100 would cap streams
            auto_decompress=False)  # pass bytes through untouched
        await self.source.start()
        try:
            yield
        finally:
            await self.source.stop()
            await self._session.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        tried: list[Endpoint] = []
        while (endpoint := self.balancer.pick(exclude=tried)) is not None:
            if tried:
                self.metrics.retries.inc()
            tried.append(endpoint)
            try:
                with self._in_flight(endpoint):
                    return await self._relay(request, endpoint, body)
            except CONNECT_ERRORS as exc:
                log.warning("cannot connect to %s: %s", endpoint, exc)
                self.metrics.errors.labels(str(endpoint), "connect").inc()
        message = (f"none of the {len(tried)} ready replicas accepted a connection" if tried
                   else "no ready replica for this service yet")
        self.metrics.errors.labels(NO_ENDPOINT, "no_endpoint").inc()
        return self._answer_error(NO_ENDPOINT, 503, message, "service_unavailable",
                                  "no_ready_endpoint")

    @contextmanager
    def _in_flight(self, endpoint: Endpoint) -> Iterator[None]:
        self.balancer.acquire(endpoint)
        gauge = self.metrics.in_flight.labels(str(endpoint))
        gauge.inc()
        try:
            yield
        finally:
            self.balancer.release(endpoint)
            gauge.dec()

    async def _relay(self, request: web.Request, endpoint: Endpoint,
                     body: bytes) -> web.StreamResponse:
        assert self._session is not None, "router used outside its lifecycle"
        try:
            upstream = await self._session.request(
                request.method, endpoint.url + request.rel_url.raw_path_qs,
                headers=_end_to_end(request.headers, keep_length=False), data=body)
        except CONNECT_ERRORS:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("%s failed before answering: %r", endpoint, exc)
            self.metrics.errors.labels(str(endpoint), "upstream_error").inc()
            return self._answer_error(str(endpoint), 502, f"replica {endpoint} failed before "
                                      "answering", "bad_gateway", "upstream_error")
        async with upstream:
            response = web.StreamResponse(
                status=upstream.status, reason=upstream.reason,
                headers=_end_to_end(upstream.headers, keep_length=True))
            try:
                await response.prepare(request)
                complete = await _pump(upstream, response)
            except ConnectionResetError:
                # Leaving `async with` drops the upstream connection, so the engine
                # sees the disconnect and stops generating.
                self.metrics.requests.labels(str(endpoint), str(CLIENT_GONE)).inc()
                return response
        self.metrics.requests.labels(str(endpoint), str(upstream.status)).inc()
        if not complete:
            log.warning("%s broke off its response mid-way", endpoint)
            self.metrics.errors.labels(str(endpoint), "upstream_broken").inc()
            # The status line is gone already; closing without the final chunk is the
            # only way left to tell the client its response is incomplete.
            if request.transport is not None:
                request.transport.close()
        return response

    def _answer_error(self, endpoint: str, status: int, message: str, type_: str,
                      code: str) -> web.Response:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        return error_response(status, message, type_, code)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        count = len(self.source.endpoints())
        if count == 0:
            return error_response(503, "no ready replica known", "service_unavailable",
                                  "no_ready_endpoint")
        return web.json_response({"status": "ready", "endpoints": count})

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _pump(upstream: aiohttp.ClientResponse, response: web.StreamResponse) -> bool:
    """Copy the body as it arrives; False when the replica broke off mid-way.
    Client-side write errors propagate: they are the caller's to handle."""
    while True:
        try:
            chunk = await upstream.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        if not chunk:
            await response.write_eof()
            return True
        await response.write(chunk)


def build_app(source: EndpointSource, connect_timeout: float = 5.0) -> web.Application:
    router = Router(source, connect_timeout)
    app = web.Application(client_max_size=64 << 20)  # long prompts are still small JSON
    app.cleanup_ctx.append(router.lifecycle)
    app.router.add_get("/health", router.health)
    app.router.add_get("/ready", router.ready)
    app.router.add_get("/metrics", router.metrics_page)
    app.router.add_route("*", "/v1/{tail:.*}", router.forward)
    return app
