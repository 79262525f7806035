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

LATE_BIAS 1 drops the subtract: each nibble is first shifted to bits 12..15 or 16..19 (three shifts
a word: << 8 for codes 1-2, >> 8 for 5-6, a rotation by 16 for 0 and 7; 3-4 are in place), where its
float is worth 2**11 or 2**7 plus the code, and the biases times x are taken off once a tile. Biases
that small keep fp32's error near 1e-5 of the sum; at bit 0 (2**23) the products would lose the
codes. Counted in the sm_90 cubins by bench/sass.py for a 128x128 tile, 128 codes a thread: 717
instructions in the loop before NIBBLE, 585 after, 512 with LATE_BIAS (FADD 172 -> 56), at 101
registers instead of 87 (4 programs an SM instead of 5).

On an H200 (bench/results/tune-w4-m1-nvidia-h200-20261130-*.json) PREFETCH at 16 splits was best,
17.2 us on 4096x14336 (1.89x cuBLAS bf16), LATE_BIAS within 3%. Tried there and not kept, none
faster: the split-K sum in this kernel (the last program of each N tile, by ticket counters), the
sum over a tile's words after the K loop (no barrier a tile), tiles spanning several groups, and
Triton's pipelining of the loop (cp.async). Every config stays at about 3.3 us plus the bytes at
2.2 TB/s, half the copy peak.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _as_float(word, at: tl.constexpr, nibble):
    # The code at bits at..at+3 (at <= 19) with the exponent of 2**(23 - at) OR-ed above it: the
    # float 2**(23 - at) + code, exactly.
    return ((word & (nibble << at)) | ((150 - at) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _nibble(word, shift: tl.constexpr, nibble):
    # The code at bits shift..shift+3 (shift <= 12), less its bias: the code as a float.
    bias = tl.full([], (150 - shift) << 23, tl.int32).to(tl.float32, bitcast=True)
    return _as_float(word, shift, nibble) - bias


@triton.jit
def _placed(word, i: tl.constexpr, nibble):
    # Code i (bits 4i..4i+3) moved to bits `at` = 16 (even i) or 12 (odd i), as the float 2**(23 - at) + code.
    at: tl.constexpr = 16 - 4 * (i % 2)
    shift: tl.constexpr = at - 4 * i
    if shift == 16 or shift == -16:  # codes 0 and 7: the word rotated by 16 holds both, one funnel shift
        moved = (word << 16) | (word.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
    else:
        moved = word << shift if shift >= 0 else word >> -shift  # bits above `at + 3` are masked off
    return _as_float(moved, at, nibble)


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
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, K, k_per_split, nibble,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_ym, stride_ys,
    HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, LATE_BIAS: tl.constexpr,
):
    # Grid (rows of x, N tiles, K splits). w_ptr: int32 [N, K // 8] (stride_wn in words).
    # PREFETCH 1: the next tile's words are loaded before this tile's math, so a program waits on
    # memory once, not once a tile (compiled for sm_90, the plain loop has no cp.async: Triton
    # does not pipeline these loads itself). PREFETCH 2: the next two tiles', twice the bytes in
    # flight a thread (Nsight's top stall was the wait on loads) at 127 registers instead of 96 in
    # the sm_90 cubin of a 128x128 tile: 4 programs an SM instead of 5.
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
    if PREFETCH == 2:
        rows_next = tl.where(k_lo + BLOCK_K < k_hi, N, 0)
        words_after = tl.load(tiles + (k_lo + BLOCK_K) // 8, mask=(offs_n < rows_next)[:, None], other=0,
                              eviction_policy="evict_first")
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PREFETCH:
            this = words
            ahead: tl.constexpr = PREFETCH * BLOCK_K
            rows_next = tl.where(k0 + ahead < k_hi, N, 0)  # no rows past the partition's last tile
            fetched = tl.load(tiles + (k0 + ahead) // 8, mask=(offs_n < rows_next)[:, None], other=0,
                              eviction_policy="evict_first")
            if PREFETCH == 2:
                words = words_after
                words_after = fetched
            else:
                words = fetched
        else:
            this = tl.load(tiles + k0 // 8, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
        part = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)
        x_sum = tl.zeros([BLOCK_K // 8], tl.float32)
        x_bias = tl.zeros([BLOCK_K // 8], tl.float32)  # LATE_BIAS: the codes' biases times x
        x_row = x_ptr + row * stride_xm + k0 + offs_w * 8
        if not LATE_BIAS:
            high = this >> 16
        for i in tl.static_range(8):
            # x's column 8w + i for each word w (x is a few KB, read from cache)
            x = tl.load(x_row + i).to(tl.float32)
            if LATE_BIAS:
                part += _placed(this, i, nibble) * x[None, :]
                x_bias += x * (128.0 if i % 2 == 0 else 2048.0)
            else:
                part += _nibble(this if i < 4 else high, 4 * (i % 4), nibble) * x[None, :]
            x_sum += x
        dot = tl.sum(part, axis=1)
        if LATE_BIAS:
            dot -= tl.sum(x_bias, axis=0)
        acc += group_dot(dot, tl.sum(x_sum, axis=0), s_ptr + rows_w * stride_sn + k0 // GROUP,
                         z_ptr + rows_w * stride_zn + k0 // GROUP, n_ok, HAS_ZEROS, HAS_MINS)
    y_ptr += tl.program_id(2).to(tl.int64) * stride_ys
    tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def as_words(qweight: torch.Tensor) -> torch.Tensor | None:
    """The packed uint8 [N, K // 2] weight as int32 [N, K // 8] over the same memory, or None where
    its rows are not whole aligned words (then the byte-wise kernel serves)."""
    if qweight.stride(1) != 1 or qweight.shape[1] % 4 or qweight.stride(0) % 4 or qweight.data_ptr() % 4:
        return None
    return qweight.view(torch.int32)


# The kernel's `nibble` mask, passed at run time: as a constant, ptxas put it in a fresh register before
# every AND-OR (one AND-OR takes one immediate; the exponent is the other), about 100 moves a 128x128
# tile a thread in the sm_90 cubin; as an argument it stays in a register and those moves are gone.
NIBBLE = 0xF
VARIANTS = ("PREFETCH", "LATE_BIAS")  # this kernel's own switches in a tuned config (0 when absent)


def launch(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, z: torch.Tensor, target: torch.Tensor,
           n: int, k: int, k_per_split: int, splits: int, strides: tuple[int, ...], has_zeros: bool,
           has_mins: bool, variants: dict[str, int], tiles: dict[str, int]) -> None:
    """strides and tiles (GROUP, BLOCK_N, BLOCK_K, num_warps ...) as quant_gemm._launch has them;
    the weight's stride is in bytes there, in words here. variants: VARIANTS' values."""
    stride_xm, stride_wn, *rest = strides
    _int4_words_gemv_kernel[(x2.shape[0], triton.cdiv(n, tiles["BLOCK_N"]), splits)](
        x2, words, scales, z, target, n, k, k_per_split, NIBBLE, stride_xm, stride_wn // 4, *rest,
        HAS_ZEROS=has_zeros, HAS_MINS=has_mins, **variants, **tiles)
