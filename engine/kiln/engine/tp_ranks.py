"""The processes of a tensor-parallel engine. Rank 0 is the engine's own process: it runs the
scheduler and the sampler and sends each step's inputs to the worker ranks, which run the
forward only. Workers are spawned (torch.multiprocessing) and joined into one torch.distributed
group: gloo on CPU, NCCL on CUDA (rank r on cuda:r).

Commands go down a pipe per worker: a worker blocks on it while the engine idles (no
collective timeout runs out between requests) and sees the pipe close when rank 0 dies, so no
worker outlives it. The tensors a step computes move by collectives, under a timeout. A worker
that exits is fatal: a watchdog on its process sentinel reports it at once (on_failure), even
while the engine idles, and the next step raises instead of waiting on a dead peer.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.engine.config import Config
from kiln.engine.context import Context, get_context, reset_context, set_context
from kiln.engine.loader import LoadedModel, load_model
from kiln.engine.lora import LoRAAdapter, LoRAMapping, on_device
from kiln.engine.model_runner import ModelRunner
from kiln.engine.tensor_parallel import (Shard, ShardedModel, check_model, local_model_config, shard_adapter,
                                         shard_model)

log = logging.getLogger(__name__)

JOIN_TIMEOUT_ENV = "KILN_TP_JOIN_TIMEOUT"  # seconds for a spawned rank to join the group (default 120)
COLLECTIVE_TIMEOUT_ENV = "KILN_TP_COLLECTIVE_TIMEOUT"  # seconds one collective may wait (default 120)
_STOP_GRACE_S = 10.0


class TensorParallelError(RuntimeError):
    """A rank failed: it did not join in time, could not load, or died."""


def _seconds(env: str, default: float) -> float:
    value = os.environ.get(env, str(default))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < math.inf:  # inf passed, and timedelta then raised OverflowError
        raise ValueError(f"{env} must be a positive number of seconds, got {value!r}")
    return seconds


def _context_fields(ctx: Context) -> tuple:
    """The step's Context as the workers get it: its tensors, then each LoRA adapter's id and
    rows (host copies: pickled as is, a GPU tensor would come back on rank 0's device)."""
    lora = None if ctx.lora is None else \
        [(adapter.id, None if rows is None else rows.cpu()) for adapter, rows in ctx.lora.groups]
    return (ctx.cu_seqlens_q, ctx.seq_lens, ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.slot_mapping, ctx.block_tables,
            lora)


def _worker_context(fields: list, adapters: dict[int, LoRAAdapter], device: torch.device) -> Context:
    """A worker's Context from _context_fields' (its tensors already on the device)."""
    *tensors, lora = fields
    mapping = None if lora is None else LoRAMapping(
        [(adapters[id_], None if rows is None else rows.to(device)) for id_, rows in lora])
    return Context(*tensors, lora=mapping)


def _to_host(value: Any) -> Any:
    """A tensor as sent to the workers. A view (a prompt-logprobs chunk of the step's hidden
    states) is copied out: pickled, a view writes its whole storage."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.cpu()
    return value.clone() if value.untyped_storage().nbytes() > value.nbytes else value


class WorkerGroup:
    """Rank 0's handle on the worker ranks."""

    def __init__(self, config: Config, shared_block_bytes: int = 0) -> None:
        """shared_block_bytes: as ModelRunner's (rank 0's draft model cache), which every rank's
        budget pays so that all pools have the same block count."""
        self.size = config.tensor_parallel_size
        self.failure: TensorParallelError | None = None
        self.on_failure: Callable[[TensorParallelError], None] | None = None
        self._closing = False
        self._threads_before = torch.get_num_threads()  # rank 0's own, given back on close
        self._failing = threading.Lock()  # the watchdog and the engine thread may both see the death
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        # Commands go out from a thread of their own: written from the engine thread, a message
        # larger than the pipe's buffer to a rank that hangs (alive, not reading) blocked rank 0
        # for good, past every timeout, with /health still 200. Now rank 0 goes on to its part,
        # whose first collective times out (COLLECTIVE_TIMEOUT_ENV) and breaks the group.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name="kiln-tp-sender", daemon=True)
        device = config.torch_device
        if device.type == "cuda" and self.size > torch.cuda.device_count():
            raise TensorParallelError(f"tensor_parallel_size {self.size} is larger than the "
                                      f"{torch.cuda.device_count()} GPU(s) this process sees")
        if device.type == "cuda" and device.index not in (None, 0):
            raise TensorParallelError(f"device {config.device!r}: tensor parallelism puts rank r on cuda:r; give "
                                      "cuda and choose the GPUs with CUDA_VISIBLE_DEVICES")
        if dist.is_initialized():  # torch.distributed has one default group a process
            raise TensorParallelError("this process already runs a tensor-parallel engine; close it first "
                                      "(LLM.close())")
        backend = "nccl" if device.type == "cuda" else "gloo"
        join_s, collective_s = _seconds(JOIN_TIMEOUT_ENV, 120), _seconds(COLLECTIVE_TIMEOUT_ENV, 120)
        # The store's own operations get the collective timeout: the join deadline is _await's, and
        # a tiny one here would fail rank 0's connection to its own store on a busy machine.
        store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=collective_s))
        ctx = mp.get_context("spawn")
        atexit.register(self.close)
        if device.type == "cpu":  # the ranks compute at once on the same CPUs: each takes its share
            torch.set_num_threads(max(1, self._threads_before // self.size))
        try:  # whatever stops the start (Ctrl-C while ranks join, rank 0's own join failing) stops the ranks
            for rank in range(1, self.size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, name=f"kiln-tp-rank{rank}",
                                   args=(rank, config, store.port, child, torch.get_num_threads(),
                                         shared_block_bytes, os.getpid()))
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            self._sender.start()
            self.rank_threads = [torch.get_num_threads(), *self._await("joined", join_s)]
            log.info("tensor parallel: %d ranks, torch threads per rank %s", self.size, self.rank_threads)
            dist.init_process_group(backend, store=store, rank=0, world_size=self.size,
                                    timeout=timedelta(seconds=collective_s))
        except BaseException:
            self.close(grace=0)
            raise

    def _await(self, what: str, timeout: float | None) -> list[Any]:
        """Each worker's next message, which must be `what`; a clear error for a rank that exits,
        fails or (with a timeout) does not answer in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        answers = []
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait([conn, proc.sentinel], left):
                self.close(grace=0)
                raise TensorParallelError(f"tensor-parallel rank {rank} did not join within {timeout:g} s "
                                          f"({JOIN_TIMEOUT_ENV})")
            try:
                kind, payload = conn.recv()
            except EOFError:
                proc.join()
                self.close(grace=0)
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} "
                                          f"before it was {what}") from None
            if kind != what:
                self.close(grace=0)
                raise TensorParallelError(f"tensor-parallel rank {rank} failed: {payload}")
            answers.append(payload)
        return answers

    def wait_ready(self, num_blocks: int) -> None:
        """Block until every worker loaded and sharded its model and allocated its KV cache."""
        blocks = self._await("ready", None)
        if any(b != num_blocks for b in blocks):
            self.close()
            raise TensorParallelError(f"KV pools differ across ranks: {[num_blocks, *blocks]} blocks")
        threading.Thread(target=self._watch, name="kiln-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        wait([p.sentinel for p in self._procs])
        if self._closing:
            return
        self.fail(None)

    def _dead_rank(self, timeout: float) -> str | None:
        """'rank r (pid p) exited with code c' for the first worker found exited within timeout."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, start=1)}
        for sentinel in wait(list(sentinels), timeout):
            rank, proc = sentinels[sentinel]
            proc.join()
            return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def fail(self, error: BaseException | None) -> None:
        """The group is broken (a rank died: error None, from the watchdog; or a collective failed):
        the other ranks are killed and the engine told (on_failure), so it reports itself dead
        instead of waiting on a peer. One thread at a time: two reaping the same rank would read
        no exit code."""
        with self._failing:
            if self.failure is not None:
                return
            dead = self._dead_rank(0.0 if error is None else 1.0)
            if error is None:
                error = TensorParallelError(dead or "a tensor-parallel rank exited")
            elif not isinstance(error, TensorParallelError):  # a collective failed: most often a peer died
                cause = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
                what = "interrupted mid-step" if isinstance(error, KeyboardInterrupt) else "a collective failed"
                error = TensorParallelError(f"{dead or what} ({cause})")
            self.failure = error
            log.critical("%s: the tensor-parallel group is broken; stopping every rank", self.failure)
            self.close(grace=0)  # the other ranks may be stuck in a collective
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def send(self, *message: Any) -> None:
        if self.failure is not None:
            raise self.failure
        # Pickled here, at once: the step's tensors may change as soon as this returns.
        self._outbox.put(pickle.dumps(tuple(_to_host(v) for v in message), protocol=pickle.HIGHEST_PROTOCOL))

    def _send_all(self) -> None:
        """Each command to every worker, in order, until None."""
        while (data := self._outbox.get()) is not None:
            for conn in self._conns:
                try:
                    conn.send_bytes(data)
                except OSError:
                    pass  # that rank is gone: the watchdog reports it

    def close(self, grace: float = _STOP_GRACE_S) -> None:
        """Stop every worker (asked first, killed past the grace period); safe to call again."""
        if self._closing:
            return
        self._closing = True
        if grace > 0:
            self._outbox.put(pickle.dumps(("stop",)))
        deadline = time.monotonic() + grace
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self._sender.is_alive():  # its writes fail now that no rank reads: it ends
            self._outbox.put(None)
            self._sender.join()
        for conn in self._conns:
            conn.close()
        torch.set_num_threads(self._threads_before)
        # NCCL's teardown may wait on a dead peer; gloo's never does.
        if dist.is_initialized() and (self.failure is None or dist.get_backend() == "gloo"):
            dist.destroy_process_group()
        atexit.unregister(self.close)


class LeaderModel(ShardedModel):
    """Rank 0's model: each forward and logits call is first sent to the workers, which then run
    the same collectives."""

    def __init__(self, sharded: ShardedModel, group: WorkerGroup) -> None:
        super().__init__(sharded.inner, sharded.shard)
        self.group = group

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._together(super().forward, ("forward", input_ids, positions, *_context_fields(get_context())),
                              input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._together(super().compute_logits, ("logits", hidden), hidden)

    def _together(self, fn: Callable[..., torch.Tensor], message: tuple, *args: torch.Tensor) -> torch.Tensor:
        """Send the workers their command, then run rank 0's part; any failure breaks the group."""
        try:
            self.group.send(*message)
            return fn(*args)
        except BaseException as e:  # a Ctrl-C between two collectives leaves the workers in one
            self.group.fail(e)
            if not isinstance(e, Exception):
                raise
            raise self.group.failure from e


class LeaderRunner(ModelRunner):
    """ModelRunner on rank 0 of a tensor-parallel engine: the workers' KV caches follow its own
    (sleep, wake), and a failed group stops every rank."""

    def __init__(self, config: Config, model: LeaderModel, loaded: LoadedModel, shared_block_bytes: int = 0) -> None:
        self.group, self._started = model.group, False
        super().__init__(config, model, local_model_config(loaded.model_config, self.group.size), shared_block_bytes)
        self._started = True

    def allocate_kv_cache(self) -> None:
        if self._started:  # a wake-up; at start each worker allocates its own
            self.group.send("allocate")
        super().allocate_kv_cache()

    def release_kv_cache(self) -> None:
        if self.group.failure is None:  # after a failure the ranks are gone already
            self.group.send("release")
        super().release_kv_cache()

    def add_lora(self, adapter: LoRAAdapter) -> LoRAAdapter:
        # Read and checked here once; each worker cuts its own part from a host copy. Rank 0 cuts
        # first: had its cut failed (shapes, out of memory) after the send, the adapter cache would
        # never hold it, never send remove_lora, and every worker would keep its copy for good.
        local = shard_adapter(adapter, self.model.inner.config, self.model.shard)
        self.group.send("add_lora", on_device(adapter, "cpu"))
        return local

    def remove_lora(self, adapter: LoRAAdapter) -> None:
        self.group.send("remove_lora", adapter.id)

    def close(self) -> None:
        self.group.close()


def start_tensor_parallel(config: Config, loaded: LoadedModel, shared_block_bytes: int = 0) -> LeaderRunner:
    """Spawn ranks 1..N-1, shard rank 0's loaded model, and return rank 0's runner once every rank
    holds its shard and its KV cache."""
    check_model(loaded.model, config.tensor_parallel_size)  # before any rank starts
    group = WorkerGroup(config, shared_block_bytes)
    try:
        sharded = shard_model(loaded.model, Shard(0, group.size))
        runner = LeaderRunner(config, LeaderModel(sharded, group), loaded, shared_block_bytes)
        group.wait_ready(runner.num_blocks)
    except BaseException:
        group.close(grace=0)
        raise
    log.info("tensor parallel: %d ranks (%s), %d KV blocks each", group.size,
             dist.get_backend(), runner.num_blocks)
    return runner


def _exit_with_parent(parent: int) -> None:
    """Rank 0 gone while this rank joins or loads, before it reads its pipe (rank 0 stopped or
    killed during start-up): exit too, as the pipe's end would tell it later."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _worker_main(rank: int, config: Config, port: int, conn: Connection, threads: int,
                 shared_block_bytes: int, parent: int) -> None:
    # Rank 0 drains on SIGTERM/SIGINT and then stops the workers; a signal sent to the whole
    # process group must not take a worker away mid-drain.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent,), name="kiln-tp-parent", daemon=True).start()
    torch.set_num_threads(threads)
    size = config.tensor_parallel_size
    if config.torch_device.type == "cuda":
        torch.cuda.set_device(rank)
        config = replace(config, device=f"cuda:{rank}")
    try:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                              timeout=timedelta(seconds=_seconds(COLLECTIVE_TIMEOUT_ENV, 120)))
        conn.send(("joined", torch.get_num_threads()))
        dist.init_process_group("nccl" if config.torch_device.type == "cuda" else "gloo", store=store,
                                rank=rank, world_size=size,
                                timeout=timedelta(seconds=_seconds(COLLECTIVE_TIMEOUT_ENV, 120)))
        loaded = load_model(config)
        model = shard_model(loaded.model, Shard(rank, size))
        runner = ModelRunner(config, model, local_model_config(loaded.model_config, size), shared_block_bytes)
        conn.send(("ready", runner.num_blocks))
    except Exception:
        conn.send(("error", traceback.format_exc(limit=4)))
        os._exit(1)
    _serve(model, runner, conn, config.torch_device)


@torch.inference_mode()
def _serve(model: ShardedModel, runner: ModelRunner, conn: Connection, device: torch.device) -> None:
    adapters: dict[int, LoRAAdapter] = {}  # LoRA adapters by id, this rank's part of each
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # rank 0 is gone
            os._exit(1)
        kind, args = message[0], [a.to(device) if isinstance(a, torch.Tensor) else a for a in message[1:]]
        if kind == "forward":
            input_ids, positions, *fields = args
            set_context(_worker_context(fields, adapters, device))
            try:
                model(input_ids, positions)  # rank 0 keeps the hidden states; the next "logits" sends them
            finally:
                reset_context()
        elif kind == "logits":
            model.compute_logits(args[0])
        elif kind == "allocate":
            runner.allocate_kv_cache()
        elif kind == "release":
            runner.release_kv_cache()
        elif kind == "add_lora":
            adapters[args[0].id] = on_device(shard_adapter(args[0], model.inner.config, model.shard), device)
        elif kind == "remove_lora":
            del adapters[args[0]]
        elif kind == "stop":
            dist.destroy_process_group()
            os._exit(0)
