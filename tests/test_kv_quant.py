"""Quantized KV cache (int8 / fp8 e4m3, a float16 scale per token and KV head; kiln.engine.kv_quant).

The store and attention kernels (Triton under the interpreter, as in test_kernels.py) and the
torch path against a torch reference that quantizes the same way (tight), and against attention
over the float cache (loose). The whole engine on a tiny Llama: Triton and torch pick the same
tokens. On the real SmolLM2-135M: greedy agreement with a float cache, teacher-forced, and the
blocks a 1 GiB budget holds. Bad input.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_kernels import DEVICE, DTYPES, MIXED, NAN, assert_close, greedy_tokens, paged_batch, poisoned  # noqa: E402
from test_kernels import tiny_llama  # noqa: E402, F401 (a fixture, requested by name)

from kiln.engine import kv_quant  # noqa: E402
from kiln.engine.config import Config  # noqa: E402
from kiln.engine.kernels import get_backend  # noqa: E402
from kiln.engine.kernels.kv_store import store_kvcache, store_kvcache_ref  # noqa: E402
from kiln.engine.kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from kiln.engine.kv_quant import SCALE_DTYPE, dequantize_kv, quantize_kv  # noqa: E402

FP8 = torch.float8_e4m3fn
CACHE_DTYPES = [pytest.param(torch.int8, id="int8"), pytest.param(FP8, id="fp8")]
# Attention over a quantized cache vs over the float cache, relative to the output's largest value
# (measured: int8 ~0.006, fp8 ~0.033 on the mixed batch).
VS_FULL_PRECISION = {torch.int8: 2e-2, FP8: 8e-2}


def poisoned_cache(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty quantized cache and its scales: every scale NaN, every value an impossible byte
    (int8 -128 is never stored, 0x7f is e4m3's NaN)."""
    values = torch.full(shape, -128 if dtype == torch.int8 else 0x7F, dtype=torch.int8, device=DEVICE).view(dtype)
    return values, torch.full(shape[:-1], NAN, dtype=SCALE_DTYPE, device=DEVICE)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_store_quantized_kvcache(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """Triton, the torch path and the reference store the same bytes and scales; the values
    read back are within half a quantization step."""
    gen = torch.Generator().manual_seed(7)
    # Heads of very different magnitudes, and one all-zero token (the smallest scale).
    k = (torch.randn(9, 3, 24, generator=gen) * torch.tensor([0.01, 1.0, 30.0])[:, None]).to(dtype).to(DEVICE)
    v = torch.randn(9, 3, 24, generator=gen).to(dtype).to(DEVICE)
    k[4] = 0
    slots = torch.tensor([3, 0, -1, 19, 7, 8, -1, 12, 1], device=DEVICE)
    stores = {"triton": store_kvcache, "torch": get_backend("torch", DEVICE).store_kvcache, "ref": store_kvcache_ref}
    caches = {}
    for name, store in stores.items():
        (k_cache, k_scales), (v_cache, v_scales) = (poisoned_cache((5, 4, 3, 24), cache_dtype) for _ in "kv")
        store(k, v, k_cache, v_cache, slots, k_scales, v_scales)
        caches[name] = (k_cache, v_cache, k_scales, v_scales)
    for name in ("triton", "torch"):
        for got, want in zip(caches[name][:2], caches["ref"][:2]):
            assert same_bytes(got, want), f"{name} stored other values than the reference"
        for got, want in zip(caches[name][2:], caches["ref"][2:]):
            assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), f"{name} stored other scales"
    k_cache, v_cache, k_scales, v_scales = caches["triton"]
    written = ~k_scales.view(-1, 3).isnan().all(-1)
    assert written.sum() == 7  # two tokens skipped, every other slot untouched
    keep = slots >= 0
    for cache, scales, x in ((k_cache, k_scales, k), (v_cache, v_scales, v)):
        values, s = cache.view(-1, 3, 24)[slots[keep]], scales.view(-1, 3)[slots[keep]].float()[..., None]
        y = x[keep].float() / s  # in units of the scale
        # e4m3 has 3 mantissa bits and subnormals 2^-9 apart; the float16 scale's rounding may clip by 2^-11.
        half_step = 0.5 if cache_dtype == torch.int8 else torch.clamp(y.abs() * 2 ** -4, min=2 ** -10)
        err = (dequantize_kv(values, s[..., 0], torch.float32) / s - y).abs()
        assert (err <= half_step + y.abs() * 2 ** -11 + 1e-6).all()


