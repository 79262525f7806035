"""Weight-only quantization (kiln.engine.quantization, kiln.engine.awq): each format against its
error bound, the CPU packed matmuls against dequantize-then-matmul, AWQ against RTN, the module
swap through load_model / LLM / the server flag, and the real SmolLM2 in float32."""
from __future__ import annotations

import argparse
import copy

import pytest
import torch

from kiln.engine.awq import calibration_text, capture_inputs, search_scale
from kiln.engine.config import KV_CACHE_DTYPES, Config
from kiln.engine.loader import load_model
from kiln.engine.quantization import (
    QUANTIZATION_METHODS, Fp8Linear, Int4Linear, Int8Linear, QuantLinear, dequantize_fp8, dequantize_int4,
    dequantize_int8, fake_quantize, fake_quantize_int4, int4_group_size, quantize_fp8, quantize_int4, quantize_int8,
    quantize_model, resident_weight_bytes)
from test_model import forward_prefill

# Lewis Carroll, Alice's Adventures in Wonderland (1865), chapter 1: public domain (Project Gutenberg #11).
EVAL_TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
    "in it, \"and what is the use of a book,\" thought Alice \"without pictures or conversations?\" So she was "
    "considering in her own mind (as well as she could, for the hot day made her feel very sleepy and stupid), "
    "whether the pleasure of making a daisy-chain would be worth the trouble of getting up and picking the "
    "daisies, when suddenly a White Rabbit with pink eyes ran close by her. There was nothing so very remarkable "
    "in that; nor did Alice think it so very much out of the way to hear the Rabbit say to itself, \"Oh dear! "
    "Oh dear! I shall be late!\"")


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, and a few outliers
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n)[:, None]
    w[0, 3] = 5.0
    return w


def test_int8_error_within_half_a_step_per_channel() -> None:
    w = weights(64, 200)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (64,)
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("k, group", [(256, 128), (576, 64), (96, 32)])
def test_int4_error_within_half_a_step_per_group(k: int, group: int) -> None:
    assert int4_group_size(k) == group
    w = weights(48, k)
    packed, scales, zeros = quantize_int4(w)
    assert packed.shape == (48, k // 2) and packed.dtype == torch.uint8 and scales.shape == (48, k // group)
    assert int(zeros.max()) <= 15
    err = (dequantize_int4(packed, scales, zeros) - w).abs().view(48, -1, group)
    assert (err <= scales[..., None] / 2 * (1 + 1e-5)).all()
    torch.testing.assert_close(fake_quantize_int4(w, group), dequantize_int4(packed, scales, zeros))


def test_int4_layout_is_quant_gemms() -> None:
    # Not at the top: imported at collection, its kernels could be defined before test_kernels sets
    # TRITON_INTERPRET, and would not run on a CPU there.
    from kiln.engine.kernels import quant_gemm
    w = weights(32, 256)
    packed, scales, zeros = quantize_int4(w)
    torch.testing.assert_close(quant_gemm.dequantize_w4(packed, scales, zeros, 128),
                               dequantize_int4(packed, scales, zeros))


def test_fp8_relative_error_of_e4m3() -> None:
    w = weights(64, 200)
    q, scales = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    err = (dequantize_fp8(q, scales) - w).abs()
    # 3 mantissa bits: half a unit in the last place is 2^-4 relative; subnormals (below 2^-6) step 2^-9
    assert (err <= w.abs() * 2 ** -4 + scales[:, None] * 2 ** -10 + 1e-12).all()


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="int4-rtn"):
        Config(quantization="int3")
    with pytest.raises(ValueError, match="unknown quantization method 'q2'.*int8"):
        quantize_model(torch.nn.Linear(4, 4), "q2")
    with pytest.raises(ValueError, match="in_features=100"):
        quantize_int4(torch.randn(16, 100))
    with pytest.raises(ValueError, match="in_features=48"):
        int4_group_size(48)
    assert set(QUANTIZATION_METHODS) == {"none", "int8", "int4", "int4-rtn", "fp8"}


