"""The cpu backend's decoder layers in one op call (kiln.engine.cpu_decoder, csrc/decoder_cpu.cpp) on
the real SmolLM2-135M: the same tokens and the same logprobs, bit for bit, as the module loop it
replaces, with the op's bf16 GEMM (up to 4 rows), oneDNN's packed GEMM (more rows) and float32; short
prefill chunks over a cached prefix run in it beside decodes; the steps and models it must leave to
the module loop (plain prefill, int8 weights, an int8 KV cache) get None; bad input is a clear error."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.engine import LLM, SamplingParams, cpu_library
from test_engine_generate import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    assert cpu_library.available(), cpu_library.unavailable_reason()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared two-core machine: see test_engine_generate's one_thread
    yield
    torch.set_num_threads(before)


def counted(llm: LLM) -> dict[str, int]:
    """Counts, on llm's model, the steps the op ran ("fused") and those it left to the modules."""
    inner = llm.engine.runner.model.model
    run_layers = inner.backend.decoder_layers
    counts = {"fused": 0, "modules": 0}

    def counting(*args):
        out = run_layers(*args)
        counts["fused" if out is not None else "modules"] += 1
        return out

    inner.backend = dataclasses.replace(inner.backend, decoder_layers=counting)
    return counts


def generate(llm: LLM, prompts: list[str], fused: bool) -> list[tuple[list[int], list]]:
    inner = llm.engine.runner.model.model
    saved = inner.backend
    if not fused:
        inner.backend = dataclasses.replace(saved, decoder_layers=None)
    try:
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)]
    finally:
        inner.backend = saved


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_same_bits_as_the_module_loop(dtype: str) -> None:
    """One prompt (1-row decode steps: the op's GEMM in bf16) and eight (8 rows: oneDNN's packed GEMM),
    with 32-token steps: prompts of 3-37 tokens, so that prefills of at most 16 tokens run in the op,
    longer ones and chunks (SDPA's) in the modules, and chunks over a cached prefix beside decodes."""
    # Plain weights (bf16 would serve the packaged Q4_1 GGUF packed); no prefix caching: the second
    # run of a prompt would attend over the first one's cached blocks.
    llm = LLM(dtype=dtype, attention_backend="cpu", gguf_dequantize=True, max_num_batched_tokens=32,
              max_model_len=256, enable_prefix_caching=False)
    counts = counted(llm)
    for prompts in (PROMPTS[:1], PROMPTS):
        fused = generate(llm, prompts, fused=True)
        assert generate(llm, prompts, fused=False) == fused
        assert all(len(tokens) == GREEDY.max_tokens for tokens, _ in fused)
    print(dtype, counts)
    assert counts["fused"] >= 2 * GREEDY.max_tokens  # every step of the one-prompt run, decodes of the other
    assert counts["modules"] >= 1  # the 17- and 33-token prompts' first step


@pytest.mark.parametrize("setting", [{"quantization": "int8"}, {"kv_cache_dtype": "int8"}])
def test_left_to_the_module_loop(setting: dict) -> None:
    llm = LLM(dtype="float32", attention_backend="cpu", max_model_len=128, **setting)
    counts = counted(llm)
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert counts["fused"] == 0 and counts["modules"] >= GREEDY.max_tokens


def test_bad_input_is_a_clear_error() -> None:
    x = torch.zeros(1, 8)
    cache = torch.zeros(2, 16, 1, 8)
    ids = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="6 weights and a K and V cache per layer expected, got 5 weights"):
        torch.ops.kiln.decoder_layers(x, [torch.ones(8)] * 5, [], [cache], [cache], torch.zeros(1, dtype=torch.long),
                                      torch.ones(4, 8), torch.zeros(1, dtype=torch.long), torch.tensor([0, 1], dtype=torch.int32),
                                      ids + 1, ids.view(1, 1), 1, 1, 1e-5, 1.0, 0)
    with pytest.raises(RuntimeError, match="at least one layer"):
        torch.ops.kiln.decoder_layers(x, [], [], [], [], torch.zeros(1, dtype=torch.long), torch.ones(4, 8),
                                      torch.zeros(1, dtype=torch.long), torch.tensor([0, 1], dtype=torch.int32),
                                      ids + 1, ids.view(1, 1), 1, 1, 1e-5, 1.0, 0)
