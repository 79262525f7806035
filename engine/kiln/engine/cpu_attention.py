"""The "cpu" attention backend: a fused C++/OpenMP paged-attention op (csrc/paged_attention_cpu.cpp,
built with Kiln's other CPU ops by cpu_library.py), registered as torch.ops.kiln.paged_attention.

Only a float cache is read here; an int8/fp8 cache (kv_quant.py) goes to the torch path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.cpu_library import available, unavailable_reason

# Sequences with more query tokens than this (prefill chunks) go to SDPA, whose GEMMs beat the op's
# per-row loops there: 256 tokens over 1024 cached, 2x (bench/results/cpu-attention-*.json).
SDPA_ABOVE = 16
# The head sizes the op is compiled for (its registers hold whole rows): others run the torch backend.
HEAD_DIMS = (16, 32, 64, 96, 128)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_seqlen_q: int, max_seqlen_k: int, *, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None, partition_size: int = 0,
                    sdpa_above: int = SDPA_ABOVE) -> torch.Tensor:
    """Causal attention of q [N,Hq,D] over the paged cache -> [N,Hq,D], the Triton kernel's
    signature (max_seqlen_* unused: the lengths are read from the tensors). The op attends to every
    sequence with at most `sdpa_above` query tokens; longer prefill chunks go to SDPA over their
    gathered keys, as on the torch path. An int8/fp8 cache runs the torch path.
    partition_size > 0 forces the keys per context split (tests); 0 lets the op choose."""
    from kiln.engine import attention
    if k_scales is not None or v_scales is not None:
        return attention.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                         max_seqlen_q, max_seqlen_k, k_scales=k_scales, v_scales=v_scales)
    plan = plan_cpu_attention(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1], sdpa_above)
    return run_cpu_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, plan, partition_size)


@dataclass
class CpuPlan:
    """What the op's call derives from the step's metadata alone, built once per step
    (kiln.engine.attention.prepare_step): the sequences SDPA takes, with their keys and masks."""
    sdpa_above: int  # passed to the op: it skips sequences with more query tokens (0: none are)
    long: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (lo, hi, slots [1, S], mask or None=causal)


def plan_cpu_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int, sdpa_above: int = SDPA_ABOVE, bounds: list[int] | None = None) -> CpuPlan:
    from kiln.engine.attention import sequence_keys
    bounds = cu_seqlens_q.tolist() if bounds is None else bounds
    long = [b for b in range(len(bounds) - 1) if bounds[b + 1] - bounds[b] > sdpa_above]
    lens = seq_lens.tolist() if long else []
    return CpuPlan(sdpa_above if long else 0,
                   [sequence_keys(bounds, lens, seq_lens, block_tables, b, block_size) for b in long])


def run_cpu_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, plan: CpuPlan,
                      partition_size: int = 0) -> torch.Tensor:
    """The op over a float cache, then SDPA for the plan's long sequences: no host sync."""
    from kiln.engine import attention
    if not available():
        raise RuntimeError(f"the CPU paged-attention op is unavailable: {unavailable_reason()}")
    out = torch.ops.kiln.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                         float(scale), int(partition_size), plan.sdpa_above)
    for lo, hi, slots, mask in plan.long:
        keys, values = (attention._gather(cache, slots, None, q.dtype) for cache in (k_cache, v_cache))
        out[lo:hi] = attention._attend(q[None, lo:hi], keys, values, scale, mask, mask is None)[0]
    return out
