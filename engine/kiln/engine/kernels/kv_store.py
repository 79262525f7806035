"""KV store: scatter each new token's K/V into its pool slot (slot -1 = skip).

Slots come from the model runner (block_id * block_size + offset); -1 marks tokens whose
K/V must not be written, e.g. padding in a CUDA-graph batch or prefix-cache hits.
An int8/fp8 cache is quantized on the way in, one float16 scale per (token, head): the
formula of kiln.engine.kv_quant.quantize_kv, which is this kernel's reference.
"""
import torch
import triton
import triton.language as tl

from kiln.engine.kv_quant import SCALE_MAX, SCALE_MIN, check_scales, is_quantized, qmax, quantize_kv

_SCALE_MIN = tl.constexpr(SCALE_MIN)
_SCALE_MAX = tl.constexpr(SCALE_MAX)


@triton.jit
def _round_to_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic.
    The cast of a value already on the e4m3 grid is exact everywhere; the Triton interpreter's
    own rounding cast drops the carry when a mantissa rounds up (31.9 -> 16)."""
    biased_exp = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased_exp = tl.maximum(biased_exp, 127 - 6)  # subnormals share the smallest normal's spacing
    spacing = ((biased_exp - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    steps = tl.abs(y) / spacing  # exact: a power of two
    steps = (steps + 8388608.0) - 8388608.0  # adding 2^23 rounds to an integer, ties to even
    return tl.where(y < 0, -steps, steps) * spacing  # sign kept apart: tiny negatives give -0, as in torch


@triton.jit
def _quantize(x, QMAX: tl.constexpr, ROUND: tl.constexpr):
    """Rows of x [H, D] (fp32) -> values within +-QMAX and a float16 scale per row; the values are
    integers for int8 (ROUND) and on the e4m3 grid for fp8."""
    amax = tl.max(tl.abs(x), 1)
    scale = tl.minimum(tl.maximum(amax / QMAX, _SCALE_MIN), _SCALE_MAX).to(tl.float16)
    y = x / scale.to(tl.float32)[:, None]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if ROUND:
        y = tl.floor(y + 0.5)
    else:
        y = _round_to_e4m3(y)
    return y, scale


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h, stride_sc_slot, stride_sc_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr, ROUND: tl.constexpr,
):
    # QMAX = 0: a float cache, stored as is; else quantized, with scales at k/v_scale_ptr.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    if QMAX > 0:
        k, k_scale = _quantize(k.to(tl.float32), QMAX, ROUND)
        v, v_scale = _quantize(v.to(tl.float32), QMAX, ROUND)
        scale_offs = slot * stride_sc_slot + offs_h * stride_sc_h
        tl.store(k_scale_ptr + scale_offs, k_scale, mask=offs_h < NUM_HEADS)
        tl.store(v_scale_ptr + scale_offs, v_scale, mask=offs_h < NUM_HEADS)
    tl.store(k_cache_ptr + slot * stride_kc_slot + offs_h[:, None] * stride_kc_h + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc_slot + offs_h[:, None] * stride_vc_h + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if k.shape != v.shape or k.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"store_kvcache wants k, v [N,Hkv,D] and caches [blocks,block_size,Hkv,D]; got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"store_kvcache shape mismatch: k {tuple(k.shape)}, cache {tuple(k_cache.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)}")
    if not slot_mapping.is_contiguous():  # read one element after another
        raise ValueError("store_kvcache needs slot_mapping contiguous")


def _slot_after_slot(t: torch.Tensor) -> bool:
    return t.stride(0) == t.shape[1] * t.stride(1)


def _check_layout(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("store_kvcache needs the head dim contiguous")
    if not (_slot_after_slot(k_cache) and _slot_after_slot(v_cache)):
        raise ValueError("store_kvcache needs each cache's blocks laid out slot after slot")


def check_float_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """What a kernel writing k, v straight into a float cache (norm_rope.rope_store) needs."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    if is_quantized(k_cache.dtype):
        raise ValueError(f"a fused store writes float caches; this one holds {k_cache.dtype} (use store_kvcache)")
    _check_layout(k, v, k_cache, v_cache)


def quant_constexprs(cache_dtype: torch.dtype) -> dict[str, float | bool]:
    """The store kernel's QMAX (0 = a float cache, stored as is) and ROUND (int8) for a cache dtype."""
    quantized = is_quantized(cache_dtype)
    return dict(QMAX=qmax(cache_dtype) if quantized else 0.0, ROUND=cache_dtype == torch.int8)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None) -> None:
    """Write k, v [N,Hkv,D] into caches [blocks,block_size,Hkv,D] at slot_mapping [N]. An int8/fp8
    cache also gets each (token, head)'s scale in k_scales/v_scales [blocks,block_size,Hkv]."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    check_scales(k_cache, k_scales, v_scales)
    if k.shape[0] == 0:
        return
    _check_layout(k, v, k_cache, v_cache)
    quantized = is_quantized(k_cache.dtype)
    if quantized and (k_scales.stride() != v_scales.stride() or not _slot_after_slot(k_scales)):
        raise ValueError("store_kvcache needs k_scales and v_scales laid out alike, slot after slot")
    # A float cache passes itself as the (unused) scales.
    k_scales, v_scales = (k_scales, v_scales) if quantized else (k_cache, v_cache)
    _, num_heads, head_dim = k.shape
    _store_kvcache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        k_scales.stride(1), k_scales.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        **quant_constexprs(k_cache.dtype),
    )


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                      v_scales: torch.Tensor | None = None) -> None:
    """Pure-torch reference of store_kvcache."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    check_scales(k_cache, k_scales, v_scales)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for cache, scales, new in ((k_cache, k_scales, k[keep]), (v_cache, v_scales, v[keep])):
        if scales is not None:
            new, new_scales = quantize_kv(new, cache.dtype)
            scales.view(-1, scales.shape[2])[slots] = new_scales
        cache.view(-1, *cache.shape[2:])[slots] = new.to(cache.dtype)
