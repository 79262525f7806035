"""The per-object reconcile loop (kiln.operator.controller) on a real event loop, with a recording
pass in place of reconcile: it tells a pass an event asked for from one only its timer asked for
(a timer pass may reuse the last read; an event's must read afresh)."""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import kubernetes
import pytest
import urllib3

from kiln.operator import controller as controller_module
from kiln.operator import leader
from kiln.operator import main as operator_main
from kiln.operator.api import Api, timed
from kiln.operator.controller import Controller
from kiln.operator.leader import RENEW_DEADLINE_S, Leadership, NotLeading, campaign
from kiln.operator.plan import SCALE, Action
from kiln.operator.reconcile import Settings, execute, patch_pod, post_event, report
from kiln.operator.render import Owner


def test_a_pass_is_told_whether_an_event_or_its_timer_woke_it():
    seen: list[bool] = []  # each pass's `woken`, in order

    def run_pass(namespace: str, name: str, woken: bool) -> float:
        seen.append(woken)
        return 0.05  # the next pass is due soon, event or not

    async def passes(n: int) -> None:
        while len(seen) < n:
            await asyncio.sleep(0.01)

    async def scenario() -> int:
        controller = Controller(run_pass)
        controller.trigger(("ns", "a"))  # first sight: a watch event
        await asyncio.wait_for(passes(3), 10)
        event_at = len(seen)
        controller.trigger(("ns", "a"))
        await asyncio.wait_for(passes(event_at + 3), 10)
        await controller.stop()
        return event_at

    event_at = asyncio.run(scenario())
    assert seen[:3] == [True, False, False]
    # one pass for the event (a timer pass under way when it came may finish first), then the timer's
    assert seen[event_at:].count(True) == 1 and seen[-1] is False


def test_a_timer_pass_that_waited_for_leadership_reads_afresh():
    """Meanwhile another replica may have led and changed things."""
    async def scenario() -> list[bool]:
        seen: list[bool] = []
        clock = [0.0]
        leading = Leadership(clock=lambda: clock[0])
        leading.renewed(clock[0])
        second = asyncio.Event()

        def run_pass(namespace: str, name: str, woken: bool) -> float:
            seen.append(woken)
            clock[0] += RENEW_DEADLINE_S + 1  # the Lease lapses after the first pass
            if len(seen) == 2:
                second.set()
            return 0.05

        controller = Controller(run_pass, leading=leading)
        controller.trigger(("ns", "a"))
        async with asyncio.timeout(10):  # a thread runs the first pass: waited for, however busy the machine
            while not seen:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the timer's pass is due, and waits for leadership
        assert seen == [True]
        leading.renewed(clock[0])
        await asyncio.wait_for(second.wait(), 10)
        await controller.stop()
        return seen

    assert asyncio.run(scenario()) == [True, True]


def test_the_operator_watches_only_its_children_in_pages():
    # The handlers' label filter ran in the operator: it listed (unpaged) and watched every pod,
    # Deployment and Service of the cluster, one by one.
    from kiln.operator.main import CHILDREN, build_settings
    from kiln.operator.render import LABEL_ISVC
    settings = build_settings()
    selected = {(s.group, s.version, s.any_name): v for s, v in settings.watching.label_selectors.items()}
    assert selected == {child: LABEL_ISVC for child in CHILDREN} and settings.watching.chunk_size == 500


def test_a_long_run_of_failed_passes_does_not_end_the_loop(monkeypatch):
    """The backoff's 2 ** failures overflowed a float at 1024 failures in a row (17 hours at the
    60 s cap): the loop ended and the object was never reconciled again."""
    monkeypatch.setattr(controller_module, "MAX_BACKOFF_S", 1e-4)
    calls = []

    def run_pass(namespace: str, name: str, woken: bool) -> float:
        calls.append(woken)
        if len(calls) <= 1100:
            raise RuntimeError("the API server says no")
        return 60.0

    async def scenario() -> None:
        controller = Controller(run_pass)
        controller.trigger(("ns", "a"))
        async with asyncio.timeout(120):
            while len(calls) <= 1100:
                await asyncio.sleep(0.01)
        await controller.stop()

    asyncio.run(scenario())
    assert len(calls) == 1101


