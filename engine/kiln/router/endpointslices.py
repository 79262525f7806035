"""Ready replicas from EndpointSlices, by revision. The operator makes one headless Service
per engine revision, labelled with the revision; Kubernetes copies a Service's labels onto
its slices, so one label selector finds every revision's slices. Kubernetes already folds
pod readiness (and termination) into `conditions.ready`, so the router never probes pods."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable

from kubernetes import client, watch

from kiln.router.endpoints import Changes, Endpoint, ReadyEndpoints

log = logging.getLogger("kiln.router")

REVISION_LABEL = "kiln.dev/revision"  # set by the operator on each revision's Service
RETRY_SECONDS = 2.0  # after an API error; the last known replicas keep serving meanwhile


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
    """Lists the selected slices, then watches them; a thread does the blocking client
    calls, swaps in a new ReadyEndpoints that request handlers read without locks, and
    wakes the requests waiting for one through Changes."""

    def __init__(self, api_client: client.ApiClient, namespace: str, selector: str,
                 port_name: str = "http", resync_seconds: int = 60) -> None:
        self._api = client.DiscoveryV1Api(api_client)
        self._namespace = namespace
        self._selector = selector
        self._port_name = port_name
        self._resync_seconds = resync_seconds
        self._slices: dict[str, client.V1EndpointSlice] = {}
        self._ready = ReadyEndpoints()
        self._changes = Changes()
        self._first_look = threading.Event()  # the first list answered, or failed
        self._stopping = threading.Event()
        self._watch = watch.Watch()

    def ready(self) -> ReadyEndpoints:
        return self._ready

    async def changed(self) -> None:
        await self._changes.wait()

    async def start(self) -> None:
        self._changes.bind(asyncio.get_running_loop())
        threading.Thread(target=self._follow, name=f"endpointslices[{self._selector}]",
                         daemon=True).start()
        # So that a restarted router does not turn requests away before it has looked.
        await asyncio.to_thread(self._first_look.wait)

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
                self._first_look.set()
                if self._stopping.is_set():
                    return  # stop() cut the watch short
                log.warning("EndpointSlices %s in %s: %s; retrying in %.0fs", self._selector,
                            self._namespace, exc, RETRY_SECONDS)
                self._stopping.wait(RETRY_SECONDS)

    def _list_then_watch(self) -> None:
        listed = self._api.list_namespaced_endpoint_slice(
            self._namespace, label_selector=self._selector, _request_timeout=30)
        self._slices = {s.metadata.name: s for s in listed.items}
        self._publish()
        self._first_look.set()
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
        ready = ready_endpoints(self._slices.values(), self._port_name)
        if ready == self._ready:
            return
        log.info("ready replicas of %s: %s", self._selector, "; ".join(
            f"{revision or '(no revision)'}: {', '.join(map(str, endpoints)) or 'none'}"
            for revision, endpoints in ready.by_revision.items()) or "none")
        self._ready = ready
        self._changes.notify()
