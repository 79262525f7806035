"""Attention over the paged KV cache: the torch backend (reference, and the CPU fallback)
and the `Attention` layer, which stores the step's K/V then attends.

The Triton backend (kiln.engine.kernels) and the fused CPU op (kiln.engine.cpu_attention)
have the same two functions with the same signatures; kiln.engine.kernels.backend picks one
(with the norm and RoPE) at model construction. What the torch and cpu paths derive from the
step's metadata, host syncs included, is built once per step before the layer loop
(`prepare_step`), never per layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.engine.context import Context, get_context
from kiln.engine.cpu_attention import SDPA_ABOVE, CpuPlan, plan_cpu_attention, run_cpu_attention
from kiln.engine.kernels.backend import Backend
from kiln.engine.kv_quant import check_scales, dequantize_kv, quantize_kv


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None) -> None:
    """Write k, v [N,Hkv,D] into caches [blocks,block_size,Hkv,D] at slot_mapping [N]; slot -1 skips.
    An int8/fp8 cache also gets each (token, head)'s scale in k_scales/v_scales [blocks,block_size,Hkv]."""
    check_scales(k_cache, k_scales, v_scales)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    write_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)


def write_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None) -> None:
    """store_kvcache for slots already known to be >= 0 (checked once per step): no host sync."""
    writes = [(k_cache, k), (v_cache, v)]
    if k_scales is not None:
        (k, k_scale), (v, v_scale) = quantize_kv(k, k_cache.dtype), quantize_kv(v, v_cache.dtype)
        writes = [(k_cache, k), (v_cache, v), (k_scales, k_scale), (v_scales, v_scale)]
    for cache, new in writes:
        rows = _rows(cache)
        rows.index_copy_(0, slot_mapping, new.to(cache.dtype).flatten(1).view(rows.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """SDPA with GQA for batched q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D] -> [B,Sq,Hq,D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            bounds: list[int], scale: float) -> torch.Tensor:
    """Causal attention of each sequence over its own fresh tokens (plain prefill, no cached
    prefix): no cache read at all. One SDPA call per sequence; prefill batches are few.
    bounds: cu_seqlens_q on the host."""
    if len(bounds) == 2:
        return _attend(q[None], k[None], v[None], scale, None, True)[0]
    out = torch.empty_like(q)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        out[lo:hi] = _attend(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], scale, None, True)[0]
    return out


def _key_slots(block_tables: torch.Tensor, lens: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """Cache slot of key j of each sequence: [B, num_keys] int64. Past a sequence's length the
    slot is its key 0 instead: always written, so finite (masked out anyway), where the real
    slot may hold never-written memory whose NaN would leak through the masked matmul."""
    pos = torch.arange(num_keys, device=lens.device)[None, :]
    pos = torch.where(pos < lens[:, None], pos, 0)
    return block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache as one row per slot [slots, Hkv*D], reinterpreted as int64 when the row allows:
    index_select/index_copy move wide elements about twice as fast as bf16 ones on CPU.
    A view, never a copy: a non-contiguous cache raises here instead of being copied each call."""
    rows = cache.view(cache.shape[0] * cache.shape[1], -1)
    return rows.view(torch.int64) if rows.shape[1] * rows.element_size() % 8 == 0 else rows


def _gather(cache: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """K (or V) at slots [B, S] -> [B, S, Hkv, D], dequantized to `dtype` when the cache has scales."""
    def rows_at(t: torch.Tensor) -> torch.Tensor:
        return _rows(t).index_select(0, slots.flatten()).view(t.dtype).view(*slots.shape, *t.shape[2:])
    return rows_at(cache) if scales is None else dequantize_kv(rows_at(cache), rows_at(scales), dtype)


def sequence_keys(bounds: list[int], lens: list[int], seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  b: int, block_size: int) -> tuple[int, int, torch.Tensor, torch.Tensor | None]:
    """Sequence b's query rows (lo, hi), the cache slots of all its keys [1, S] and its causal mask
    over them (None: no cached prefix, so plain causal SDPA, which also skips the masked half)."""
    lo, hi, seq_len = bounds[b], bounds[b + 1], lens[b]
    device = seq_lens.device
    q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=device)
    mask = None if hi - lo == seq_len else torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
    return lo, hi, _key_slots(block_tables[b:b + 1], seq_lens[b:b + 1].long(), seq_len, block_size), mask


@dataclass
class PagedPlan:
    """What paged attention derives from the step's metadata alone: the same for every layer,
    so the torch backend builds it once per step (see Attention.forward)."""
    decode_rows: torch.Tensor  # [b] flat-batch row of each one-token (decode) sequence
    decode_slots: torch.Tensor  # [b, Sk] cache slot of each key
    decode_mask: torch.Tensor  # [b, 1, 1, Sk] key within the sequence's length
    all_decode: bool
    multi: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (lo, hi, slots [1, S], mask or None=causal)


def plan_paged_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                         block_size: int) -> PagedPlan:
    device = seq_lens.device
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    decode = (q_lens == 1).nonzero().flatten()
    lens = seq_lens[decode].long()
    num_keys = int(lens.max()) if decode.numel() else 0
    bounds, lens_host = cu_seqlens_q.tolist(), seq_lens.tolist()
    multi = [sequence_keys(bounds, lens_host, seq_lens, block_tables, b, block_size)
             for b in (q_lens > 1).nonzero().flatten().tolist()]
    return PagedPlan(
        decode_rows=cu_seqlens_q[:-1][decode].long(),
        decode_slots=_key_slots(block_tables[decode], lens, num_keys, block_size),
        decode_mask=(torch.arange(num_keys, device=device)[None, :] < lens[:, None])[:, None, None, :],
        all_decode=decode.numel() == seq_lens.numel(), multi=multi)


def run_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PagedPlan,
                        scale: float, k_scales: torch.Tensor | None = None,
                        v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Decodes as one batched SDPA with a length mask; sequences with several query tokens one
    SDPA each, so a long prefill never pads a batch of decodes."""
    def keys(slots: torch.Tensor) -> torch.Tensor:
        return _gather(k_cache, slots, k_scales, q.dtype)

    def values(slots: torch.Tensor) -> torch.Tensor:
        return _gather(v_cache, slots, v_scales, q.dtype)

    decoded = None
    if plan.decode_rows.numel():
        slots = plan.decode_slots
        decoded = _attend(q.index_select(0, plan.decode_rows)[:, None], keys(slots), values(slots), scale,
                          plan.decode_mask, False)[:, 0]
        if plan.all_decode:
            return decoded
    out = torch.empty_like(q)
    if decoded is not None:
        out[plan.decode_rows] = decoded
    for lo, hi, slots, mask in plan.multi:
        out[lo:hi] = _attend(q[None, lo:hi], keys(slots), values(slots), scale, mask, mask is None)[0]
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_seqlen_q: int, max_seqlen_k: int, *, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [N,Hq,D] over the paged cache -> [N,Hq,D]. Query token i of
    sequence b sits at position seq_lens[b] - q_len_b + i and attends to keys 0..that position.
    An int8/fp8 cache is read with its scales (see store_kvcache)."""
    check_scales(k_cache, k_scales, v_scales)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    plan = plan_paged_attention(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1])
    return run_paged_attention(q, k_cache, v_cache, plan, scale, k_scales, v_scales)


