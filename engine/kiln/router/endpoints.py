"""Where the engine replicas are. The router asks a source for the ready endpoints right
now, grouped by revision, and waits on it for a change while there are none (scale from
zero); a static list (local use, tests) and EndpointSlices (in a cluster) both fit."""
from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Protocol

HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")  # a DNS name or IPv4 address


class Endpoint(NamedTuple):
    host: str
    port: int
    revision: str = ""  # the engine revision serving here; "" when unknown (--endpoints)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
        return f"http://{host}:{self.port}"

    def __str__(self) -> str:
        return self.url.removeprefix("http://")


@dataclass(frozen=True)
class ReadyEndpoints:
    """The ready endpoints at one moment, by revision. A known revision may have none ready
    (its pods are starting, or it is scaled to zero). Sources swap in a whole new one, so a
    request handler never sees half an update."""

    by_revision: Mapping[str, tuple[Endpoint, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, endpoints: Iterable[Endpoint], revisions: Iterable[str] = ()) -> ReadyEndpoints:
        """Grouped by each endpoint's revision, plus `revisions` known to have none ready.
        Sorted, so the balancer's rotation over them stays stable across updates."""
        groups: dict[str, set[Endpoint]] = {revision: set() for revision in revisions}
        for endpoint in endpoints:
            groups.setdefault(endpoint.revision, set()).add(endpoint)
        return cls({revision: tuple(sorted(groups[revision])) for revision in sorted(groups)})

    @cached_property
    def all(self) -> tuple[Endpoint, ...]:
        return tuple(e for group in self.by_revision.values() for e in group)


class EndpointSource(Protocol):
    def ready(self) -> ReadyEndpoints:
        """The ready endpoints now; cheap, called on every request."""

    async def changed(self) -> None:
        """Returns once ready() has changed; on the event loop the source started on."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Changes:
    """How a source wakes the coroutines waiting in its changed(). A source may change in
    another thread (the EndpointSlice watch), so notify() hands the wake-up to the event
    loop rather than touch asyncio objects from there."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next = asyncio.Event()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop whose coroutines wait; before any change that should wake them."""
        self._loop = loop
        self._next = asyncio.Event()  # an Event belongs to the first loop that waits on it

    def notify(self) -> None:
        """From any thread, after the change is in place."""
        # A source can outlive the loop that started it (tests do): nobody is left to wake.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake)

    async def wait(self) -> None:
        await self._next.wait()

    def _wake(self) -> None:
        self._next.set()  # wakes everyone waiting now; later waiters wait for the next one
        self._next = asyncio.Event()


class StaticEndpoints:
    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self._ready = ReadyEndpoints.of(endpoints)

    def ready(self) -> ReadyEndpoints:
        return self._ready

    async def changed(self) -> None:
        await asyncio.Event().wait()  # a fixed list never changes

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def _valid_host(host: str) -> bool:
    """A name or IPv4 address, or an IPv6 address in brackets. Anything else (a scheme, a path,
    a second colon) would make every request to it fail, long after startup."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return HOST_NAME.fullmatch(host) is not None


def parse_endpoint(text: str) -> Endpoint:
    """'host:port' or '[IPv6]:port'."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not _valid_host(host) or not (port.isascii() and port.isdigit()) \
            or not 0 < int(port) < 65536:
        raise ValueError(f"{text.strip()!r} is not host:port (port 1-65535; IPv6 in brackets)")
    return Endpoint(host.removeprefix("[").removesuffix("]"), int(port))


def parse_endpoints(text: str) -> list[Endpoint]:
    """'a:8000,b:8000' -> endpoints; duplicates would double a replica's share, so refuse them."""
    endpoints = [parse_endpoint(item) for item in text.split(",")]
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"duplicate endpoint in {text!r}")
    return endpoints
