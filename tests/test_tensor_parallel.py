"""Tensor parallelism (issue 19) with gloo on the CPU: a TP engine gives the TP=1 logits and
greedy tokens (tiny random Llama 4 q / 2 KV heads at TP=2, its KV heads replicated at TP=4,
SmolLM2 9 q / 3 KV heads at TP=3), refuses shapes and set-ups it cannot run with one clear error,
and leaves no process behind; int8 and int4 weights shard too. The server-side failure
and shutdown paths are in test_tensor_parallel_server.py. One torch thread per rank: the ranks
share the machine's cores."""
from __future__ import annotations

import contextlib
import json
import logging
import pickle
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from kiln.engine import llm_engine
from kiln.engine.config import Config
from kiln.engine.context import prefill_context, reset_context, set_context
from kiln.engine.llm import LLM
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.speculative import SpeculativeConfig
from kiln.engine.quantization import Int4Linear, quantize_int4
from kiln.engine.tensor_parallel import ShardingError, _column_slice, _row_slice
from kiln.engine import tp_ranks
from kiln.engine.tp_ranks import COLLECTIVE_TIMEOUT_ENV, JOIN_TIMEOUT_ENV, TensorParallelError, WorkerGroup
from kiln_process import spawned_ranks
from tiny_models import write_tiny_model

# Lengths 5..70 under a 32-token budget: long prompts are prefilled in chunks while the short
# ones decode in the same steps (mixed batches), and the 64 greedy tokens run on paged KV.
TINY_PROMPTS = [[3 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate([5, 40, 70, 13, 27])]
TINY = dict(dtype="float32", device="cpu", max_num_batched_tokens=32, kv_cache_memory=1 << 22)
GREEDY_64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_no_ranks_left(llm: LLM) -> None:
    llm.close()
    assert not spawned_ranks()


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), **TINY)


def logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """One plain prefill of the prompts through the engine's (rank 0's) model: every row's logits."""
    model = llm.engine.runner.model
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    set_context(prefill_context([len(p) for p in prompts]))
    try:
        with torch.inference_mode():
            return model.compute_logits(model(ids, positions))
    finally:
        reset_context()


def greedy(llm: LLM, prompts: list) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY_64)]


@pytest.fixture(scope="class")
def tiny_tp2(tiny_llama_dir):
    """One engine for TestTP2, closed (every rank checked gone) after it: one TP engine a process."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY)
    yield llm
    assert_no_ranks_left(llm)


class TestTP2:
    def test_tp2_logits_equal_tp1(self, tiny_reference, tiny_tp2):
        assert len(spawned_ranks()) == 1
        want, got = logits(tiny_reference, TINY_PROMPTS), logits(tiny_tp2, TINY_PROMPTS)
        assert got.shape == want.shape == (sum(map(len, TINY_PROMPTS)), 96)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)

    def test_tp2_greedy_equals_tp1_in_mixed_chunked_batches(self, tiny_reference, tiny_tp2):
        want = greedy(tiny_reference, TINY_PROMPTS)
        assert all(len(t) == 64 for t in want)
        assert greedy(tiny_tp2, TINY_PROMPTS) == want
        engine = tiny_tp2.engine
        assert engine.runner.model.shard.size == 2
        # each rank holds one of the two KV heads: its pool has twice the blocks of TP=1 in the same bytes
        assert engine.runner.num_blocks == 2 * tiny_reference.engine.runner.num_blocks

    def test_tp2_prompt_logprobs_equal_tp1(self, tiny_reference, tiny_tp2):
        # scored through rank 0's compute_logits in chunks, each one sent to the workers
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)

        def scored(llm: LLM) -> list[tuple[int, float, int]]:
            return [(token, e["logprob"], e["rank"]) for o in llm.generate(TINY_PROMPTS, params)
                    for position in o.prompt_logprobs[1:] for token, e in position.items()]

        want, got = scored(tiny_reference), scored(tiny_tp2)
        assert len(got) == len(want) >= 3 * (sum(map(len, TINY_PROMPTS)) - len(TINY_PROMPTS))
        assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want]
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)

    def test_tp2_sleep_and_wake_follow_on_every_rank(self, tiny_reference, tiny_tp2):
        # The pod's pools, every rank's (rank 0's alone was reported: half of what two ranks hold).
        assert tiny_tp2.engine.stats().kv_cache_bytes == 2 * tiny_tp2.engine.runner.kv_cache.nbytes > 0
        tiny_tp2.engine.sleep()
        assert tiny_tp2.engine.stats().kv_cache_bytes == 0
        tiny_tp2.engine.wake_up()
        assert greedy(tiny_tp2, TINY_PROMPTS[:2]) == greedy(tiny_reference, TINY_PROMPTS[:2])

    def test_a_worker_dying_while_idle_is_reported_at_once(self, tiny_tp2):
        group = tiny_tp2.engine.runner.group
        reported = threading.Event()
        group.on_failure = lambda error: reported.set()  # what the server's async engine hooks
        (worker,) = spawned_ranks()
        worker.kill()
        assert reported.wait(5), "the watchdog did not report the dead rank"
        assert f"tensor-parallel rank 1 (pid {worker.pid}) exited with code -9" in str(group.failure)
        with pytest.raises(TensorParallelError, match="rank 1"):
            tiny_tp2.generate(TINY_PROMPTS[:1], GREEDY_64)


def test_a_view_sent_to_the_workers_carries_only_its_own_rows():
    """Prompt logprobs send the workers chunks of the step's hidden states: pickled as views,
    each chunk wrote the whole step's storage down every worker's pipe."""
    hidden = torch.randn(2048, 64)
    chunk = tp_ranks._to_host(hidden[128:256])
    assert torch.equal(chunk, hidden[128:256])
    assert len(pickle.dumps(chunk)) < 2 * hidden[128:256].nbytes
    assert tp_ranks._to_host(hidden) is hidden and tp_ranks._to_host(3) == 3  # whole ones go as they are


def test_cpu_ranks_share_rank_0s_threads(tiny_llama_dir):
    """The ranks compute at once on the same CPUs: each takes its share of the thread budget (a
    whole budget each oversubscribes the cores), and rank 0 gets its own count back on close."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY)
        try:
            assert llm.engine.runner.group.rank_threads == [2, 2]
            assert torch.get_num_threads() == 2
        finally:
            assert_no_ranks_left(llm)
        assert torch.get_num_threads() == 4
    finally:  # one_torch_thread's one thread again: 4 made the later tests' ranks oversubscribe the cores
        torch.set_num_threads(before)


