"""The engine on a GPU: KV pool sized from free memory, CUDA graphs for decode steps, pinned
host copies, and the Triton backend's greedy tokens against the torch backend's.

The pure parts (the budget arithmetic, the captured sizes, the flags and their errors, random
weights) run everywhere. The rest needs an NVIDIA GPU, which CI does not have: those tests skip
with that reason there; bench/results/gpu-tests-*.txt holds their output from a lent H100/H200.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.engine import LLM, SamplingParams
from kiln.engine.config import Config, ModelLoadError
from kiln.engine.model_runner import gpu_kv_budget, graph_batch_sizes, profile_seq_lens, sampled_rows
from kiln.engine.speculative import SpeculativeConfig
from test_engine_generate import PROMPTS as ENGINE_CORE_PROMPTS

GiB = 2 ** 30
REPO = Path(__file__).resolve().parents[1]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs an NVIDIA GPU; CI has none (bench/results/gpu-tests-*.txt is the GPU run)")


def test_kv_budget_is_what_the_utilization_leaves() -> None:
    # 80 GiB card, 2 GiB held by the CUDA context and others, torch peaked at 20 GiB of 21 reserved.
    total, free, reserved = 80 * GiB, 57 * GiB, 21 * GiB
    assert gpu_kv_budget(total, free, reserved, 20 * GiB, 0.9) == int(72 * GiB) - 20 * GiB - 2 * GiB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.25 leaves no room.*20.0 GiB for the weights"):
        gpu_kv_budget(total, free, reserved, 20 * GiB, 0.25)


def test_decode_graph_sizes_and_profile_step() -> None:
    assert graph_batch_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]
    assert profile_seq_lens(2048, 8192) == [2048]
    assert profile_seq_lens(2048, 600) == [600, 600, 600, 248]
    # The sampler's rows the profile sizes for: a draft's row each with speculation, within the budget.
    assert sampled_rows(Config(load_format="dummy")) == 128
    assert sampled_rows(Config(load_format="dummy", speculative=SpeculativeConfig(num_speculative_tokens=3))) == 512
    assert sampled_rows(Config(load_format="dummy", max_num_seqs=8, max_num_batched_tokens=4)) == 4


@pytest.mark.parametrize("field, value, message", [
    ("gpu_memory_utilization", 0.0, "must be in"), ("gpu_memory_utilization", 1.2, "must be in"),
    ("gpu_memory_utilization", True, "must be in"), ("enforce_eager", "yes", "true or false"),
    ("load_format", "zeros", "auto, dummy"), ("kv_cache_memory", 0, "positive integer"),
])
def test_bad_gpu_settings_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**{field: value})


def test_dummy_weights_need_no_weight_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """load_format='dummy' builds the model from config.json with random weights; without it the
    missing safetensors are an error; a GGUF file cannot be 'dummy'."""
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_llama_dir / name).read_bytes())
    # A download of the JSON files only (`--include "*.json"`): its index names shards not there.
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    llm = LLM(str(folder), load_format="dummy", dtype="float32", device="cpu", max_model_len=64)
    index.unlink()
    params = dict(llm.engine.runner.model.named_parameters())
    assert all(p.isfinite().all() for p in params.values())
    assert params["model.embed_tokens.weight"].std() > 0.01 and (params["model.norm.weight"] == 1).all()
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    # CPU: no graphs, the 1 GiB default pool
    assert llm.engine.runner.graphs is None and llm.engine.runner.kv_source == "the CPU default"
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(folder), dtype="float32", device="cpu")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="needs a model folder"):
        LLM(str(gguf), load_format="dummy", device="cpu")


# ---------------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------------
# The engine-core prompts (tests/test_engine_generate.py), the last one shortened, as run on the H200.
PROMPTS = ENGINE_CORE_PROMPTS[:7] + ["The quick brown fox jumps over the lazy dog. Translate this sentence into French:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)


def smollm2(**config: object) -> LLM:
    return LLM("smollm2-135m", device="cuda", max_model_len=1024, max_num_seqs=20,
               **{"dtype": "bfloat16", "gpu_memory_utilization": 0.3, **config})


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def fresh_gpu() -> None:
    """An engine an earlier test left to the garbage collector would count as memory held by others."""
    if torch.cuda.is_available():
        free_cuda()


def assert_greedy_close(ours: list, theirs: list, name: str) -> None:
    """vLLM's check for two implementations in 16-bit floats: the same tokens up to a first
    difference, where each side's pick is among the other's top 5 (a near-tie that rounding
    flipped); nothing is compared after it, since the texts differ from there."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for pos, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                top_a, top_b = ({t for t, _ in o.logprobs[pos]["top"]} for o in (a, b))
                assert x in top_b and y in top_a, f"{name}, prompt {i}, token {pos}: {x} vs {y}, not a near-tie"
                break


