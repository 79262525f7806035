"""Requests held while no replica is ready: the service is scaled to zero, or its replicas are
still starting (during a rollout: none of a revision the split gives requests to). The operator counts held requests as load and starts a replica for them; each
waits until one is ready, up to --activation-timeout, and at most --max-held wait at once."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from kiln.router.endpoints import EndpointSource
from kiln.router.errors import error_response

# After the only ready replica refused the connection: how long to wait for the EndpointSlice
# to catch up (a replica gone, or a new one at the same address) before trying again.
REFUSED_WAIT_S = 1.0
# How often a held request looks again without an endpoint change: the rollout's split, which
# decides what may take it, changes apart from the endpoints.
RECHECK_S = 1.0


class Held(Protocol):
    held: float | None  # when the request began waiting for a replica, if it had to


class Holding:
    def __init__(self, source: EndpointSource, max_held: int, activation_timeout: float) -> None:
        self.source, self.max_held, self.activation_timeout = source, max_held, activation_timeout
        self.count = 0  # requests waiting now
        self._waits: set[asyncio.Timeout] = set()  # theirs, which a shutdown ends at once
        self._stopping = False

    async def wait(self, exchange: Held, servable: Callable[[], bool], after_change: bool,
                   warm: bool = False) -> web.Response | None:
        """Waits until `servable()` (and, `after_change`, up to REFUSED_WAIT_S for the ready
        replicas to change first); None then, else the error to answer. A client that hangs up
        meanwhile cancels this wait, so it is never forwarded."""
        if self.count >= self.max_held:
            return error_response(429, f"{self.count} requests are already waiting for a "
                                  "replica to start; try again later", "rate_limit_error",
                                  "too_many_held_requests")
        self.count += 1
        # Not after a refused connection (its replica was there, no cold start), nor a second
        # time (the replica it waited for left before it was picked), nor while replicas were
        # ready (`warm`: a split not read yet): the autoscaler reports the last cold start.
        if exchange.held is None and not after_change and not warm:
            exchange.held = time.monotonic()
        waiting = asyncio.timeout(-1 if self._stopping else self.activation_timeout)
        self._waits.add(waiting)
        try:
            async with waiting:
                if after_change:  # the change may have come already: wait a moment at most
                    await self._changed(REFUSED_WAIT_S)
                while not servable():
                    await self._changed(RECHECK_S)
        except TimeoutError:
            if self._stopping:
                return error_response(503, "the router is shutting down before a replica became ready; "
                                      "try again", "service_unavailable", "router_shutting_down")
            return error_response(503, f"no replica became ready within {self.activation_timeout:g}s",
                                  "service_unavailable", "activation_timeout")
        finally:
            self.count -= 1
            self._waits.discard(waiting)
        return None

    async def _changed(self, at_most: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most):
                await self.source.changed()

    async def stop(self, app: web.Application) -> None:
        """aiohttp on_shutdown (SIGTERM; the listener is closed already): held requests are answered
        503 with Retry-After now, for the client to retry through another router, rather than wait
        out the drain and be cut off with the connection. Requests already forwarded finish."""
        self._stopping = True
        for waiting in self._waits:
            if not waiting.expired():  # one that fired this very moment ends of itself (reschedule raises)
                waiting.reschedule(-1)  # in the past: the held request's wait raises TimeoutError
