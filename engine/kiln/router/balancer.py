"""Least-in-flight balancing: a replica that is busy with long generations gets fewer new
requests. Ties rotate, so an idle service still spreads sequential requests."""
from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType

from kiln.router.endpoints import Endpoint, EndpointSource


class LeastInFlight:
    def __init__(self, source: EndpointSource) -> None:
        self._source = source
        self._in_flight: Counter[Endpoint] = Counter()
        self._turn = 0

    def pick(self, exclude: Collection[Endpoint] = (), revision: str | None = None) -> Endpoint | None:
        """The least busy ready endpoint, of `revision` if given."""
        ready = self._source.ready()
        pool = ready.all if revision is None else ready.by_revision.get(revision, ())
        candidates = [e for e in pool if e not in exclude]
        if not candidates:
            return None
        start = self._turn % len(candidates)
        self._turn += 1
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda e: self._in_flight[e])  # min keeps the first tie

    @contextmanager
    def busy(self, endpoint: Endpoint) -> Iterator[None]:
        """Counts a request at `endpoint` while the block runs."""
        self._in_flight[endpoint] += 1
        try:
            yield
        finally:
            self._in_flight[endpoint] -= 1
            if self._in_flight[endpoint] <= 0:
                del self._in_flight[endpoint]  # endpoints come and go; forget idle ones

    def in_flight(self) -> Mapping[Endpoint, int]:
        """Requests in flight by endpoint; idle endpoints are absent."""
        return MappingProxyType(self._in_flight)