def test_fp8_store_rounds_ties_to_even() -> None:
    """Every midpoint between neighbouring e4m3 values, at scale 1 (each row's amax is 448):
    Triton's store rounds like torch's float8 cast."""
    grid = torch.arange(0x7F, dtype=torch.uint8).view(FP8).float()  # every finite value >= 0
    mids = (grid[:-1] + grid[1:]) / 2
    values = torch.cat([mids, -mids]).view(4, 1, 63)
    x = torch.cat([torch.full((4, 1, 1), 448.0), values], dim=2).to(DEVICE)
    (k_cache, k_scales), (v_cache, v_scales) = (poisoned_cache((1, 4, 1, 64), FP8) for _ in "kv")
    store_kvcache(x, x, k_cache, v_cache, torch.arange(4, device=DEVICE), k_scales, v_scales)
    assert torch.equal(k_scales, torch.ones_like(k_scales))
    assert same_bytes(k_cache.view(4, 1, 64), x.to(FP8))


def quantized_batch(batch: dict, cache_dtype: torch.dtype) -> dict:
    """paged_batch's float caches quantized; their unused (NaN) slots get NaN scales, so a kernel
    that reads one poisons its output."""
    out = dict(batch)
    for name in ("k", "v"):
        cache = batch[f"{name}_cache"]
        values, scales = quantize_kv(cache.nan_to_num(0.0), cache_dtype)
        scales[cache.isnan().all(-1)] = NAN
        out[f"{name}_cache"], out[f"{name}_scales"] = values, scales
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_paged_attention_over_quantized_cache(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    batch = paged_batch(*MIXED, 6, 2, 32, dtype, block_size=16, seed=1)
    quantized = quantized_batch(batch, cache_dtype)
    ref = paged_attention_ref(**quantized)
    out = poisoned(batch["q"].shape, dtype)
    paged_attention(**quantized, num_splits=1, out=out)
    assert_close(out, ref)
    assert_close(paged_attention(**quantized, num_splits=3), ref)
    assert_close(get_backend("torch", DEVICE).paged_attention(**quantized), ref)
    full = paged_attention_ref(**batch)
    err = float((out.float() - full.float()).abs().max() / full.float().abs().max())
    assert err <= VS_FULL_PRECISION[cache_dtype], f"{err:.3f} off attention over the float cache"


def test_bad_kv_cache_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8, got 'int3'"):
        Config(kv_cache_dtype="int3")
    assert Config(kv_cache_dtype="int8", device="cpu").kv_cache_torch_dtype == torch.int8
    assert Config(dtype="float16", device="cpu").kv_cache_torch_dtype == torch.float16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="compute capability >= 8.9, this GPU has 8.0"):
        Config(kv_cache_dtype="fp8", device="cuda", attention_backend="triton").kv_cache_torch_dtype
    monkeypatch.setattr(kv_quant, "FP8_DTYPE", None)  # a torch without float8
    with pytest.raises(ValueError, match="needs torch.float8_e4m3fn"):
        Config(kv_cache_dtype="fp8", device="cpu").kv_cache_torch_dtype
    # A quantized cache without its scales, or scales for a float one.
    k = torch.zeros(2, 1, 8, device=DEVICE)
    cache = torch.zeros(1, 4, 1, 8, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scales and v_scales"):
        store_kvcache(k, k, cache, cache, torch.arange(2, device=DEVICE))
    with pytest.raises(ValueError, match="not quantized"):
        store_kvcache(k, k, cache.float(), cache.float(), torch.arange(2, device=DEVICE), cache[..., 0], None)


@pytest.mark.parametrize("module", ["cli", "server"])
def test_kv_cache_dtype_flag(module: str) -> None:
    from kiln.engine import cli, server
    parser = argparse.ArgumentParser(exit_on_error=False)
    (cli if module == "cli" else server).add_arguments(parser)
    base = ["--prompt", "hi"] if module == "cli" else []
    assert parser.parse_args(base).kv_cache_dtype == "auto"
    assert parser.parse_args(base + ["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'int3'"):
        parser.parse_args(base + ["--kv-cache-dtype", "int3"])


# --- the real SmolLM2-135M -------------------------------------------------------------------

NEW_TOKENS = 32
GiB = 1 << 30


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M in float32, loaded once. make_llm(**config) builds an LLM over these weights
    (the KV pool depends only on the config); each one rebinds the attention layers to its own
    pool, so only the latest one built may run."""
    from kiln.engine import LLM, llm_engine
    from kiln.engine.loader import load_model
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: see test_engine_generate.py
    loaded = load_model(Config(dtype="float32", device=DEVICE))

    def make_llm(**config) -> LLM:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(llm_engine, "load_model", lambda _: loaded)
            return LLM(**{"dtype": "float32", "device": DEVICE, **config})

    yield loaded, make_llm
    torch.set_num_threads(before)


def test_quantized_cache_holds_about_twice_the_blocks(smollm2) -> None:
    """Blocks that a 1 GiB budget holds, read off the pools the engine allocates. Per token and
    KV head SmolLM2 (head_dim 64) stores 64 values: 128 bytes in bf16, 256 in fp32, and 64 + a
    2-byte scale = 66 in int8/fp8, so 128 / 66 = 1.94x bf16's blocks and 3.88x fp32's."""
    from kiln.engine.model_runner import kv_block_bytes
    _, make_llm = smollm2
    blocks = {}
    for dtype, kv in (("bfloat16", "auto"), ("float32", "auto"), ("float32", "int8"), ("float32", "fp8"),
                      ("bfloat16", "int8")):
        engine = make_llm(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=GiB).engine
        runner = engine.runner
        allocated = runner.kv_cache.nbytes + (runner.kv_scales.nbytes if runner.kv_scales is not None else 0)
        block_bytes = kv_block_bytes(engine.model_config, engine.config.block_size, runner.kv_cache.dtype)
        assert allocated == runner.num_blocks * block_bytes and GiB - block_bytes < allocated <= GiB
        assert engine.block_manager.num_blocks == runner.num_blocks
        blocks[dtype if kv == "auto" else f"{kv}/{dtype}"] = runner.num_blocks
    print(f"\nKV blocks of 16 tokens per GiB: {blocks}")
    assert blocks["int8/float32"] == blocks["fp8/float32"] == blocks["int8/bfloat16"]  # the model dtype is moot
    assert 1.9 < blocks["int8/float32"] / blocks["bfloat16"] < 2
    assert 3.8 < blocks["int8/float32"] / blocks["float32"] < 4


@pytest.fixture(scope="module")
def greedy_reference(smollm2) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy continuations) of the engine with a float32 KV cache."""
    from test_engine_generate import PROMPTS

    from kiln.engine import SamplingParams
    llm = smollm2[1](max_model_len=512)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return prompts, [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("kv_cache_dtype,floor", [("int8", 0.97), ("fp8", 0.9)])
def test_greedy_agreement_with_float_cache(smollm2, greedy_reference, kv_cache_dtype: str, floor: float) -> None:
    """Teacher-forced: fed the float-cache run's tokens, the quantized-cache engine's greedy pick
    at each position matches the float-cache pick. Free-running (each engine its own tokens), the
    share of tokens before the first divergence is reported."""
    from kiln.engine import SamplingParams
    from kiln.engine.evaluate import Scorer, greedy_agreement
    prompts, reference = greedy_reference
    llm = smollm2[1](max_model_len=512, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.kv_cache.dtype == {"int8": torch.int8, "fp8": FP8}[kv_cache_dtype]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    free = [o.token_ids for o in llm.generate(prompts, params)]
    same_prefix = [next((i for i, (a, b) in enumerate(zip(r, f)) if a != b), len(r)) for r, f in zip(reference, free)]
    # Through the engine's own KV pool, in chunks, so every position reads K/V back from the cache.
    scorer = Scorer(llm.engine.runner.model, llm.engine.runner, llm.engine.config.block_size, through_cache=True)
    logits = scorer.logits([p + r for p, r in zip(prompts, reference)])
    picks = [lg[len(p) - 1:len(p) - 1 + len(r)].argmax(-1).tolist() for lg, p, r in zip(logits, prompts, reference)]
    agreement = greedy_agreement(reference, picks)
    print(f"\n{kv_cache_dtype} KV cache: teacher-forced greedy agreement {agreement:.4f} over "
          f"{sum(map(len, reference))} tokens; free-running, tokens before the first divergence "
          f"{sum(same_prefix)}/{sum(map(len, reference))} {same_prefix}")
    assert agreement >= floor


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_engine_triton_matches_torch_over_quantized_cache(tiny_llama: str, kv_cache_dtype: str) -> None:
    """The whole engine (chunked prefill, prefix hit, decodes) on a quantized cache: the Triton
    kernels and the torch path pick the same greedy tokens."""
    torch_tokens, torch_cached = greedy_tokens(tiny_llama, "torch", kv_cache_dtype=kv_cache_dtype)
    triton_tokens, triton_cached = greedy_tokens(tiny_llama, "triton", kv_cache_dtype=kv_cache_dtype)
    assert torch_cached == triton_cached == 32
    assert triton_tokens == torch_tokens
