"""Per step, not per layer (issue 16 item 3), on the real SmolLM2-135M: the attention metadata is
derived once per step and the layer loop never synchronises with the host; one forward per step;
the fused residual-add + RMSNorm and the RoPE of the torch/cpu backends equal the references; one
backend object serves attention, norms and RoPE; outputs are snapshots without per-step copies."""
from __future__ import annotations

import pytest
import torch

from kiln.engine import LLM, SamplingParams, attention, cpu_kernels, cpu_library, cpu_ops
from kiln.engine.kernels.backend import get_backend
from kiln.engine.kernels.norm_rope import cos_sin_cache, rms_norm_ref, rope_ref
from kiln.engine.llama import Linear, rope_inv_freq
from test_engine_generate import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Conversions to host values: what a host sync looks like from Python.
SYNCS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared two-core machine: see test_engine_generate's one_thread
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["torch", "cpu"])
def llm(request) -> LLM:
    if request.param == "cpu":
        assert cpu_library.available(), cpu_library.unavailable_reason()
    # 16-token chunks: steps mix prefill chunks over a cached prefix with decodes.
    return LLM(dtype="float32", attention_backend=request.param, max_num_batched_tokens=16, max_model_len=256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_equals_unfused_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(37, 576, generator=gen).mul(4).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=gen).to(dtype)
    want, want_sum = rms_norm_ref(x, weight, 1e-5, residual)
    out, summed = cpu_ops.rms_norm(x.clone(), weight, 1e-5, residual.clone())
    assert torch.equal(out, want) and torch.equal(summed, want_sum)  # bit for bit, HF's rounding
    alone, same = cpu_ops.rms_norm(x, weight, 1e-5)
    assert torch.equal(alone, rms_norm_ref(x, weight, 1e-5)[0]) and same is x


def test_rope_equals_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    table = cos_sin_cache(rope_inv_freq(64, 10000.0, None), 512)
    positions = torch.randint(0, 512, (23,), generator=gen)
    q, k = torch.randn(23, 9, 64, generator=gen), torch.randn(23, 3, 64, generator=gen)
    got_q, got_k = cpu_ops.rope(torch.cat([q, k], 1), 9, cpu_ops.rope_prepare(positions, table))
    want_q, want_k = rope_ref(positions, q, k, table)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_one_backend_for_attention_norm_and_rope(llm: LLM) -> None:
    model = llm.engine.runner.model
    users = {id(m.backend) for m in model.modules() if hasattr(m, "backend")}
    assert users == {id(model.backend)} and model.backend.name == llm.engine.config.attention_backend
    ops = cpu_kernels if model.backend.name == "cpu" else cpu_ops  # the C++ ops, or their torch references
    assert model.backend.rms_norm is ops.rms_norm and model.backend.rope is ops.rope
    gemms = {m.gemm for m in model.modules() if isinstance(m, Linear)}
    assert gemms == {model.backend.linear}  # the GEMM comes from the same switch
    assert get_backend("auto", "cpu").name == "cpu"  # the op builds here, as the llm fixture asserts


def test_metadata_once_per_step_and_one_forward_per_step(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"steps": 0, "forwards": 0, "built": 0, "plans": 0}
    engine, model = llm.engine, llm.engine.runner.model

    def counting(key: str, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(engine, "step", counting("steps", engine.step))
    monkeypatch.setattr(model, "forward", counting("forwards", model.forward))
    monkeypatch.setattr(attention, "StepAttention", counting("built", attention.StepAttention))
    monkeypatch.setattr(attention, "plan_paged_attention", counting("plans", attention.plan_paged_attention))
    monkeypatch.setattr(attention, "plan_cpu_attention", counting("plans", attention.plan_cpu_attention))
    outs = llm.generate(PROMPTS[:4], GREEDY)
    assert all(len(o.token_ids) == 6 for o in outs)
    print(counts)
    assert counts["steps"] >= 10  # 4 prompts in 16-token chunks, then 6 tokens each
    assert counts["forwards"] == counts["steps"] == counts["built"]  # 30 layers, one of each per step
    # Every step that reads the cache plans its paged attention once: all but plain prefills.
    assert counts["steps"] - 1 <= counts["plans"] <= counts["steps"]


def test_no_host_sync_inside_the_layer_loop(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    model = llm.engine.runner.model
    where = {"layer": False}
    seen = {"in_layers": [], "outside": 0}

    def detecting(name: str):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if where["layer"]:
                seen["in_layers"].append(name)
            else:
                seen["outside"] += 1
            return original(self, *args, **kwargs)
        return wrapper

    hooks = [hook for layer in model.model.layers
             for hook in (layer.register_forward_pre_hook(lambda *_: where.update(layer=True)),
                          layer.register_forward_hook(lambda *_: where.update(layer=False)))]
    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, detecting(name))
    try:
        outs = llm.generate(PROMPTS[:4] + [PROMPTS[2] + " and"], GREEDY)  # the last one hits the prefix cache
    finally:
        for hook in hooks:
            hook.remove()
    assert all(len(o.token_ids) == 6 for o in outs)
    print(f"host conversions: {seen['outside']} outside the layers, {len(seen['in_layers'])} inside")
    assert seen["outside"] > 0  # the detector sees the per-step ones
    assert seen["in_layers"] == []


def test_outputs_are_snapshots(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("snap", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4, 5]
    assert [len(o.logprobs) for o in outputs] == [1, 2, 3, 4, 5]
    assert [o.new_token_ids for o in outputs] == [[t] for t in outputs[-1].token_ids]
    assert outputs[0].text == outputs[0].new_text and outputs[-1].text.startswith(outputs[1].text)
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode(PROMPTS[0])
