"""Where the cold start of `kiln serve` goes. The process starts, imports its modules, reads the
weights, quantizes them (a GGUF's blocks dequantized, or made Kiln's packed modules, a variant
computed or read from its cache), allocates the KV cache and runs a warm-up generation; then it is
ready.

The server makes one StartupTimer current while it loads (`timing`); the loader and the engine name
what they are doing with `phase(...)`, which times nothing when no timer is current (`LLM`, `kiln
generate`, tests). The clock runs for the innermost open phase only, so a dequantize inside the
weight read counts as quantize and not twice: the phases never overlap, and add up to at most the
total."""
from __future__ import annotations

import contextlib
import contextvars
import os
import time
from pathlib import Path
from typing import Iterator

PHASES = ("process_start", "imports", "weights_read", "quantize", "kv_alloc", "cuda_graphs", "warmup")
# `kiln serve` imports this module before anything else (kiln.engine.server): from here on, the
# process is importing the server's modules.
_IMPORTED_AT = time.perf_counter()


def process_age() -> float:
    """Seconds since this process started: /proc/self/stat's start time, counted in clock ticks
    since boot (10 ms each), against CLOCK_BOOTTIME. 0 where there is no /proc."""
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return 0.0
    # starttime is field 22; the command name (field 2) may hold spaces, so count after its ')'.
    ticks = int(stat.rpartition(")")[2].split()[19])
    return max(time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


class StartupTimer:
    """Seconds spent in each phase of PHASES, and the total from the start until ready()."""

    def __init__(self, started: float | None = None) -> None:
        """started: the start, on time.perf_counter's clock (default: now)."""
        now = time.perf_counter()
        self.started = now if started is None else started
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._open: list[str] = []  # the phases open now, innermost last
        self._since = now  # when the clock last moved from one phase to another

    @classmethod
    def for_this_process(cls) -> StartupTimer:
        """A timer that started with the process, with process_start (until this module was
        imported) and imports (from then until now) already counted."""
        now = time.perf_counter()
        timer = cls(started=now - process_age())
        # The process's start time is known to a clock tick: never let that make a phase negative.
        timer.seconds["process_start"] = max(_IMPORTED_AT - timer.started, 0.0)
        timer.seconds["imports"] = now - max(_IMPORTED_AT, timer.started)
        timer._since = now
        return timer

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time in this block as `name`, less the time in phases opened inside it."""
        if name not in self.seconds:
            raise ValueError(f"unknown startup phase {name!r} (known: {', '.join(PHASES)})")
        self._switch()
        self._open.append(name)
        try:
            yield
        finally:
            self._switch()
            self._open.pop()

    def ready(self) -> dict[str, float]:
        """Every phase's seconds, and the total from the start until now."""
        return {**self.seconds, "total": time.perf_counter() - self.started}

    def _switch(self) -> None:
        """Count the time since the last switch for the innermost open phase, if any."""
        now = time.perf_counter()
        if self._open:
            self.seconds[self._open[-1]] += now - self._since
        self._since = now


_current: contextvars.ContextVar[StartupTimer | None] = contextvars.ContextVar("startup_timer", default=None)


@contextlib.contextmanager
def timing(timer: StartupTimer) -> Iterator[StartupTimer]:
    """Make timer the one phase() counts for, in this context and in the threads that
    asyncio.to_thread starts from it (they run in a copy of the context)."""
    token = _current.set(timer)
    try:
        yield timer
    finally:
        _current.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the block (or, as a decorator, each call) as `name` on the current timer, if any."""
    timer = _current.get()
    if timer is None:
        yield
        return
    with timer.phase(name):
        yield


def describe(seconds: dict[str, float]) -> str:
    """'process_start 0.04s, imports 2.10s, ..., total 3.95s' for the log."""
    return ", ".join(f"{name} {value:.2f}s" for name, value in seconds.items())
