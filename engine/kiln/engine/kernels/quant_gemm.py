"""Weight-only quantized GEMM: y = x @ dequant(W).T with 16-bit activations.

W8A16: int8 weights [N, K], symmetric, one scale per output channel (row): W ~ q * s[n],
or one per (row, group of 32/64/128 along K): W ~ q * s[n, k // G] (GGUF's Q8_0).
W4A16: 4-bit weights, group-wise along K (group 32/64/128), two per byte: byte [n, k // 2]
holds k even in its low nibble and k odd in its high nibble. W ~ (q - z) * s with one
scale per (row, group) and either
  - asymmetric: an integer zero point z in 0..15 per (row, group) (stored as uint8), or
  - symmetric: zeros=None, implicit z = 8, s = absmax / 7 (codes 1..15; 0 is unused),
or W ~ q * s + m with a float min m per (row, group) (mins=, GGUF's Q4_1).
Scales keep the weight's dtype (or any float dtype: kernels read them as fp32). Kernels
dequantize tiles in registers, so the 4-/8-bit weight is all that crosses memory; the
references dequantize whole matrices in torch.

Small-M (decode) GEMMs have few output tiles to spread over the GPU; a tuned split-K config
cuts K into partitions whose fp32 partial products a second kernel sums. The same GEMV kernel
also serves 16-bit weights at batch 1 (`linear`) on the shapes where it was tuned to beat cuBLAS.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.engine.kernels import dequant, int4_codes, int4_gemv, tuned
from kiln.engine.kernels.paged_attention import dot_precision

GROUP_SIZES = (32, 64, 128)
SUM_TILE = 4096  # partial sums a program of the split-K sum adds (splits x columns)


def quantize_w8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qweight int8 [N, K], scales [N] in w's dtype)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_w8 wants a float matrix [N, K]; got {w.dtype} {tuple(w.shape)}")
    scales = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-8)
    q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(w.dtype)


def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per-channel scales [N] or group-wise scales [N, K // G]."""
    n = qweight.shape[0]
    return (qweight.float().view(n, scales.shape[-1] if scales.dim() == 2 else 1, -1)
            * scales.float().view(n, -1, 1)).view(n, -1)


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
                  group_size: int, mins: torch.Tensor | None = None) -> torch.Tensor:
    q = unpack_int4(qweight).float().view(qweight.shape[0], -1, group_size)
    if mins is not None:
        return (q * scales.float()[..., None] + mins.float()[..., None]).view(qweight.shape[0], -1)
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
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_ym, stride_ys,
    INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
    MAGIC: tl.constexpr,
):
    # GROUP = 0: int8 with per-channel scales. Else BLOCK_K divides GROUP, so each K tile shares
    # one (row, group) scale. z_ptr holds integer zeros (HAS_ZEROS) or float mins (HAS_MINS).
    # Program (m, n, s) sums K range [s * k_per_split, (s + 1) * k_per_split), a multiple of
    # BLOCK_K, into slice s of y (stride_ys: 0 without split-K, else an fp32 partials buffer).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_w = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(K, k_lo + k_per_split), BLOCK_K):
        if INT4:
            # Byte j holds k = 2j (low nibble) and 2j + 1 (high): each byte is loaded once, and its
            # two codes meet x's even and odd columns in two dots over half the tile each.
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # K is whole groups: no column masks
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None], other=0.0)
            x_lo, x_hi = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))  # even, odd columns
            packed = tl.load(w_ptr + rows_w[:, None] * stride_wn + offs_j[None, :],
                             mask=n_ok[:, None], other=0)
            if HAS_ZEROS:
                offset = tl.load(z_ptr + rows_w * stride_zn + k0 // GROUP, mask=n_ok, other=0).to(tl.int32)[:, None]
            elif HAS_MINS:  # q * s + m: see below
                offset = 0
            else:  # symmetric: codes centred on 8
                offset = 8
            if MAGIC == 3 and x_lo.dtype != tl.float32:  # fp32 x: MAGIC 1's codes
                lo, hi = int4_codes.ptx_codes(packed, offset, x_lo)
            else:
                # |q - z| <= 15: exact in 16-bit floats
                lo = int4_codes.codes(packed.to(tl.int32), 0, offset, MAGIC, x_lo.dtype)
                hi = int4_codes.codes(packed.to(tl.int32), 4, offset, MAGIC, x_lo.dtype)
            part = tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)), input_precision=DOT_PREC)
            part += tl.dot(x_hi, tl.trans(hi.to(x_hi.dtype)), input_precision=DOT_PREC)
            x_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0).to(x.dtype)
            part = tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
        if GROUP:
            scale = tl.load(s_ptr + rows_w * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
            part *= scale[None, :]
        if HAS_MINS:  # the mins multiply the tile's row sums of x
            mins = tl.load(z_ptr + rows_w * stride_zn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
            part += x_sum[:, None] * mins[None, :]
        acc += part
    if not GROUP:  # one scale per output channel factors out of the K sum
        acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptr += pid_k.to(tl.int64) * stride_ys
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequant_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_ym, stride_ys,
    INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAGIC: tl.constexpr, SCALED: tl.constexpr,
):
    # The same product for one row of x a program (grid: rows, N tiles, K splits), on the CUDA
    # cores: a [BLOCK_N, BLOCK_K] weight tile times the row, summed along K, without the 15 idle
    # rows a 16-row tensor-core tile carries at M = 1. Integer zeros come off as z * sum(x).
    # Weights are read once: loaded evict-first, so x and the outputs keep the cache.
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_w = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_N], tl.float32)
    # Without group scales (16-bit or per-channel int8 weights) the products add up elementwise and
    # are summed along K once, after the loop: one FMA an element, no per-tile reduction.
    acc_2d = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_lo = tl.program_id(2) * k_per_split
    for k0 in range(k_lo, tl.minimum(K, k_lo + k_per_split), BLOCK_K):
        if INT4:
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            j_ok = offs_j < K // 2
            # x's tile in one contiguous (vector) load, then its even and odd columns
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            x_lo, x_hi = tl.split(tl.reshape(x, [BLOCK_K // 2, 2]))
            packed = tl.load(w_ptr + rows_w[:, None] * stride_wn + offs_j[None, :],
                             mask=n_ok[:, None] & j_ok[None, :], other=0, eviction_policy="evict_first").to(tl.int32)
            part = tl.sum(int4_codes.codes(packed, 0, 0, MAGIC, tl.float32).to(tl.float32) * x_lo[None, :]
                          + int4_codes.codes(packed, 4, 0, MAGIC, tl.float32).to(tl.float32) * x_hi[None, :], axis=1)
            x_sum = tl.sum(x_lo, axis=0) + tl.sum(x_hi, axis=0)
            acc += int4_gemv.group_dot(part, x_sum, s_ptr + rows_w * stride_sn + k0 // GROUP,
                                       z_ptr + rows_w * stride_zn + k0 // GROUP, n_ok, HAS_ZEROS, HAS_MINS)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            # x as a [1, BLOCK_K] row: loaded in the weight tile's layout, no shuffle through shared memory
            x = tl.load(x_ptr + row * stride_xm + offs_k[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0, eviction_policy="evict_first").to(tl.float32)
            if GROUP:
                acc += tl.sum(w * x, axis=1) * tl.load(s_ptr + rows_w * stride_sn + k0 // GROUP, mask=n_ok,
                                                       other=0.0).to(tl.float32)
            else:
                acc_2d += w * x
    if not (INT4 or GROUP):
        acc = tl.sum(acc_2d, axis=1)
    if SCALED and not GROUP:
        acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    y_ptr += tl.program_id(2).to(tl.int64) * stride_ys
    tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, M, N, splits, stride_ym, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
    # part [splits, M, N] fp32 contiguous -> y [M, N] rows of stride_ym. Every split's slice is
    # loaded at once (SPLITS: splits rounded up to a power of two): a loop over splits waited one
    # memory latency a split, as long as a decode GEMV itself at 16 splits or more.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    s = tl.arange(0, SPLITS)
    parts = tl.load(part_ptr + (s[:, None] * M + row) * N + offs[None, :], mask=(s < splits)[:, None] & ok[None, :],
                    other=0.0)
    tl.store(y_ptr + row * stride_ym + offs, tl.sum(parts, axis=0).to(y_ptr.dtype.element_ty), mask=ok)


def sum_tiles(splits: int) -> dict[str, int]:
    """The split-K sum's constexprs: about SUM_TILE partial sums a program, at least 32 columns."""
    pad = triton.next_power_of_2(splits)
    return dict(SPLITS=pad, BLOCK=max(32, min(1024, SUM_TILE // pad)))


def _m_bucket(m: int) -> str:
    return "1" if m == 1 else "16" if m <= 16 else "64" if m <= 64 else "big"


def tile_config(m: int, group_size: int, device: torch.device | None = None, int4: bool = False) -> dict[str, int]:
    """Small-M (decode) GEMMs take 16-row tiles, the tensor-core minimum; K tiles stay inside one
    quantization group (group_size 0: int8 with per-channel scales).

    Given a device, its GPU's tuned entry (kiln.engine.kernels.tuned, key w<4|8>-g<group>-m<1|16|64|big>)
    may set BLOCK_N, BLOCK_K (dividing the group), num_warps, num_stages, SPLIT_K (K partitions) and
    GEMV (1: a row a program on the CUDA cores, _dequant_gemv_kernel; with WORDS 1 and int4 weights,
    int4_gemv's kernel, which reads them as int32 words, and its VARIANTS), MAGIC (int4_codes) and DEQUANT.
    DEQUANT (the default above 16 rows): dequantize the whole weight, then cuBLAS (kernels.dequant)."""
    tiles = dict(GROUP=group_size, BLOCK_M=16 if m <= 16 else 64, BLOCK_N=64,
                 BLOCK_K=min(64, group_size) if group_size else 64, DEQUANT=int(m > 16))
    if device is not None:
        key = f"w{4 if int4 else 8}-g{group_size}-m{_m_bucket(m)}"
        tiles.update(tuned.lookup("quant_gemm", key, device) or {})
    return tiles


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            mins: torch.Tensor | None, n: int, group_size: int, int4: bool, out: torch.Tensor | None,
            tiles: dict[str, int] | None = None, scaled: bool = True) -> torch.Tensor:
    """tiles: the launch config (default tile_config's); scaled=False: 16-bit weights, no scales (GEMV only)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is not None and out.stride(-1) != 1:  # the kernels store each row's columns one after another
        raise ValueError("the quantized GEMM's out needs its last dim contiguous")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out.view(m, n)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    tiles = dict(tiles or tile_config(m, group_size, x.device, int4))
    if tiles.pop("DEQUANT", 0):
        w = dequant.dequantize(qweight, scales, zeros if zeros is not None else mins, k, group_size, int4,
                               zeros is not None, x.dtype)
        torch.matmul(x2, w.t(), out=y)
        return y.view(*x.shape[:-1], n)
    block_k = tiles["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(k, tiles.pop("SPLIT_K", 1)), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)  # every partition non-empty
    target = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    z = next((t for t in (zeros, mins) if t is not None), scales)  # scales: a placeholder, unread
    strides = (x2.stride(0), qweight.stride(0), scales.stride(0), z.stride(0), target.stride(-2),
               target.stride(0) if splits > 1 else 0)
    kinds = dict(INT4=int4, HAS_ZEROS=zeros is not None, HAS_MINS=mins is not None, MAGIC=tiles.pop("MAGIC", 0))
    words = int4_gemv.as_words(qweight) if tiles.pop("WORDS", 0) and int4 else None
    variants = {name: tiles.pop(name, 0) for name in int4_gemv.VARIANTS}
    if tiles.pop("GEMV", 0):
        del tiles["BLOCK_M"]
        if words is not None:
            int4_gemv.launch(x2, words, scales, z, target, n, k, k_per_split, splits, strides, kinds["HAS_ZEROS"],
                             kinds["HAS_MINS"], variants, tiles)
        else:
            _dequant_gemv_kernel[(m, triton.cdiv(n, tiles["BLOCK_N"]), splits)](
                x2, qweight, scales, z, target, n, k, k_per_split, *strides, **kinds, **tiles, SCALED=scaled)
    else:
        grid = (triton.cdiv(m, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]), splits)
        _dequant_gemm_kernel[grid](x2, qweight, scales, z, target, m, n, k, k_per_split, *strides, **kinds, **tiles,
                                   DOT_PREC=dot_precision(x.dtype))
    if splits > 1:
        sums = sum_tiles(splits)
        _sum_splits_kernel[(m, triton.cdiv(n, sums["BLOCK"]))](target, y, m, n, splits, y.stride(0), **sums)
    return y.view(*x.shape[:-1], n)


GEMV_DEFAULTS = dict(GROUP=0, BLOCK_M=1, BLOCK_N=32, BLOCK_K=128, GEMV=1)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T by the GEMV kernel on 16-bit weights (one program a row of x and
    BLOCK_N outputs); config: BLOCK_N, BLOCK_K, SPLIT_K, num_warps over GEMV_DEFAULTS."""
    n, k = weight.shape
    _check_x(x, k, "gemv")
    if weight.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError(f"gemv: weight must be [N, K] rows contiguous in x's dtype; got {weight.dtype} "
                         f"strides {weight.stride()}")
    return _launch(x, weight, weight, None, None, n, 0, False, None, GEMV_DEFAULTS | (config or {}), scaled=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear (cuBLAS), or for one row of x (decode at batch 1) `gemv` where this GPU's tuned file
    has an entry for the weight's shape (kernel gemv, key n<N>-k<K>): bench/tune_kernels.py writes
    one only where the kernel beat cuBLAS there."""
    n, k = weight.shape
    if bias is None and x.numel() == k and x.dtype == weight.dtype and weight.stride(1) == 1:
        config = tuned.lookup("gemv", f"n{n}-k{k}", x.device)
        if config is not None:
            return gemv(x, weight, config)
    return F.linear(x, weight, bias)


def _check_x(x: torch.Tensor, k: int, name: str) -> None:
    if not x.is_floating_point() or x.shape[-1] != k:
        raise ValueError(f"{name}: x must be float [..., {k}]; got {x.dtype} {tuple(x.shape)}")


def _check_w8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> int:
    """The group size (0: per-channel scales)."""
    n, k = qweight.shape if qweight.dim() == 2 else (0, 0)
    group = k // scales.shape[1] if scales.dim() == 2 and scales.shape[1] else 0
    per_channel = scales.shape == (n,)
    grouped = group in GROUP_SIZES and group * scales.shape[-1] == k and scales.shape == (n, k // group)
    if qweight.dtype != torch.int8 or not (per_channel or grouped):  # (a K of no whole groups read past a row)
        raise ValueError(f"w8a16: want qweight int8 [N, K] and scales [N] or [N, K // G] (G in {GROUP_SIZES}); "
                         f"got {qweight.dtype} {tuple(qweight.shape)}, scales {tuple(scales.shape)}")
    _check_x(x, k, "w8a16")
    return group


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_w8(qweight [N, K] int8, scales [N] or [N, K // G]).T -> [..., N] in x's dtype."""
    group = _check_w8(x, qweight, scales)
    return _launch(x, qweight.contiguous(), scales.contiguous(), None, None, qweight.shape[0], group, False, out)


def w8a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    _check_w8(x, qweight, scales)
    return (x.float() @ dequantize_w8(qweight, scales).T).to(x.dtype)


def _check_w4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              group_size: int, mins: torch.Tensor | None) -> None:
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"w4a16: qweight must be packed uint8 [N, K // 2]; got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    _check_w4_shape(n, k, group_size)
    if scales.shape != (n, k // group_size) or (zeros is not None and zeros.shape != scales.shape):
        raise ValueError(f"w4a16: scales/zeros must be [{n}, {k // group_size}]; got {tuple(scales.shape)}, "
                         f"{None if zeros is None else tuple(zeros.shape)}")
    if mins is not None and (zeros is not None or mins.shape != scales.shape):
        raise ValueError(f"w4a16: mins replace zeros and must be [{n}, {k // group_size}]; "
                         f"got zeros {zeros is not None}, mins {tuple(mins.shape)}")
    _check_x(x, k, "w4a16")


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group_size: int, *, mins: torch.Tensor | None = None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [..., K] @ dequantize_w4(qweight, scales, zeros, group_size, mins).T -> [..., N] in x's dtype."""
    _check_w4(x, qweight, scales, zeros, group_size, mins)
    zeros, mins = (t.contiguous() if t is not None else None for t in (zeros, mins))
    return _launch(x, qweight.contiguous(), scales.contiguous(), zeros, mins, qweight.shape[0], group_size, True,
                   out)


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group_size: int, *, mins: torch.Tensor | None = None) -> torch.Tensor:
    _check_w4(x, qweight, scales, zeros, group_size, mins)
    return (x.float() @ dequantize_w4(qweight, scales, zeros, group_size, mins).T).to(x.dtype)
