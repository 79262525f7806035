"""Compile Kiln's Triton kernels for a CUDA architecture on a machine without a GPU.

The interpreter (tests/test_kernels.py) checks what the kernels compute; only the GPU
compiler checks that they compile: tensor-core tile minimums, loop-carried types, shared
memory. This lowers the tile configurations the launchers pick for Llama-family shapes all
the way to a cubin, with Triton's bundled ptxas. Run it without TRITON_INTERPRET:

    python -m kiln.engine.kernels.gpu_compile [--arch 90] [--all]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, CompiledKernel

from kiln.engine.kernels import activation, dequant, int4_gemv, kv_store, norm_rope, paged_attention, quant_gemm

Job = tuple[object, dict[str, str], dict[str, object], int]  # kernel, arg types, constexprs, warps
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# KV cache element types: the model's own, or quantized (kiln.engine.kv_quant) with fp16 scales.
QUANTIZED_CACHES = {"i8": torch.int8, "fp8e4nv": torch.float8_e4m3fn}


def attention_jobs(dtype: torch.dtype, group: int, head_dim: int, cache: str | None = None) -> Iterator[Job]:
    t = TYPES[dtype]
    c = cache or t
    for max_seqlen_q, split in ((1, False), (1, True), (512, False)):
        tiles = paged_attention.tile_config(max_seqlen_q, group, head_dim)
        part = "*fp32" if split else f"*{t}"
        yield (paged_attention._paged_attention_kernel,
               dict(q_ptr=f"*{t}", k_cache_ptr=f"*{c}", v_cache_ptr=f"*{c}", k_scale_ptr="*fp16",
                    v_scale_ptr="*fp16", out_ptr=part, lse_ptr=part,
                    cu_seqlens_q_ptr="*i32", seq_lens_ptr="*i32", block_tables_ptr="*i32", scale_log2="fp32"),
               dict(tiles, KV_BLOCK_SIZE=16, SPLIT=split, DOT_PREC=paged_attention.dot_precision(dtype),
                    QUANT=cache is not None), 4)


def store_jobs(dtype: torch.dtype, kv_heads: int, head_dim: int) -> Iterator[Job]:
    t, p2 = TYPES[dtype], triton.next_power_of_2
    shape = dict(NUM_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=p2(kv_heads), BLOCK_D=p2(head_dim))
    for cache, cache_dtype in [(t, dtype), *QUANTIZED_CACHES.items()]:
        yield (kv_store._store_kvcache_kernel,
               dict(k_ptr=f"*{t}", v_ptr=f"*{t}", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}",
                    k_scale_ptr="*fp16", v_scale_ptr="*fp16", slot_ptr="*i64"),
               dict(shape, **kv_store.quant_constexprs(cache_dtype)), 4)


def gemm_tiles(m: int, group: int) -> dict[str, int]:
    """The tensor-core GEMM's constexprs for m rows (tile_config less its launcher-only DEQUANT flag)."""
    tiles = quant_gemm.tile_config(m, group)
    del tiles["DEQUANT"]
    return tiles