@pytest.mark.parametrize("in_features", [100, 130])
def test_int8_in_bf16_with_a_width_torchs_kernel_cannot_take_is_dequantized(in_features: int) -> None:
    """torch's int8 kernel with bf16 activations returned inf/NaN, or crashed the process, for an
    input width that is no multiple of 16."""
    q, scales = quantize_int8(weights(37, in_features))
    layer = Int8Linear(q, scales, dtype=torch.bfloat16)
    assert layer.kernel == "dequantize"
    x = torch.randn(5, in_features).to(torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), x.float() @ dequantize_int8(q, scales).T, rtol=0.02, atol=0.1)


@pytest.mark.parametrize("rows", [1, 3])
def test_int8_packed_matmul_matches_dequantized(rows: int) -> None:
    w, bias = weights(96, 256), torch.randn(96)
    q, scales = quantize_int8(w)
    x = torch.randn(rows, 256)
    layer = Int8Linear(q, scales, bias=bias)
    assert layer.kernel == "weight_int8pack_mm"
    ref = x @ dequantize_int8(q, scales).T + bias
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-4)
    # the op itself at more rows (the layer takes the dequantize path there for float32)
    x16 = torch.randn(16, 256)
    torch.testing.assert_close(torch._weight_int8pack_mm(x16, q, scales), x16 @ dequantize_int8(q, scales).T,
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x16), x16 @ dequantize_int8(q, scales).T + bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k", [256, 576])
def test_int4_packed_matmul_matches_dequantized(k: int) -> None:
    w = weights(64, k)
    packed, scales, zeros = quantize_int4(w)
    deq = dequantize_int4(packed, scales, zeros)
    x = torch.randn(5, k)
    packed_layer = Int4Linear(packed, scales, zeros, kernel="weight_int4pack_mm_for_cpu")
    torch.testing.assert_close(packed_layer(x), x @ deq.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed_layer.dequantized_weight(), deq, rtol=1e-5, atol=1e-6)
    assert Int4Linear(packed, scales, zeros).kernel == "dequantize"  # float32: the op's reference path is slow
    bf16 = Int4Linear(packed, scales, zeros, dtype=torch.bfloat16)
    assert bf16.kernel == "weight_int4pack_mm_for_cpu"
    ref = (x.bfloat16().float() @ deq.T)
    assert ((bf16(x.bfloat16()).float() - ref).norm() / ref.norm()) < 1e-2
    odd = Int4Linear(*quantize_int4(weights(24, k)), dtype=torch.bfloat16)  # N % 16 != 0
    assert odd.kernel == "dequantize"


def test_fp8_linear_matches_dequantized() -> None:
    w = weights(64, 256)
    q, scales = quantize_fp8(w)
    x = torch.randn(7, 256)
    layer = Fp8Linear(q, scales)
    torch.testing.assert_close(layer(x), x @ dequantize_fp8(q, scales).T, rtol=1e-5, atol=1e-4)


def test_fp8_in_float16_does_not_overflow() -> None:
    # Codes up to 448 times activations of 20 summed over K=1536 pass float16's 65504 unless
    # the scales come first: the output was inf, the model's logits NaN.
    q, scales = quantize_fp8(weights(64, 1536) * 0.02)
    x = torch.randn(4, 1536) * 20
    out = Fp8Linear(q, scales, dtype=torch.float16)(x.half())
    reference = x @ dequantize_fp8(q, scales).T
    assert out.isfinite().all()
    assert ((out.float() - reference).norm() / reference.norm()) < 1e-2


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_activation_aware_scaling_beats_plain_rounding_on_salient_channels(method: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g)
    salient = torch.tensor([5, 77, 200, 301, 450])
    def acts(rows: int) -> torch.Tensor:
        x = torch.randn(rows, 512, generator=g)
        x[:, salient] *= 25
        return x
    s, alpha, _ = search_scale(w, acts(256), method)
    x = acts(256)  # held out
    ref = x @ w.T
    plain = (x @ fake_quantize(w, method).T - ref).pow(2).mean()
    aware = ((x / s) @ fake_quantize(w * s, method).T - ref).pow(2).mean()
    print(method, "alpha", alpha, "output MSE plain", plain.item(), "activation-aware", aware.item())
    assert alpha > 0 and aware < 0.7 * plain


