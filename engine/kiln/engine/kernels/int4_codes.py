"""How quant_gemm's kernels make int4 codes floats (its tile configs' MAGIC): an int-to-float
conversion runs at a quarter of the FMA rate or less, so the code is OR-ed into a float's mantissa
instead, whose value is then exactly a bias plus the code."""
import triton
import triton.language as tl


@triton.jit
def codes(packed, shift: tl.constexpr, offset, MAGIC: tl.constexpr, DTYPE: tl.constexpr):
    # The 4-bit codes at `shift` of int32 `packed`, less `offset` (a zero point per row, 8 or 0).
    # MAGIC 0: int32 (the caller converts). 1: fp32, made by OR-ing the code into the mantissa of
    # 2**23 and subtracting 2**23 + offset. 2: the same in DTYPE's 16 bits (bf16 128.0, fp16 1024.0),
    # no conversion at all (3: the same in inline PTX, `ptx_codes`). Every step is exact:
    # |code - offset| <= 15.
    q = (packed >> shift) & 0xF
    if MAGIC == 0:
        q = q - offset
    elif MAGIC == 2 and DTYPE == tl.bfloat16:
        q = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (offset + 128.0).to(tl.bfloat16)
    elif MAGIC == 2 and DTYPE == tl.float16:
        q = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (offset + 1024.0).to(tl.float16)
    else:
        q = (q | 0x4B000000).to(tl.float32, bitcast=True) - (offset + 8388608.0)
    return q


def biased_asm(magic: str) -> str:
    # Four bytes at $4 -> their low codes at $0 (bytes 0, 1), $1 (bytes 2, 3), high codes at $2, $3,
    # each a 16-bit float in half a word: the code OR-ed under `magic`'s exponent.
    pairs = "".join(f"lop3.b32 ${o}, t{o % 2}, 0x000F000F, {magic}, 0xEA; "
                    + ("shr.u32 t0, t0, 4; shr.u32 t1, t1, 4; " if o == 1 else "") for o in range(4))
    return "{ .reg .b32 t0, t1; prmt.b32 t0, $4, 0, 0x4140; prmt.b32 t1, $4, 0, 0x4342; " + pairs + " }"


BIASED_BF16 = tl.constexpr(biased_asm("0x43004300"))  # 128.0
BIASED_FP16 = tl.constexpr(biased_asm("0x64006400"))  # 1024.0


@triton.jit
def ptx_codes(packed, offset, x):
    # MAGIC 3: the low and high codes of uint8 `packed`, less `offset`, in x's 16-bit floats. Four
    # bytes at once in PTX: two byte permutes spread bytes 0-1 and 2-3 to the halves of two words,
    # then one AND-OR a pair of codes (the float 128 + code in bf16, 1024 + code in fp16), one shift
    # a word for the high codes. Triton's lowering of MAGIC 2 (codes) spends about two PRMTs a code
    # packing bytes widened to int32. Only a GPU runs this (the interpreter has no PTX):
    # tests/test_gpu.py checks it.
    bf16: tl.constexpr = x.dtype == tl.bfloat16
    lo, hi = tl.inline_asm_elementwise(asm=BIASED_BF16 if bf16 else BIASED_FP16, constraints="=r,=r,=r,=r,r",
                                       args=[packed], dtype=(x.dtype, x.dtype), is_pure=True, pack=4)
    bias = (offset + (128.0 if bf16 else 1024.0)).to(x.dtype)
    return lo - bias, hi - bias