def other_jobs(dtype: torch.dtype, hidden: int, heads: int, kv_heads: int, head_dim: int) -> Iterator[Job]:
    t, p2 = TYPES[dtype], triton.next_power_of_2
    yield (paged_attention._merge_splits_kernel, dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{t}"),
           dict(HEAD_DIM=head_dim, BLOCK_D=p2(head_dim), SPLITS_PAD=16), 4)
    yield from store_jobs(dtype, kv_heads, head_dim)
    for residual in (True, False):
        yield (norm_rope._rms_norm_kernel,
               dict(x_ptr=f"*{t}", res_ptr=f"*{t}", w_ptr=f"*{t}", out_ptr=f"*{t}", res_out_ptr=f"*{t}", eps="fp32"),
               dict(HIDDEN=hidden, BLOCK=p2(hidden), HAS_RESIDUAL=residual), 8 if hidden >= 2048 else 4)
    rope_shape = dict(NUM_Q_HEADS=heads, NUM_K_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
                      BLOCK_QH=p2(heads), BLOCK_KH=p2(kv_heads), BLOCK_HALF=p2(head_dim // 2), BLOCK_D=p2(head_dim))
    for store in (False, True):  # rope alone, and with the K/V store
        yield (norm_rope._rope_kernel,
               dict(pos_ptr="*i64", q_ptr=f"*{t}", k_ptr=f"*{t}", v_ptr=f"*{t}", cache_ptr="*fp32", q_out_ptr=f"*{t}",
                    k_out_ptr=f"*{t}", v_out_ptr=f"*{t}", slot_ptr="*i64"), dict(rope_shape, STORE=store), 4)
    # int8 per channel, int4 asymmetric and symmetric; GGUF's Q8_0 and Q4_1 with their fp16 scales/mins.
    for int4, offsets, group, s in ((False, None, 0, t), (True, "zeros", 128, t), (True, None, 32, t),
                                    (False, None, 32, "fp16"), (True, "mins", 32, "fp16")):
        pointers = dict(w_ptr="*u8" if int4 else "*i8", s_ptr=f"*{s}", z_ptr="*u8" if offsets == "zeros" else f"*{s}")
        for m in (1, 64):  # 64: the tensor-core kernel a tuned entry may keep (DEQUANT 0) above 16 rows
            yield (quant_gemm._dequant_gemm_kernel, dict(pointers, x_ptr=f"*{t}", y_ptr=f"*{t}"),
                   dict(gemm_tiles(m, group), INT4=int4, HAS_ZEROS=offsets == "zeros", HAS_MINS=offsets == "mins",
                        DOT_PREC=paged_attention.dot_precision(dtype), MAGIC=0), 4)
        yield (dequant._dequant_kernel, dict(pointers, out_ptr=f"*{t}"),
               dict(INT4=int4, HAS_ZEROS=offsets == "zeros", HAS_MINS=offsets == "mins", GROUP=group,
                    BLOCK_N=dequant.BLOCK_N, BLOCK_K=dequant.BLOCK_K), 4)
    # A split-K config (tuned on a GPU, see kernels.tuned): fp32 partial products, then their sum;
    # with int4 codes made floats each way (int4_codes: codes, ptx_codes' inline PTX).
    for magic, offsets in ((0, "zeros"), (1, "zeros"), (2, "zeros"), (2, None), (2, "mins"), (3, "zeros"), (3, None),
                           (3, "mins")):
        yield (quant_gemm._dequant_gemm_kernel,
               dict(x_ptr=f"*{t}", w_ptr="*u8", s_ptr=f"*{t}", z_ptr="*u8" if offsets == "zeros" else f"*{t}",
                    y_ptr="*fp32"),
               dict(gemm_tiles(1, 128), BLOCK_N=32, BLOCK_K=128, INT4=True, HAS_ZEROS=offsets == "zeros",
                    HAS_MINS=offsets == "mins", DOT_PREC=paged_attention.dot_precision(dtype), MAGIC=magic), 4)
    for splits in (4, 28):
        yield (quant_gemm._sum_splits_kernel, dict(part_ptr="*fp32", y_ptr=f"*{t}"), quant_gemm.sum_tiles(splits), 4)
    # The GEMV configs (a row a program): int8 per channel, int4 with zeros (converted, or by the 2**23 trick),
    # GGUF Q4_1's mins, and 16-bit weights (quant_gemm.linear).
    for w, offsets, group, s, magic in (("i8", None, 0, t, 0), ("u8", "zeros", 128, t, 0),
                                        ("u8", "zeros", 128, t, 1), ("u8", "mins", 32, "fp16", 1), (t, None, 0, t, 0)):
        yield (quant_gemm._dequant_gemv_kernel,
               dict(x_ptr=f"*{t}", w_ptr=f"*{w}", s_ptr=f"*{s}", z_ptr="*u8" if offsets == "zeros" else f"*{s}",
                    y_ptr="*fp32"),
               dict(INT4=w == "u8", HAS_ZEROS=offsets == "zeros", HAS_MINS=offsets == "mins", GROUP=group, BLOCK_N=32,
                    BLOCK_K=min(128, group or 256), MAGIC=magic, SCALED=w != t), 4)
    # int4 read as int32 words (int4_gemv): zeros, symmetric, GGUF Q4_1's mins.
    for offsets, group, s, prefetch, late in (("zeros", 128, t, 0, 0), ("zeros", 128, t, 0, 1), (None, 128, t, 1, 1),
                                              ("mins", 32, "fp16", 1, 0), ("zeros", 128, t, 2, 0)):
        yield words_gemv_job(t, s, offsets, group, 64, 4, PREFETCH=prefetch, LATE_BIAS=late)
    yield (activation._silu_mul_kernel, dict(x_ptr=f"*{t}", out_ptr=f"*{t}"), dict(BLOCK=activation.BLOCK), 4)


def words_gemv_job(t: str, s: str, offsets: str | None, group: int, block_n: int, warps: int, **variants: int) -> Job:
    """int4_gemv's kernel for x in type t, scales (and mins) in s, offsets "zeros", "mins" or None
    (symmetric), one group a tile; variants: int4_gemv.VARIANTS' values."""
    return (int4_gemv._int4_words_gemv_kernel,
            dict(x_ptr=f"*{t}", w_ptr="*i32", s_ptr=f"*{s}", z_ptr="*u8" if offsets == "zeros" else f"*{s}",
                 y_ptr="*fp32"),
            dict(HAS_ZEROS=offsets == "zeros", HAS_MINS=offsets == "mins", GROUP=group, BLOCK_N=block_n,
                 BLOCK_K=group, **variants), warps)


def jobs(everything: bool) -> Iterator[Job]:
    """Llama-3-8B-like shapes in bf16, with int8 and fp8 KV caches too; --all adds fp16/fp32,
    GQA 1/3/8 and head dims 64/80."""
    yield from attention_jobs(torch.bfloat16, 4, 128)
    for cache in QUANTIZED_CACHES:
        yield from attention_jobs(torch.bfloat16, 4, 128, cache)
    yield from other_jobs(torch.bfloat16, 4096, 32, 8, 128)
    if everything:
        for dtype in (torch.float16, torch.float32):
            yield from attention_jobs(dtype, 4, 128)
            yield from other_jobs(dtype, 4096, 32, 8, 128)
        for group, head_dim in ((1, 64), (3, 80), (8, 128)):
            yield from attention_jobs(torch.bfloat16, group, head_dim)


def compile_kernel(job: Job, arch: int, aligned: tuple[str, ...] = ()) -> CompiledKernel:
    """Compile one kernel (a triton CompiledKernel, its cubin in .asm). Scalar args not named in
    types are i32; those in `aligned` are taken to be multiples of 16, as Triton's launcher
    specializes pointers and sizes that are (so the loads vectorize as on a GPU)."""
    kernel, types, consts, warps = job
    signature = {name: "constexpr" if name in consts else types.get(name, "i32") for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps})


def compile_job(job: Job, arch: int) -> int:
    """Compile one kernel; returns its cubin size."""
    return len(compile_kernel(job, arch).asm["cubin"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability as an integer (80 = A100, 90 = H100)")
    parser.add_argument("--all", action="store_true", help="every dtype and GQA/head-dim variant (slower)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_compile: unset TRITON_INTERPRET; interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    if args.arch < 75:
        parser.error(f"--arch {args.arch}: Kiln's kernels need tensor cores (>= 75)")
    for job in jobs(args.all):
        size = compile_job(job, args.arch)
        print(f"sm_{args.arch} {job[0].__name__}: {size} B cubin  {job[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
