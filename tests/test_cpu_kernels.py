"""The cpu backend's C++ norm, RoPE, KV store, bf16 GEMM and argmax (kiln.engine.cpu_kernels, csrc/norm_rope_cpu.cpp,
csrc/linear_cpu.cpp and csrc/argmax_cpu.cpp) against their torch references, their bad-input errors, and the GEMM
in the real SmolLM2 engine: as close to the float32 model as oneDNN's bf16 GEMM is."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # norm_rope's references sit beside Triton kernels (test_kernels)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kiln.engine import LLM, SamplingParams, attention, cpu_kernels, cpu_library  # noqa: E402
from kiln.engine.kernels.backend import get_backend  # noqa: E402
from kiln.engine.kernels.norm_rope import cos_sin_cache, rms_norm_ref, rope_ref  # noqa: E402
from kiln.engine.llama import Linear, rope_inv_freq  # noqa: E402
from test_engine_generate import PROMPTS  # noqa: E402

ULP_BF16 = 2.0 ** -7  # spacing of bf16 values in [1, 2): one rounding step, relative


@pytest.fixture(scope="module", autouse=True)
def library_built() -> None:
    assert cpu_library.available(), cpu_library.unavailable_reason()


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- bf16 GEMM ----

def bf16_gemm_supported() -> bool:
    return cpu_kernels.linear_op_supported()


@pytest.mark.parametrize("k,n", [(576, 960), (37, 70), (1536, 33), (64, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_op_equals_fp32_reference(k: int, n: int, bias: bool) -> None:
    """Rows 1..9 (tiles of 4 rows and their remainders), K with and without a 32-element tail, N
    odd: the exact fp32 product of the bf16 inputs, rounded once, as torch's bf16 GEMM is."""
    if not bf16_gemm_supported():  # this CPU has no AVX512-BF16: the op refuses and the backend keeps torch's
        with pytest.raises(RuntimeError, match="without AVX512-BF16"):
            torch.ops.kiln.linear_bf16(randn(1, k, seed=0, dtype=torch.bfloat16),
                                       randn(n, k, seed=1, dtype=torch.bfloat16), None)
        assert get_backend("cpu", "cpu").linear is F.linear
        return
    w, b = randn(n, k, seed=1, dtype=torch.bfloat16), randn(n, seed=2, dtype=torch.bfloat16) if bias else None
    for m in range(1, 10):
        x = randn(m, k, seed=m, dtype=torch.bfloat16)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        got = torch.ops.kiln.linear_bf16(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want, rtol=ULP_BF16, atol=1e-3)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=ULP_BF16, atol=1e-3)  # torch's own bf16 GEMM


def test_linear_takes_the_op_only_for_bf16_decode_rows() -> None:
    """Rows above MAX_ROWS go to oneDNN's GEMM on a packed copy of the weight, kept with it."""
    x32, w32 = randn(2, 64, seed=5), randn(96, 64, seed=6)
    assert torch.equal(cpu_kernels.linear(x32, w32), F.linear(x32, w32))  # float32: torch's GEMM
    backend = get_backend("cpu", "cpu")
    assert backend.linear is (cpu_kernels.linear if bf16_gemm_supported() else F.linear)
    assert get_backend("torch", "cpu").linear is F.linear
    if not bf16_gemm_supported():  # no AVX512-BF16: the backend keeps torch's GEMM, as just seen (and
        return  # oneDNN's packed bf16 GEMM needs AVX512 too)
    w = randn(96, 64, seed=3, dtype=torch.bfloat16)
    long = randn(cpu_kernels.MAX_ROWS + 1, 64, seed=4, dtype=torch.bfloat16)
    torch.testing.assert_close(cpu_kernels.linear(long, w), F.linear(long, w), rtol=ULP_BF16, atol=1e-3)
    if cpu_kernels.PACKING:
        packed = w._kiln_packed
        cpu_kernels.linear(long, w)
        assert w._kiln_packed is packed  # packed once
        w.data = w.data.clone()  # new storage: packed again
        cpu_kernels.linear(long, w)
        assert w._kiln_packed is not packed and w._kiln_packed[0] == w.data_ptr()


