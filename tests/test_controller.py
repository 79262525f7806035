"""The per-object reconcile loop (kiln.operator.controller) on a real event loop, with a recording
pass in place of reconcile: it tells a pass an event asked for from one only its timer asked for
(a timer pass may reuse the last read; an event's must read afresh)."""
from __future__ import annotations

import asyncio

from kiln.operator.controller import Controller
from kiln.operator.leader import RENEW_DEADLINE_S, Leadership


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
        leading.renewed()
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
        leading.renewed()
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