def test_tp4_replicates_two_kv_heads(tiny_llama_dir, tiny_reference, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln.engine.tensor_parallel"):
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=4, **TINY)
    try:
        assert "2 KV heads for 4 ranks: each KV head is replicated on 2 ranks" in caplog.text
        assert greedy(llm, TINY_PROMPTS) == greedy(tiny_reference, TINY_PROMPTS)
    finally:
        assert_no_ranks_left(llm)


def test_smollm2_tp3_greedy_equals_tp1(smollm2_path):
    # 9 query / 3 KV heads: one KV head and 3 query heads a rank. 8 prompts, 24 tokens each (kept
    # short for CI time: three SmolLM2 ranks on two shared cores). The TP engine speculates
    # (n-gram drafts, checked by the ranks as short chunks); half the prompts repeat themselves.
    prompts = [f"Write one sentence about the number {i}." for i in range(4)]
    prompts += [f"Say {i} apples, {i} pears. Say {i} apples, {i} pears. Say {i} apples," for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", kv_cache_memory=64 << 20, max_model_len=256)
    want = [o.token_ids for o in LLM(str(smollm2_path), **kw).generate(prompts, params)]
    llm = LLM(str(smollm2_path), tensor_parallel_size=3, speculative=SpeculativeConfig(), **kw)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.num_accepted_tokens > 0
    finally:
        assert_no_ranks_left(llm)


def test_heads_tp_cannot_split_are_refused_before_any_rank_starts(smollm2_path):
    with pytest.raises(ShardingError, match=r"num_attention_heads \(9\) is not divisible by tensor_parallel_size \(2\)"):
        LLM(str(smollm2_path), tensor_parallel_size=2, dtype="float32", device="cpu", max_model_len=256)
    assert not spawned_ranks()


@pytest.mark.parametrize("overrides, tp, error", [
    ({}, 3, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"),
    ({"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}, 2,
     r"num_key_value_heads \(3\) and tensor_parallel_size \(2\): one must divide the other"),
    ({"intermediate_size": 130}, 4, r"intermediate_size \(130\) is not divisible by tensor_parallel_size \(4\)"),
])
def test_a_folder_tp_cannot_split_is_refused_before_any_weight_is_read(overrides, tp, error, tiny_llama_dir, tmp_path,
                                                                       monkeypatch):
    """Refused from its config.json: it was refused only once rank 0 had loaded the whole model."""
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **overrides}))  # no weights: none may be read

    def load_model(config: Config) -> None:
        raise AssertionError("the weights were read")
    monkeypatch.setattr(llm_engine, "load_model", load_model)
    with pytest.raises(ShardingError, match=error):
        LLM(str(tmp_path), tensor_parallel_size=tp, **TINY)
    assert not spawned_ranks()