def test_linear_op_bad_input_is_a_clear_error() -> None:
    x, w = randn(2, 64, seed=7, dtype=torch.bfloat16), randn(8, 64, seed=8, dtype=torch.bfloat16)
    if not bf16_gemm_supported():
        with pytest.raises(RuntimeError, match="built for a CPU without AVX512-BF16"):
            torch.ops.kiln.linear_bf16(x, w, None)
        return
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        torch.ops.kiln.linear_bf16(x, w[:, :32], None)
    with pytest.raises(RuntimeError, match="bfloat16 x and weight"):
        torch.ops.kiln.linear_bf16(x.float(), w, None)
    with pytest.raises(RuntimeError, match="bias of N elements"):
        torch.ops.kiln.linear_bf16(x, w, torch.zeros(3, dtype=torch.bfloat16))


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    """Each engine-core prompt token's log-probability given the tokens before it, all prompts."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    return torch.tensor([e[t]["logprob"] for o in outs for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])


def test_engine_with_the_gemm_op_as_faithful_as_torch_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 in bf16 on the cpu backend, prompts run in chunks of MAX_ROWS tokens so every GEMM
    has decode-sized rows: the prompt tokens' log-probabilities with the op are as close to the
    float32 model's as with oneDNN's bf16 GEMM (greedy tokens are not compared: bf16 flips
    near-ties either way)."""
    chunks = {"max_model_len": 256, "max_num_batched_tokens": cpu_kernels.MAX_ROWS, "max_num_seqs": 1,
              "gguf_dequantize": True}  # float weights (the packaged GGUF is Q4_1)
    reference = prompt_logprobs(LLM(dtype="float32", attention_backend="cpu", **chunks))
    llm = LLM(dtype="bfloat16", attention_backend="cpu", **chunks)
    if not bf16_gemm_supported():  # no AVX512-BF16 here: every GEMM of the engine is torch's F.linear
        assert {m.gemm for m in llm.engine.runner.model.modules() if isinstance(m, Linear)} == {F.linear}
        return
    with_op = (prompt_logprobs(llm) - reference).abs()
    monkeypatch.setattr(cpu_kernels, "MAX_ROWS", 0)
    with_torch = (prompt_logprobs(llm) - reference).abs()
    print(f"|bf16 - fp32| prompt logprobs over {len(reference)} tokens: op mean {with_op.mean():.4f} "
          f"max {with_op.max():.3f}; oneDNN GEMM mean {with_torch.mean():.4f} max {with_torch.max():.3f}")
    assert with_op.mean() <= 1.25 * with_torch.mean() and with_op.max() <= 2 * with_torch.max() + 0.05


# ---- residual-add + RMSNorm ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_op_equals_reference(dtype: torch.dtype) -> None:
    x, residual = randn(37, 576, seed=10, dtype=dtype).mul(4), randn(37, 576, seed=11, dtype=dtype)
    weight = randn(576, seed=12, dtype=dtype)
    want, want_sum = rms_norm_ref(x, weight, 1e-5, residual)
    into = x.clone()
    out, summed = cpu_kernels.rms_norm(into, weight, 1e-5, residual)
    assert torch.equal(summed, want_sum) and summed.data_ptr() == into.data_ptr()  # the sum, written into x
    rtol = 1e-6 if dtype == torch.float32 else ULP_BF16  # a different order of the squares' sum
    torch.testing.assert_close(out, want, rtol=rtol, atol=1e-6)
    alone, same = cpu_kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(alone, rms_norm_ref(x, weight, 1e-5)[0], rtol=rtol, atol=1e-6)
    assert same is x


def test_norm_op_bad_input_is_a_clear_error() -> None:
    x, w = randn(3, 16, seed=13), randn(16, seed=14)
    with pytest.raises(RuntimeError, match="contiguous x \\[N, hidden\\] and weight \\[hidden\\]"):
        cpu_kernels.rms_norm(x, w[:8], 1e-5)
    with pytest.raises(RuntimeError, match="a contiguous residual like x"):
        cpu_kernels.rms_norm(x, w, 1e-5, x[:2])
    with pytest.raises(RuntimeError, match="weight and x differ in dtype"):
        cpu_kernels.rms_norm(x, w.bfloat16(), 1e-5)


# ---- RoPE ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [64, 32])  # full, and partial rotary (the table covers half of D)
def test_rope_op_equals_reference(dtype: torch.dtype, rotary: int) -> None:
    """q and k side by side in a view of a fused qkv output (rows strided past v), as the model calls it."""
    table = cos_sin_cache(rope_inv_freq(rotary, 10000.0, None), 512).to(dtype)
    positions = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(15))
    qkv = randn(23, (9 + 3 + 3) * 64, seed=16, dtype=dtype)
    q, k = qkv[:, :9 * 64].reshape(23, 9, 64).clone(), qkv[:, 9 * 64:12 * 64].reshape(23, 3, 64).clone()
    want_q, want_k = rope_ref(positions, q, k, table)
    v = qkv[:, 12 * 64:].clone()
    got_q, got_k = cpu_kernels.rope(qkv[:, :12 * 64].view(23, 12, 64), 9, cpu_kernels.rope_prepare(positions, table))
    rtol = 1e-6 if dtype == torch.float32 else ULP_BF16  # fused multiply-adds may round differently
    torch.testing.assert_close(got_q, want_q, rtol=rtol, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=rtol, atol=1e-6)
    assert got_q.data_ptr() == qkv.data_ptr()  # in place, in the qkv buffer
    assert torch.equal(qkv[:, 12 * 64:], v)  # v, past the rotated heads, untouched


