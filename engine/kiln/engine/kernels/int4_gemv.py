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
registers instead of 87 (4 programs an SM instead of 5); not yet timed.

SUM_SPLITS 1 sums the split-K partitions in this kernel: each program stores its partial sums, takes a
ticket from its N tile's counter, and the last to arrive adds every partition's into the output and
sets the counter back to 0. That saves the second kernel, about as long as a small GEMV's own
launch and tail (4096x4096 at batch 1 took 9.7 us on an H100 for 2.9 us of bytes). The counters
are one int32 per (row, N tile), kept per device and left at 0 by every launch; two launches must
not run at once on one device (the engine decodes on one stream).

DEFER_SUM 1 leaves the sum over a tile's words to the end: each tile adds its words' shares of the
group's scaled, offset sum into a tile-shaped accumulator (_group_terms), so the loop has no
reduction across threads (shuffles, and the barrier and shared memory that x's sums across warps
took each tile) and a program's warps run the K loop independently. Its rows' scales and zeros
still cross threads through shared memory (1), or each thread loads them once a word column it
holds (2). Counted by bench/sass.py for a 128x128 tile with LATE_BIAS: 496 instructions a thread in
the loop with 4 barriers (1), 609 with none (2), against 512 with 2. On an H200 neither was faster
(bench/results/tune-w4-m1-nvidia-h200-20261130-2.json). Only 2 lets a tile span several groups
(BLOCK_K a multiple of GROUP dividing K; otherwise one group a tile): longer runs of each row.
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
def _per_row(ptr, n_ok, offs_w, GROUP: tl.constexpr, IN_TILE: tl.constexpr):
    # A value per row and group as a [BLOCK_N, 1] or (IN_TILE) [BLOCK_N, words] float: a 1-D load
    # comes in a layout of its own, which reaches the tile's through shared memory behind a barrier;
    # loaded in the tile's layout, a thread loads its row's value once for each word column it holds,
    # that column's group's (a tile may then span several groups).
    if IN_TILE:
        value = tl.load(ptr[:, None] + (offs_w * 8 // GROUP)[None, :], mask=n_ok[:, None], other=0)
    else:
        value = tl.load(ptr, mask=n_ok, other=0)[:, None]
    return value.to(tl.float32)


@triton.jit
def _group_terms(part, x_sum, x_bias, scales, offsets, n_ok, offs_w, HAS_ZEROS: tl.constexpr,
                 HAS_MINS: tl.constexpr, GROUP: tl.constexpr, IN_TILE: tl.constexpr):
    # group_dot before the sum over a tile's words: each word column's share, whose row sums are
    # group_dot's. x_sum, x_bias: per word column, in the thread that holds it.
    if not (HAS_ZEROS or HAS_MINS):
        x_bias += 8.0 * x_sum  # the symmetric zero point
    part -= x_bias[None, :]
    if HAS_ZEROS:
        part -= _per_row(offsets, n_ok, offs_w, GROUP, IN_TILE) * x_sum[None, :]
    part *= _per_row(scales, n_ok, offs_w, GROUP, IN_TILE)
    if HAS_MINS:
        part += _per_row(offsets, n_ok, offs_w, GROUP, IN_TILE) * x_sum[None, :]
    return part


@triton.jit
def _int4_words_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, out_ptr, count_ptr, N, K, k_per_split, splits, nibble,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_ym, stride_ys, stride_om,
    HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, LATE_BIAS: tl.constexpr,
    SUM_SPLITS: tl.constexpr, DEFER_SUM: tl.constexpr, STAGES: tl.constexpr,
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
    terms = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)  # DEFER_SUM: summed over its words after the loop
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if PREFETCH:
        words = tl.load(tiles + k_lo // 8, mask=n_ok[:, None], other=0, eviction_policy="evict_first")
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        if PREFETCH:
            this = words
            rows_next = tl.where(k0 + BLOCK_K < k_hi, N, 0)  # no rows past the partition's last tile
            words = tl.load(tiles + (k0 + BLOCK_K) // 8, mask=(offs_n < rows_next)[:, None], other=0,
                            eviction_policy="evict_first")
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
        scales, offsets = s_ptr + rows_w * stride_sn + k0 // GROUP, z_ptr + rows_w * stride_zn + k0 // GROUP
        if DEFER_SUM:
            terms += _group_terms(part, x_sum, x_bias, scales, offsets, n_ok, offs_w, HAS_ZEROS, HAS_MINS, GROUP,
                                  DEFER_SUM == 2)
        else:
            dot = tl.sum(part, axis=1)
            if LATE_BIAS:
                dot -= tl.sum(x_bias, axis=0)
            acc += group_dot(dot, tl.sum(x_sum, axis=0), scales, offsets, n_ok, HAS_ZEROS, HAS_MINS)
    if DEFER_SUM:
        acc = tl.sum(terms, axis=1)
    tl.store(y_ptr + tl.program_id(2).to(tl.int64) * stride_ys + row * stride_ym + offs_n,
             acc.to(y_ptr.dtype.element_ty), mask=n_ok)
    if SUM_SPLITS:  # SUM_SPLITS: the partitions rounded up to a power of two
        _sum_if_last(y_ptr + row * stride_ym, out_ptr + row * stride_om, count_ptr + row * tl.num_programs(1)
                     + tl.program_id(1), offs_n, n_ok, splits, stride_ys, SUM_SPLITS)


@triton.jit
def _sum_if_last(parts_ptr, out_ptr, count_ptr, offs_n, n_ok, splits, stride_ys, SPLITS: tl.constexpr):
    # The barrier orders every thread's partial store before the ticket, taken with release (and
    # acquire, for the last program's loads of the others' partials, read from L2: .cg).
    tl.debug_barrier()
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == splits - 1:
        s = tl.arange(0, SPLITS)
        parts = tl.load(parts_ptr + s[:, None].to(tl.int64) * stride_ys + offs_n[None, :],
                        mask=(s < splits)[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + offs_n, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty), mask=n_ok)
        tl.atomic_xchg(count_ptr, 0)  # ready for the next launch


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
VARIANTS = ("PREFETCH", "LATE_BIAS", "SUM_SPLITS", "DEFER_SUM", "STAGES")  # this kernel's own switches in a tuned config (0 when absent)
_counters: dict[torch.device, torch.Tensor] = {}  # SUM_SPLITS' tickets, per device, all 0 between launches


def counters(device: torch.device, size: int) -> torch.Tensor:
    """At least `size` int32 zeros on the device, the same tensor each call while it is large enough."""
    have = _counters.get(device)
    if have is None or have.numel() < size:
        have = _counters[device] = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
    return have


def launch(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, z: torch.Tensor, target: torch.Tensor,
           y: torch.Tensor, n: int, k: int, k_per_split: int, splits: int, strides: tuple[int, ...],
           has_zeros: bool, has_mins: bool, variants: dict[str, int], tiles: dict[str, int]) -> bool:
    """strides and tiles (GROUP, BLOCK_N, BLOCK_K, num_warps ...) as quant_gemm._launch has them;
    the weight's stride is in bytes there, in words here. variants: VARIANTS' values. target: y, or
    the split-K partials; True where the kernel also summed those into y (SUM_SPLITS)."""
    stride_xm, stride_wn, *rest = strides
    grid = (x2.shape[0], triton.cdiv(n, tiles["BLOCK_N"]), splits)
    summing = splits > 1 and variants.get("SUM_SPLITS", 0)
    count = counters(x2.device, grid[0] * grid[1]) if summing else target
    _int4_words_gemv_kernel[grid](
        x2, words, scales, z, target, y, count, n, k, k_per_split, splits, NIBBLE, stride_xm, stride_wn // 4,
        *rest, y.stride(0), HAS_ZEROS=has_zeros, HAS_MINS=has_mins,
        **(variants | {"SUM_SPLITS": triton.next_power_of_2(splits) if summing else 0,
                       "STAGES": max(1, variants.get("STAGES", 0))}), **tiles)
    return bool(summing)
