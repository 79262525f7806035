"""Where the engine replicas are. The router only asks a source for the ready endpoints
right now; a static list (local use, tests) and EndpointSlices (in a cluster) both fit."""
from __future__ import annotations

from typing import NamedTuple, Protocol


class Endpoint(NamedTuple):
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
        return f"http://{host}:{self.port}"

    def __str__(self) -> str:
        return self.url.removeprefix("http://")


class EndpointSource(Protocol):
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The ready endpoints now; cheap, called on every request."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class StaticEndpoints:
    def __init__(self, endpoints: list[Endpoint]) -> None:
        self._endpoints = tuple(endpoints)

    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._endpoints

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def parse_endpoint(text: str) -> Endpoint:
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text.strip()!r} is not host:port (port 1-65535)")
    return Endpoint(host, int(port))


def parse_endpoints(text: str) -> list[Endpoint]:
    """'a:8000,b:8000' -> endpoints; duplicates would double a replica's share, so refuse them."""
    endpoints = [parse_endpoint(item) for item in text.split(",")]
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"duplicate endpoint in {text!r}")
    return endpoints