def test_stop_returns_only_once_the_running_pass_has_finished():
    """Cancelling a loop leaves its pass running in its thread; the operator released the Lease
    while that pass still wrote, and the next leader's writes raced it."""
    started, go, finished = threading.Event(), threading.Event(), threading.Event()

    def run_pass(namespace: str, name: str, woken: bool) -> float:
        started.set()
        go.wait(timeout=10)
        finished.set()
        return 60.0

    async def scenario() -> None:
        controller = Controller(run_pass)
        controller.trigger(("ns", "a"))
        assert await asyncio.to_thread(started.wait, 10)
        stopping = asyncio.create_task(controller.stop())
        await asyncio.sleep(0.2)
        assert not stopping.done()
        go.set()
        await asyncio.wait_for(stopping, 10)
        assert finished.is_set()

    asyncio.run(scenario())


def test_a_recreated_namesakes_pass_waits_for_the_deleted_ones_and_state_is_dropped_after_it():
    """Deleted and made again under the same name while a pass ran: the new object's loop started
    a second pass alongside. And what passes keep per object is dropped after the last pass (a
    pass still running when the deletion came kept it again), not at the deletion, and not when
    the operator merely stops."""
    running, overlaps, gone = [0], [], []
    first, go = threading.Event(), threading.Event()

    def run_pass(namespace: str, name: str, woken: bool) -> float:
        running[0] += 1
        overlaps.append(running[0])
        first.set()
        go.wait(timeout=10)
        running[0] -= 1
        return 60.0

    async def scenario() -> None:
        controller = Controller(run_pass, on_gone=lambda key: gone.append((key, running[0])))
        controller.trigger(("ns", "a"))
        assert await asyncio.to_thread(first.wait, 10)
        controller.forget(("ns", "a"))  # deleted...
        controller.trigger(("ns", "a"))  # ...and made again
        await asyncio.sleep(0.3)
        assert overlaps == [1] and gone == []
        go.set()
        async with asyncio.timeout(10):
            while len(overlaps) < 2:
                await asyncio.sleep(0.01)
        await controller.stop()

    asyncio.run(scenario())
    assert overlaps == [1, 1]
    assert gone == [(("ns", "a"), 0)]  # once, after the deleted one's pass; not at stop()


def test_a_name_made_again_while_a_pass_found_it_gone_is_reconciled():
    """The pass that found the object gone (404) ended the loop by name: it took the recreated
    object's wake-up (or its successor loop's) with it, and the new object got no pass at all."""
    calls, first = [], threading.Event()
    go = threading.Event()

    def run_pass(namespace: str, name: str, woken: bool) -> float | None:
        calls.append(woken)
        if len(calls) == 1:
            first.set()
            go.wait(timeout=10)
            return None  # it read a 404
        return 60.0

    async def scenario(delete_first: bool) -> None:
        calls.clear()
        first.clear()
        go.clear()
        controller = Controller(run_pass)
        controller.trigger(("ns", "a"))
        assert await asyncio.to_thread(first.wait, 10)
        if delete_first:  # the DELETED event, then the new object's: a successor loop
            controller.forget(("ns", "a"))
        controller.trigger(("ns", "a"))  # made again (or, without the DELETED seen yet, a wake-up)
        go.set()
        async with asyncio.timeout(10):
            while len(calls) < 2:
                await asyncio.sleep(0.01)
        await controller.stop()

    for delete_first in (True, False):
        asyncio.run(scenario(delete_first))
        assert len(calls) == 2, delete_first


