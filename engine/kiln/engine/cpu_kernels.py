"""The "cpu" backend's own ops besides attention, from Kiln's C++ library (cpu_library.py):
the fused residual-add + RMSNorm, in-place RoPE and the KV-cache store (csrc/norm_rope_cpu.cpp),
one call where torch makes 9, ~15 and ~10 small ones, and the bf16 GEMM of decode steps (csrc/linear_cpu.cpp), which reads
the weights at ~2x the speed of torch's bf16 GEMM there. Every other GEMM (float32, prefill
chunks, a CPU without AVX512-BF16) is torch's F.linear. The torch versions (cpu_ops.py) are the
references these are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.engine import attention, cpu_library

# Rows of x up to which the bf16 op beats torch's GEMM: memory-bound rows, ~20 GB/s against ~9 at
# M=1, 10 against 7 at M=8; even at 16, where both are bound by the multiply-adds
# (bench/results/linear-cpu-*.json).
MAX_ROWS = 8


def linear_op_supported() -> bool:
    """Whether the bf16 GEMM op was built for this CPU (the library built with AVX512-BF16)."""
    return cpu_library.available() and torch.ops.kiln.linear_bf16_supported()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): the op where it is faster, torch elsewhere. The backend checks
    linear_op_supported() once, when it picks this function (kiln.engine.kernels.backend)."""
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
        return torch.ops.kiln.linear_bf16(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_ops.rms_norm's contract in one call: (norm(x + residual) * weight, x + residual written into x)."""
    return torch.ops.kiln.rms_norm(x, weight, eps, residual)


def write_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None) -> None:
    """attention.write_kvcache's contract (slots already >= 0): one call for a float cache of k's
    dtype; an int8/fp8 cache (scales) takes the torch path, which quantizes."""
    if k_scales is None and k_cache.dtype == k.dtype:
        torch.ops.kiln.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    else:
        attention.write_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)


def rope_prepare(positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return positions, cos_sin  # the op reads each token's row of the table itself


def rope(qk: torch.Tensor, num_q_heads: int, prepared: tuple[torch.Tensor, torch.Tensor]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation of q and k side by side in qk [N, Hq + Hkv, D], in place -> (q, k) views."""
    torch.ops.kiln.rope_(qk, *prepared)
    return qk[:, :num_q_heads], qk[:, num_q_heads:]