@dataclass
class StepAttention:
    """What the torch and cpu paths of every layer read from the step, derived once before the
    layer loop: the host syncs happen here, never per layer."""
    bounds: list[int]  # cu_seqlens_q on the host
    no_cached_prefix: bool  # every sequence attends only to its own new tokens (a plain prefill)
    keep: torch.Tensor | None  # rows whose K/V are stored (slot >= 0); None: all of them
    slots: torch.Tensor  # their cache slots, all >= 0
    plan: Any  # PagedPlan (torch path) or cpu_attention.CpuPlan; None for a plain prefill SDPA takes


def prepare_step(ctx: Context, layer: Attention) -> StepAttention | None:
    """Build (once per step, cached on the context) what `layer`'s backend derives from the step's
    metadata; every layer shares backend, block size and cache dtype. None for Triton, which reads
    the metadata on the device (and must not sync: CUDA graphs)."""
    if layer.backend.name == "triton" and layer.k_cache.numel() > 0:
        return None
    step = ctx.derived.get("attention")
    if step is not None:
        return step
    bounds, lens = ctx.cu_seqlens_q.tolist(), ctx.seq_lens.tolist()
    no_cached_prefix = all(hi - lo == n for lo, hi, n in zip(bounds[:-1], bounds[1:], lens))
    keep = ctx.slot_mapping >= 0
    keep = None if bool(keep.all()) else keep.nonzero().flatten()
    slots = ctx.slot_mapping if keep is None else ctx.slot_mapping[keep]
    plan = None
    if layer.k_cache.numel() > 0:
        block_size = layer.k_cache.shape[1]
        if layer.backend.name == "cpu" and layer.k_scales is None:  # the op reads a float cache only
            # A plain prefill of short prompts too, when it stores every row: the op over their
            # just-stored K/V beats SDPA's per-sequence calls there (and lets cpu_decoder run the
            # step's layers in one call).
            short = max((hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])), default=0) <= SDPA_ABOVE and keep is None
            if not no_cached_prefix or short:
                plan = plan_cpu_attention(ctx.cu_seqlens_q, ctx.seq_lens, ctx.block_tables, block_size,
                                          bounds=bounds)
        elif not no_cached_prefix:
            plan = plan_paged_attention(ctx.cu_seqlens_q, ctx.seq_lens, ctx.block_tables, block_size)
    step = ctx.derived["attention"] = StepAttention(bounds, no_cached_prefix, keep, slots, plan)
    return step


