"""The reverse proxy: each /v1 request (and vLLM's /tokenize, /detokenize) goes to the least
busy ready replica and its response streams back chunk by chunk, so SSE tokens reach the
client as they are made.

A request goes to a second replica (once at most) only when the first cannot have acted on
it: the connection could not be made, or a pooled keep-alive connection turned out to be
closed already (the rule Go's net/http uses). A fresh connection dropped after the request
went out, or a failure after response bytes, could mean a generation ran, so the client
gets an error instead of a second run.

With no replica ready at all (the service is scaled to zero), a request is held until one
is (holding.py)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, Gauge

from kiln.engine.api_errors import unreadable_body
from kiln.engine.openapi import handler
from kiln.router import auth
from kiln.router.auth import ApiKeys
from kiln.router.affinity import MAX_BODY, Affinity, prefix_keys
from kiln.router.balancer import LeastInFlight
from kiln.router.endpoints import Endpoint, EndpointSource
from kiln.router.errors import error_response, http_errors
from kiln.router.forwarding import has_dot_segment, header_not_utf8, request_headers, response_headers
from kiln.router.holding import Holding
from kiln.router.metrics import NO_REVISION, RouterMetrics
from kiln.router.mirror import Mirroring
from kiln.router.openapi import router_document
from kiln.router.retries import (ATTEMPTS, RETRYABLE, NotServedHere, Retryable, error_code, failure_reason,
                                 is_refusal, mark_reused)
from kiln.router.traffic import StaticTraffic, TrafficSource, WeightedChoice, split_unknown

log = logging.getLogger("kiln.router")

CLIENT_GONE = 499  # nginx's code for "client closed the request"
# What aiohttp would add that the client never sent: Accept-Encoding would get a compressed
# answer (passed through undecoded) a client never asked for, and a vLLM engine reads a body
# without Content-Type as JSON but refuses application/octet-stream.
NOT_ADDED = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


@dataclass(frozen=True)
class Limits:
    connect_timeout: float = 5.0  # seconds for a replica to accept a connection
    # Seconds to a replica's response headers, 0 for no limit. Generous: a non-streaming
    # engine sends its headers only once the whole generation is done.
    first_byte_timeout: float = 600.0
    # Seconds a response may go without a byte once its headers came, 0 for no limit: a replica
    # whose node vanished sends no reset, and its stream would hold a place for ever.
    stream_idle_timeout: float = 600.0
    max_in_flight: int = 1024  # /v1 requests at once; more wait in line (max_queue), then 429
    max_body_bytes: int = 16 << 20  # long prompts are still small JSON; more get a 413
    # Request bodies held at once (the router keeps each until its answer ends); past it a 429.
    # The default fits the 512 MiB the operator gives it: 1024 requests of 16 MiB would not.
    max_body_bytes_in_flight: int = 192 << 20
    max_held: int = 256  # requests waiting at once for a replica to start; more get a 429
    activation_timeout: float = 300.0  # seconds a request waits for a replica, then a 503
    max_queue: int = 0  # requests waiting in line for one of max_in_flight; 0: none wait
    body_timeout: float = 30.0  # seconds to receive a request's body once admitted, then a 408
    # Prefix affinity (affinity.py): requests in flight a replica may have beyond the least busy
    # one and still get the prompts whose prefix it served last; -1: balance on load alone.
    prefix_slack: int = 8


class ShuttingDown(Exception):
    """Set on a request waiting in line when the router shuts down."""


@dataclass
class _Exchange:
    """One /v1 request, as its metrics see it."""
    received: float = field(default_factory=time.monotonic)
    # When it went to the replica that answered: its time to first token counts from there, as
    # the router's own waits (line, upload, hold, failed tries) would blur canary against stable.
    sent: float = 0.0
    revision: str = NO_REVISION  # of the replica that answered
    code: int | None = None  # set where it differs from the response's status
    held: float | None = None  # when it began waiting for a replica, if it had to
    last_chunk: float | None = None  # when the previous chunk of a stream came
    streaming: bool = False  # the replica answered with an SSE stream


class Router:
    def __init__(self, source: EndpointSource, limits: Limits, traffic: TrafficSource) -> None:
        self.source = source
        self.limits = limits
        self.traffic = traffic
        affinity = Affinity(limits.prefix_slack) if limits.prefix_slack >= 0 else None
        self.balancer = LeastInFlight(source, affinity,
                                      lambda outcome: self.metrics.prefix_routed.labels(outcome).inc())
        self.metrics = RouterMetrics(source, self.balancer, held=lambda: self.holding.count)
        self.weighted = WeightedChoice()
        self.mirroring = Mirroring(self.balancer, self.metrics, lambda: self._session)
        Gauge("kiln_router_queued_requests", "Requests waiting in line for a place among "
              "--max-in-flight (--max-queue)", registry=self.metrics.registry
              ).set_function(lambda: len(self._line))
        self._active = 0  # /v1 requests being handled, against limits.max_in_flight
        self._body_bytes = 0  # their bodies' bytes, against limits.max_body_bytes_in_flight
        self._line: deque[asyncio.Future[None]] = deque()  # waiting for one of them, first come first
        self.holding = Holding(source, limits.max_held, limits.activation_timeout)  # of those, none ready
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # never reuses a connection (proxy._send)

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: follow the endpoints and hold one pooled session."""
        tracing = aiohttp.TraceConfig()
        tracing.on_connection_reuseconn.append(mark_reused)
        # No total/read timeout: a long generation is not a failure. No connection limit: the
        # default 100 would cap streams. auto_decompress off: bytes pass through untouched.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.limits.connect_timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                              trace_configs=[tracing], auto_decompress=False)
        self._fresh = aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        await self.source.start()
        await self.traffic.start()
        try:
            yield
        finally:
            await self.mirroring.stop()
            await self.traffic.stop()
            await self.source.stop()
            await self._session.close()
            await self._fresh.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        exchange = _Exchange()
        try:
            response = await self._admit(request, exchange)
            exchange.code = exchange.code or response.status
            return response
        except asyncio.CancelledError:  # handler cancellation: the client hung up
            exchange.code = CLIENT_GONE
            if exchange.streaming:
                # What it waited for the next token counts, at least: a replica that stalls
                # until clients give up (their 499s count as nobody's failure) must still show
                # in the latencies the canary analysis compares.
                self._time_chunk(exchange)
            raise
        finally:
            self.metrics.answered(exchange.revision, exchange.code or 500,
                                  time.monotonic() - exchange.received)

    async def _admit(self, request: web.Request, exchange: _Exchange) -> web.StreamResponse:
        if has_dot_segment(request.path):
            return error_response(400, "a path with '.' or '..' segments is refused",
                                  "invalid_request_error", "invalid_path")
        if name := header_not_utf8(request_headers(request.headers)):
            return error_response(400, f"the {name} header is not UTF-8, so the router cannot pass it on as sent",
                                  "invalid_request_error", "invalid_header")
        if refused := await self._take_place():
            return refused
        held = 0  # body bytes this request holds
        try:
            if (request.content_length or 0) > self.limits.max_body_bytes:
                return self._too_large()
            # Counted as the bytes arrive: a body read whole first, then counted, was memory no
            # limit saw while a client stalled its last bytes; a declared length counted before
            # its bytes came let a few clients that send none (slowloris) take the whole budget.
            chunks = []
            try:
                # A client that stalls its upload would hold its place for ever (slowloris).
                async with asyncio.timeout(self.limits.body_timeout):
                    while chunk := await request.content.readany():
                        if held + len(chunk) > self.limits.max_body_bytes:
                            return self._too_large()
                        if not self._hold_body(len(chunk), mine=held):
                            return self._bodies_refused()
                        held += len(chunk)
                        chunks.append(chunk)
            except TimeoutError:
                return error_response(408, f"the request body did not arrive within "
                                      f"{self.limits.body_timeout:g} s", "invalid_request_error", "request_timeout")
            except RequestPayloadError as exc:  # a corrupt gzip body, broken chunks
                return error_response(400, unreadable_body(exc), "invalid_request_error",
                                      "invalid_body")
            body = b"".join(chunks)
            del chunks  # or the body is held twice until its answer ends, and counted once
            if request.method == "POST":
                self.mirroring.offer(request.path, body, self.traffic.current(),
                                     request.headers.get("Authorization"))
            return await self._send(request, body, exchange)
        finally:
            self._body_bytes -= held
            self._leave()

    def _hold_body(self, size: int, mine: int = 0) -> bool:
        """Room for `size` more body bytes beside the `mine` this request holds already; one
        request alone always has it (it is under max_body_bytes)."""
        if self._body_bytes - mine and self._body_bytes + size > self.limits.max_body_bytes_in_flight:
            return False
        self._body_bytes += size
        return True

    def _too_large(self) -> web.Response:
        return error_response(413, f"the request body is over the router's limit of {self.limits.max_body_bytes} "
                              "bytes", "invalid_request_error", "request_too_large")

    def _bodies_refused(self) -> web.Response:
        return error_response(429, f"the router holds {self._body_bytes} bytes of request bodies, its limit "
                              f"being {self.limits.max_body_bytes_in_flight} (--max-body-bytes-in-flight)",
                              "rate_limit_error", "rate_limit_exceeded")

    async def _take_place(self) -> web.Response | None:
        """One of the max_in_flight places (None), after waiting in line behind at most max_queue
        others; else the answer: a 429 when even the line is full, a 503 when the router shuts
        down first. A client hanging up in line cancels the wait."""
        if self._active < self.limits.max_in_flight and not self._line:
            self._active += 1
            return None
        if len(self._line) >= self.limits.max_queue:
            waiting = f" and {len(self._line)} waiting" if self.limits.max_queue else ""
            return error_response(429, f"the router is at its limit of {self._active} requests "
                                  f"in flight{waiting}", "rate_limit_error", "rate_limit_exceeded")
        turn = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        try:
            await turn  # _leave hands its place over: _active already counts this request
        except asyncio.CancelledError:
            if turn.cancelled():
                with contextlib.suppress(ValueError):  # _leave may have dropped it already
                    self._line.remove(turn)
            elif turn.exception() is None:
                self._leave()  # handed a place just as the client left: pass it on
            raise
        except ShuttingDown:
            return error_response(503, "the router is shutting down before a place in its line came free; "
                                  "try again", "service_unavailable", "router_shutting_down")
        return None

    async def close_line(self, app: web.Application) -> None:
        """aiohttp on_shutdown: requests waiting in line are answered 503 with Retry-After now, to
        retry through another router, rather than wait out the drain and be cut off."""
        for turn in self._line:
            if not turn.done():
                turn.set_exception(ShuttingDown())
        self._line.clear()

    def _leave(self) -> None:
        """A request is done: its place goes to the first in line, else it is free."""
        while self._line:
            turn = self._line.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._active -= 1

    async def _send(self, request: web.Request, body: bytes,
                    exchange: _Exchange) -> web.StreamResponse:
        failed: list[Endpoint] = []  # refused this request since the ready replicas last changed
        tried: list[Endpoint] = []
        not_served: web.Response | None = None  # a revision's 404 for the model named, or a replica's refusal
        refused_by = NO_REVISION  # not_served's revision, which the metrics blame (not the last one tried)
        elsewhere = False  # a revision lacks the model named: then one at weight 0 may answer it
        sent_to: Endpoint | None = None  # the replica of the last attempt (retries are counted by its revision)
        again: Endpoint | None = None  # the replica a dead pooled connection was to
        suspect: Endpoint | None = None  # ... which may have died of reading this request
        fresh = False  # the next attempt takes a new connection
        keys = prefix_keys(request.path, body, request.get(auth.SALT)) if self.limits.prefix_slack >= 0 else []
        while len(tried) < ATTEMPTS:
            if again is not None and again in self.source.ready().all:
                endpoint = again
            else:
                endpoint = self._pick(failed, keys, anywhere=elsewhere)
            again = None
            if endpoint is None and not_served is not None:  # no other revision to ask
                exchange.revision = refused_by
                return not_served
            if endpoint is None:
                # None ready (scaled to zero, still starting), or only one that just refused the
                # connection (a replica gone before its EndpointSlice caught up): wait for another.
                warm = split_unknown(self.traffic.current(), self.source.ready().by_revision)
                if refused := await self.holding.wait(exchange, self._servable, bool(failed), warm):
                    return refused
                failed = []  # the replicas changed: an address that refused may be a new pod's now
                continue
            if sent_to is not None:
                self.metrics.retries.labels(sent_to.revision).inc()
            sent_to = endpoint
            tried.append(endpoint)
            try:
                with self.balancer.busy(endpoint):
                    return await self._relay(request, endpoint, body, exchange, fresh)
            except NotServedHere as e:
                not_served, refused_by, elsewhere = e.answer, endpoint.revision, True
                sent_to = None  # lacking a model (a client's typo, often) is no failure to count against it
                failed += self.source.ready().by_revision.get(endpoint.revision, [endpoint])
            except Retryable as retry:
                if retry.stale and not fresh:
                    # A dead pooled connection says nothing of the replica (e.g. one that left
                    # pooled connections to an address a new pod now has): not a try. The same
                    # replica takes it once more, on a new connection, as with Go's net/http: a
                    # replica that crashed on reading it looks the same, and must neither pass it
                    # on to the next replica as a free retry nor run it once per pooled connection.
                    fresh = True
                    tried.pop()
                    again = suspect = endpoint
                    sent_to = None  # nor a retry: the canary analysis counts those as the revision's errors
                    continue
                if retry.reason == "connect" and endpoint == suspect:
                    # Its connection broke on reading the request, then it refused a new one: the
                    # replica died, maybe of this request. Passed on, it could kill them all.
                    exchange.revision = endpoint.revision
                    return error_response(502, f"replica {endpoint} closed the connection on reading the "
                                          "request and is gone: not passed on to another", "bad_gateway",
                                          "upstream_error")
                failed.append(endpoint)
                if retry.answer is not None:
                    not_served, refused_by = retry.answer, endpoint.revision
        if not_served is not None:
            exchange.revision = refused_by
            return not_served
        exchange.revision = NO_REVISION
        self.metrics.errors.labels(NO_REVISION, "no_endpoint").inc()
        return error_response(503, f"no replica could take the request ({len(tried)} "
                              "tried)", "service_unavailable", "no_ready_endpoint")

    def _pick(self, failed: list[Endpoint], keys: list[bytes], anywhere: bool) -> Endpoint | None:
        """The replica for the next try. During a rollout, by its weights among the revisions with
        a ready replica left to try; a revision at weight 0 (a canary not yet vetted) takes none,
        unless a weighted one does not serve the model asked for (`anywhere`). A canary's share
        goes to the stable revision while it has no replica, never the other way: the stable
        revision's share waits for it. None: hold it."""
        traffic, ready = self.traffic.current(), self.source.ready().by_revision
        weights = traffic.weights
        if weights is None:
            return None if split_unknown(traffic, ready) else self.balancer.pick(failed, None, keys)
        left = {revision for revision in weights if any(e not in failed for e in ready.get(revision, ()))}
        revision = self.weighted.choose({revision: weight for revision, weight in weights.items()
                                         if revision in left or (revision == traffic.stable and not anywhere)})
        if revision not in left and not anywhere:
            return None
        return self.balancer.pick(failed, revision, keys)

    def _servable(self) -> bool:
        """A held request may go: a replica is ready in a revision the split gives requests to,
        the stable revision's own while it has a share."""
        traffic, ready = self.traffic.current(), self.source.ready().by_revision
        weights = traffic.weights
        if weights is None:
            return any(ready.values()) and not split_unknown(traffic, ready)
        if weights.get(traffic.stable or "", 0) > 0:
            return bool(ready.get(traffic.stable or ""))
        return any(ready.get(revision) for revision, weight in weights.items() if weight > 0)

    async def _relay(self, request: web.Request, endpoint: Endpoint, body: bytes,
                     exchange: _Exchange, fresh: bool) -> web.StreamResponse:
        """`fresh`: on a new connection, not a pooled one."""
        assert self._session is not None and self._fresh is not None, "router used outside its lifecycle"
        exchange.revision = endpoint.revision
        attempt = SimpleNamespace(reused=False)  # mark_reused sets it
        sent = exchange.sent = time.monotonic()
        try:
            async with asyncio.timeout(self.limits.first_byte_timeout or None):
                upstream = await (self._fresh if fresh else self._session).request(
                    request.method, endpoint.url + request.rel_url.raw_path_qs,
                    headers=request_headers(request.headers, request.get(auth.SALT)), data=body,
                    skip_auto_headers=NOT_ADDED, allow_redirects=False,  # a 3xx is the client's to follow
                    trace_request_ctx=attempt)
                if upstream.status in (404, 503) and upstream.content_type == "application/json":
                    async with upstream:  # an error body: small, and needed whole to tell which 404 or 503
                        error_body = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = failure_reason(exc, attempt.reused, time.monotonic() - sent)
            log.warning("%s gave no response (%s): %r", endpoint, reason, exc)
            self.metrics.errors.labels(endpoint.revision, reason).inc()
            if reason in RETRYABLE:
                raise Retryable(reason) from exc
            if reason == "first_byte_timeout":
                return error_response(504, f"replica {endpoint} sent no response within "
                                      f"{self.limits.first_byte_timeout:g} s", "timeout_error",
                                      "upstream_timeout")
            return error_response(502, f"replica {endpoint} failed before answering",
                                  "bad_gateway", "upstream_error")
        except asyncio.CancelledError:  # the client gave up before a status line came
            if _asks_to_stream(body):  # its wait is its first token's: a replica stalling until
                self._time_chunk(exchange)  # clients leave must show in the canary analysis
            raise
        answer = None
        if upstream.status in (404, 503) and upstream.content_type == "application/json":
            answer = web.Response(status=upstream.status, body=error_body, headers=response_headers(upstream.headers))
            if upstream.status == 404 and error_code(answer.body) == "model_not_found":
                raise NotServedHere(answer)
            if is_refusal(upstream.status, answer.body):
                log.warning("%s refused the request: %s", endpoint, error_code(answer.body))
                self.metrics.errors.labels(endpoint.revision, "refused").inc()
                raise Retryable("refused", answer)
        if exchange.held is not None:  # the status line of what the client gets: the first byte after the wait
            self.metrics.cold_started(time.monotonic() - exchange.held)
        if answer is not None:
            return answer
        async with upstream:
            response = web.StreamResponse(
                status=upstream.status, reason=upstream.reason,
                headers=response_headers(upstream.headers))
            try:
                await response.prepare(request)
                complete = await self._pump(upstream, response, exchange)
            except ConnectionResetError:
                # Leaving `async with` drops the upstream connection, so the engine
                # sees the disconnect and stops generating.
                exchange.code = CLIENT_GONE
                if request.transport is not None:  # one that stopped reading is still connected:
                    request.transport.abort()  # close() would wait for it to take what is queued
                return response
        if not complete:
            log.warning("%s broke off its response mid-way, or went silent", endpoint)
            self.metrics.errors.labels(endpoint.revision, "upstream_broken").inc()
            # Counted as the failure it is, not as the 200 its status line said: the canary
            # analysis reads 5xx codes, and an engine dying mid-generation must count there.
            exchange.code = 502
            # The status line is gone already; closing without the final chunk is the
            # only way left to tell the client its response is incomplete. A client that
            # stopped reading (writes paused) would hold a closing socket until it reads.
            if request.transport is not None and request.protocol.writing_paused:
                request.transport.abort()
            elif request.transport is not None:
                request.transport.close()
        return response

    async def _pump(self, upstream: aiohttp.ClientResponse, response: web.StreamResponse,
                    exchange: _Exchange) -> bool:
        """Copy the body as it arrives, timing the chunks of an SSE stream; False when the
        replica broke off mid-way or sent nothing for stream_idle_timeout. Client-side write
        errors are the caller's to handle; a client that took nothing for stream_idle_timeout
        (its receive window shut) is one (ConnectionResetError), or it held its place for ever."""
        streamed = exchange.streaming = upstream.content_type == "text/event-stream"
        idle = self.limits.stream_idle_timeout or None
        while True:
            try:
                async with asyncio.timeout(idle):
                    chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError):
                return False
            if streamed and chunk:
                self._time_chunk(exchange)
            try:  # the last chunk waits on the client too: the end of a stream it stopped reading
                async with asyncio.timeout(idle):
                    await (response.write(chunk) if chunk else response.write_eof())
            except TimeoutError:
                raise ConnectionResetError(f"the client read nothing for {idle:g} s") from None
            if not chunk:
                return True

    def _time_chunk(self, exchange: _Exchange) -> None:
        now = time.monotonic()
        if exchange.last_chunk is None:
            self.metrics.time_to_first_token.labels(exchange.revision).observe(
                now - exchange.sent)
        else:
            self.metrics.inter_token_latency.labels(exchange.revision).observe(
                now - exchange.last_chunk)
        exchange.last_chunk = now

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Ready as soon as it serves, engines or not: with none (scaled to zero), a request
        waits here for one, so the router must stay in its Service meanwhile."""
        ready = self.source.ready()
        return web.json_response({
            "status": "ready", "endpoints": len(ready.all),
            "revisions": {revision: len(e) for revision, e in ready.by_revision.items()}})

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


def _asks_to_stream(body: bytes) -> bool:
    """Whether a request body is JSON asking for "stream": true; any other body is not. One over
    MAX_BODY is not parsed (its wait goes untimed), as prefix hashing and the mirror leave it: on
    the event loop, 16 MiB of [{}, ...] took ~400 MiB and stalled every stream for ~0.6 s."""
    if len(body) > MAX_BODY:
        return False
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(payload, dict) and payload.get("stream") is True


async def adapters_are_in_the_spec(request: web.Request) -> web.Response:
    """Loading an adapter through the router would change one replica of many: the set is the
    InferenceService's, and a change to it rolls out to every replica."""
    return error_response(403, "LoRA adapters are set in the InferenceService's engine.adapters; a change there "
                               "rolls out to every replica", "invalid_request_error", "adapters_in_spec")


def build_app(source: EndpointSource, limits: Limits = Limits(),
              traffic: TrafficSource | None = None, api_keys: ApiKeys | None = None) -> web.Application:
    """`traffic`: the rollout's split (None: no split, every ready replica alike); `api_keys`:
    demand one (None: open)."""
    router = Router(source, limits, traffic or StaticTraffic())
    keys = [auth.middleware(api_keys)] if api_keys else []
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[http_errors, *keys])
    app.cleanup_ctx.append(router.lifecycle)
    app.on_shutdown.append(router.holding.stop)
    app.on_shutdown.append(router.close_line)
    app.router.add_get("/health", router.health)
    app.router.add_get("/ready", router.ready)
    app.router.add_get("/metrics", router.metrics_page)
    app.router.add_get("/openapi.json", handler(router_document))
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # before /v1/*: never one replica's
        app.router.add_route("*", path, adapters_are_in_the_spec)
    app.router.add_route("*", "/v1/{tail:.*}", router.forward)
    for path in ("/tokenize", "/detokenize"):  # vLLM's, answered by any replica
        app.router.add_route("*", path, router.forward)
    return app
