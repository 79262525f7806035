"""The "cpu" backend's own ops besides attention, from Kiln's C++ library (cpu_library.py):
the fused residual-add + RMSNorm, in-place RoPE and the KV-cache store (csrc/norm_rope_cpu.cpp),
one call where torch makes 9, ~15 and ~10 small ones, and the bf16 GEMM (csrc/linear_cpu.cpp
for decode rows, which reads the weights ~2x faster than torch's GEMM there; oneDNN's GEMM on
packed weights for more rows; float32, and a CPU without AVX512-BF16, use torch's F.linear) and
the sampler's argmax over the vocabulary (csrc/argmax_cpu.cpp).
The torch versions (cpu_ops.py) are the references these are tested against.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kiln.engine import attention, cpu_library

log = logging.getLogger(__name__)
# oneDNN's packed bf16 GEMM (torch.ops.mkldnn), in every x86 build of torch
PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")

# Rows of x up to which Kiln's bf16 op beats oneDNN's GEMM on the weight in its own packed layout:
# memory-bound rows, where the op's one sequential weight stream reads ~1.8x faster at M=1; from 8
# rows on the packed GEMM's register blocking wins, up to 2.2x at 16 (bench/linear_cpu.py,
# bench/results/linear-cpu-*.json). Without oneDNN, torch's plain GEMM is the other side, which the
# op beats up to 8 rows.
MAX_ROWS = 4
MAX_ROWS_UNPACKED = 8
_logged_packing: list[bool] = []


def linear_op_supported() -> bool:
    """Whether the bf16 GEMM op was built for this CPU (the library built with AVX512-BF16)."""
    return cpu_library.available() and torch.ops.kiln.linear_bf16_supported()


def op_rows() -> int:
    """The most rows of x that `linear` gives Kiln's bf16 op (csrc/decoder_cpu.cpp splits alike)."""
    return MAX_ROWS if PACKING else MAX_ROWS_UNPACKED


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight in oneDNN's blocked layout for the GEMM, made on first use and kept beside it (a
    second copy of each bf16 weight: the op wants the plain one). Weights are not written after
    load; a tensor given new storage is packed again."""
    kept = getattr(weight, "_kiln_packed", None)  # (its data_ptr, the oneDNN copy): freed with the weight
    if kept is None or kept[0] != weight.data_ptr():
        if not _logged_packing:
            _logged_packing.append(True)
            log.info("cpu backend: bf16 weights are also kept in oneDNN's packed layout, for GEMMs of "
                     "more than %d rows (a second copy of each)", MAX_ROWS)
        kept = weight._kiln_packed = (weight.data_ptr(), torch.ops.mkldnn._reorder_linear_weight(weight, 64))
    return kept[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for bf16: Kiln's op for decode rows, oneDNN's packed GEMM above
    them; float32 is torch's. The backend checks linear_op_supported() once, when it picks this
    function (kiln.engine.kernels.backend)."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2:
        return F.linear(x, weight, bias)
    if x.shape[0] <= op_rows():
        return torch.ops.kiln.linear_bf16(x, weight, bias)
    if PACKING:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) for float32 rows [M, V] (finite, as the sampler passes them) in one
    vectorised pass per row, where torch's CPU argmax over the last dimension goes one element at a
    time: 10-14x faster on SmolLM2's 49k vocabulary at 1-64 rows. Anything else goes to torch."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return torch.ops.kiln.argmax_rows(logits)


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
