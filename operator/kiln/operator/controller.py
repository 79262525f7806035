"""One serialized reconcile loop per InferenceService, woken by its own changes and by its
children's, with a long resync as a safety net.

kopf delivers watch events (no finalizer, no bookkeeping annotations); each event only wakes
the loop of the InferenceService it concerns. Wake-ups that arrive while a pass runs fold into
one more pass, so a burst of pod updates costs a pass or two, never one each, and two passes
over one object never overlap. Each pass says when the next one is due regardless (the
builtin autoscaler's tick, or the resync), and is told whether an event woke it or only its
timer (a timer pass may reuse what the last pass read: reconcile.py). Passes run in threads (the Kubernetes client blocks), at most
`workers` at once across all objects. With leader election, passes wait until this replica leads
(`leading`, kept by leader.campaign); wake-ups seen meanwhile are kept, so the new leader passes
over every object it has heard of at once. A pass that waited for a worker slot checks
leadership again before it runs."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from .leader import Leadership

log = logging.getLogger("kiln.operator")

Key = tuple[str, str]  # (namespace, name)
MAX_BACKOFF_S = 60.0


def backoff_s(failures: int) -> float:
    """Seconds before retrying after `failures` failed passes in a row (the exponent is capped:
    2 ** 1024 does not fit a float, and an OverflowError ended the loop for good)."""
    return min(0.5 * 2 ** min(failures, 16), MAX_BACKOFF_S)


class Controller:
    def __init__(self, run_pass: Callable[..., Optional[float]], workers: int = 4,
                 leading: Leadership | None = None, on_gone: Callable[[Key], None] = lambda key: None) -> None:
        """`run_pass(namespace, name, woken=...)` reconciles once and returns the seconds until the
        next pass is due even if nothing wakes it (None: the object is gone); `woken` is False
        for a pass only the timer asked for. `leading`: run passes only while it is set (None:
        always). `on_gone(key)`: after the last pass over an object that is gone, to drop what
        was kept for it."""
        self._run_pass = run_pass
        self._leading = leading
        self._on_gone = on_gone
        self._slots = asyncio.Semaphore(workers)
        self._wake: dict[Key, asyncio.Event] = {}
        self._loops: dict[Key, asyncio.Task] = {}
        self._passes: set[asyncio.Future] = set()  # running in their threads

    def trigger(self, key: Key) -> None:
        """Ask for a pass over `key` soon (starts its loop on first sight)."""
        wake = self._wake.get(key)
        if wake is None:
            wake = self._wake[key] = asyncio.Event()
            ending = self._loops.get(key)  # a deleted namesake's loop, still in its last pass
            self._loops[key] = asyncio.get_running_loop().create_task(self._loop(key, wake, ending))
        wake.set()

    def forget(self, key: Key) -> None:
        """The object is gone: its loop ends after any pass in progress."""
        wake = self._wake.pop(key, None)
        if wake is not None:
            wake.set()

    def known(self) -> list[Key]:
        return sorted(self._wake)

    async def stop(self) -> None:
        """Returns once no pass runs: cancelling a loop does not stop its pass's thread, whose
        writes must land before leader election hands over."""
        for task in self._loops.values():
            task.cancel()
        await asyncio.gather(*self._loops.values(), return_exceptions=True)
        await asyncio.gather(*self._passes, return_exceptions=True)

    async def _loop(self, key: Key, wake: asyncio.Event, ending: asyncio.Task | None) -> None:
        failures, due = 0, 0.0
        try:
            if ending is not None:  # two passes over one name never overlap
                await asyncio.wait({ending})
            while self._wake.get(key) is wake:
                delay = due if failures == 0 else backoff_s(failures)
                try:
                    await asyncio.wait_for(wake.wait(), delay)
                except TimeoutError:
                    pass  # resync, the autoscaler's tick, or retry after a failure
                if self._wake.get(key) is not wake:
                    break
                woken = wake.is_set()  # (a zero timeout raises even when it is set)
                wake.clear()
                if self._leading is not None and not self._leading.held():
                    await self._leading.wait()
                    woken = True  # another replica led meanwhile: what this one read last is old
                    if self._wake.get(key) is not wake:  # deleted while this replica followed
                        break
                async with self._slots:
                    if self._leading is not None and not self._leading.held():
                        wake.set()  # the Lease lapsed while this waited for a slot: wait for it again
                        continue
                    log.debug("%s/%s: pass starts", *key)
                    running = asyncio.ensure_future(asyncio.to_thread(self._run_pass, *key, woken=woken))
                    self._passes.add(running)
                    running.add_done_callback(self._passes.discard)
                    try:
                        next_in = await asyncio.shield(running)
                    except Exception as err:  # noqa: BLE001 - any failure: log, back off, retry
                        failures += 1
                        log.warning("%s/%s: pass failed (%s: %s); retrying in %.1fs", *key,
                                    type(err).__name__, err, backoff_s(failures))
                        continue
                failures = 0
                if next_in is None:
                    # Gone as this pass read it; but a wake-up since (the name made again) asks for
                    # another pass, and a successor's loop is not this one's to end.
                    if self._wake.get(key) is wake and not wake.is_set():
                        self.forget(key)
                else:
                    due = next_in
        finally:
            if self._loops.get(key) is asyncio.current_task():  # not a successor's loop
                del self._loops[key]
            if self._wake.get(key) is not wake:  # gone, not stopped
                self._on_gone(key)
