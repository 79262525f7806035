"""The operator's own HTTP endpoints: liveness (`--liveness URL`) for the kubelet's probe and
/metrics (`--metrics-port`) for Prometheus.

Both are served on the operator's event loop, so a stuck loop fails the probe, as kopf's own
endpoint would. Their sockets come from kiln.listening, bound by main.py before it connects: with
no host (`http://:8080/healthz`, and always for /metrics) one socket takes IPv4 and IPv6, so the
kubelet and Prometheus reach the pod IP on an IPv4, IPv6 or dual-stack cluster. kopf bound the
URL's host as given, and asyncio makes "::" IPv6-only: no value served both families.
"""
from __future__ import annotations

import contextlib
import socket
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


@dataclass(frozen=True)
class Liveness:
    host: str | None  # None: every address, both families
    port: int
    path: str


def parse_liveness(url: str) -> Liveness:
    """`http://[HOST]:PORT/PATH`; raises ValueError with a message for the user."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not port or parts.query or parts.fragment:
        raise ValueError(f"--liveness takes http://[HOST]:PORT/PATH, e.g. http://:8080/healthz (every address, "
                         f"IPv4 and IPv6), got {url!r}")
    return Liveness(parts.hostname, port, parts.path or "/")


@dataclass
class Listeners:
    """The bound sockets, made before the operator connects: a taken port is one line and exit 1."""
    liveness: list[socket.socket] = field(default_factory=list)
    liveness_path: str = "/healthz"
    metrics: list[socket.socket] = field(default_factory=list)


# Each answer closes its connection: kopf waits 5 s at its stop for every task begun after its
# start, and a connection Prometheus keeps open between scrapes is one.
async def _alive(_: web.Request) -> web.Response:
    response = web.json_response({"status": "ok"})  # answered at all: the event loop runs
    response.force_close()
    return response


async def _metrics(_: web.Request) -> web.Response:
    response = web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})
    response.force_close()
    return response


@contextlib.asynccontextmanager
async def serving(listeners: Listeners) -> AsyncIterator[None]:
    """Serve the endpoints that have sockets until the block ends."""
    runners: list[web.AppRunner] = []
    try:
        for sockets, path, handler in ((listeners.liveness, listeners.liveness_path, _alive),
                                       (listeners.metrics, "/metrics", _metrics)):
            if not sockets:
                continue
            app = web.Application()
            app.router.add_get(path, handler)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            runners.append(runner)
            for sock in sockets:
                await web.SockSite(runner, sock).start()
        yield
    finally:
        for runner in runners:
            await runner.cleanup()
