"""Whole-matrix dequantization for prefill-sized quantized GEMMs.

With many rows of x (prefill, large decode batches), a GEMM is compute-bound and cuBLAS's 16-bit
tensor-core kernels are hard to beat; the weight's bytes matter less. So above a few rows
kiln.engine.kernels.quant_gemm dequantizes the weight into a transient 16-bit matrix in one pass
(reads 4 or 8 bits an element, writes 16) and hands it to cuBLAS, as vLLM does for AWQ prefill.
Same formats as quant_gemm: int8 per channel or per group, int4 with zeros, symmetric or with mins.
"""
import torch
import triton
import triton.language as tl

BLOCK_N = 32
BLOCK_K = 128  # a multiple of every group size quant_gemm takes


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_zn, stride_on,
                    INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_n.to(tl.int64)[:, None]
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    if INT4:  # byte k // 2 holds k even in its low nibble, k odd in its high one
        byte = tl.load(w_ptr + rows * stride_wn + offs_k[None, :] // 2, mask=ok, other=0).to(tl.int32)
        w = ((byte >> ((offs_k[None, :] % 2) * 4)) & 0xF).to(tl.float32)
    else:
        w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=ok, other=0).to(tl.float32)
    if GROUP:
        group = offs_k[None, :] // GROUP
        if INT4 and HAS_ZEROS:
            w -= tl.load(z_ptr + rows * stride_zn + group, mask=ok, other=0).to(tl.float32)
        elif INT4 and not HAS_MINS:
            w -= 8.0
        w *= tl.load(s_ptr + rows * stride_sn + group, mask=ok, other=0.0).to(tl.float32)
        if HAS_MINS:
            w += tl.load(z_ptr + rows * stride_zn + group, mask=ok, other=0.0).to(tl.float32)
    else:  # int8 per channel
        w *= tl.load(s_ptr + rows, mask=(offs_n < N)[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, k: int, group_size: int,
               int4: bool, has_zeros: bool, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in `dtype`; offsets: the int4 zeros (has_zeros) or mins, else None.
    Shapes are quant_gemm's, checked there."""
    n = qweight.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    z = offsets if offsets is not None else scales  # a placeholder, unread
    _dequant_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))](
        qweight, scales, z, out, n, k, qweight.stride(0), scales.stride(0), z.stride(0), out.stride(0),
        INT4=int4, HAS_ZEROS=has_zeros, HAS_MINS=offsets is not None and not has_zeros, GROUP=group_size,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