def test_kv_heads_tp_cannot_split_are_refused(tiny_llama_dir):
    with pytest.raises(ShardingError, match=r"num_attention_heads \(4\) is not divisible"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, **TINY)
    # hidden 64: int4 groups of 64 input channels, which o_proj's two slices of 32 would cut
    with pytest.raises(ShardingError, match="o_proj: its int4 groups of 64 input channels do not split into 2 "
                                            "slices of 32"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, quantization="int4-rtn", quantization_cache="off", **TINY)
    assert not spawned_ranks()


def test_int8_weights_shard_qwen2_biases_tied_embeddings_and_one_kv_head(tiny_hf_models, tmp_path):
    # Qwen2: q/k/v biases, a tied lm_head, one KV head replicated on both ranks; int8 (AWQ-scaled)
    # codes and scales cut like the float weights, the variant computed once and cached.
    kw = dict(TINY, quantization="int8", quantization_cache=str(tmp_path))
    want = greedy(LLM(str(tiny_hf_models["qwen2"]), **kw), TINY_PROMPTS)
    llm = LLM(str(tiny_hf_models["qwen2"]), tensor_parallel_size=2, **kw)
    try:
        assert type(llm.engine.runner.model.inner.model.layers[0].mlp.down_proj.local).__name__ == "Int8Linear"
        assert greedy(llm, TINY_PROMPTS) == want
    finally:
        assert_no_ranks_left(llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # canonical layout; the CPU op's int4pack
@pytest.mark.parametrize("offsets", ["zeros", "mins"])  # AWQ/RTN integer zeros; a GGUF Q4's float mins
def test_int4_slices_hold_exactly_their_part_of_the_weight(dtype, offsets):
    torch.manual_seed(0)
    packed, scales, zeros = quantize_int4(torch.randn(96, 256), 64)
    mins = -zeros.float() * scales if offsets == "mins" else None
    act_scale = torch.rand(256) + 0.5

    def full() -> Int4Linear:
        return Int4Linear(packed, scales, None if offsets == "mins" else zeros, torch.randn(96), act_scale,
                          dtype, mins=mins)

    assert full().kernel == ("dequantize" if dtype == torch.float32 else "weight_int4pack_mm_for_cpu")
    w = full().dequantized_weight()
    top = _column_slice(full(), lambda t: t[:48])
    assert top.kernel == full().kernel and torch.equal(top.dequantized_weight(), w[:48])
    right = _row_slice(full(), 128, 128)
    assert right.bias is None and torch.equal(right.act_scale, full().act_scale[128:])
    assert torch.equal(right.dequantized_weight(), w[:, 128:])


@pytest.mark.parametrize("method", ["int4-rtn", "int4"])
def test_int4_weights_shard(tmp_path, method):
    # Wide enough for whole groups on each rank: o_proj's 256 input channels (2 x 128), down_proj's 512.
    folder = write_tiny_model("llama", tmp_path / "wide", hidden_size=256, intermediate_size=512)
    kw = dict(TINY, quantization=method, quantization_cache=str(tmp_path / "variants"))
    want = greedy(LLM(str(folder), **kw), TINY_PROMPTS)
    llm = LLM(str(folder), tensor_parallel_size=2, **kw)
    try:
        layer = llm.engine.runner.model.inner.model.layers[0]
        assert type(layer.self_attn.o_proj.local).__name__ == "Int4Linear"
        assert layer.mlp.down_proj.local.in_features == 256
        assert greedy(llm, TINY_PROMPTS) == want
    finally:
        assert_no_ranks_left(llm)


def test_a_rank_that_does_not_join_in_time_is_a_clear_error(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv(JOIN_TIMEOUT_ENV, "0.01")  # a spawned interpreter takes seconds to start
    with pytest.raises(TensorParallelError, match=rf"rank 1 did not join within 0.01 s \({JOIN_TIMEOUT_ENV}\)"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY)
    assert not spawned_ranks()


def test_a_ctrl_c_mid_step_breaks_the_group_at_once(tiny_llama_dir):
    """A KeyboardInterrupt between two of rank 0's collectives left the workers inside one: the
    next generate paired the wrong collectives and hung for the collective timeout (120 s)."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY)
    try:
        def interrupt(*_: object) -> None:
            hook.remove()
            raise KeyboardInterrupt  # what Ctrl-C does mid-forward
        hook = llm.engine.runner.model.inner.model.layers[1].register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(TINY_PROMPTS[:2], GREEDY_64)
        with pytest.raises(TensorParallelError, match=r"interrupted mid-step \(KeyboardInterrupt\)"):
            llm.generate(TINY_PROMPTS[:2], GREEDY_64)
        assert not spawned_ranks()  # stopped with the group
    finally:
        llm.close()
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY) as again:  # the process may start another
        assert greedy(again, TINY_PROMPTS[:1]) == greedy(LLM(str(tiny_llama_dir), **TINY), TINY_PROMPTS[:1])
    assert not spawned_ranks()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_do_not_outlive_a_rank_0_stopped_while_they_start(tiny_llama_dir, sig):
    """Rank 0 gone before its workers read their pipes (stopped while loading: `kiln serve`
    exits at once then): they waited out their 120 s timeouts and more, holding a GPU's memory."""
    server = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", "--model", str(tiny_llama_dir),
                               "--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "256",
                               "--kv-cache-memory", "4Mi", "--port", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[psutil.Process] = []
    try:
        ranks = eventually_ranks(server.pid)
        server.send_signal(sig)
        assert server.wait(60) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        _, alive = psutil.wait_procs(ranks, timeout=60)  # a spawned rank takes seconds to import torch
        assert not alive, f"ranks left running: {alive}"
    finally:
        server.kill()
        server.wait(60)  # collected, or it stays a zombie below this process for the tests after
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()


def eventually_ranks(pid: int) -> list[psutil.Process]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = spawned_ranks(pid)
        if ranks:
            return ranks
        time.sleep(0.05)
    raise AssertionError("no rank was spawned within 60 s")


@pytest.mark.timeout(180)  # without the fix it blocked for good
def test_a_rank_that_hangs_breaks_the_group_within_the_collective_timeout(tmp_path, monkeypatch):
    """A command larger than the pipe's buffer (a 20k-token prefill's ids, positions and slots:
    480 KB) to a rank that hangs, alive but not reading, blocked rank 0 for good, past every
    timeout; its Ctrl-C and close blocked too."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "5")
    folder = write_tiny_model("llama", tmp_path / "long", max_position_embeddings=32768)
    tokens = 20_000
    llm = LLM(str(folder), tensor_parallel_size=2, dtype="float32", device="cpu", max_model_len=tokens + 8,
              max_num_batched_tokens=tokens + 8, kv_cache_memory=16 << 20)
    try:
        (worker,) = spawned_ranks()
        worker.suspend()
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="collective"):
            llm.generate([[5 + i % 80 for i in range(tokens)]], SamplingParams(temperature=0, max_tokens=1))
        assert time.monotonic() - started < 60
    finally:  # whatever failed, the engine is closed: a second one in this process is refused
        for rank in spawned_ranks():
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()
        llm.close()
    assert not spawned_ranks()


@pytest.mark.parametrize("value", ["soon", "inf", "nan", "-1"])  # inf was an OverflowError, its ranks left running
def test_a_bad_timeout_setting_is_refused_before_any_rank_starts(tiny_llama_dir, monkeypatch, value):
    monkeypatch.setenv(JOIN_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"{JOIN_TIMEOUT_ENV} must be a positive number of seconds, got '{value}'"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY)
    assert not spawned_ranks()


def test_ranks_do_not_outlive_a_start_that_fails_after_they_joined(tiny_llama_dir, monkeypatch):
    """Only the failures _await handles stopped the ranks: rank 0's own join failing left them running."""
    def refused(*_, **__):
        raise RuntimeError("rank 0 could not join")
    monkeypatch.setattr(tp_ranks.dist, "init_process_group", refused)
    with pytest.raises(RuntimeError, match="rank 0 could not join"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY)
    assert not spawned_ranks()


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    if not torch.cuda.is_available():  # as on a one-GPU machine: Config itself refuses a cuda device with none
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpus = torch.cuda.device_count()
    with pytest.raises(TensorParallelError, match=rf"tensor_parallel_size {gpus + 1} is larger than the {gpus} GPU"):
        WorkerGroup(Config(device="cuda", tensor_parallel_size=gpus + 1, kv_cache_memory=1 << 22))


def test_a_gpu_index_is_refused(monkeypatch):
    # Rank 0 on cuda:1 and rank 1 on cuda:1 too: NCCL refused the pair after every rank had loaded.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(TensorParallelError, match="device 'cuda:1': tensor parallelism puts rank r on cuda:r"):
        WorkerGroup(Config(device="cuda:1", tensor_parallel_size=2, kv_cache_memory=1 << 22))


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        Config(tensor_parallel_size=0)


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_tensor_parallel_on_cuda_without_kv_cache_memory_is_refused_by_the_config(device, monkeypatch):
    # ModelRunner refused it too, but only once rank 0 had loaded the whole model.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # as on a two-GPU machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"tensor parallelism on CUDA needs kv_cache_memory \(per rank\): the pool "
                                         r"is not sized from free GPU memory across ranks"):
        Config(device=device, tensor_parallel_size=2)
    assert Config(device=device, tensor_parallel_size=2, kv_cache_memory=1 << 30).kv_cache_memory == 1 << 30
    assert Config(device=device).tensor_parallel_size == 1  # one rank: its pool is sized from free memory
    assert Config(device="cpu", tensor_parallel_size=2).kv_cache_memory is None  # the CPU default per rank
