"""Unified paged attention: one Triton kernel for prefill, chunked prefill and decode.

Every step is a flat varlen batch (see kiln.engine.context.Context): query token i of
sequence b sits at position seq_lens[b] - q_len_b + i and attends causally to keys
0..that position, read from the paged cache through block_tables[b].

One program owns BLOCK_Q query tokens of one sequence and one KV head; its tile rows are
(token, query head of that KV group) pairs, so each K/V tile is loaded once per GQA
group and decode (one token) still fills a tensor-core tile with the group's heads.
Softmax is online in fp32 (exp2 domain).

Long decode contexts leave too few programs to fill the GPU, so a split-KV variant cuts
the context into partitions, writes one normalised partial output and its log-sum-exp
per partition, and a reduce kernel merges them.

An int8/fp8 cache (kiln.engine.kv_quant) is dequantized as each K/V tile is loaded: its
values times their (token, head) scales, in q's dtype, so the dots run as for a float cache.
"""
import math

import torch
import triton
import triton.language as tl

from kiln.engine.kernels import tuned
from kiln.engine.kv_quant import check_scales, dequantize_kv, is_quantized


@triton.jit
def _find_seq(cu_seqlens_q_ptr, num_seqs, qblock, BLOCK_Q: tl.constexpr):
    # Sequence b owns flat q-blocks [cu_q[b] // BLOCK_Q + b, cu_q[b+1] // BLOCK_Q + b + 1);
    # binary search keeps the grid a function of (N, B) only: no host sync, graph-safe.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first <= qblock:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, scale_log2,
    stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_on, stride_oh, stride_os,
    stride_ln, stride_lh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, QUANT: tl.constexpr,
):
    qblock = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(cu_seqlens_q_ptr, num_seqs, qblock, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # tokens already cached before this step
    tok0 = (qblock - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tok0 >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tok = tok0 + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    q_pos = first_pos + tok

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    # Causality bounds the keys this block needs by its last query's position.
    kv_hi = tl.minimum(seq_len, first_pos + tl.minimum(tok0 + BLOCK_Q, q_len))
    kv_lo = 0
    if SPLIT:
        # The sequence's own keys are cut into as many partitions of whole tiles as the grid has
        # splits: every split has work at any context length, also under a CUDA graph, whose
        # launch arguments were frozen at capture.
        partition = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        kv_lo = split * partition
        kv_hi = tl.minimum(kv_hi, kv_lo + partition)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_hi
        block = tl.load(table + offs_n // KV_BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % KV_BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if QUANT:
            scale_offs = block * stride_sb + in_block * stride_ss + kv_head * stride_sh
            k_scale = tl.load(k_scale_ptr + scale_offs, mask=n_ok, other=0.0).to(tl.float32)
            v_scale = tl.load(v_scale_ptr + scale_offs, mask=n_ok, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key yet (split partitions, padding rows): keep exp2 finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:
        tl.store(o_ptrs + split * stride_os, o, mask=row_ok[:, None] & d_mask[None, :])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + q_rows * stride_ln + head * stride_lh + split, lse, mask=row_ok)
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pn, stride_ph, stride_ps, stride_ln, stride_lh, stride_on, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse = tl.load(lse_ptr + n * stride_ln + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    # Partition 0 always holds key 0, so the max is finite.
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_ptr + n * stride_pn + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + n * stride_on + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention wants q [N,Hq,D] and caches [blocks,block_size,Hkv,D]; got "
                         f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"head dim / GQA mismatch: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention needs the head dim contiguous")


def tile_config(max_seqlen_q: int, group: int, head_dim: int, device: torch.device | None = None,
                split: bool = False) -> dict[str, int]:
    """Tile sizes: rows are (token, head-in-group) pairs; decode-only steps need one token per
    block, prefill blocks hold many. 16 rows is the tensor-core minimum.

    Given a device, steps take its GPU's tuned entry (kiln.engine.kernels.tuned, key
    decode[-split]-g<group>-d<head_dim>, or prefill-g<group>-d<head_dim> for steps with several
    query tokens): BLOCK_M (prefill), BLOCK_N, num_warps, num_stages (and SPLIT_KEYS, read by
    default_num_splits)."""
    group_pad = triton.next_power_of_2(group)
    block_m = max(16 if max_seqlen_q == 1 else 64, group_pad)
    tiles = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_m // group_pad, BLOCK_M=block_m,
                 BLOCK_N=64 if head_dim <= 64 else 32, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim))
    if device is not None:
        key = f"decode{'-split' if split else ''}-g{group}-d{head_dim}" if max_seqlen_q == 1 else \
            f"prefill-g{group}-d{head_dim}"
        tiles.update({k: v for k, v in (tuned.lookup("paged_attention", key, device) or {}).items()
                      if k != "SPLIT_KEYS"})
        tiles["BLOCK_Q"] = tiles["BLOCK_M"] // group_pad
    return tiles


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (the default would round them to tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


SPLIT_KEYS = 128  # default least keys a split partition averages
MAX_SPLITS = 16


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int,
                       device: torch.device, group: int = 4, head_dim: int = 128) -> int:
    """Split only decode batches whose programs cannot fill the GPU on their own, into partitions
    of at least SPLIT_KEYS keys on average (an 8B model's batch-1 decode at 1k keys: 8), or the
    GPU's tuned SPLIT_KEYS (key decode-split-g<group>-d<head_dim>)."""
    if max_seqlen_q != 1 or max_seqlen_k < 256 or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(2 * sms / (num_seqs * num_kv_heads))
    entry = tuned.lookup("paged_attention", f"decode-split-g{group}-d{head_dim}", device) or {}
    return max(1, min(want, math.ceil(max_seqlen_k / entry.get("SPLIT_KEYS", SPLIT_KEYS)), MAX_SPLITS))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_seqlen_q: int, max_seqlen_k: int, *,
                    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                    num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [N,Hq,D] over the paged cache; returns out [N,Hq,D] in q's dtype.

    k_scales/v_scales [blocks,block_size,Hkv]: the scales of an int8/fp8 cache (None for a float one).
    num_splits: KV partitions (None = heuristic; 1 = no split), each sequence's keys cut into that
    many by its own length. max_seqlen_k only picks the split count: under CUDA graphs pass the
    largest context the graph will see.
    """
    _check_layout(q, k_cache, v_cache)
    # The kernel steps through these one element at a time: a strided view would be read wrong.
    if not (cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous()) or block_tables.stride(-1) != 1:
        raise ValueError("paged_attention needs cu_seqlens_q, seq_lens and each block table row contiguous")
    if out is not None and (out.shape != q.shape or out.stride(2) != 1):
        raise ValueError(f"paged_attention's out must be shaped like q {tuple(q.shape)}, head dim contiguous")
    check_scales(k_cache, k_scales, v_scales)
    quantized = is_quantized(k_cache.dtype)
    if quantized and k_scales.stride() != v_scales.stride():
        raise ValueError("paged_attention needs k_scales and v_scales laid out alike")
    # A float cache passes itself as the (unused) scales.
    k_scales, v_scales = (k_scales, v_scales) if quantized else (k_cache, v_cache)
    n, num_heads, head_dim = q.shape
    _, kv_block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k, q.device,
                                        num_heads // num_kv_heads, head_dim)
    split = num_splits > 1
    tiles = tile_config(max_seqlen_q, num_heads // num_kv_heads, head_dim, q.device, split)
    block_q = tiles["BLOCK_Q"]
    if split:
        target = torch.empty(n, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(n, num_heads, num_splits, dtype=torch.float32, device=q.device)
        stride_os, stride_ln, stride_lh = target.stride(2), lse.stride(0), lse.stride(1)
    else:
        target, lse = out, out  # lse unused without splits
        stride_os = stride_ln = stride_lh = 0
    grid = (n // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_scales, v_scales, target, lse, cu_seqlens_q, seq_lens, block_tables,
        num_seqs, scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scales.stride(0), k_scales.stride(1), k_scales.stride(2),
        target.stride(0), target.stride(1), stride_os, stride_ln, stride_lh,
        block_tables.stride(0),
        **tiles, KV_BLOCK_SIZE=kv_block_size, SPLIT=split, DOT_PREC=dot_precision(q.dtype), QUANT=quantized,
    )
    if split:
        _merge_splits_kernel[(n, num_heads)](
            target, lse, out, num_splits,
            target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, max_seqlen_q: int, max_seqlen_k: int, *, k_scales: torch.Tensor | None = None,
                        v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch reference: gather each sequence's keys and run dense causal softmax in fp32
    (an int8/fp8 cache dequantized to fp32 first)."""
    _check_layout(q, k_cache, v_cache)
    check_scales(k_cache, k_scales, v_scales)
    if k_scales is not None:
        k_cache = dequantize_kv(k_cache, k_scales, torch.float32)
        v_cache = dequantize_kv(v_cache, v_scales, torch.float32)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seq_len = int(seq_lens[b])
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * scale
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        scores.masked_fill_(pos[None, :] > q_pos[:, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
