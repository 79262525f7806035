"""W4A16 at one row of x (batch-1 decode) on the CUDA cores, reading the packed weight as int32 words;
and `group_dot`, the per-group dequantization arithmetic both int4 GEMV kernels share.

The byte-wise kernels (quant_gemm) spend several integer instructions a code: widen the byte,
shift, mask, offset, convert. On an H100 every W4A16 config of theirs stopped near W8A16's time on
the same shape, 1 TB/s of int4 weights (bench/results/kernels-nvidia-h100-20261127.json): the work
a code, not memory, looked like the limit (the integer pipe runs at half the FMA rate). This kernel
took the 4096x14336 GEMV from 1.54x to 2.11x cuBLAS bf16 there (`-2.json`).

Here a word holds 8 codes, k = 8w + i in bits 4i..4i+3 (the uint8 [N, K // 2] layout read four
bytes at a time). A code becomes a float with one AND-OR where it stands: OR-ed under the exponent
of 2**(23 - 4i) the nibble is worth exactly its value, so `float - 2**(23 - 4i)` is the code
(nibbles 0-3 from the word, 4-7 from the word shifted right by 16: one shift for eight codes).
Then one FMA with x. Each program sums BLOCK_N rows over one quantization group a tile (BLOCK_K
divides the group); split-K partitions are summed by quant_gemm's second kernel.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _nibble(word, shift: tl.constexpr):
    # The code at bits shift..shift+3 (shift <= 12) as an exact float: the bits OR-ed under the
    # exponent of 2**(23 - shift) are worth 2**(23 - shift) + code.
    exponent: tl.constexpr = (150 - shift) << 23
    bias = tl.full([], exponent, tl.int32).to(tl.float32, bitcast=True)
    return ((word & (0xF << shift)) | exponent).to(tl.float32, bitcast=True) - bias


@triton.jit
def group_dot(dot, x_sum, scales, offsets, n_ok, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr):
    # One quantization group's sum of codes times x per row -> the sum of its dequantized weights
    # times x: less the zero point (8 when symmetric) times x's sum, times the scale, plus the min
    # (GGUF Q4_1) times x's sum. scales, offsets: pointers to each row's scale and zero (or min).
    if HAS_ZEROS:
        dot -= x_sum * tl.load(offsets, mask=n_ok, other=0).to(tl.float32)
    elif not HAS_MINS:
        dot -= 8.0 * x_sum
    dot *= tl.load(scales, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_MINS:
        dot += x_sum * tl.load(offsets, mask=n_ok, other=0.0).to(tl.float32)
    return dot


@triton.jit
def _int4_words_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_ym, stride_ys,
    HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
):
    # Grid (rows of x, N tiles, K splits). w_ptr: int32 [N, K // 8] (stride_wn in words).
    # PREFETCH 1: the next tile's words are loaded before this tile's math, so a program waits on
    # memory once, not once a tile (compiled for sm_90, the plain loop has no cp.async: Triton
    # does not pipeline these loads itself).
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_w = offs_n.to(tl.int64)
    offs_w = tl.arange(0, BLOCK_K // 8)
    tiles = w_ptr + rows_w[:, None] * stride_wn + offs_w[None, :]  # K is whole groups: no column mask
    acc = tl.zeros([BLOCK_N], tl.float32)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if PREFETCH:
        words = tl.load(tiles + k_lo // 8, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PREFETCH:
            this = words
            rows_next = tl.where(k0 + BLOCK_K < k_hi, N, 0)  # no rows past the partition's last tile
            words = tl.load(tiles + (k0 + BLOCK_K) // 8, mask=(offs_n < rows_next)[:, None], other=0,
                            eviction_policy="evict_first")
        else:
            this = tl.load(tiles + k0 // 8, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
        high = this >> 16
        part = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)
        x_sum = tl.zeros([BLOCK_K // 8], tl.float32)
        x_row = x_ptr + row * stride_xm + k0 + offs_w * 8
        for i in tl.static_range(8):
            # x's column 8w + i for each word w (x is a few KB, read from cache)
            x = tl.load(x_row + i).to(tl.float32)
            part += _nibble(this if i < 4 else high, 4 * (i % 4)) * x[None, :]
            x_sum += x
        acc += group_dot(tl.sum(part, axis=1), tl.sum(x_sum, axis=0), s_ptr + rows_w * stride_sn + k0 // GROUP,
                         z_ptr + rows_w * stride_zn + k0 // GROUP, n_ok, HAS_ZEROS, HAS_MINS)
    y_ptr += tl.program_id(2).to(tl.int64) * stride_ys
    tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def as_words(qweight: torch.Tensor) -> torch.Tensor | None:
    """The packed uint8 [N, K // 2] weight as int32 [N, K // 8] over the same memory, or None where
    its rows are not whole aligned words (then the byte-wise kernel serves)."""
    if qweight.stride(1) != 1 or qweight.shape[1] % 4 or qweight.stride(0) % 4 or qweight.data_ptr() % 4:
        return None
    return qweight.view(torch.int32)


def launch(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, z: torch.Tensor, target: torch.Tensor,
           n: int, k: int, k_per_split: int, splits: int, strides: tuple[int, ...], has_zeros: bool,
           has_mins: bool, prefetch: int, tiles: dict[str, int]) -> None:
    """strides and tiles (GROUP, BLOCK_N, BLOCK_K, num_warps ...) as quant_gemm._launch has them;
    the weight's stride is in bytes there, in words here."""
    stride_xm, stride_wn, *rest = strides
    _int4_words_gemv_kernel[(x2.shape[0], triton.cdiv(n, tiles["BLOCK_N"]), splits)](
        x2, words, scales, z, target, n, k, k_per_split, stride_xm, stride_wn // 4, *rest,
        HAS_ZEROS=has_zeros, HAS_MINS=has_mins, PREFETCH=prefetch, **tiles)
