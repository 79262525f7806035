"""The cold start's phase timer (kiln.engine.startup) as a unit: on a clock the test moves by hand,
in the worker threads the server loads in, and the process's own start time."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from kiln.engine import startup


class Clock:
    """time.perf_counter as the test sets it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(startup.time, "perf_counter", clock)
    return clock


def test_a_nested_phase_is_counted_once_and_time_outside_phases_only_in_the_total(clock: Clock) -> None:
    timer = startup.StartupTimer(started=clock.now - 0.5)
    clock.now += 1  # in no phase
    with timer.phase("weights_read"):
        clock.now += 2
        with timer.phase("quantize"):
            clock.now += 3
        clock.now += 4
    with timer.phase("quantize"):  # a phase entered twice adds up
        clock.now += 5
    assert timer.ready() == {"process_start": 0.0, "imports": 0.0, "weights_read": 6.0, "quantize": 8.0,
                             "kv_alloc": 0.0, "cuda_graphs": 0.0, "warmup": 0.0, "total": 15.5}


def test_a_phase_left_by_an_exception_stops_counting(clock: Clock) -> None:
    timer = startup.StartupTimer()
    with pytest.raises(RuntimeError), timer.phase("kv_alloc"):
        clock.now += 1
        raise RuntimeError("out of memory")
    clock.now += 10
    assert timer.seconds["kv_alloc"] == 1.0


def test_unknown_phase_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown startup phase 'load'"):
        with startup.StartupTimer().phase("load"):
            pass


def test_every_phase_the_engine_opens_is_known() -> None:
    """model_runner opened "cuda_graphs", not in PHASES: `kiln serve` on a GPU raised at start
    (a timer is current only in the server, so LLM and the CPU tests never saw it)."""
    import re
    from pathlib import Path
    sources = Path(startup.__file__).parent.rglob("*.py")
    opened = {name for path in sources for name in re.findall(r'startup\.phase\("([a-z_]+)"\)', path.read_text())}
    assert "cuda_graphs" in opened and opened <= set(startup.PHASES), opened - set(startup.PHASES)


def test_phase_counts_on_the_current_timer_in_worker_threads_and_nowhere_without_one(clock: Clock) -> None:
    @startup.phase("weights_read")
    def load() -> None:
        clock.now += 2
        with startup.phase("quantize"):
            clock.now += 1

    load()  # no current timer: timed by nothing, and no error
    timer = startup.StartupTimer()

    async def serve() -> None:  # what Server.load does
        with startup.timing(timer):
            await asyncio.to_thread(load)

    asyncio.run(serve())
    assert (timer.seconds["weights_read"], timer.seconds["quantize"]) == (2.0, 1.0)


def test_process_age_counts_from_the_process_start() -> None:
    # A fresh interpreter that waits 0.5 s before it asks: its age covers the wait, and not much more.
    code = "import time; time.sleep(0.5); from kiln.engine.startup import process_age; print(process_age())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 5.0


def test_a_timer_for_this_process_has_counted_its_start_and_imports() -> None:
    timer = startup.StartupTimer.for_this_process()
    phases = timer.ready()
    assert phases["process_start"] > 0 and phases["imports"] >= 0
    assert phases["total"] == pytest.approx(phases["process_start"] + phases["imports"], abs=0.05)
