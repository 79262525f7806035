"""Leader election on a coordination.k8s.io Lease, so that of several operator replicas only one
reconciles (client-go's leaderelection, in small).

Every replica runs kopf and its watches; only the Lease's holder runs reconcile passes
(controller.py waits on `leading`). The holder renews every RETRY_S; a follower takes the Lease
once it has seen the same record unchanged for LEASE_S by its own clock (never by comparing the
holder's timestamps to its clock, so skewed clocks are harmless). A holder that cannot renew for
RENEW_DEADLINE_S (< LEASE_S) stops leading before anyone else may start. A holder that stops
cleanly releases the Lease, so the next one takes over on its next try.

Hand-over after the leader dies: at most HANDOVER_S. The follower first sees the leader's last
record within a retry of the kill (either side: renewals are a retry apart), waits LEASE_S from
that sight, then up to a retry for its next try: 13-19 s from the kill. After a clean stop: one
retry."""
from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("kiln.operator")

LEASE_S = 15
RENEW_DEADLINE_S = 10.0
RETRY_S = 2.0
HANDOVER_S = LEASE_S + 2 * RETRY_S  # the bound after a crash (above)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class LeaseElector:
    """One candidate for the Lease namespace/name; `identity` must be unique among candidates."""

    def __init__(self, coordination: client.CoordinationV1Api, namespace: str, name: str, identity: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.namespace, self.name, self.identity = coordination, namespace, name, identity
        self._clock = clock
        self._seen: tuple[str | None, object] | None = None  # (holder, renewTime) last read
        self._seen_at = 0.0
        # A renewal still running in its thread when the operator stops must not race the release
        # (its write would turn the release into a 409, and the Lease would have to expire).
        self._lock = threading.Lock()
        self._released = False

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this candidate holds the Lease afterwards. A conflicting
        write (another candidate won the race) is a plain False; after release(), always False."""
        with self._lock:
            return not self._released and self._try()

    def _try(self) -> bool:
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as err:
            if err.status != 404:
                raise
            return self._write(None)
        spec = lease.spec or client.V1LeaseSpec()
        record = (spec.holder_identity, spec.renew_time)
        if record != self._seen:
            self._seen, self._seen_at = record, self._clock()
        holder = spec.holder_identity
        if holder and holder != self.identity and self._clock() - self._seen_at < (spec.lease_duration_seconds or LEASE_S):
            return False
        return self._write(lease)

    def _write(self, lease: client.V1Lease | None) -> bool:
        now = _now()
        spec = lease.spec if lease is not None and lease.spec else client.V1LeaseSpec()
        if spec.holder_identity != self.identity:  # taking it over
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + (lease is not None)
        spec.holder_identity, spec.renew_time, spec.lease_duration_seconds = self.identity, now, LEASE_S
        try:
            if lease is None:
                self.api.create_namespaced_lease(self.namespace, client.V1Lease(
                    metadata=client.V1ObjectMeta(name=self.name), spec=spec))
            else:  # replace carries resourceVersion: a write that raced another fails with 409
                lease.spec = spec
                self.api.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as err:
            if err.status == 409:
                return False
            raise
        return True

    def release(self) -> None:
        """Give the Lease up if held, so a follower need not wait for it to expire; this candidate
        tries no more."""
        with self._lock:
            self._released = True
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity, lease.spec.lease_duration_seconds = None, 1
            try:
                self.api.replace_namespaced_lease(self.name, self.namespace, lease)
            except ApiException as err:
                if err.status != 409:  # another candidate took it meanwhile: nothing left to give up
                    raise


class NotLeading(RuntimeError):
    """A pass that began while leading met a lapsed Lease before a write."""


class Leadership:
    """Whether this replica may reconcile now: it renewed the Lease less than RENEW_DEADLINE_S
    ago by the monotonic clock. Judged at each pass, not only when the campaign next runs, so a
    replica frozen past its Lease (SIGSTOP, a stalled node) runs no pass when it wakes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._renewed: float | None = None
        self._changed = asyncio.Event()

    def renewed(self, tried_at: float) -> None:
        """A renewal that began at `tried_at` (by `clock`) succeeded. Its start, not its end: the
        write may have landed long before a slow answer came, and followers count from the write."""
        self._renewed = tried_at
        self._changed.set()

    def held(self) -> bool:
        return self._renewed is not None and self.clock() - self._renewed < RENEW_DEADLINE_S

    def check(self) -> None:
        """NotLeading unless held(): a pass checks before each write (Api.fence)."""
        if not self.held():
            raise NotLeading("the Lease lapsed during this pass: it writes nothing more")

    def ever(self) -> bool:
        return self._renewed is not None

    async def wait(self) -> None:
        """Until held()."""
        while not self.held():
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), RETRY_S)
            except TimeoutError:
                pass


# The API server's verdict on this Lease itself (forbidden by RBAC, its namespace missing, a name
# it refuses): trying again changes nothing, and a replica that never leads looks like a follower.
REFUSED = (401, 403, 404, 422)


async def campaign(elector: LeaseElector, leading: Leadership, lost: Callable[[str], None]) -> None:
    """Take the Lease and keep it renewed. When a leader's renewal fails past RENEW_DEADLINE_S,
    call `lost(why)` (the operator then exits, as client-go's controllers do: a fresh start is the
    only safe way back to following); so too when the API server refuses the Lease itself."""
    where = f"Lease {elector.namespace}/{elector.name}"
    log.info("leader election: %s waits for %s", elector.identity, where)
    while True:
        tried_at = leading.clock()
        try:
            held = await asyncio.to_thread(elector.try_acquire_or_renew)
        except ApiException as err:
            if err.status in REFUSED:
                why = f"the API server refuses {where}: {err.status} {err.reason}"
                log.error("leader election: %s", why)
                lost(why)
                return
            log.warning("leader election: %s: %s", where, err)
            held = False
        except Exception as err:  # noqa: BLE001 - an unreachable API server is a failed try
            log.warning("leader election: %s: %s", where, err)
            held = False
        if held:
            if not leading.held():
                log.info("leader election: %s leads (Lease %s/%s)", elector.identity, elector.namespace, elector.name)
            leading.renewed(tried_at)
        elif leading.ever() and not leading.held():
            log.error("leader election: %s lost %s; stopping", elector.identity, where)
            lost(f"lost the leader {where}; exiting so a fresh start follows again")
            return
        await asyncio.sleep(RETRY_S)
