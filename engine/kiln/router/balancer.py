"""Least-in-flight balancing: a replica that is busy with long generations gets fewer new
requests. Ties rotate, so an idle service still spreads sequential requests. With prefix
affinity (affinity.py), a request whose prompt prefix a replica served last goes there unless
that replica is too busy."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType

from kiln.router.affinity import Affinity
from kiln.router.endpoints import Endpoint, EndpointSource


class LeastInFlight:
    def __init__(self, source: EndpointSource, affinity: Affinity | None = None,
                 routed: Callable[[str], None] = lambda outcome: None) -> None:
        """routed: told each prefix-affinity outcome (affinity.Affinity.choose), for metrics."""
        self._source = source
        self._in_flight: Counter[Endpoint] = Counter()
        # Picks so far from each pool (a revision; None: every ready replica), whose ties rotate on
        # its own count: on one count for all, a 50/50 split alternating revisions gave each only
        # even turns, and every request to its first replica. A few ints: one per revision.
        self._turns: Counter[str | None] = Counter()
        self._affinity, self._routed = affinity, routed

    def pick(self, exclude: Collection[Endpoint] = (), revision: str | None = None,
             keys: Sequence[bytes] = ()) -> Endpoint | None:
        """The least busy ready endpoint, of `revision` if given; with prefix affinity and the
        keys of the request's prompt prefixes, the one that served the longest of them last if it
        is not too busy."""
        ready = self._source.ready()
        pool = ready.all if revision is None else ready.by_revision.get(revision, ())
        candidates = [e for e in pool if e not in exclude]
        if not candidates:
            return None
        chosen = None
        if self._affinity is not None and keys:
            chosen, outcome = self._affinity.choose(keys, candidates, self._in_flight)
            self._routed(outcome)
        if chosen is None:
            start = self._turns[revision] % len(candidates)
            self._turns[revision] += 1
            rotated = candidates[start:] + candidates[:start]
            chosen = min(rotated, key=lambda e: self._in_flight[e])  # min keeps the first tie
        if self._affinity is not None and keys:
            self._affinity.remember(keys, chosen)
        return chosen

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
