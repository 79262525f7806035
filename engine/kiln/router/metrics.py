"""The router's own Prometheus metrics, in a registry of their own so several routers
(tests start many in one process) never collide in the global one.

Series are labelled by revision, never by pod alone: pods come and go with every scale
and rollout, revisions are few. The gauges are read at scrape time from the balancer and
the endpoint source, so a pod or revision that went away leaves no stale series behind. A
retired revision's counters and histograms go RETIRED_AFTER_S after its Service did (enough
scrapes to read their last counts), so a long-lived router's series do not grow with every
rollout."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.router.balancer import LeastInFlight
from kiln.router.endpoints import EndpointSource

NO_REVISION = "none"  # revision label of answers the router made up itself (503, 413, 429)


def geometric(low: float, high: float, factor: float) -> tuple[float, ...]:
    """Bucket bounds from `low` to about `high`, each `factor` times the last (three significant
    digits, so the `le` labels stay readable)."""
    count = round(math.log(high / low, factor)) + 1
    return tuple(float(f"{low * factor ** i:.3g}") for i in range(count))


# Seconds. A first token waits for queueing and the whole prompt's prefill; later tokens
# come every few tens of milliseconds; a whole generation can take minutes.
# The canary analysis judges p95 ratios of the two latency histograms against thresholds such as
# 1.25, interpolated inside a bucket, so where latencies usually fall adjacent bounds are 1.2x
# apart (a 1 -> 2.5 s bucket read 1.05 s against 2.4 s as a ratio of 1.0). Coarser at the rare
# ends, to keep each histogram near 40 series per revision.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.035) + geometric(0.05, 12, 1.2) + (15, 20, 30, 45, 60)
INTER_TOKEN_BUCKETS = (0.001,) + geometric(0.002, 0.6, 1.2) + (0.75, 1, 1.5, 2)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
# An engine pod starting from zero: scheduling, maybe a node, the image, the weights.
COLD_START_BUCKETS = (1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 240, 300, 450, 600)
RETIRED_AFTER_S = 600.0  # seconds a revision's series outlive its Service and its last request


class RouterMetrics:
    def __init__(self, source: EndpointSource, balancer: LeastInFlight,
                 held: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kiln_router_requests", "Requests answered, by revision and HTTP status "
            "(499: the client went away; 502 also for a response the replica broke off mid-way)", ["revision", "code"], registry=self.registry)
        self.errors = Counter(
            "kiln_router_errors", "Failures talking to a replica, by reason (connect, "
            "stale_connection, refused, upstream_error, first_byte_timeout, upstream_broken, "
            "no_endpoint)", ["revision", "reason"], registry=self.registry)
        self.retries = Counter(
            "kiln_router_retries", "Requests sent again to another replica, by the revision "
            "of the one that could not take them", ["revision"], registry=self.registry)
        self.duration = Histogram(
            "kiln_router_request_duration_seconds", "From request received to the end of "
            "the response, all requests", ["revision"], buckets=DURATION_BUCKETS,
            registry=self.registry)
        self.time_to_first_token = Histogram(
            "kiln_router_time_to_first_token_seconds", "From the request's sending to the "
            "replica that answered to the first body chunk of a streamed (SSE) response", ["revision"],
            buckets=FIRST_TOKEN_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "kiln_router_inter_token_latency_seconds", "Gaps between the later body chunks "
            "of a streamed (SSE) response", ["revision"], buckets=INTER_TOKEN_BUCKETS,
            registry=self.registry)
        # Unlabelled, and there from the start: the operator's builtin autoscaler sums it
        # over the routers as load, the only load there is at zero replicas.
        Gauge("kiln_router_held_requests", "Requests waiting for a replica to become ready "
              "(scale from zero)", registry=self.registry).set_function(held)
        self.cold_start = Histogram(
            "kiln_router_cold_start_seconds", "From a request being held (no replica ready) "
            "to the first response byte from a replica", buckets=COLD_START_BUCKETS,
            registry=self.registry)
        self.last_cold_start = Gauge(
            "kiln_router_last_cold_start_seconds", "The latest cold start's "
            "held-to-first-byte seconds; 0 until there is one (the operator copies it into "
            "the InferenceService's status)", registry=self.registry)
        self.last_cold_start_time = Gauge(
            "kiln_router_last_cold_start_timestamp_seconds", "When the latest cold start ended (Unix "
            "time): of several routers, the operator reports the newest", registry=self.registry)
        # The quality gate (mirror.py), labelled by the revision that scored the stable
        # revision's greedy tokens: the canary, or stable itself (the noise floor).
        self.mirror_tokens = Counter(
            "kiln_router_mirror_tokens", "Mirrored greedy tokens of the stable revision scored "
            "by this revision", ["revision"], registry=self.registry)
        self.mirror_agreed = Counter(
            "kiln_router_mirror_agreed", "Of those, positions where this revision's argmax was "
            "the stable revision's token", ["revision"], registry=self.registry)
        self.mirrored = Counter(
            "kiln_router_mirrored_requests", "Requests mirrored for the quality gate, by outcome "
            "(scored, skipped, failed)", ["outcome"], registry=self.registry)
        self.prefix_routed = Counter(
            "kiln_router_prefix_routed", "Requests with a prompt prefix, by prefix affinity's outcome: hit (sent "
            "where it was served last), spill (that replica was too busy), none (no replica had it)", ["outcome"],
            registry=self.registry)
        self.registry.register(_LiveGauges(source, balancer))
        self._source, self._balancer = source, balancer
        self._by_revision = (self.requests, self.errors, self.retries, self.duration, self.time_to_first_token,
                             self.inter_token_latency, self.mirror_tokens, self.mirror_agreed)
        self._by_revision_names = {family.name for metric in self._by_revision for family in metric.describe()}
        self._last_seen: dict[str, float] = {}  # revision with series -> when it last had a Service or a request

    def answered(self, revision: str, code: int, seconds: float) -> None:
        self.requests.labels(revision, str(code)).inc()
        self.duration.labels(revision).observe(seconds)

    def cold_started(self, seconds: float) -> None:
        self.cold_start.observe(seconds)
        self.last_cold_start.set(seconds)
        self.last_cold_start_time.set_to_current_time()

    def render(self) -> bytes:
        families = list(self.registry.collect())  # once a scrape: read for retired revisions, then written
        if self._forget_retired(families, time.monotonic()):
            families = list(self.registry.collect())
        return generate_latest(_Collected(families))

    def _forget_retired(self, families: list[Metric], now: float) -> bool:
        """Drop the series of revisions that have had neither a Service (the endpoint source
        lists every revision whose Service exists, ready or not) nor a request in flight for
        RETIRED_AFTER_S; True if any went. NO_REVISION (answers the router made up) is never retired."""
        live = set(self._source.ready().by_revision) | {e.revision for e in self._balancer.in_flight()}
        with_series = {sample.labels["revision"] for family in families if family.name in self._by_revision_names
                       for sample in family.samples} - {NO_REVISION}
        forgot = False
        for revision in with_series | self._last_seen.keys():
            if revision in live or revision not in self._last_seen:
                self._last_seen[revision] = now
            elif now - self._last_seen[revision] >= RETIRED_AFTER_S:
                del self._last_seen[revision]
                for metric in self._by_revision:
                    metric.remove_by_labels({"revision": revision})
                forgot = True
        return forgot


@dataclass
class _Collected:
    """Families collected already, as generate_latest reads a registry."""
    families: list[Metric]

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class _LiveGauges(Collector):
    def __init__(self, source: EndpointSource, balancer: LeastInFlight) -> None:
        self._source = source
        self._balancer = balancer

    def collect(self) -> Iterator[Metric]:
        ready = self._source.ready()
        in_flight = self._balancer.in_flight()
        ready_gauge = GaugeMetricFamily(
            "kiln_router_ready_endpoints", "Ready replicas known to the router, by revision",
            labels=["revision"])
        for revision, endpoints in ready.by_revision.items():
            ready_gauge.add_metric([revision], len(endpoints))
        # A replica that left the ready set may still be finishing requests: count those too.
        by_revision = dict.fromkeys(ready.by_revision, 0)
        for endpoint, count in in_flight.items():
            by_revision[endpoint.revision] = by_revision.get(endpoint.revision, 0) + count
        revision_gauge = GaugeMetricFamily(
            "kiln_router_in_flight_requests", "Requests in flight, by revision",
            labels=["revision"])
        for revision, count in sorted(by_revision.items()):
            revision_gauge.add_metric([revision], count)
        endpoint_gauge = GaugeMetricFamily(
            "kiln_router_endpoint_in_flight_requests", "Requests in flight per ready replica "
            "(a replica's series goes when it leaves the ready set)",
            labels=["revision", "endpoint"])
        for endpoint in ready.all:
            endpoint_gauge.add_metric([endpoint.revision, str(endpoint)],
                                      in_flight.get(endpoint, 0))
        yield from (ready_gauge, revision_gauge, endpoint_gauge)