@needs_gpu
def test_kernel_tests_pass_compiled_on_the_gpu() -> None:
    """tests/test_kernels.py with TRITON_INTERPRET=0: every kernel compiled, bf16 included."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    parallel = ["-n", "8"] if importlib.util.find_spec("xdist") else []  # compiling is the cost
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", *parallel,
                           "tests/test_kernels.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_backend_matches_torch_on_smollm2(dtype: str) -> None:
    """The engine-core prompts, greedy: the Triton backend with CUDA graphs and the same eagerly
    give the same tokens; the torch backend the same tokens in float32, and in bfloat16 the same
    up to near-ties (on the H200, 6 of 8 prompts identical over 32 tokens)."""
    outputs = {}
    for name, config in {"triton+graphs": {}, "triton eager": {"enforce_eager": True},
                         "torch": {"attention_backend": "torch"}}.items():
        llm = smollm2(dtype=dtype, **config)
        assert (llm.engine.runner.graphs is not None) == (name == "triton+graphs")
        outputs[name] = llm.generate(PROMPTS, GREEDY)
        del llm
        free_cuda()
    tokens = {name: [o.token_ids for o in outs] for name, outs in outputs.items()}
    assert tokens["triton eager"] == tokens["triton+graphs"]
    if dtype == "float32":
        assert tokens["torch"] == tokens["triton+graphs"]
    else:
        assert_greedy_close(outputs["triton+graphs"], outputs["torch"], "torch vs triton")


@needs_gpu
def test_speculative_decoding_keeps_the_tokens_on_the_gpu() -> None:
    """N-gram drafts checked by the Triton backend (steps with drafts run eagerly, the rest replay
    graphs) give plain decoding's tokens in float32, and some drafts are accepted."""
    from kiln.engine.speculative import SpeculativeConfig

    prompts = PROMPTS + ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"]
    plain = smollm2(dtype="float32")
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    del plain
    free_cuda()
    spec = smollm2(dtype="float32", speculative=SpeculativeConfig(num_speculative_tokens=4))
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == expected
    assert spec.engine.num_accepted_tokens > 0


@needs_gpu
def test_decode_steps_replay_graphs_and_survive_sleep() -> None:
    llm = smollm2()
    runner = llm.engine.runner
    assert sorted(runner.graphs.graphs) == [1, 2, 4, 8, 16, 20]
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: replays.append(a[0].shape[0]) or run(*a)
    first = [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
    assert replays.count(3) >= 29  # the batch's decode steps (31 after the prefill step)
    llm.engine.sleep()
    assert runner.graphs is None
    again = [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]  # wakes: a new pool, graphs anew
    assert runner.graphs is not None and again == first


@needs_gpu
def test_kv_pool_is_sized_from_free_gpu_memory() -> None:
    total = torch.cuda.mem_get_info()[1]
    sizes = {}
    for utilization in (0.2, 0.4):
        llm = smollm2(gpu_memory_utilization=utilization)
        sizes[utilization] = llm.engine.stats().kv_cache_bytes
        assert llm.engine.runner.kv_source == f"gpu_memory_utilization={utilization}"
        assert torch.cuda.memory_reserved() <= utilization * total
        del llm
        free_cuda()
    # The fixed costs (weights, activations, CUDA context) are the same, so the pool grows by 0.2 of the card.
    assert abs(sizes[0.4] - sizes[0.2] - 0.2 * total) < 0.01 * total
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        smollm2(gpu_memory_utilization=0.001)
    free_cuda()
    llm = smollm2(kv_cache_memory=256 << 20)  # an explicit budget wins
    assert llm.engine.stats().kv_cache_bytes <= 256 << 20 and llm.engine.runner.kv_source == "kv_cache_memory"


@needs_gpu
def test_eager_steps_copy_their_inputs_from_pinned_memory() -> None:
    llm = smollm2(enforce_eager=True)
    runner = llm.engine.runner
    assert runner.graphs is None and runner.pin_memory
    seen = []
    to_device = runner._to_device
    runner._to_device = lambda values, dtype: seen.append(t := to_device(values, dtype)) or t
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3))
    assert seen and all(t.is_cuda for t in seen)
