"""Triton kernels against their pure-torch references, run by Triton's interpreter on CPU.

TRITON_INTERPRET must be set before any kernel is defined, so it is set before kiln's
kernel modules are imported. The interpreter computes bf16 wrongly, so only fp32 and fp16
are tested here; TRITON_INTERPRET=0 on a CUDA machine runs this file on the GPU, bf16 included.
Outputs are poisoned with NaN first, so an element a kernel fails to write fails the test;
unused cache slots and padded block-table entries hold NaN too, so a kernel that reads
past a sequence's length fails as well.
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kiln.engine.kernels import get_backend, int4_gemv, quant_gemm, tuned  # noqa: E402
from kiln.engine.kernels.backend import resolve_backend_name  # noqa: E402
from kiln.engine.kernels.kv_store import store_kvcache, store_kvcache_ref  # noqa: E402
from kiln.engine.kernels.norm_rope import (cos_sin_cache, rms_norm, rms_norm_ref, rope, rope_ref,  # noqa: E402
                                           rope_store)
from kiln.engine.kernels.paged_attention import paged_attention, paged_attention_ref, tile_config  # noqa: E402
from kiln.engine.kernels.quant_gemm import (dequantize_w4, dequantize_w8, pack_int4, quantize_w4,  # noqa: E402
                                            quantize_w8, unpack_int4, w4a16_gemm, w4a16_gemm_ref, w8a16_gemm,
                                            w8a16_gemm_ref)

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
NAN = float("nan")


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), "kernel left unwritten (NaN) elements or read poisoned memory"
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)
    assert err <= TOL[out.dtype], f"relative error {err:.2e} > {TOL[out.dtype]:.0e}"


def poisoned(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(tuple(shape), NAN, dtype=dtype, device=DEVICE)


def paged_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, block_size: int, seed: int) -> dict:
    """A flat varlen batch over a scattered paged cache whose unused slots hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3  # spare blocks stay NaN; block 0 pads the tables
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros((len(seq_lens), max(blocks) + 1), dtype=torch.int32)
    valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, (n, s) in enumerate(zip(blocks, seq_lens)):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        pos = torch.arange(s)
        valid[tables[b, pos // block_size].long() * block_size + pos % block_size] = True
    caches = []
    for _ in range(2):
        cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
        cache.view(-1, num_kv_heads, head_dim)[~valid] = NAN
        caches.append(cache.to(DEVICE))
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return dict(q=q.to(DEVICE), k_cache=caches[0], v_cache=caches[1], cu_seqlens_q=cu.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=tables.to(DEVICE),
                scale=head_dim ** -0.5, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))


# Mixed batch: fresh prefill, chunked prefill over a cached prefix (a prefix hit), decodes.
MIXED = ([19, 7, 1, 1, 5], [19, 37, 1, 50, 5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_paged_attention_mixed_batch(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    batch = paged_batch(*MIXED, num_heads, num_kv_heads, 32, dtype, block_size=16, seed=num_heads)
    out = poisoned(batch["q"].shape, dtype)
    paged_attention(**batch, num_splits=1, out=out)
    assert_close(out, paged_attention_ref(**batch))


@pytest.mark.parametrize("block_size,head_dim", [(8, 40), (32, 64)])
def test_paged_attention_odd_head_dim_and_block_sizes(block_size: int, head_dim: int) -> None:
    batch = paged_batch([33, 1, 3], [33, 70, 41], 6, 2, head_dim, torch.float32, block_size, seed=block_size)
    assert_close(paged_attention(**batch), paged_attention_ref(**batch))


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_decode_matches_single_pass(dtype: torch.dtype) -> None:
    batch = paged_batch([1, 1, 1], [300, 129, 17], 8, 2, 32, dtype, block_size=16, seed=3)
    single = paged_attention(**batch, num_splits=1)
    split = poisoned(single.shape, dtype)
    paged_attention(**batch, num_splits=5, out=split)  # the 17-token sequence leaves partitions empty
    assert_close(split, single)
    assert_close(split, paged_attention_ref(**batch))


@pytest.mark.parametrize("splits", [1, 5])
def test_tuned_decode_config(splits: int) -> None:
    """A tuned decode entry (only an override reaches the interpreter) changes tiles, not results."""
    batch = paged_batch([1, 1, 1], [300, 129, 17], 8, 2, 32, torch.float32, block_size=16, seed=3)
    key = f"decode{'-split' if splits > 1 else ''}-g4-d32"
    with tuned.override("paged_attention", key, {"BLOCK_N": 16, "num_warps": 8, "num_stages": 2}):
        assert tile_config(1, 4, 32, torch.device(DEVICE), splits > 1)["BLOCK_N"] == 16
        out = poisoned(batch["q"].shape, torch.float32)
        paged_attention(**batch, num_splits=splits, out=out)
    assert_close(out, paged_attention_ref(**batch))
    assert tile_config(1, 4, 32, torch.device(DEVICE), splits > 1)["BLOCK_N"] == 64  # defaults again


def test_tuned_prefill_config() -> None:
    """A tuned prefill entry may set BLOCK_M too: the tokens a program takes follow from it."""
    batch = paged_batch(*MIXED, 8, 2, 32, torch.float32, block_size=16, seed=5)
    with tuned.override("paged_attention", "prefill-g4-d32", {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 2}):
        tiles = tile_config(40, 4, 32, torch.device(DEVICE))
        assert (tiles["BLOCK_M"], tiles["BLOCK_Q"], tiles["BLOCK_N"]) == (32, 8, 16)
        out = poisoned(batch["q"].shape, torch.float32)
        paged_attention(**batch, out=out)
    assert_close(out, paged_attention_ref(**batch))
    assert tile_config(40, 4, 32, torch.device(DEVICE))["BLOCK_Q"] == 16  # defaults again


def test_split_kv_on_mixed_batch() -> None:
    batch = paged_batch(*MIXED, 6, 2, 32, torch.float32, block_size=16, seed=4)
    assert_close(paged_attention(**batch, num_splits=3), paged_attention_ref(**batch))


def test_torch_backend_attention_matches_reference() -> None:
    """The model's own torch path (kiln.engine.attention) against the kernel reference."""
    batch = paged_batch(*MIXED, 6, 2, 32, torch.float32, block_size=16, seed=5)
    assert_close(get_backend("torch", DEVICE).paged_attention(**batch), paged_attention_ref(**batch))


def test_paged_attention_rejects_mismatched_heads() -> None:
    batch = paged_batch([1], [5], 6, 2, 32, torch.float32, block_size=16, seed=6)
    batch["q"] = batch["q"][:, :5]
    with pytest.raises(ValueError, match="GQA"):
        paged_attention(**batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_scatters_and_skips(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(9, 3, 24, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(9, 3, 24, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([3, 0, -1, 19, 7, 8, -1, 12, 1], device=DEVICE)
    k_cache, v_cache = poisoned((5, 4, 3, 24), dtype), poisoned((5, 4, 3, 24), dtype)
    store_kvcache(k, v, k_cache, v_cache, slots)
    k_ref, v_ref = poisoned((5, 4, 3, 24), dtype), poisoned((5, 4, 3, 24), dtype)
    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache.nan_to_num(123.0), k_ref.nan_to_num(123.0))
    assert torch.equal(v_cache.nan_to_num(123.0), v_ref.nan_to_num(123.0))
    written = k_cache.view(-1, 3, 24)[~k_cache.view(-1, 3, 24).isnan().all(-1).all(-1)]
    assert written.shape[0] == 7  # two tokens skipped, every other slot untouched


def test_store_kvcache_rejects_wrong_slot_count() -> None:
    k = torch.zeros(4, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(k, k, torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping contiguous"):  # a view: read with the wrong stride
        store_kvcache(k, k, torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8), torch.zeros(8, dtype=torch.int64)[::2])


def test_kernels_refuse_strided_index_and_output_views() -> None:
    """Views the kernels would read or write with the wrong stride, silently: refused first."""
    batch = paged_batch([1], [5], 6, 2, 32, torch.float32, block_size=16, seed=6)
    wide = batch["block_tables"].repeat_interleave(2, dim=1)
    with pytest.raises(ValueError, match="block table row contiguous"):
        paged_attention(**{**batch, "block_tables": wide[:, ::2]})
    with pytest.raises(ValueError, match="out must be shaped like q"):
        paged_attention(**batch, out=torch.empty(*batch["q"].shape[:2], 64, device=DEVICE)[..., ::2])
    qweight, scales = quantize_w8(torch.randn(24, 64))
    with pytest.raises(ValueError, match="last dim contiguous"):
        w8a16_gemm(torch.randn(4, 64, device=DEVICE), qweight.to(DEVICE), scales.to(DEVICE),
                   out=torch.empty(24, 4, device=DEVICE).t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(8)
    x, res, w = (torch.randn(*s, generator=gen).to(dtype).to(DEVICE) for s in [(7, 96), (7, 96), (96,)])
    residual = res if with_residual else None
    out, res_out = poisoned(x.shape, dtype), poisoned(x.shape, dtype)
    normed, new_res = rms_norm(x, w, 1e-6, residual, out=out, residual_out=res_out)
    ref_normed, ref_res = rms_norm_ref(x, w, 1e-6, residual)
    assert_close(normed, ref_normed)
    assert_close(new_res, ref_res)
    assert with_residual or new_res is x
    if with_residual:  # the sum written over x in place: added all the same (it was skipped)
        inplace = x.clone()
        normed, new_res = rms_norm(inplace, w, 1e-6, residual, residual_out=inplace)
        assert_close(normed, ref_normed)
        assert_close(new_res, ref_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [32, 16])  # full and partial rotary
def test_rope(dtype: torch.dtype, rotary_dim: int) -> None:
    gen = torch.Generator().manual_seed(9)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    cos_sin = cos_sin_cache(inv_freq, 200).to(DEVICE)
    pos = torch.randint(0, 200, (11,), generator=gen).to(DEVICE)
    q = torch.randn(11, 6, 32, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(11, 2, 32, generator=gen).to(dtype).to(DEVICE)
    q_out, k_out = poisoned(q.shape, dtype), poisoned(k.shape, dtype)
    rope(pos, q, k, cos_sin, q_out=q_out, k_out=k_out)
    q_ref, k_ref = rope_ref(pos, q, k, cos_sin)
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store(dtype: torch.dtype) -> None:
    """RoPE with the K/V store fused: q as rope's, the cache as store_kvcache's after rope (slot -1
    skips a token; partial rotary passes the tail through); quantized caches are refused."""
    gen = torch.Generator().manual_seed(18)
    n, hq, hkv, d = 7, 4, 2, 32
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype).to(DEVICE) for h in (hq, hkv, hkv))
    cos_sin = cos_sin_cache(1.0 / 10000 ** (torch.arange(0, 24, 2).float() / 24), 64).to(DEVICE)  # rotary dim 24
    positions = torch.randint(0, 64, (n,), generator=gen).to(DEVICE)
    slots = torch.tensor([5, 0, -1, 17, 30, -1, 2]).to(DEVICE)
    k_cache, v_cache = (torch.full((4, 8, hkv, d), NAN, dtype=dtype, device=DEVICE) for _ in range(2))
    q_out = poisoned(q.shape, dtype)
    rope_store(positions, q, k, v, cos_sin, k_cache, v_cache, slots, q_out=q_out)
    q_ref, k_ref = rope_ref(positions, q, k, cos_sin)
    k_ref_cache, v_ref_cache = (torch.full_like(k_cache, NAN) for _ in range(2))
    store_kvcache_ref(k_ref, v, k_ref_cache, v_ref_cache, slots)
    assert_close(q_out, q_ref)
    for out, ref in ((k_cache, k_ref_cache), (v_cache, v_ref_cache)):
        assert torch.equal(out.isnan(), ref.isnan())  # the same slots written, the others untouched
        assert_close(out.nan_to_num(), ref.nan_to_num())
    with pytest.raises(ValueError, match="float caches"):
        rope_store(positions, q, k, v, cos_sin, k_cache.to(torch.int8), v_cache.to(torch.int8), slots)


def test_rope_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)
    pos = torch.tensor([0, 5, 17, 3])
    q, k = torch.randn(4, 4, 32), torch.randn(4, 2, 32)
    emb = torch.cat([torch.outer(pos.float(), inv_freq)] * 2, dim=-1)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())  # unsqueeze_dim=1: heads at dim 1
    q_out, k_out = rope(pos.to(DEVICE), q.to(DEVICE), k.to(DEVICE), cos_sin_cache(inv_freq, 20).to(DEVICE))
    assert_close(q_out.cpu(), q_hf)
    assert_close(k_out.cpu(), k_hf)


def half_step(dtype: torch.dtype, largest_code: int) -> float:
    """A quantizer's round trip is off by at most half a step, plus the step's own rounding to
    `dtype` times the largest code (bf16 scales carry 8 bits: 127 codes can drift a whole step)."""
    return 0.5 * 1.01 + largest_code * torch.finfo(dtype).eps / 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [5, 33])
def test_w8a16_gemm(dtype: torch.dtype, m: int) -> None:
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(m, 192, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(48, 192, generator=gen).to(dtype)
    qweight, scales = quantize_w8(w)
    assert (dequantize_w8(qweight, scales) - w.float()).abs().max() <= scales.float().max() * half_step(dtype, 127)
    out = poisoned((m, 48), dtype)
    w8a16_gemm(x, qweight.to(DEVICE), scales.to(DEVICE), out=out)
    assert_close(out, w8a16_gemm_ref(x, qweight.to(DEVICE), scales.to(DEVICE)))
    ragged = torch.zeros(48, 130, dtype=torch.int8, device=DEVICE)  # K of no whole groups: 4 scales of 32
    with pytest.raises(ValueError, match="w8a16: want qweight"):
        w8a16_gemm(torch.zeros(m, 130, dtype=dtype, device=DEVICE), ragged, torch.ones(48, 4, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_w4a16_gemm(dtype: torch.dtype, group_size: int, symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(group_size)
    x = torch.randn(2, 3, 256, generator=gen).to(dtype).to(DEVICE)  # leading dims flatten
    w = torch.randn(40, 256, generator=gen).to(dtype)
    qweight, scales, zeros = quantize_w4(w, group_size, symmetric)
    assert (zeros is None) == symmetric
    assert torch.equal(pack_int4(unpack_int4(qweight)), qweight)
    err = (dequantize_w4(qweight, scales, zeros, group_size) - w.float()).view(40, -1, group_size)
    assert (err.abs().amax(-1) <= scales.float() * half_step(dtype, 15)).all()
    args = [t.to(DEVICE) if t is not None else None for t in (qweight, scales, zeros)]
    out = poisoned((2, 3, 40), dtype)
    w4a16_gemm(x, *args, group_size, out=out)
    assert_close(out, w4a16_gemm_ref(x, *args, group_size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_quant_gemm_split_k(dtype: torch.dtype, bits: int) -> None:
    """A tuned split-K entry: K = 320 in 4 partitions of 96, 96, 96, 32 (a ragged last one)."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5, 320, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(40, 320, generator=gen).to(dtype)
    if bits == 8:
        args = [t.to(DEVICE) for t in quantize_w8(w)]
        kernel, ref, group = w8a16_gemm, w8a16_gemm_ref, 0
    else:
        args = [t.to(DEVICE) for t in quantize_w4(w, 64)] + [64]
        kernel, ref, group = w4a16_gemm, w4a16_gemm_ref, 64
    config = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 4, "num_warps": 2, "num_stages": 2}
    out = poisoned((5, 40), dtype)
    with tuned.override("quant_gemm", f"w{bits}-g{group}-m16", config):
        assert quant_gemm.tile_config(5, group, torch.device(DEVICE), bits == 4)["SPLIT_K"] == 4
        kernel(x, *args, out=out)
    assert_close(out, ref(x, *args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["w8", "w4-zeros", "w4-symmetric", "w4-mins"])
@pytest.mark.parametrize("m", [1, 3])
def test_quant_gemv(dtype: torch.dtype, kind: str, m: int) -> None:
    """A tuned GEMV entry (a row a program, no tensor cores), split over K, each weight format."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(m, 256, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(40, 256, generator=gen).to(dtype)
    if kind == "w8":
        args, kw, group = [t.to(DEVICE) for t in quantize_w8(w)], {}, 0
        kernel, ref = w8a16_gemm, w8a16_gemm_ref
    else:
        qweight, scales, zeros = quantize_w4(w, 64, symmetric=kind == "w4-symmetric")
        kw, group = {}, 64
        if kind == "w4-mins":  # GGUF Q4_1: q * s + m
            zeros, kw = None, {"mins": torch.randn(scales.shape, generator=gen).to(dtype).to(DEVICE)}
        args = [t.to(DEVICE) if t is not None else None for t in (qweight, scales, zeros)] + [group]
        kernel, ref = w4a16_gemm, w4a16_gemm_ref
    out = poisoned((m, 40), dtype)
    config = {"GEMV": 1, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2}
    with tuned.override("quant_gemm", f"w{8 if kind == 'w8' else 4}-g{group}-m{1 if m == 1 else 16}", config):
        kernel(x, *args, **kw, out=out)
    assert_close(out, ref(x, *args, **kw))


@pytest.mark.parametrize("script,args,expected", [
    ("tune_kernels.py", ["--keys", "w4-g128-m1", "w4-g999-m1"], "unknown --keys ['w4-g999-m1']; the keys are ["),
    ("kernels.py", ["--kernels", "w4a16_gemm", "flash"], "invalid choice: 'flash'")])
def test_gpu_benchmarks_refuse_unknown_selections(script: str, args: list[str], expected: str) -> None:
    """A mistyped --keys/--kernels exits 2 naming it (before looking for a GPU), not a run of nothing."""
    bench = Path(__file__).resolve().parent.parent / "bench"
    done = subprocess.run([sys.executable, str(bench / script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and expected in done.stderr, done.stderr


def test_kernel_benchmark_names_its_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/kernels.py --kernels picks cases by KERNELS: every case has a listed name and every name cases
    (the cases are only listed: their tensors are made on first use)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import kernels as bench_kernels

    assert {case.kernel for case in bench_kernels.cases(torch.float32, quick=False, device="cpu")} == set(
        bench_kernels.KERNELS)


def test_tuning_never_replaces_an_entry_with_a_slower_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --with, the candidates may not hold the file's entry: it is timed beside them and kept
    when it is faster. The GPU timer is the one stand-in (this machine has no GPU)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import tune_kernels
    held, faster = {"GEMV": 1, "WORDS": 1, "SPLIT_K": 16}, {"MAGIC": 3, "SPLIT_K": 8}
    times = {None: 10.0, str(held): 4.0, str(faster): 6.0, str({"MAGIC": 3}): 8.0}
    monkeypatch.setattr(tune_kernels, "time_candidates", lambda kernel, key, candidates, shapes, deadline: [
        [times[str(c) if c else None]] for c in candidates])
    for file_holds, chosen in ((held, held), (None, faster), ({"MAGIC": 3}, faster)):
        configs = {"quant_gemm": {"w4-g128-m1": file_holds}} if file_holds else {}
        tune_kernels.tune("quant_gemm", [("w4-g128-m1", [])], [{}, {"MAGIC": 3}, faster], math.inf, configs, [])
        assert configs["quant_gemm"]["w4-g128-m1"] == chosen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["w4-zeros", "w4-symmetric", "w4-mins"])
@pytest.mark.parametrize("magic,gemv", [(1, False), (2, False), (3, False), (1, True)])
def test_int4_codes_without_conversions(dtype: torch.dtype, kind: str, magic: int, gemv: bool) -> None:
    """The MAGIC configs build the codes by OR-ing them into a float's mantissa: results as exact
    as the converting kernel's, in the tensor-core GEMM and the GEMV, for every int4 format.
    MAGIC 3 does it in inline PTX, which only a GPU runs (test_gpu.py runs this file compiled)."""
    if magic == 3 and DEVICE == "cpu":
        pytest.skip("MAGIC 3 is inline PTX: the interpreter cannot run it; it runs compiled on a GPU")
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(3, 256, generator=gen).to(dtype).to(DEVICE)
    qweight, scales, zeros = quantize_w4(torch.randn(40, 256, generator=gen).to(dtype), 64,
                                         symmetric=kind == "w4-symmetric")
    kw = {}
    if kind == "w4-mins":
        zeros, kw = None, {"mins": torch.randn(scales.shape, generator=gen).to(dtype).to(DEVICE)}
    args = [t.to(DEVICE) if t is not None else None for t in (qweight, scales, zeros)] + [64]
    config = {"MAGIC": magic, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2, **({"GEMV": 1} if gemv else {})}
    out = poisoned((3, 40), dtype)
    with tuned.override("quant_gemm", "w4-g64-m16", config):
        w4a16_gemm(x, *args, **kw, out=out)
    assert_close(out, w4a16_gemm_ref(x, *args, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["w8", "w8-groups", "w4-zeros", "w4-symmetric", "w4-mins"])
@pytest.mark.parametrize("dequant", [1, 0])
def test_prefill_sized_gemm(dtype: torch.dtype, kind: str, dequant: int) -> None:
    """Above 16 rows the weight is dequantized whole, then multiplied by torch (cuBLAS on a GPU);
    a tuned DEQUANT 0 keeps the tensor-core kernel with 64-row tiles. K = 320: ragged tiles."""
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(33, 320, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(40, 320, generator=gen).to(dtype)
    kw, group = {}, 64
    if kind.startswith("w8"):
        qweight, scales = quantize_w8(w)
        if kind == "w8-groups":  # GGUF Q8_0: a scale per 32 columns
            scales = scales[:, None].repeat(1, 320 // 32) * torch.rand(40, 10, generator=gen).to(dtype)
            group = 32
        else:
            group = 0
        args = [qweight.to(DEVICE), scales.to(DEVICE)]
        kernel, ref = w8a16_gemm, w8a16_gemm_ref
    else:
        qweight, scales, zeros = quantize_w4(w, 64, symmetric=kind == "w4-symmetric")
        if kind == "w4-mins":
            zeros, kw = None, {"mins": torch.randn(scales.shape, generator=gen).to(dtype).to(DEVICE)}
        args = [t.to(DEVICE) if t is not None else None for t in (qweight, scales, zeros)] + [64]
        kernel, ref = w4a16_gemm, w4a16_gemm_ref
    assert quant_gemm.tile_config(33, group)["DEQUANT"] == 1
    out = poisoned((33, 40), dtype)
    with tuned.override("quant_gemm", f"w{8 if kind.startswith('w8') else 4}-g{group}-m64", {"DEQUANT": dequant}):
        kernel(x, *args, **kw, out=out)
    assert_close(out, ref(x, *args, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_on_16bit_weights(dtype: torch.dtype) -> None:
    """quant_gemm.linear: F.linear unless the GPU's tuned file names the weight's shape; then, for
    one row of x, the GEMV kernel (split over K here), matching F.linear."""
    gen = torch.Generator().manual_seed(15)
    w = torch.randn(40, 320, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(1, 320, generator=gen).to(dtype).to(DEVICE)
    ref = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
    assert torch.equal(quant_gemm.linear(x, w), torch.nn.functional.linear(x, w))  # no entry: cuBLAS/torch
    with tuned.override("gemv", "n40-k320", {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2}):
        assert_close(quant_gemm.linear(x, w), ref)
        rows = torch.randn(2, 320, generator=gen).to(dtype).to(DEVICE)  # not decode at batch 1
        assert torch.equal(quant_gemm.linear(rows, w), torch.nn.functional.linear(rows, w))
    with tuned.override("gemv", "n40-k320", None):  # None: as if the file had no entry
        assert torch.equal(quant_gemm.linear(x, w), torch.nn.functional.linear(x, w))
    assert_close(quant_gemm.gemv(x, w), ref)  # the defaults
    with pytest.raises(ValueError, match="rows contiguous in x's dtype"):
        quant_gemm.gemv(x, w.t().contiguous().t())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    from kiln.engine.kernels.activation import silu_mul, silu_mul_ref
    from kiln.engine.kernels.backend import torch_silu_mul
    gen = torch.Generator().manual_seed(16)
    gate_up = (torch.randn(5, 2 * 1500, generator=gen) * 4).to(dtype).to(DEVICE)  # 1500: two ragged blocks
    ref = silu_mul_ref(gate_up)
    out = silu_mul(gate_up)
    assert out.shape == (5, 1500) and out.is_contiguous()
    assert_close(out, ref)
    assert_close(torch_silu_mul(gate_up.clone()), ref)  # the torch backend's in-place version
    assert silu_mul(gate_up[:0]).shape == (0, 1500)
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(gate_up[:, :-1])


def test_int4_rejects_bad_groups() -> None:
    with pytest.raises(ValueError, match="group size"):
        quantize_w4(torch.randn(8, 96), group_size=48)
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_w4(torch.randn(8, 96), group_size=64)
    qweight, scales, zeros = quantize_w4(torch.randn(8, 128), group_size=64)
    with pytest.raises(ValueError, match=r"x must be float \[..., 128\]"):
        w4a16_gemm(torch.randn(2, 64), qweight, scales, zeros, 64)


def test_backend_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.engine import cpu_library
    assert get_backend("auto", "cpu").name == ("cpu" if cpu_library.available() else "torch")
    assert resolve_backend_name("auto", "cuda") == "triton"
    assert get_backend("triton", DEVICE).paged_attention is paged_attention  # the interpreter runs on CPU
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_backend("cudnn", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("triton", "cpu")
    from kiln.engine.config import Config
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Config(attention_backend="triton", device="cpu").resolved_attention_backend


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama (GQA 4:2) saved by transformers, with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    # A wide init makes logits peaked, so greedy picks are not near-ties that rounding could flip.
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def greedy_tokens(model: str, backend: str, **config: object) -> tuple[list[list[int]], int]:
    from kiln.engine import LLM, SamplingParams
    # A 32-token budget chunks the 45-token prompt and mixes prefill chunks with decodes.
    llm = LLM(model, dtype="float32", device=DEVICE, attention_backend=backend, block_size=16,
              max_num_batched_tokens=32, max_model_len=128, kv_cache_memory=1 << 20, **config)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 128, (n,), generator=gen).tolist() for n in (45, 20, 7)]
    first = llm.generate(prompts, params)
    again = llm.generate([prompts[0][:40] + [3, 4]], params)  # two cached blocks: a prefix hit
    return [o.token_ids for o in first + again], again[0].num_cached_tokens


def test_engine_triton_backend_matches_torch_greedy(tiny_llama: str) -> None:
    torch_tokens, torch_cached = greedy_tokens(tiny_llama, "torch")
    triton_tokens, triton_cached = greedy_tokens(tiny_llama, "triton")
    assert torch_cached == triton_cached == 32
    assert triton_tokens == torch_tokens
    assert all(len(t) == 6 for t in triton_tokens)


def test_kernels_compile_for_h100() -> None:
    """The interpreter does not check GPU-only rules (tensor-core tile minimums, loop-carried
    types): lower each kernel to an sm_90 cubin with Triton's bundled ptxas, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kiln.engine.kernels.gpu_compile", "--arch", "90"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("sm_90 ")]
    assert {line.split()[1] for line in compiled} == {"_paged_attention_kernel:", "_merge_splits_kernel:",
                                                      "_store_kvcache_kernel:", "_rms_norm_kernel:",
                                                      "_rope_kernel:", "_dequant_gemm_kernel:",
                                                      "_sum_splits_kernel:", "_dequant_gemv_kernel:",
                                                      "_silu_mul_kernel:", "_dequant_kernel:",
                                                      "_int4_words_gemv_kernel:"}
    assert all(int(line.split()[2]) > 0 for line in compiled)


def test_int4_word_gemv_loop_as_compiled_for_sm90() -> None:
    """bench/sass.py reads the K loop from the sm_90 cubin: with LATE_BIAS no float subtract a code is
    left (FADDs well under one a code), and the nibble mask, a kernel argument, is not re-made into a
    register before each AND-OR (no MOVs in the loop)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bench = Path(__file__).resolve().parent.parent / "bench"
    done = subprocess.run([sys.executable, str(bench / "sass.py"), "--late-bias", "1"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    census = dict(op.split(":") for op in done.stdout.splitlines()[-1].split())
    codes = int(re.search(r"a tile of (\d+) codes", done.stdout).group(1))
    assert int(census["FFMA"]) >= codes and int(census["FADD"]) < codes / 2 and "MOV" not in census, done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("script,args", [("kernels.py", ["--dtype", "float16"]),
                                         ("gpu_engine.py", ["--dtype", "float16"]), ("tune_kernels.py", [])])
def test_gpu_benchmarks_exit_clearly_without_cuda(script: str, args: list[str]) -> None:
    bench = Path(__file__).resolve().parent.parent / "bench"
    done = subprocess.run([sys.executable, str(bench / script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device found" in done.stderr


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["w4-zeros", "w4-symmetric", "w4-mins"])
@pytest.mark.parametrize("group,m,splits", [(32, 1, 2), (64, 3, 3), (128, 1, 3)])
@pytest.mark.parametrize("variants", [{}, {"PREFETCH": 1}, {"LATE_BIAS": 1}, {"PREFETCH": 1, "LATE_BIAS": 1},
                                      {"PREFETCH": 2}], ids=["plain", "prefetch", "late-bias", "both", "prefetch-2"])
def test_int4_words_gemv(dtype: torch.dtype, kind: str, group: int, m: int, splits: int,
                         variants: dict[str, int]) -> None:
    """WORDS: the GEMV reading int4 weights as int32 words (int4_gemv), each nibble of a word made a
    float where it stands (or moved to bits 12/16 first, its bias taken off a tile at once: LATE_BIAS),
    for every int4 format and group, split over K (3 splits: the sum's padded rows masked), N not a
    tile multiple, with and without the next tile (or two: PREFETCH 2) prefetched."""
    gen = torch.Generator().manual_seed(group + m)
    x = torch.randn(m, 384, generator=gen).to(dtype).to(DEVICE)
    qweight, scales, zeros = quantize_w4(torch.randn(40, 384, generator=gen).to(dtype), group,
                                         symmetric=kind == "w4-symmetric")
    kw = {}
    if kind == "w4-mins":
        zeros, kw = None, {"mins": torch.randn(scales.shape, generator=gen).to(dtype).to(DEVICE)}
    args = [t.to(DEVICE) if t is not None else None for t in (qweight, scales, zeros)] + [group]
    assert int4_gemv.as_words(args[0]) is not None
    config = {"GEMV": 1, "WORDS": 1, "BLOCK_N": 16, "BLOCK_K": min(group, 64), "SPLIT_K": splits, **variants}
    out = poisoned((m, 40), dtype)
    with tuned.override("quant_gemm", f"w4-g{group}-m{1 if m == 1 else 16}", config):
        w4a16_gemm(x, *args, **kw, out=out)
    assert_close(out, w4a16_gemm_ref(x, *args, **kw))


def test_int4_words_gemv_falls_back_off_word_boundaries() -> None:
    """A packed weight that does not start on a 4-byte boundary is read byte-wise instead: same result."""
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(1, 128, generator=gen).half().to(DEVICE)
    qweight, scales, zeros = quantize_w4(torch.randn(24, 128, generator=gen).half(), 64)
    # made on the device: a copy there would start on a fresh, aligned allocation
    shifted = torch.empty(qweight.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(qweight.shape)
    shifted.copy_(qweight)
    args = [shifted] + [t.to(DEVICE) for t in (scales, zeros)] + [64]
    assert int4_gemv.as_words(args[0]) is None
    config = {"GEMV": 1, "WORDS": 1, "PREFETCH": 1, "BLOCK_N": 16, "BLOCK_K": 64}
    with tuned.override("quant_gemm", "w4-g64-m1", config):
        out = w4a16_gemm(x, *args)
    assert_close(out, w4a16_gemm_ref(x, *args))
