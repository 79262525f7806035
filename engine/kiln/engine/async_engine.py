"""Runs an LLMEngine in a background thread beside the server's asyncio loop.

Only the engine thread touches the engine: the loop sends it commands (add, abort) through a
queue, and it hands each step's outputs back with one call_soon_threadsafe per step. Each
request's outputs land in its own asyncio.Queue, so many HTTP handlers share one batch.

An exception in the engine loop is fatal, as vLLM's EngineDeadError is: a failed step leaves
the scheduler's and the KV cache's state unknown, so the engine fails every request it holds,
releases its KV cache and refuses everything after (the server answers /health with 503, so
the kubelet restarts the pod). The test-only hook KILN_FAULT_INJECT=step:N raises in step N."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from kiln.engine import LLMEngine, RequestOutput, SamplingParams
from kiln.engine.metrics import ServerMetrics

log = logging.getLogger("kiln.serve")


FAULT_ENV = "KILN_FAULT_INJECT"


class QueueFullError(Exception):
    pass


class EngineDeadError(Exception):
    """The engine loop failed: no request can be served by this process any more."""


class InjectedFault(RuntimeError):
    """Raised inside the engine loop by the test-only hook KILN_FAULT_INJECT."""


def fault_step_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """KILN_FAULT_INJECT=step:N (test-only): the engine's Nth serving step raises. None if unset;
    ValueError naming the variable if malformed."""
    spec = environ.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    kind, _, n = spec.partition(":")
    if kind != "step" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected step:N with N >= 1 (a test-only fault hook)")
    return int(n)


@dataclass
class RequestStream:
    """What a handler reads: the engine's outputs for one request, in order."""
    request_id: str
    arrival: float
    prompt_tokens: int
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | Exception
    running: bool = False  # in the batch as of the last step (a preempted one waits again)
    started: bool = False  # a step ran it (its queue time is counted)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False


