"""Ready replicas from the EndpointSlices of the engine Service. Kubernetes already folds
pod readiness (and termination) into `conditions.ready`, so the router never probes pods."""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from kubernetes import client, watch

from kiln.router.endpoints import Endpoint

log = logging.getLogger("kiln.router")

SERVICE_LABEL = "kubernetes.io/service-name"
RETRY_SECONDS = 2.0  # after an API error; the last known replicas keep serving meanwhile


def ready_endpoints(slices: Iterable[client.V1EndpointSlice],
                    port_name: str) -> tuple[Endpoint, ...]:
    """The ready addresses on the port named `port_name` ("" for an unnamed port)."""
    found: set[Endpoint] = set()  # a set: slices overlap while the controller rebalances
    for endpoint_slice in slices:
        port = next((p.port for p in endpoint_slice.ports or ()
                     if (p.name or "") == port_name and p.port), None)
        if port is None:
            continue
        for item in endpoint_slice.endpoints or ():
            ready = item.conditions.ready if item.conditions else None
            if ready is not False and item.addresses:  # the API says nil means ready
                found.add(Endpoint(item.addresses[0], port))
    return tuple(sorted(found))  # stable order keeps the round-robin turn meaningful


class EndpointSliceSource:
    """Lists the Service's slices, then watches them; a thread does the blocking client
    calls and swaps in a new tuple that request handlers read without locks."""

    def __init__(self, api_client: client.ApiClient, namespace: str, service: str,
                 port_name: str = "http", resync_seconds: int = 60) -> None:
        self._api = client.DiscoveryV1Api(api_client)
        self._namespace = namespace
        self._selector = f"{SERVICE_LABEL}={service}"
        self._port_name = port_name
        self._resync_seconds = resync_seconds
        self._slices: dict[str, client.V1EndpointSlice] = {}
        self._endpoints: tuple[Endpoint, ...] = ()
        self._stopping = threading.Event()
        self._watch = watch.Watch()

    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._endpoints

    async def start(self) -> None:
        threading.Thread(target=self._follow, name=f"endpointslices[{self._selector}]",
                         daemon=True).start()

    async def stop(self) -> None:
        # Watch.stop() shuts the watch's socket, so the thread leaves at once; it is a
        # daemon and only touches this object, so nobody needs to wait for it.
        self._stopping.set()
        self._watch.stop()

    def _follow(self) -> None:
        while not self._stopping.is_set():
            try:
                self._list_then_watch()
            except Exception as exc:  # noqa: BLE001 - any API trouble: retry, keep serving
                if self._stopping.is_set():
                    return  # stop() cut the watch short
                log.warning("EndpointSlices of %s/%s: %s; retrying in %.0fs", self._namespace,
                            self._selector, exc, RETRY_SECONDS)
                self._stopping.wait(RETRY_SECONDS)

    def _list_then_watch(self) -> None:
        listed = self._api.list_namespaced_endpoint_slice(
            self._namespace, label_selector=self._selector, _request_timeout=30)
        self._slices = {s.metadata.name: s for s in listed.items}
        self._publish()
        # The watch ends after resync_seconds; the loop in _follow lists afresh.
        for event in self._watch.stream(
                self._api.list_namespaced_endpoint_slice, self._namespace,
                label_selector=self._selector, resource_version=listed.metadata.resource_version,
                timeout_seconds=self._resync_seconds, _request_timeout=self._resync_seconds + 10):
            if self._stopping.is_set():
                return
            name = event["object"].metadata.name
            if event["type"] == "DELETED":
                self._slices.pop(name, None)
            else:
                self._slices[name] = event["object"]
            self._publish()

    def _publish(self) -> None:
        endpoints = ready_endpoints(self._slices.values(), self._port_name)
        if endpoints != self._endpoints:
            log.info("ready replicas of %s: %s", self._selector,
                     ", ".join(map(str, endpoints)) or "none")
        self._endpoints = endpoints
