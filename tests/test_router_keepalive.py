"""`kiln router` over keep-alive connections a real aiohttp engine closes: one it closed while
idle is never reused, and a request that meets one closing as it goes out (an engine's idle
timeout firing just then) is sent again, once, on a fresh connection, whole, and answered."""
from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from kiln.router.endpoints import Endpoint
from router_fakes import metric, service

pytestmark = pytest.mark.timeout(60)


class ClosesReusedConnections:
    """An aiohttp engine that answers the first request on a connection and keeps it open, then
    closes it unanswered when another request comes on it: what the router meets when an engine's
    idle timeout closes a pooled connection just as a request goes out on it. `reset`: close with
    an RST (SO_LINGER 0), as a peer whose socket is gone does, instead of a FIN."""

    def __init__(self, reset: bool = False) -> None:
        self.reset = reset
        self.connections: list[asyncio.BaseTransport] = []  # each connection that was answered on
        self.bodies: list[bytes] = []  # of the requests answered
        self.dropped = 0
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)

    async def completions(self, request: web.Request) -> web.Response:
        body, transport = await request.read(), request.transport
        if transport in self.connections:
            self.dropped += 1
            if self.reset:
                transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                              struct.pack("ii", 1, 0))
            transport.close()
            return web.Response()  # never sent: the connection is gone
        self.connections.append(transport)
        self.bodies.append(body)
        return web.json_response({"engine": "closer", "prompt": json.loads(body)["prompt"]})


@asynccontextmanager
async def engine_at(app: web.Application, keepalive_timeout: float = 75.0) -> AsyncIterator[Endpoint]:
    runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield Endpoint("127.0.0.1", runner.addresses[0][1])
    finally:
        await runner.cleanup()


async def _reused_connection_found_closed(reset: bool) -> None:
    closer = ClosesReusedConnections(reset)
    async with engine_at(closer.app) as endpoint, service(0, also=[endpoint]) as svc:
        bodies = [{"prompt": "first", "max_tokens": 3}, {"prompt": "second", "max_tokens": 4}]
        answers = [await svc.client.post("/v1/completions", json=body) for body in bodies]
        assert [r.status for r in answers] == [200, 200], [await r.text() for r in answers]
        assert [(await r.json())["prompt"] for r in answers] == ["first", "second"]
        # The second went out on the first's pooled connection, which the engine closed on it:
        # sent again on a fresh one, whole.
        assert (closer.dropped, len(closer.connections)) == (1, 2)
        assert [json.loads(body) for body in closer.bodies] == bodies
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_errors_total", revision="", reason="stale_connection") == 1
        # Sent again to the same replica, for the connection's fault: not a retry the replica is blamed for.
        assert metric(samples, "kiln_router_retries_total", revision="") == 0
        assert metric(samples, "kiln_router_requests_total", revision="", code="200") == 2


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_a_reused_connection_the_engine_closes_as_the_request_goes_out_is_retried_once(reset: bool) -> None:
    asyncio.run(_reused_connection_found_closed(reset))


async def _idle_connections_closed() -> None:
    closer = ClosesReusedConnections()
    async with engine_at(closer.app, keepalive_timeout=0.1) as endpoint, service(0, also=[endpoint]) as svc:
        for i in range(3):
            answer = await svc.client.post("/v1/completions", json={"prompt": str(i)})
            assert answer.status == 200 and (await answer.json())["prompt"] == str(i)
            await asyncio.sleep(0.5)  # past the engine's keep-alive timeout: it closes the connection
        # Each request on a new connection (a reused one would have been dropped), none retried.
        assert (closer.dropped, len(closer.connections)) == (0, 3)
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_errors_total", revision="", reason="stale_connection") == 0
        assert metric(samples, "kiln_router_retries_total", revision="") == 0


def test_a_connection_the_engine_closed_while_idle_is_not_reused() -> None:
    asyncio.run(_idle_connections_closed())