def test_rope_op_bad_input_is_a_clear_error() -> None:
    table = cos_sin_cache(rope_inv_freq(64, 10000.0, None), 16)
    qk = randn(2, 4, 64, seed=17)
    with pytest.raises(RuntimeError, match="position 16 outside the table of 16"):
        torch.ops.kiln.rope_(qk, torch.tensor([0, 16]), table)
    with pytest.raises(RuntimeError, match="int64 positions \\[N\\]"):
        torch.ops.kiln.rope_(qk, torch.tensor([0, 1], dtype=torch.int32), table)
    with pytest.raises(RuntimeError, match="a table \\[P, R <= D\\] in qk's dtype"):
        torch.ops.kiln.rope_(qk, torch.tensor([0, 1]), table.bfloat16())


# ---- KV-cache store ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_op_equals_torch_store(dtype: torch.dtype) -> None:
    """k and v as views into a fused qkv output (strided rows), written at shuffled slots."""
    qkv = randn(5, (9 + 3 + 3) * 64, seed=20, dtype=dtype)
    k, v = qkv[:, 9 * 64:12 * 64].view(5, 3, 64), qkv[:, 12 * 64:].view(5, 3, 64)
    slots = torch.tensor([33, 0, 17, 5, 62])
    want_k, want_v = (torch.full((4, 16, 3, 64), float("nan"), dtype=dtype) for _ in range(2))
    attention.write_kvcache(k, v, want_k, want_v, slots)
    got_k, got_v = (torch.full((4, 16, 3, 64), float("nan"), dtype=dtype) for _ in range(2))
    cpu_kernels.write_kvcache(k, v, got_k, got_v, slots)
    assert torch.equal(got_k.nan_to_num(7.0), want_k.nan_to_num(7.0))  # written rows equal, the rest untouched
    assert torch.equal(got_v.nan_to_num(7.0), want_v.nan_to_num(7.0))
    heads = qkv[:, 9 * 64:].view(5, 6, 64)[:, ::2]  # heads strided too (every other one)
    attention.write_kvcache(heads, heads, want_k, want_v, slots)
    cpu_kernels.write_kvcache(heads, heads, got_k, got_v, slots)
    assert torch.equal(got_k.nan_to_num(7.0), want_k.nan_to_num(7.0))


def test_store_op_bad_input_is_a_clear_error() -> None:
    k = v = randn(2, 3, 64, seed=21)
    cache = torch.zeros(4, 16, 3, 64)
    with pytest.raises(RuntimeError, match="slot 64 outside the pool of 64"):
        torch.ops.kiln.store_kvcache(k, v, cache, cache.clone(), torch.tensor([0, 64]))
    with pytest.raises(RuntimeError, match="differ in dtype"):
        torch.ops.kiln.store_kvcache(k, v, cache.bfloat16(), cache.bfloat16(), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="int64 slot_mapping \\[N\\]"):
        torch.ops.kiln.store_kvcache(k, v, cache, cache.clone(), torch.tensor([0, 1], dtype=torch.int32))


# ---- the sampler's argmax ----

@pytest.mark.parametrize("m,v", [(1, 49152), (16, 49152), (3, 17), (5, 15), (2, 1), (7, 1000)])
def test_argmax_op_equals_torch(m: int, v: int) -> None:
    rows = randn(m, v, seed=m * v)
    assert torch.equal(cpu_kernels.argmax_rows(rows), rows.argmax(dim=-1))
    ties = torch.randint(0, 3, (m, v), generator=torch.Generator().manual_seed(v)).float()  # many equal maxima
    assert torch.equal(cpu_kernels.argmax_rows(ties), ties.argmax(dim=-1))  # the first one, as torch
    wide = randn(v, m + 1, seed=5).t()[:m]  # not contiguous
    assert torch.equal(cpu_kernels.argmax_rows(wide), wide.argmax(dim=-1))


def test_argmax_op_on_masked_rows() -> None:
    rows = torch.full((4, 100), float("-inf"))
    rows[1, 98] = -1e30  # the only finite value, in the scalar tail past the 16-wide lanes
    rows[2, [3, 64, 99]] = 5.0
    rows[3, 40] = float("inf")
    assert cpu_kernels.argmax_rows(rows).tolist() == rows.argmax(dim=-1).tolist() == [0, 98, 3, 40]


def test_argmax_goes_to_torch_for_other_dtypes_and_the_op_refuses_them() -> None:
    rows = randn(3, 50, seed=8, dtype=torch.bfloat16)
    assert torch.equal(cpu_kernels.argmax_rows(rows), rows.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32 logits \\[M, V\\]"):
        torch.ops.kiln.argmax_rows(rows)
    with pytest.raises(RuntimeError, match="float32 logits"):
        torch.ops.kiln.argmax_rows(torch.zeros(3, 0))


def test_the_sampler_with_the_argmax_op_picks_torchs_tokens() -> None:
    from kiln.engine.sampler import Sampler
    from test_engine_sampler import make_seqs

    logits = randn(6, 49152, seed=9) * 4
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    logits[2, 100] = float("inf")
    for params in ([SamplingParams(temperature=0)] * 6, [SamplingParams(temperature=0.8, seed=3)] * 6):
        ours, _ = Sampler(seed=1, argmax=get_backend("cpu", "cpu").argmax)(logits, make_seqs(params))
        theirs, _ = Sampler(seed=1)(logits, make_seqs(params))
        assert ours == theirs