@pytest.mark.parametrize("method", ["int8", "int4", "int4-rtn", "fp8"])
def test_load_model_quantizes_tiny_llama(tiny_llama_dir, method: str) -> None:
    fp = load_model(Config(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    quant = load_model(Config(model=str(tiny_llama_dir), dtype="float32", device="cpu", quantization=method))
    swapped = [m for m in quant.model.modules() if isinstance(m, QuantLinear)]
    assert len(swapped) == 4 * 2 and not any(isinstance(getattr(m, "weight", None), torch.nn.Parameter)
                                             for m in swapped)
    assert quant.model.lm_head.weight.dtype == torch.float32  # lm_head and embeddings stay float
    ids = [[3, 17, 42, 5, 9, 60, 11]]
    ref, out = forward_prefill(fp.model, ids), forward_prefill(quant.model, ids)
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()) < {"int8": 0.02, "fp8": 0.1}.get(method, 0.3)


def test_serve_and_generate_take_the_flag() -> None:
    from kiln.engine import cli, server
    for module in (server, cli):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        extra = ["--prompt", "x"] if module is cli else []
        assert parser.parse_args(["--quantization", "int4-rtn", *extra]).quantization == "int4-rtn"
        assert parser.parse_args(extra).quantization == "none"
        with pytest.raises(SystemExit):
            parser.parse_args(["--quantization", "int3", *extra])
    # The CLI spells the choices out (no torch import); they must stay the engine's.
    actions = {a.dest: a for a in parser._actions}
    assert tuple(actions["quantization"].choices) == QUANTIZATION_METHODS
    assert tuple(actions["kv_cache_dtype"].choices) == KV_CACHE_DTYPES


def perplexity(model, ids: list[int]) -> float:
    return torch.nn.functional.cross_entropy(forward_prefill(model, [ids])[:-1], torch.tensor(ids[1:])).exp().item()


def test_calibration_text_ships_with_the_package() -> None:
    text = calibration_text()
    assert text.startswith("It is a truth universally acknowledged") and len(text) > 2000


def test_calibration_longer_than_max_model_len_runs_in_windows(tiny_llama_dir) -> None:
    model = load_model(Config(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64)).model
    ids = [3 + i % 90 for i in range(150)]  # past the 64 positions the rotary table holds
    inputs = capture_inputs(model, ids)
    alone = capture_inputs(model, ids[:64])  # the first window is a sequence of its own
    for name, rows in inputs.items():
        assert rows.shape[0] == 150
        torch.testing.assert_close(rows[:64], alone[name])
    quantize_model(model, "int8", calibration_ids=ids)


def test_smollm2_int8_greedy_matches_float(smollm2_path, smollm2_fp32) -> None:
    from kiln.engine.llm import LLM
    from kiln.engine.sampling_params import SamplingParams
    prompts = ["The capital of France is", "Once upon a time, there was a"]
    llm = LLM(str(smollm2_path), dtype="float32", device="cpu", quantization="int8", kv_cache_memory=1 << 24,
              max_model_len=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = smollm2_fp32.tokenizer.encode(prompt)
        for _ in range(8):  # the float model's greedy continuation, recomputed without a cache
            ids.append(int(forward_prefill(smollm2_fp32.model, [ids])[-1].argmax()))
        assert out.token_ids == ids[-8:], (prompt, out.text)


def test_smollm2_int4_awq_beats_rtn_and_stays_packed(smollm2_dequantized) -> None:
    model, tokenizer = smollm2_dequantized.model, smollm2_dequantized.tokenizer
    ids = tokenizer.encode(EVAL_TEXT)
    float_bytes = resident_weight_bytes(model, linears_only=True)
    ppl = {"float32": perplexity(model, ids)}
    ratio = {}
    for method in ("int8", "int4-rtn", "int4"):
        quant = quantize_model(copy.deepcopy(model), method, tokenizer=tokenizer)
        ppl[method] = perplexity(quant, ids)
        ratio[method] = resident_weight_bytes(quant, linears_only=True) / float_bytes
        del quant
    print("perplexity", ppl, "resident linear bytes / float32", ratio)
    assert ppl["int8"] < 1.05 * ppl["float32"]
    assert ppl["int4"] < ppl["int4-rtn"]
    assert ratio["int8"] < 0.55 and ratio["int4"] < 0.35 and ratio["int4-rtn"] < 0.35
