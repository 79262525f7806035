"""Ready replicas from EndpointSlices, by revision. The operator makes one headless Service
per engine revision, labelled with the revision; Kubernetes copies a Service's labels onto
its slices, so one label selector finds every revision's slices. Kubernetes already folds
pod readiness (and termination) into `conditions.ready`, so the router never probes pods."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from kubernetes import client

from kiln.router.endpoints import Changes, Endpoint, ReadyEndpoints
from kiln.router.watching import ListWatch

log = logging.getLogger("kiln.router")

REVISION_LABEL = "kiln.dev/revision"  # set by the operator on each revision's Service


def ready_endpoints(slices: Iterable[client.V1EndpointSlice], port_name: str) -> ReadyEndpoints:
    """The ready addresses on the port named `port_name` ("" for an unnamed port), by the
    slices' revision label; a revision whose slices list nobody ready is kept, with none."""
    found: list[Endpoint] = []  # may repeat: slices overlap while the controller rebalances
    revisions: set[str] = set()
    for endpoint_slice in slices:
        revision = (endpoint_slice.metadata.labels or {}).get(REVISION_LABEL, "")
        revisions.add(revision)
        port = next((p.port for p in endpoint_slice.ports or ()
                     if (p.name or "") == port_name and p.port), None)
        if port is None:
            continue
        for item in endpoint_slice.endpoints or ():
            ready = item.conditions.ready if item.conditions else None
            if ready is not False and item.addresses:  # the API says nil means ready
                found.append(Endpoint(item.addresses[0], port, revision))
    return ReadyEndpoints.of(found, revisions)


class EndpointSliceSource:
    """Follows the selected slices (a ListWatch thread), swaps in a new ReadyEndpoints that
    request handlers read without locks, and wakes the requests waiting for one through
    Changes."""

    def __init__(self, api_client: client.ApiClient, namespace: str, selector: str,
                 port_name: str = "http", resync_seconds: int = 60) -> None:
        self._selector = selector
        self._port_name = port_name
        self._ready = ReadyEndpoints()
        self._changes = Changes()
        self._follower = ListWatch(client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice,
                                   f"EndpointSlices {selector} in {namespace}", self._publish,
                                   resync_seconds, namespace=namespace, label_selector=selector)

    def ready(self) -> ReadyEndpoints:
        return self._ready

    async def changed(self) -> None:
        await self._changes.wait()

    async def start(self) -> None:
        self._changes.bind(asyncio.get_running_loop())
        self._follower.start()
        # So that a restarted router does not turn requests away before it has looked.
        await asyncio.to_thread(self._follower.first_look.wait)

    async def stop(self) -> None:
        self._follower.stop()

    def _publish(self, slices: list[client.V1EndpointSlice]) -> None:
        ready = ready_endpoints(slices, self._port_name)
        if ready == self._ready:
            return
        log.info("ready replicas of %s: %s", self._selector, "; ".join(
            f"{revision or '(no revision)'}: {', '.join(map(str, endpoints)) or 'none'}"
            for revision, endpoints in ready.by_revision.items()) or "none")
        self._ready = ready
        self._changes.notify()