def test_a_pass_waiting_for_a_worker_slot_checks_leadership_again():
    """Queued behind another object's pass while the Lease lapsed (a frozen replica waking): it
    ran anyway, alongside the new leader."""
    clock = [0.0]
    leading = Leadership(clock=lambda: clock[0])
    leading.renewed(clock[0])
    ran, go = [], threading.Event()

    def run_pass(namespace: str, name: str, woken: bool) -> float:
        ran.append(name)
        if name == "a":
            go.wait(timeout=10)
        return 60.0

    async def scenario() -> None:
        controller = Controller(run_pass, workers=1, leading=leading)
        controller.trigger(("ns", "a"))
        async with asyncio.timeout(10):
            while not ran:
                await asyncio.sleep(0.01)
        controller.trigger(("ns", "b"))  # waits for the one slot
        await asyncio.sleep(0.2)
        clock[0] += RENEW_DEADLINE_S + 1
        go.set()
        await asyncio.sleep(0.5)
        assert ran == ["a"]
        leading.renewed(clock[0])  # leads again: b's pass runs
        async with asyncio.timeout(10):
            while "b" not in ran:
                await asyncio.sleep(0.01)
        await controller.stop()

    asyncio.run(scenario())


def test_a_slow_renewal_counts_from_when_it_was_tried():
    """A renewal whose answer came 20 s after it was sent re-armed leadership for another
    RENEW_DEADLINE_S, though followers count the Lease from the write: two leaders at once."""
    clock = [0.0]
    leading = Leadership(clock=lambda: clock[0])

    class SlowElector:
        namespace, name, identity = "kiln-system", "lease", "me"

        def try_acquire_or_renew(self) -> bool:
            clock[0] += 20.0
            return True

    async def scenario() -> None:
        task = asyncio.create_task(campaign(SlowElector(), leading, lambda why: None))
        async with asyncio.timeout(10):
            while not leading.ever():
                await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(scenario())
    assert not leading.held()