class TorchThread:
    """The thread every torch op of a server runs on: loading, warm-up and the engine loop. One
    thread keeps one OpenMP team: a second (a load run on another thread leaves its team behind)
    makes libgomp stop spinning between parallel regions once its threads outnumber the CPUs, and
    a decode step then waits on every wake-up: 1.5x slower on 2 cores (bench/serving_path.py).
    A daemon thread, as the engine loop's was: it never holds up the process's exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="kiln-engine", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on this thread, in a copy of the caller's context as asyncio.to_thread would."""
        return await asyncio.wrap_future(self.submit(contextvars.copy_context().run, fn, *args))

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the caller gets it; the thread lives on for the next job
                future.set_exception(e)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queue: int,
                 max_queued_tokens: int | None = None, fault_step: int | None = None,
                 torch_thread: TorchThread | None = None) -> None:
        """torch_thread: the thread that built the engine; the loop runs on it."""
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.max_queued_tokens, self.fault_step = max_queued_tokens, fault_step
        self.dead: EngineDeadError | None = None  # set once, on the loop thread, when the loop failed
        self._steps = 0
        self._loop = asyncio.get_running_loop()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched only on the loop thread
        self._thread = torch_thread or TorchThread()
        self._running: Any = None  # the loop's concurrent.futures.Future once started

    def start(self) -> None:
        # A tensor-parallel worker rank that dies is fatal even while the engine idles (tp_ranks).
        group = getattr(getattr(self.engine, "runner", None), "group", None)
        if group is not None:
            group.on_failure = self.fail
        self._running = self._thread.submit(self._run)

    def fail(self, error: BaseException) -> None:
        """Kill the engine (any thread): its loop raises `error` at its next command, as when a
        tensor-parallel rank died. What was queued before it still runs; what came after fails."""
        self._commands.put(("fail", error))

    async def stop(self) -> None:
        self._commands.put(None)
        await asyncio.wrap_future(self._running)

    async def submit_all(self, requests: list[tuple[str, list[int], SamplingParams]],
                         lora: str | None = None) -> list[RequestStream]:
        """Admit requests together (one client request's choices, all with the LoRA adapter `lora`
        or none): ValueError if the engine rejects one, QueueFullError if too many requests or
        prompt tokens wait, EngineDeadError once the engine loop has failed. Room is checked for
        all of them at once: they are refused whole or admitted whole."""
        self._check_alive()
        self.check_room(len(requests), sum(len(prompt) for _, prompt, _ in requests))
        # All queued at once, not one per engine step (the engine reads its commands between
        # steps: the last of n would wait n steps), and nothing awaited between the room check
        # and the last one's place (a concurrent request is checked against them all).
        streams = [RequestStream(request_id, time.perf_counter(), len(prompt)) for request_id, prompt, _ in requests]
        added = [self._loop.create_future() for _ in requests]
        for stream, (request_id, prompt, params), future in zip(streams, requests, added):
            self._streams[request_id] = stream
            self._commands.put(("add", request_id, prompt, params, lora, future))
        try:
            await asyncio.wait(added)
        except asyncio.CancelledError:  # client gone while queued: the adds still run, so undo them
            for stream, future in zip(streams, added):
                future.cancel()  # no reader now: a refusal left on it was logged as never retrieved
                self.abort(stream.request_id)
            raise
        # Every answer read: each refusal not read was logged as an error ("never retrieved").
        refused = next((e for e in [f.exception() for f in added] if e is not None), None)
        if refused is not None:  # the engine refused one (or died): the client sees an error, not an abort
            for stream in streams:
                if self._streams.pop(stream.request_id, None) is not None:
                    self._commands.put(("abort", stream.request_id))
            raise refused
        return streams

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if self._running is None or self._running.done():
            raise EngineDeadError("the engine thread has stopped")

    @property
    def capacity(self) -> int:
        """Requests held at once: the batch's seats and the queue behind them."""
        return self.engine.config.max_num_seqs + self.max_queue

    def check_room(self, count: int, prompt_tokens: int | None = None) -> None:
        """The waiting caps: --max-queue requests beyond the batch's --max-num-seqs seats (so a
        burst fills the seats and the queue both), and --max-num-queued-tokens prompt tokens of
        requests not in the batch yet (prompt_tokens None: not counted yet, the first cap alone).
        Requests finding nothing waiting are never refused for their length alone: retrying them
        would not help. QueueFullError past either."""
        seats = self.engine.config.max_num_seqs
        if len(self._streams) + count > self.capacity:
            raise QueueFullError(f"the engine holds {len(self._streams)} requests; {count} more would pass what its "
                                 f"batch (--max-num-seqs {seats}) and its queue (--max-queue {self.max_queue}) "
                                 "take; retry later")
        waiting = [s for s in self._streams.values() if not s.running]
        cap = self.max_queued_tokens
        queued = sum(s.prompt_tokens for s in waiting)
        if cap is not None and prompt_tokens is not None and waiting and queued + prompt_tokens > cap:
            raise QueueFullError(f"{queued} prompt tokens are waiting already and this request's {prompt_tokens} "
                                 f"would pass the limit of {cap} (--max-num-queued-tokens); retry later")

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps (sleep, wake_up); its result or exception."""
        self._check_alive()
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
        try:
            self._serve()
        except BaseException as e:  # whatever escapes the loop kills the engine, loudly
            self._die(e)

    def _serve(self) -> None:
        self.metrics.record_engine_stats(self.engine.stats())  # the pool's size from the start
        last_step_end = None  # while requests remain: where the engine's time between steps goes
        while True:
            # Sleep on the command queue only when there is nothing to step.
            cmds = self._drain_commands(block=not self.engine.has_unfinished_requests())
            for i, cmd in enumerate(cmds):
                if cmd is None:
                    return
                try:
                    self._execute(cmd)
                except BaseException:
                    # Fatal (a "fail" command): the ones drained behind it go back on the queue, where
                    # _fail_everything answers them; dropped here, their callers would wait for ever.
                    for later in cmds[i + 1:]:
                        self._commands.put(later)
                    raise
            if self.engine.has_unfinished_requests():
                started = time.perf_counter()
                if last_step_end is not None:
                    self.metrics.engine_gap_seconds.inc(started - last_step_end)
                self._step(started)
                last_step_end = time.perf_counter()
                self.metrics.engine_step_seconds.inc(last_step_end - started)
            else:
                last_step_end = None
                self.metrics.record_engine_stats(self.engine.stats())  # what commands changed (abort)

    def _drain_commands(self, block: bool) -> list:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _execute(self, cmd: tuple) -> None:
        if cmd[0] == "fail":
            raise cmd[1]
        if cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
            return
        if cmd[0] == "call":
            _, fn, done = cmd
            try:
                result = fn()
                # Before answering: a caller reading /metrics next sees what its call changed (sleep).
                self.metrics.record_engine_stats(self.engine.stats())
                self._loop.call_soon_threadsafe(_resolve, done, result, None)
            except Exception as e:
                self._loop.call_soon_threadsafe(_resolve, done, None, e)
            return
        _, request_id, prompt, params, lora, added = cmd
        try:
            self.engine.add_request(request_id, prompt, params, lora)
            self._loop.call_soon_threadsafe(_resolve, added, None, None)
        except Exception as e:  # ValueError for bad input; anything else is still this request's error
            self._loop.call_soon_threadsafe(_resolve, added, None, e)

    def _step(self, started: float) -> None:
        self._steps += 1
        if self._steps == self.fault_step:
            raise InjectedFault(f"fault injected in engine step {self._steps} ({FAULT_ENV}, test-only)")
        outputs = self.engine.step()
        running = self.engine.running_request_ids()
        # Before the outputs go back: a client that reads /metrics the moment its answer ends
        # sees what its request did (prefix-cache hits, KV usage), never the step before.
        self.metrics.record_engine_stats(self.engine.stats())
        self._loop.call_soon_threadsafe(self._deliver, outputs, started, set(running))

    # ---- loop thread ----

    def _deliver(self, outputs: list[RequestOutput], step_started: float, running: set[str]) -> None:
        now = time.perf_counter()
        m = self.metrics
        finished = {out.request_id for out in outputs if out.finished}
        for s in self._streams.values():
            s.running = s.request_id in running  # a preempted request waits again, and counts so
            # Queued until the step that first ran it: of a prompt in chunks the first chunk's, not
            # the one that gave its first token; one done within that step is no longer running.
            if not s.started and (s.running or s.request_id in finished):
                s.started = True
                m.request_queue_time.observe(max(step_started - s.arrival, 0.0))
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is None:  # aborted meanwhile
                continue
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

    def _die(self, error: BaseException) -> None:
        """Engine thread, once, as it ends: free what the engine holds and tell the loop."""
        cause = f"{type(error).__name__}: {error}"
        log.critical("the engine loop failed (%s): failing every request; /health now answers 503",
                     cause, exc_info=error)
        traceback.clear_frames(error.__traceback__)  # the failed step's locals may hold KV-cache views
        try:
            self.engine.discard()
            self.metrics.record_engine_stats(self.engine.stats())
        except Exception:
            log.exception("could not release the dead engine's KV cache")
        dead = EngineDeadError(f"the engine died ({cause}); this replica must be restarted")
        with contextlib.suppress(RuntimeError):  # the loop is closed already: nobody is waiting
            self._loop.call_soon_threadsafe(self._fail_everything, dead)

    def _fail_everything(self, dead: EngineDeadError) -> None:
        """Every request in flight ends with the cause; commands never run are answered too."""
        self.dead = dead
        for s in self._streams.values():
            s.outputs.put_nowait(dead)
            self.metrics.request_success["error"].inc()
        log.error("failed %d request(s) in flight: %s", len(self._streams), dead)
        self._streams.clear()
        while True:  # the engine thread has ended: nobody else reads the queue now
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is not None and cmd[0] in ("add", "call"):
                _resolve(cmd[-1], None, dead)


def _resolve(fut: asyncio.Future, result: Any, error: Exception | None) -> None:
    if fut.done():  # the handler was cancelled (client gone) while the command was queued
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
