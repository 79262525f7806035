"""How requests split between an InferenceService's revisions during a rollout. The operator
writes each revision's weight, and what the quality gate mirrors, into the InferenceService's
status; the router follows that object and never its spec (so a GitOps tool never sees a
diff). Without weights every ready replica is alike, as before rollouts existed."""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Mirror:
    sample_rate: float  # share of requests mirrored for the quality gate
    floor_sample_rate: float  # share of those also scored by a stable replica (the noise floor)


@dataclass(frozen=True)
class Traffic:
    weights: Mapping[str, int] | None = None  # percent by revision; None: no split
    stable: str | None = None
    canary: str | None = None
    mirror: Mirror | None = None
    # False until the InferenceService was read: with several revisions ready, which of them may
    # take requests (a canary at weight 0?) is not known yet.
    known: bool = True


def traffic_of(status: Mapping[str, Any] | None) -> Traffic:
    """The split an InferenceService's status asks for."""
    status = status or {}
    revisions = status.get("revisions") or []
    weights = {r["name"]: int(r["weight"]) for r in revisions if r.get("weight") is not None}
    rollout = status.get("rollout") or {}
    mirror = rollout.get("mirror")
    canary = rollout.get("canary") if rollout.get("phase") in ("Progressing", "Paused") else None
    return Traffic(weights or None, rollout.get("stable"), canary,
                   Mirror(float(mirror["sampleRate"]), float(mirror["floorSampleRate"]))
                   if mirror and canary else None)


def split_unknown(traffic: Traffic, ready: Mapping[str, Sequence[object]]) -> bool:
    """The InferenceService not read yet (the API server did not answer as the router started)
    while several revisions have ready replicas (`ready`, by revision): one may be a canary at
    weight 0, so requests are held until the split is known rather than spread over all of them."""
    return not traffic.known and sum(1 for endpoints in ready.values() if endpoints) > 1


class TrafficSource(Protocol):
    def current(self) -> Traffic:
        """The split now; cheap, read on every request."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class StaticTraffic:
    """A split that only changes when told (no InferenceService: --endpoints, tests)."""
    traffic: Traffic = field(default_factory=Traffic)

    def current(self) -> Traffic:
        return self.traffic

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class InferenceServiceTraffic:
    """Follows one InferenceService's status (a ListWatch thread)."""

    def __init__(self, api_client: Any, namespace: str, name: str) -> None:
        # Only routers in a cluster need the Kubernetes client.
        from kubernetes import client

        from kiln.router.watching import ListWatch

        self._traffic = Traffic(known=False)  # the API server may not answer the first list
        self._follower = ListWatch(
            client.CustomObjectsApi(api_client).list_namespaced_custom_object,
            f"InferenceService {namespace}/{name}", self._publish, group="kiln.dev", version="v1alpha1",
            namespace=namespace, plural="inferenceservices", field_selector=f"metadata.name={name}")

    def current(self) -> Traffic:
        return self._traffic

    async def start(self) -> None:
        self._follower.start()
        await asyncio.to_thread(self._follower.first_look.wait)

    async def stop(self) -> None:
        self._follower.stop()

    def _publish(self, objects: list[dict[str, Any]]) -> None:
        self._traffic = traffic_of(objects[0].get("status") if objects else None)


class WeightedChoice:
    """Smooth weighted round-robin (nginx's): over any run of requests each revision's share
    stays within one request of its weight, without randomness."""

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def choose(self, weights: Mapping[str, int]) -> str | None:
        """A revision among those with a positive weight; None when there is none."""
        live = {r: w for r, w in weights.items() if w > 0}
        if not live:
            return None
        for revision, weight in live.items():
            self._current[revision] = self._current.get(revision, 0.0) + weight
        chosen = max(sorted(live), key=lambda r: self._current[r])
        self._current[chosen] -= sum(live.values())
        # Forget revisions that left, so a returning one starts fresh.
        self._current = {r: c for r, c in self._current.items() if r in live}
        return chosen