class Attention(nn.Module):
    """Stores this step's K/V in the layer's cache, then attends over the cache.
    k_cache/v_cache are assigned by the model runner; empty means no cache (one-shot prefill).
    k_scales/v_scales too, for an int8/fp8 cache; None for a float one."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: Backend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None

    def rotate_and_attend(self, qk: torch.Tensor, v: torch.Tensor, rope: object) -> torch.Tensor:
        """qk [N, Hq + Hkv, D] (q and k side by side, not yet rotated), v [N, Hkv, D]: the backend's
        RoPE (rope: this step's RotaryEmbedding.prepare), then forward. Triton over a float cache
        rotates and stores K/V in one kernel."""
        if self.backend.rope_store is not None and self.k_cache.numel() > 0 and self.k_scales is None:
            ctx = get_context()
            q = self.backend.rope_store(qk, v, self.num_heads, rope, self.k_cache, self.v_cache, ctx.slot_mapping)
            return self._attend_cache(q, ctx)
        q, k = self.backend.rope(qk, self.num_heads, rope)
        return self(q, k, v)

    def _attend_cache(self, q: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.backend.paged_attention(q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.seq_lens,
                                            ctx.block_tables, self.scale, ctx.max_seqlen_q, ctx.max_seqlen_k,
                                            k_scales=self.k_scales, v_scales=self.v_scales)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        has_cache = self.k_cache.numel() > 0
        step = prepare_step(ctx, self)
        if step is None:  # Triton over the cache: its kernels read the metadata on the device
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, self.k_scales,
                                       self.v_scales)
            return self._attend_cache(q, ctx)
        if has_cache:
            stored = (k, v) if step.keep is None else (k[step.keep], v[step.keep])
            self.backend.write_kvcache(*stored, self.k_cache, self.v_cache, step.slots, self.k_scales, self.v_scales)
        if has_cache and isinstance(step.plan, CpuPlan):
            return run_cpu_attention(q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.seq_lens,
                                     ctx.block_tables, self.scale, step.plan)
        # A plain prefill is one causal SDPA per sequence (flash attention) on its own exact K/V,
        # even over an int8/fp8 cache: only later steps read the quantized copies back (as in vLLM).
        if step.no_cached_prefix or not has_cache:
            if not step.no_cached_prefix:
                raise RuntimeError("a step with a cached prefix needs the KV cache to be allocated")
            return varlen_causal_attention(q, k, v, step.bounds, self.scale)
        # the torch path (also the cpu backend's int8/fp8 caches)
        return run_paged_attention(q, self.k_cache, self.v_cache, step.plan, self.scale, self.k_scales,
                                   self.v_scales)
