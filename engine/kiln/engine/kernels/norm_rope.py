"""Fused residual-add + RMSNorm, and rotary position embedding (neox / HF Llama style).

Both follow Hugging Face Llama's rounding: the residual sum is rounded to the activation
dtype before it is normed, statistics are fp32, and the normed value is rounded to the
activation dtype before the weight multiplies it.
"""
import torch
import triton
import triton.language as tl

from kiln.engine.kernels.kv_store import check_float_cache


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rmsnorm(x + residual) * weight, x + residual) for x [N, hidden].

    Without residual the second value is x itself (the first layer's residual stream).
    """
    _check_norm(x, weight, residual)
    out = torch.empty_like(x) if out is None else out
    has_residual = residual is not None  # not `residual_out is not x`: the sum may be written over x
    if residual is None:
        residual, residual_out = x, x  # nothing to add: the input is the residual stream
    elif residual_out is None:
        residual_out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, residual_out, eps,
            x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
            HIDDEN=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]), HAS_RESIDUAL=has_residual,
            num_warps=8 if x.shape[1] >= 2048 else 4,
        )
    return out, residual_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of rms_norm (HF LlamaRMSNorm after an optional residual add)."""
    _check_norm(x, weight, residual)
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype), x


def _check_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm wants x [N,hidden], weight [hidden], residual like x; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, residual {None if residual is None else tuple(residual.shape)}")
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows contiguous")


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, 2 * len(inv_freq)] fp32: cos in the first half, sin in the second.

    inv_freq comes from the model (plain theta or llama3-scaled), so scaling stays in one place.
    """
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device),
                        inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@triton.jit
def _rotate_heads(x_row, o_row, stride_xh, stride_oh, cos, sin,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    # x_row, o_row: one token's heads (head h at + h * stride)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_r = tl.arange(0, BLOCK_HALF)[None, :]
    h_ok = offs_h < NUM_HEADS
    mask = h_ok & (offs_r < HALF)
    x_row += offs_h * stride_xh
    o_row += offs_h * stride_oh
    x1 = tl.load(x_row + offs_r, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + offs_r, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + offs_r, (x1 * cos - x2 * sin).to(o_row.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF + offs_r, (x2 * cos + x1 * sin).to(o_row.dtype.element_ty), mask=mask)
    if 2 * HALF < HEAD_DIM:  # partial rotary: the tail passes through
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        tail = h_ok & (offs_d >= 2 * HALF) & (offs_d < HEAD_DIM)
        tl.store(o_row + offs_d, tl.load(x_row + offs_d, mask=tail), mask=tail)


@triton.jit
def _rope_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, q_out_ptr, k_out_ptr, v_out_ptr, slot_ptr,
                 stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_qon, stride_qoh,
                 stride_kon, stride_koh, stride_von, stride_voh, stride_cache,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, STORE: tl.constexpr):
    # Rotated k goes to row `token` of k_out; with STORE, to the token's slot of a float cache
    # (k_out, v_out: the caches; slot -1: no write), and v with it: decode's K/V skip a trip
    # through memory and a second launch.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + offs_r, mask=offs_r < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_r, mask=offs_r < HALF, other=0.0)
    _rotate_heads(q_ptr + token * stride_qn, q_out_ptr + token * stride_qon, stride_qh, stride_qoh, cos, sin,
                  NUM_Q_HEADS, HEAD_DIM, HALF, BLOCK_QH, BLOCK_HALF, BLOCK_D)
    row = token
    if STORE:
        row = tl.load(slot_ptr + token).to(tl.int64)
    if row >= 0:
        _rotate_heads(k_ptr + token * stride_kn, k_out_ptr + row * stride_kon, stride_kh, stride_koh, cos, sin,
                      NUM_K_HEADS, HEAD_DIM, HALF, BLOCK_KH, BLOCK_HALF, BLOCK_D)
        if STORE:
            offs_h = tl.arange(0, BLOCK_KH)[:, None]
            offs_d = tl.arange(0, BLOCK_D)[None, :]
            mask = (offs_h < NUM_K_HEADS) & (offs_d < HEAD_DIM)
            v = tl.load(v_ptr + token * stride_vn + offs_h * stride_vh + offs_d, mask=mask)
            tl.store(v_out_ptr + row * stride_von + offs_h * stride_voh + offs_d, v.to(v_out_ptr.dtype.element_ty),
                     mask=mask)


def _shape_constexprs(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> dict[str, int]:
    half, head_dim, p2 = cos_sin.shape[1] // 2, q.shape[2], triton.next_power_of_2
    return dict(NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HEAD_DIM=head_dim, HALF=half,
                BLOCK_QH=p2(q.shape[1]), BLOCK_KH=p2(k.shape[1]), BLOCK_HALF=p2(half), BLOCK_D=p2(head_dim))


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, *,
         q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [N,Hq,D] and k [N,Hkv,D] by positions [N] (neox halves, like HF Llama)."""
    _check_rope(positions, q, k, cos_sin)
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    if q.shape[0]:
        _rope_kernel[(q.shape[0],)](  # k, k_out and positions also stand in for the unused v, v_out, slots
            positions, q, k, k, cos_sin, q_out, k_out, k_out, positions,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), 0, 0, q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), 0, 0, cos_sin.stride(0), **_shape_constexprs(q, k, cos_sin), STORE=False)
    return q_out, k_out


def rope_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
               q_out: torch.Tensor | None = None) -> torch.Tensor:
    """rope, then the rotated k and v stored at their slots of a float cache (kv_store.store_kvcache's
    layout; slot -1 skips), in one kernel: returns the rotated q."""
    _check_rope(positions, q, k, cos_sin)
    check_float_cache(k, v, k_cache, v_cache, slot_mapping)
    q_out = torch.empty_like(q) if q_out is None else q_out
    if q.shape[0]:
        _rope_kernel[(q.shape[0],)](
            positions, q, k, v, cos_sin, q_out, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
            q_out.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
            cos_sin.stride(0), **_shape_constexprs(q, k, cos_sin), STORE=True)
    return q_out


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of rope (fp32 arithmetic, then rounded to the input dtype)."""
    _check_rope(positions, q, k, cos_sin)
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[positions, :half][:, None, :], cos_sin[positions, half:][:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2, tail = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:]
        return torch.cat([(x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype), tail], -1)

    return rotate(q), rotate(k)


def _check_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or positions.shape != (q.shape[0],) \
            or q.shape[2] != k.shape[2] or cos_sin.dim() != 2 or cos_sin.shape[1] % 2 \
            or cos_sin.shape[1] > q.shape[2]:
        raise ValueError(f"rope wants positions [N], q [N,Hq,D], k [N,Hkv,D], cos_sin [P, rot<=D, even]; got "
                         f"{tuple(positions.shape)}, {tuple(q.shape)}, {tuple(k.shape)}, {tuple(cos_sin.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin.stride(1) != 1:
        raise ValueError("rope needs the head dim contiguous")
    if not positions.is_contiguous():  # read one element after another
        raise ValueError("rope needs positions contiguous")
