"""The int4 word GEMV's main loop as the GPU runs it, read on a machine without one: compile
kernels/int4_gemv.py (or with --magic, quant_gemm's tensor-core kernel at 16 rows, its int4 codes
made as kernels/int4_codes.py says) for an NVIDIA architecture with Triton's bundled ptxas, disassemble the cubin
with its nvdisasm, and count the instructions of the K loop (a thread's work for one tile) by
opcode, with the registers a thread (cuobjdump) and so how many programs share an SM. Pointers and
sizes are taken to be multiples of 16, as on Llama-3-8B shapes, where Triton's launcher
specializes them. What it cannot say is time: that needs a GPU (bench/kernels.py, bench/gpu_all.sh).

    python bench/sass.py [--arch 90] [--block-n 128] [--num-warps 4] [--prefetch 1] [--late-bias 1] [--magic 3]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

from kiln.engine.kernels import gpu_compile, quant_gemm

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
REGISTERS_AN_SM, MAX_WARPS_AN_SM = 65536, 64  # sm_80 and sm_90


def loop_census(sass: str) -> collections.Counter:
    """Opcodes of the kernel's longest backward branch's body: the K loop (the other, one line
    long, is the end-of-kernel trap)."""
    lines = sass.splitlines()
    labels = {line[1:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", line)}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\(\.(L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    start, end = max(loops, key=lambda span: span[1] - span[0])
    ops = (re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line) for line in lines[start:end + 1])
    return collections.Counter(m.group(1) for m in ops if m)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=128, help="a quantization group of 128 columns")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--prefetch", type=int, choices=(0, 1, 2), default=0)
    parser.add_argument("--late-bias", type=int, choices=(0, 1), default=0)
    parser.add_argument("--magic", type=int, choices=(0, 1, 2, 3), help="the tensor-core kernel instead")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    if args.magic is None:
        job = gpu_compile.words_gemv_job("bf16", "bf16", "zeros", args.block_k, args.block_n, args.num_warps,
                                         PREFETCH=args.prefetch, LATE_BIAS=args.late_bias)
    else:
        job = (quant_gemm._dequant_gemm_kernel,
               dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*bf16", z_ptr="*u8", y_ptr="*fp32"),
               dict(GROUP=args.block_k, BLOCK_M=16, BLOCK_N=args.block_n, BLOCK_K=args.block_k, INT4=True,
                    HAS_ZEROS=True, HAS_MINS=False, DOT_PREC="ieee", MAGIC=args.magic), args.num_warps)
    kernel, _, consts, _ = job
    aligned = tuple(n for n in kernel.arg_names if n not in consts and n != "nibble")  # nibble is 0xF
    compiled = gpu_compile.compile_kernel(job, args.arch, aligned)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([TOOLS / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([TOOLS / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    threads = 32 * args.num_warps
    programs = min(REGISTERS_AN_SM // (-(-registers // 8) * 8 * threads), MAX_WARPS_AN_SM // args.num_warps)
    census = loop_census(sass)
    codes = args.block_n * args.block_k // threads
    total = sum(census.values())
    print(f"sm_{args.arch} int4 {'word GEMV' if args.magic is None else 'tensor-core GEMM'} {consts} "
          f"num_warps={args.num_warps}")
    print(f"  {registers} registers a thread: {programs} programs an SM")
    print(f"  K loop: {total} instructions a thread a tile of {codes} codes a thread = {total / codes:.2f} a code")
    print("  " + " ".join(f"{op}:{n}" for op, n in census.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
