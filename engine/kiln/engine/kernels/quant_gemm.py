"""Weight-only quantized GEMM: y = x @ dequant(W).T with 16-bit activations.

W8A16: int8 weights [N, K], symmetric, one scale per output channel (row): W ~ q * s[n].
W4A16: 4-bit weights, group-wise along K (group 32/64/128), two per byte: byte [n, k // 2]
holds k even in its low nibble and k odd in its high nibble. W ~ (q - z) * s with one
scale per (row, group) and either
  - asymmetric: an integer zero point z in 0..15 per (row, group) (stored as uint8), or
  - symmetric: zeros=None, implicit z = 8, s = absmax / 7 (codes 1..15; 0 is unused).
Scales keep the weight's dtype. Kernels dequantize tiles in registers, so the 4-/8-bit
weight is all that crosses memory; the references dequantize whole matrices in torch.
"""
import torch
import triton
import triton.language as tl

from kiln.engine.kernels.paged_attention import dot_precision

GROUP_SIZES = (32, 64, 128)


def quantize_w8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qweight int8 [N, K], scales [N] in w's dtype)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_w8 wants a float matrix [N, K]; got {w.dtype} {tuple(w.shape)}")
    scales = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-8)
    q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(w.dtype)


def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales.float()[:, None]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 -> uint8 [N, K // 2] (even k in the low nibble)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> codes uint8 [N, K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1)


def quantize_w4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [N, K] float -> (qweight uint8 [N, K//2], scales [N, K//G], zeros uint8 [N, K//G] or None)."""
    _check_w4_shape(w.shape[0] if w.dim() == 2 else -1, w.shape[-1], group_size)
    if not w.is_floating_point():
        raise ValueError(f"quantize_w4 wants float weights; got {w.dtype}")
    groups = w.float().view(w.shape[0], -1, group_size)
    if symmetric:
        scales = (groups.abs().amax(-1) / 7).clamp(min=1e-8)
        zeros = torch.full_like(scales, 8)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(groups / scales[..., None] + zeros[..., None]).clamp(0, 15).view(w.shape)
    return pack_int4(q), scales.to(w.dtype), None if symmetric else zeros.to(torch.uint8)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  group_size: int) -> torch.Tensor:
    q = unpack_int4(qweight).float().view(qweight.shape[0], -1, group_size)
    z = 8.0 if zeros is None else zeros.float()[..., None]
    return ((q - z) * scales.float()[..., None]).view(qweight.shape[0], -1)


def _check_w4_shape(n: int, k: int, group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}; got {group_size}")
    if n < 1 or k % group_size:
        raise ValueError(f"int4 weights need shape [N, K] with K a multiple of the group size {group_size}; "
                         f"got N={n}, K={k}")


@triton.jit
def _dequant_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
    INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_w = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        if INT4:
            # BLOCK_K divides GROUP, so the whole tile shares one (row, group) scale and zero.
            packed = tl.load(w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :] // 2, mask=w_mask, other=0)
            codes = (packed.to(tl.int32) >> ((offs_k[None, :] % 2) * 4)) & 0xF
            group = k0 // GROUP
            if HAS_ZEROS:
                zero = tl.load(z_ptr + rows_w * stride_zn + group, mask=n_ok, other=0).to(tl.int32)
            else:
                zero = tl.full([BLOCK_N], 8, tl.int32)
            w = (codes - zero[:, None]).to(x.dtype)  # |q - z| <= 15: exact in 16-bit floats
            part = tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
            scale = tl.load(s_ptr + rows_w * stride_sn + group, mask=n_ok, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
        else:
            w = tl.load(w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PREC)
    if not INT4:  # one scale per output channel factors out of the K sum
        acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tile_config(m: int, group_size: int, int4: bool) -> dict[str, int]:
    """Small-M (decode) GEMMs take 16-row tiles, the tensor-core minimum; int4 K tiles stay
    inside one quantization group."""
    return dict(GROUP=group_size, BLOCK_M=16 if m <= 16 else 64, BLOCK_N=64,
                BLOCK_K=min(64, group_size) if int4 else 64)


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            n: int, group_size: int, int4: bool, out: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out.view(m, n)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    tiles = tile_config(m, group_size, int4)
    grid = (triton.cdiv(m, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
    z = zeros if zeros is not None else scales  # placeholder pointer, unread without zeros
    _dequant_gemm_kernel[grid](
        x2, qweight, scales, z, y, m, n, k,
        x2.stride(0), qweight.stride(0), scales.stride(0), z.stride(0), y.stride(0),
        INT4=int4, HAS_ZEROS=zeros is not None, **tiles, DOT_PREC=dot_precision(x.dtype),
    )
    return y.view(*x.shape[:-1], n)


def _check_x(x: torch.Tensor, k: int, name: str) -> None:
    if not x.is_floating_point() or x.shape[-1] != k:
        raise ValueError(f"{name}: x must be float [..., {k}]; got {x.dtype} {tuple(x.shape)}")


def _check_w8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.shape != (qweight.shape[0],):
        raise ValueError(f"w8a16: want qweight int8 [N, K] and scales [N]; got {qweight.dtype} "
                         f"{tuple(qweight.shape)}, scales {tuple(scales.shape)}")
    _check_x(x, qweight.shape[1], "w8a16")


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] int8 * scales [N]).T -> [..., N] in x's dtype."""
    _check_w8(x, qweight, scales)
    return _launch(x, qweight.contiguous(), scales.contiguous(), None, qweight.shape[0], 0, False, out)


def w8a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    _check_w8(x, qweight, scales)
    return (x.float() @ dequantize_w8(qweight, scales).T).to(x.dtype)


def _check_w4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              group_size: int) -> None:
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"w4a16: qweight must be packed uint8 [N, K // 2]; got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    _check_w4_shape(n, k, group_size)
    if scales.shape != (n, k // group_size) or (zeros is not None and zeros.shape != scales.shape):
        raise ValueError(f"w4a16: scales/zeros must be [{n}, {k // group_size}]; got {tuple(scales.shape)}, "
                         f"{None if zeros is None else tuple(zeros.shape)}")
    _check_x(x, k, "w4a16")


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group_size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_w4(qweight, scales, zeros, group_size).T -> [..., N] in x's dtype."""
    _check_w4(x, qweight, scales, zeros, group_size)
    zeros = zeros.contiguous() if zeros is not None else None
    return _launch(x, qweight.contiguous(), scales.contiguous(), zeros, qweight.shape[0], group_size, True, out)


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group_size: int) -> torch.Tensor:
    _check_w4(x, qweight, scales, zeros, group_size)
    return (x.float() @ dequantize_w4(qweight, scales, zeros, group_size).T).to(x.dtype)
