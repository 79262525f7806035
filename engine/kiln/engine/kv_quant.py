"""Quantized KV cache: int8 or fp8 (e4m3) elements with a float16 scale per (token, KV head).

Symmetric quantization of each head's D values: scale = amax / QMAX, q = x / scale, x ~ q * scale.
A 16-bit cache spends 2 bytes an element; a quantized one spends 1 plus 2 bytes of scale per D
elements, so for D = 64 a memory budget holds 128 / 66 = 1.94x the tokens (1.97x for D = 128).
The scale is float16 rather than float32 for those bytes; its 11-bit mantissa is plenty, because
values are divided by the float16-rounded scale, so dequantizing multiplies by exactly what was stored.

fp8 is scaled too: e4m3 has only 3 mantissa bits, and scaling each head to the full +-448 range
keeps small heads out of its subnormals. int8 rounds with floor(y + 0.5), the same formula in the
Triton kernel (kiln.engine.kernels.kv_store) and here, so both paths store the same bytes.

These torch functions are the CPU attention path's and the kernels' reference.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCALE_DTYPE = torch.float16
# Scales are clamped into float16's normal range: an all-zero head gets the smallest scale, not 0.
SCALE_MIN = torch.finfo(SCALE_DTYPE).tiny
SCALE_MAX = torch.finfo(SCALE_DTYPE).max
FP8_DTYPE: torch.dtype | None = getattr(torch, "float8_e4m3fn", None)  # None on a torch without float8


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device, backend: str) -> torch.dtype:
    """The cache's element dtype for a kv_cache_dtype name ("auto" = the model's dtype), or a
    clear error where fp8 cannot run."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    if name != "fp8":
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    if FP8_DTYPE is None:
        raise ValueError(f"kv_cache_dtype='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} "
                         "lacks; use kv_cache_dtype='int8'")
    # torch converts float8 on any device; Triton's e4m3 loads and casts need Ada or Hopper.
    if backend == "triton" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"kv_cache_dtype='fp8' with the triton backend needs compute capability >= 8.9, "
                         f"this GPU has {major}.{minor}; use kv_cache_dtype='int8'")
    return FP8_DTYPE


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == torch.int8 or (FP8_DTYPE is not None and dtype == FP8_DTYPE)


def qmax(dtype: torch.dtype) -> float:
    """Largest quantized magnitude: 127 for int8 (symmetric, -128 unused), 448 for e4m3."""
    return 127.0 if dtype == torch.int8 else torch.finfo(dtype).max


def kv_bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Cache bytes one token takes for one KV head, for K or V: its elements plus its scale."""
    return head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if is_quantized(dtype) else 0)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in `dtype`, scales [...] float16)."""
    limit = qmax(dtype)
    xf = x.float()
    scales = (xf.abs().amax(-1) / limit).clamp(SCALE_MIN, SCALE_MAX).to(SCALE_DTYPE)
    y = (xf / scales.float()[..., None]).clamp(-limit, limit)
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)
    return y.to(dtype), scales


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D], scales [...] -> [..., D] in `dtype`."""
    return (values.float() * scales.float()[..., None]).to(dtype)


def check_scales(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
    """A quantized cache [blocks, block_size, Hkv, D] needs scales [blocks, block_size, Hkv]; a float one none."""
    if not is_quantized(k_cache.dtype):
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"scales were given for a {k_cache.dtype} cache, which is not quantized")
        return
    if k_scales is None or v_scales is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs k_scales and v_scales")
    for scales in (k_scales, v_scales):
        if scales.shape != k_cache.shape[:3] or scales.dtype != SCALE_DTYPE:
            raise ValueError(f"scales must be {SCALE_DTYPE} {tuple(k_cache.shape[:3])} for cache "
                             f"{tuple(k_cache.shape)}, got {scales.dtype} {tuple(scales.shape)}")
