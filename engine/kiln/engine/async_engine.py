"""Runs an LLMEngine in a background thread beside the server's asyncio loop.

Only the engine thread touches the engine: the loop sends it commands (add, abort) through a
queue, and it hands each step's outputs back with one call_soon_threadsafe per step. Each
request's outputs land in its own asyncio.Queue, so many HTTP handlers share one batch."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.engine import LLMEngine, RequestOutput, SamplingParams
from kiln.engine.metrics import ServerMetrics

log = logging.getLogger("kiln.serve")


class QueueFullError(Exception):
    pass


class EngineDeadError(Exception):
    pass


@dataclass
class RequestStream:
    """What a handler reads: the engine's outputs for one request, in order."""
    request_id: str
    arrival: float
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | Exception
    started: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queue: int) -> None:
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self._loop = asyncio.get_running_loop()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched only on the loop thread
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)

    @property
    def num_waiting(self) -> int:
        """Admitted requests the engine has not run yet (bounded by --max-queue)."""
        return sum(not s.started for s in self._streams.values())

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> RequestStream:
        """Admit a request; ValueError if the engine rejects it, QueueFullError if too many wait."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread has stopped")
        if self.num_waiting >= self.max_queue:
            raise QueueFullError(f"too many requests waiting ({self.max_queue}); retry later")
        stream = RequestStream(request_id, time.perf_counter())
        self._streams[request_id] = stream
        added = self._loop.create_future()
        self._commands.put(("add", request_id, prompt, params, added))
        try:
            await added
        except asyncio.CancelledError:  # client gone while queued: the add still runs, so undo it
            self.abort(request_id)
            raise
        except Exception:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps (sleep, wake_up); its result or exception."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread has stopped")
        done = self._loop.create_future()
        self._commands.put(("call", fn, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone) and free its KV blocks. Safe to call more than once."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self.metrics.request_success["abort"].inc()
            self._commands.put(("abort", request_id))

    # ---- engine thread ----

    def _run(self) -> None:
        while True:
            # Sleep on the command queue only when there is nothing to step.
            for cmd in self._drain_commands(block=not self.engine.has_unfinished_requests()):
                if cmd is None:
                    return
                self._execute(cmd)
            if self.engine.has_unfinished_requests():
                self._step()
            self.metrics.record_engine_stats(self.engine.stats())

    def _drain_commands(self, block: bool) -> list:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _execute(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
            return
        if cmd[0] == "call":
            _, fn, done = cmd
            try:
                self._loop.call_soon_threadsafe(_resolve, done, fn(), None)
            except Exception as e:
                self._loop.call_soon_threadsafe(_resolve, done, None, e)
            return
        _, request_id, prompt, params, added = cmd
        try:
            self.engine.add_request(request_id, prompt, params)
            self._loop.call_soon_threadsafe(_resolve, added, None, None)
        except Exception as e:  # ValueError for bad input; anything else is still this request's error
            self._loop.call_soon_threadsafe(_resolve, added, None, e)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            # A failed step leaves no request trustworthy: fail them all, keep serving new ones.
            log.exception("engine step failed; aborting the running requests")
            self._loop.call_soon_threadsafe(self._fail_all, e)
            return
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs, started)

    # ---- loop thread ----

    def _deliver(self, outputs: list[RequestOutput], step_started: float) -> None:
        now = time.perf_counter()
        m = self.metrics
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is None:  # aborted meanwhile
                continue
            if not s.started:
                s.started = True
                m.request_queue_time.observe(max(step_started - s.arrival, 0.0))
            if out.new_token_ids:
                if s.first_token_at is None:
                    s.first_token_at = now
                    m.time_to_first_token.observe(now - s.arrival)
                else:  # several tokens in one step (speculation) share the gap
                    n = len(out.new_token_ids)
                    for _ in range(n):
                        m.inter_token_latency.observe((now - s.last_token_at) / n)
                s.last_token_at = now
            if out.finished:
                s.finished = True
                del self._streams[out.request_id]
                m.record_finished(out.finish_reason or "stop", len(out.prompt_token_ids),
                                  len(out.token_ids), now - s.arrival)
            s.outputs.put_nowait(out)

    def _fail_all(self, error: Exception) -> None:
        for request_id, s in list(self._streams.items()):
            self._commands.put(("abort", request_id))
            s.outputs.put_nowait(error)
        self._streams.clear()


def _resolve(fut: asyncio.Future, result: Any, error: Exception | None) -> None:
    if fut.done():  # the handler was cancelled (client gone) while the command was queued
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