def test_an_api_call_on_a_connection_that_never_answers_times_out():
    """The Kubernetes client sets no timeout of its own: a dead connection blocked a pass for good."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        host, port = silent.getsockname()
        client = timed(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=f"http://{host}:{port}")),
                       (1.0, 1.0))
        started = time.monotonic()
        with pytest.raises(urllib3.exceptions.HTTPError):
            kubernetes.client.CoreV1Api(client).read_namespace("default")
        assert time.monotonic() - started < 10


def test_a_pass_that_outlives_its_lease_writes_nothing_more():
    """Leadership was checked only as a pass began: one frozen (or slowed by a stalled API call)
    past its Lease woke and went on writing, beside the new leader. Each write checks it now."""
    clock = [0.0]
    leading = Leadership(clock=lambda: clock[0])
    leading.renewed(0.0)
    nowhere = kubernetes.client.Configuration()
    nowhere.host = "http://127.0.0.1:9"  # nothing listens: a write that got past the fence would say so
    api = dataclasses.replace(Api.of(kubernetes.client.ApiClient(nowhere)), fence=leading.check)
    api.fence()  # leading: no objection
    clock[0] += RENEW_DEADLINE_S + 1
    owner = Owner("a", "ns", "uid-a")
    body = {"metadata": {"name": "a", "namespace": "ns", "uid": "uid-a"}}
    writes = [lambda: execute(api, owner, Action(SCALE, "Deployment", "a-1", replicas=2)),
              lambda: post_event(api, body, "Normal", "Scaled", "x"),
              lambda: patch_pod(api, owner, "a-1-x", {"metadata": {"labels": {}}}),
              lambda: report(api, body, {}, {"replicas": 1}, Settings("engine:test"))]
    for write in writes:
        with pytest.raises(NotLeading):
            write()


def test_a_stopping_leader_keeps_its_lease_until_its_passes_have_written(monkeypatch):
    """The stop handler cancelled the Lease's renewal before it waited for the running passes:
    the Lease lapsed while they still wrote, and its release was skipped."""
    monkeypatch.setattr(leader, "RETRY_S", 0.05)
    # Scaled down: a pass outlasts it. 2 s, not 0.5: a renewal held up that long by a busy CPU
    # lapsed the Lease, and a write of the pass (or the release) was refused.
    monkeypatch.setattr(leader, "RENEW_DEADLINE_S", 2.0)
    renewals, writes, released, started = [], [], [], threading.Event()

    class Elector:
        namespace, name, identity = "kiln-system", "kiln-operator", "me"

        def try_acquire_or_renew(self) -> bool:
            renewals.append(time.monotonic())
            return True

        def release(self) -> None:
            released.append(True)

    def slow_pass(api, namespace, name, settings, woken=True):
        started.set()
        for _ in range(6):
            time.sleep(0.5)
            api.fence()  # as each write does
            writes.append(time.monotonic())
        return 60.0

    monkeypatch.setattr(operator_main, "reconcile", slow_pass)
    handlers = operator_main.build_registry(Api.of(kubernetes.client.ApiClient()), Settings("engine:test"), Elector())
    activities = {h.id: h.fn for h in handlers._activities.get_all_handlers()}
    watching = {h.id: h.fn for h in handlers._watching.get_all_handlers()}

    async def scenario() -> None:
        await activities["leader-election"]()
        await asyncio.sleep(0.2)
        await watching["inferenceservice"](event={"type": "ADDED"}, namespace="ns", name="a",
                                           meta={"resourceVersion": "1", "uid": "u"})
        await asyncio.to_thread(started.wait, 5)
        await activities["stop"]()

    asyncio.run(scenario())
    assert len(writes) == 6 and released == [True]


def test_a_namesakes_late_deletion_does_not_end_the_new_ones_loop(monkeypatch):
    """kopf handles each uid's events in its own task: the new namesake's ADDED may come before
    the old one's DELETED, which then ended the loop of the object that exists."""
    passes: list[str] = []
    monkeypatch.setattr(operator_main, "reconcile", lambda api, ns, name, settings, woken=True:
                        passes.append(name) or 0.05)
    handlers = operator_main.build_registry(Api.of(kubernetes.client.ApiClient()), Settings("engine:test"))
    on_service = {h.id: h.fn for h in handlers._watching.get_all_handlers()}["inferenceservice"]
    stop = {h.id: h.fn for h in handlers._activities.get_all_handlers()}["stop"]

    async def scenario() -> int:
        await on_service(event={"type": "ADDED"}, namespace="ns", name="a", meta={"resourceVersion": "1", "uid": "old"})
        await on_service(event={"type": "ADDED"}, namespace="ns", name="a", meta={"resourceVersion": "2", "uid": "new"})
        await on_service(event={"type": "DELETED"}, namespace="ns", name="a", meta={"resourceVersion": "3", "uid": "old"})
        seen = len(passes)
        # Its resync passes (every 0.05 s) go on; an ended loop would run none and time out here.
        async with asyncio.timeout(10):
            while len(passes) < seen + 3:
                await asyncio.sleep(0.01)
        await stop()
        return len(passes) - seen

    assert asyncio.run(scenario()) >= 3


def test_a_follower_drops_the_loop_of_an_object_deleted_meanwhile():
    """A loop parked waiting for leadership outlived its object's deletion, and ran a pass over
    every such name once this replica led."""
    leading, ran = Leadership(), []

    async def scenario() -> None:
        controller = Controller(lambda namespace, name, woken: ran.append(name) or 60.0, leading=leading)
        controller.trigger(("ns", "gone"))
        await asyncio.sleep(0.1)
        controller.forget(("ns", "gone"))
        leading.renewed(leading.clock())
        await asyncio.sleep(0.3)
        assert controller.known() == [] and not controller._loops
        await controller.stop()

    asyncio.run(scenario())
    assert ran == []
