"""The router's own Prometheus metrics, in a registry of their own so several routers
(tests start many in one process) never collide in the global one."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kiln.router.endpoints import EndpointSource

NO_ENDPOINT = "none"  # endpoint label of responses the router made up itself


class RouterMetrics:
    def __init__(self, source: EndpointSource) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kiln_router_requests", "Requests answered, by replica and HTTP status "
            "(499: the client went away)", ["endpoint", "code"], registry=self.registry)
        self.errors = Counter(
            "kiln_router_errors", "Failures talking to a replica, by reason "
            "(connect, upstream_error, upstream_broken, no_endpoint)",
            ["endpoint", "reason"], registry=self.registry)
        self.retries = Counter(
            "kiln_router_retries", "Requests sent again to another replica after a connect "
            "failure", registry=self.registry)
        self.in_flight = Gauge(
            "kiln_router_in_flight_requests", "Requests in flight per replica",
            ["endpoint"], registry=self.registry)
        ready = Gauge("kiln_router_ready_endpoints", "Ready replicas known to the router",
                      registry=self.registry)
        ready.set_function(lambda: len(source.endpoints()))

    def render(self) -> bytes:
        return generate_latest(self.registry)
