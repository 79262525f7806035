"""Tune Kiln's Triton launch configs on this GPU; write kiln/engine/kernels/tuned/<gpu>.json.

Each shape key (kiln.engine.kernels.tuned) has a small candidate grid, timed on the issue's
shapes: decode attention at batch 64 (key decode-g4-d128) and batch 1 (split-KV,
decode-split-g4-d128) over 1k/4k/16k contexts, GQA 32/8, head 128, and prefill (prefill-g4-d128:
4 x 1024 fresh tokens, 4 x 512 over 1536 cached); W4A16 (group 128) and W8A16
(per channel) at M=1, 16 and 64 on (N, K) = (4096, 14336), (14336, 4096), (4096, 4096); and the
GEMV on bf16 weights at M=1 (key gemv n<N>-k<K>) on each of Llama-3-8B's decode GEMMs, where
candidate 0 is cuBLAS: an entry there switches the engine's batch-1 GEMM to the kernel.
Batch-1 keys go first, so a short budget still covers them.

A candidate counts only where its output matches the default config's. A key keeps the
candidate with the lowest geometric mean of (time / default time) over its shapes, if that
beats the default by more than 2%; otherwise the key keeps the defaults (no entry). Times are
device times under a CUDA graph over input copies spanning 4x the L2 (gpu_common.graph_ms: what
decode runs, with no launch cost to drown a small kernel's), shorter than bench/kernels.py's so
the whole run stays near 3 minutes; past --budget-s the remaining candidates are skipped, and keys
not yet begun keep what the file holds.
Needs CUDA; exits 2 without it.

    python bench/tune_kernels.py [--out FILE] [--report FILE] [--budget-s 150] [--keys KEY ...] [--with NAME]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from gpu_common import graph_ms, machine, require_cuda, write_results
from kernels import GEMM_SHAPES, GEMV_SHAPES, Case, attention_case, gemm_case, gemv_case

Shape = tuple[str, Callable[[], Case]]  # label, builder of the case whose "triton" impl is tuned

ATTENTION = "paged_attention"
GEMM = "quant_gemm"
GEMV = "gemv"
# Decode attention: KV tile length and warps (the rows are the GQA group's heads, fixed). The
# gathered K/V loads are not software-pipelined, so num_stages barely matters.
ATTENTION_CANDIDATES = [
    {}, {"num_warps": 2}, {"num_warps": 8},
    {"BLOCK_N": 64}, {"BLOCK_N": 64, "num_warps": 2}, {"BLOCK_N": 64, "num_warps": 8}, {"BLOCK_N": 64, "num_stages": 2},
    {"BLOCK_N": 128}, {"BLOCK_N": 128, "num_warps": 8}, {"BLOCK_N": 128, "num_stages": 2},
]
# Batch-1 decode also tries shorter split partitions (more programs, shorter serial loops).
SPLIT_CANDIDATES = ATTENTION_CANDIDATES + [
    {"BLOCK_N": 64, "num_warps": 8, "SPLIT_KEYS": 64}, {"BLOCK_N": 64, "SPLIT_KEYS": 64},
    {"BLOCK_N": 32, "SPLIT_KEYS": 32}, {"BLOCK_N": 64, "num_warps": 2, "SPLIT_KEYS": 64},
]
# Prefill and chunked prefill: query rows a program (BLOCK_M, GQA heads included) and KV tile.
PREFILL_CANDIDATES = [
    {}, {"num_warps": 8}, {"BLOCK_N": 64}, {"BLOCK_N": 64, "num_warps": 8}, {"BLOCK_N": 64, "num_stages": 3},
    {"BLOCK_M": 128, "num_warps": 8}, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}, {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4},
]
# Small-M GEMMs: narrower N tiles and split-K give the GPU enough programs; BLOCK_K divides 128.
GEMM_CANDIDATES = [
    {}, {"BLOCK_N": 32, "BLOCK_K": 128}, {"BLOCK_N": 16, "BLOCK_K": 128},
    {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2}, {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4},
    {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4}, {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2},
    {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4}, {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 8},
    {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 4}, {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 2},
    {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 8},
    {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2}, {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 8},
    {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 2}, {"BLOCK_N": 32, "BLOCK_K": 128, "num_stages": 4},
    # per-channel int8 only (a K tile must stay inside one quantization group)
    {"BLOCK_N": 16, "BLOCK_K": 256}, {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 2},
    # a row a program on the CUDA cores (_dequant_gemv_kernel), not yet timed on a GPU
    {"GEMV": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4}, {"GEMV": 1, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 8},
    {"GEMV": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 8},
    {"GEMV": 1, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 4},
    # int4 codes made floats without conversions (int4_codes.codes): 2**23 in fp32, or 16-bit
    {"MAGIC": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 8}, {"MAGIC": 2, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 8},
    {"MAGIC": 2, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4}, {"MAGIC": 2, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 8},
    {"MAGIC": 2, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4}, {"MAGIC": 2, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 4},
    {"MAGIC": 2, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 8},
    {"MAGIC": 2, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 2},
    {"MAGIC": 1, "GEMV": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4},
    {"MAGIC": 1, "GEMV": 1, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 8},
    {"MAGIC": 1, "GEMV": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 8},
    {"MAGIC": 1, "GEMV": 1, "BLOCK_N": 8, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 2},
    # more bytes in flight a program: plain register loads are not pipelined, only occupancy hides them
    {"MAGIC": 1, "GEMV": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 8},
    {"MAGIC": 1, "GEMV": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 8},
    {"MAGIC": 1, "GEMV": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8},
    # no split (no second kernel): enough programs on wide N alone
    {"MAGIC": 1, "GEMV": 1, "BLOCK_N": 16, "BLOCK_K": 128}, {"MAGIC": 2, "BLOCK_N": 16, "BLOCK_K": 128},
    # the tensor-core tile's loads are software-pipelined (cp.async into shared memory)
    {"MAGIC": 2, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8, "num_stages": 4},
    {"MAGIC": 2, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4, "num_stages": 4},
    # dequantize the whole weight, then cuBLAS (kernels.dequant; the default above 16 rows)
    {"DEQUANT": 1},
    # int4 read as int32 words, a code made a float by one AND-OR where it stands (kernels.int4_gemv).
    # A thread loads x once for its columns however many rows it holds: wide N tiles amortize that.
    # Plain loads are not pipelined, so many splits (programs) keep the bytes in flight.
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 16},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 32},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 16},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 32},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 16, "num_warps": 2},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 16, "num_warps": 8},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 16, "num_warps": 8},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 32, "num_warps": 8},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 32},
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 32},
    # the next tile's words loaded before this tile's math (not yet timed on a GPU)
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 8},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 16},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 32},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 16},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 1, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 16, "num_warps": 8},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 1, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 16},
    # whole waves: the chosen 128x128 tiles in 32 splits ran 896 programs on 4096x14336, 1.4 waves at the
    # 5 programs an SM its 91 registers allow (sm_90 cubin); 20 splits make 608, one wave of 6 tiles each
    {"GEMV": 1, "WORDS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 20},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 20},
    # no subtract a code (int4_gemv's LATE_BIAS): 512 instructions a thread a 128x128 tile against 585, more
    # registers (bench/sass.py, sm_90), not yet timed
    {"GEMV": 1, "WORDS": 1, "LATE_BIAS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 32},
    {"GEMV": 1, "WORDS": 1, "LATE_BIAS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 20},
    {"GEMV": 1, "WORDS": 1, "LATE_BIAS": 1, "PREFETCH": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 20},
    {"GEMV": 1, "WORDS": 1, "LATE_BIAS": 1, "PREFETCH": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 32},
    {"GEMV": 1, "WORDS": 1, "LATE_BIAS": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 16},
    {"GEMV": 1, "WORDS": 1, "LATE_BIAS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 32, "num_warps": 2},
    # Tried on an H200 and dropped (bench/results/tune-w4-m1-nvidia-h200-20261130-*.json), none faster than
    # PREFETCH at 16 splits (17.1 us on 4096x14336): the split-K sum in the GEMV's last program of each tile
    # (ticket counters), the sum over a tile's words after the K loop, tiles of several groups, and the K
    # loop software-pipelined by Triton (cp.async, 3-5 stages: 21+ us).
    # more splits, now that their sum loads every split at once
    {"MAGIC": 2, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 16},
    {"MAGIC": 2, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 16},
    {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 16}, {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 16},
    # the codes made in inline PTX (int4_codes.ptx_codes), not yet timed: in the sm_90 cubin a 128x128
    # tile's loop is 3.2 instructions a code against MAGIC 2's 4.9 and the word GEMV's 4.6 (bench/sass.py),
    # and its loads are pipelined through shared memory, where the word GEMV's wait on occupancy
    *({"MAGIC": 3, "BLOCK_N": n, "BLOCK_K": 128, "SPLIT_K": splits, **more} for n, splits, more in (
        (64, 4, {}), (64, 8, {}), (64, 16, {}), (32, 16, {}), (128, 8, {}), (128, 16, {}), (128, 8, {"num_warps": 8}),
        (64, 8, {"num_stages": 4}), (128, 16, {"num_stages": 2}))),
    # two tiles' words in flight a thread (int4_gemv's PREFETCH 2), not yet timed
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 2, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 16},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 2, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 8},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 2, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 20},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 2, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 16},
    {"GEMV": 1, "WORDS": 1, "PREFETCH": 2, "LATE_BIAS": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 16},
]
# The GEMV on 16-bit weights at batch 1 (quant_gemm.linear), against cuBLAS (candidate 0).
GEMV_CANDIDATES = [
    {"BLOCK_N": 32, "BLOCK_K": 128}, {"BLOCK_N": 16, "BLOCK_K": 128}, {"BLOCK_N": 16, "BLOCK_K": 256},
    {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2}, {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 4},
    {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8}, {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 2},
    {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 2, "num_warps": 8},
    {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 8}, {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8},
    # long K tiles: 8 16-byte loads in flight a thread
    {"BLOCK_N": 16, "BLOCK_K": 512}, {"BLOCK_N": 8, "BLOCK_K": 512}, {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8},
    {"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 2}, {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 2},
    {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4},
]
TUNED_IMPL = {GEMV: "linear"}  # the case's impl a kernel's candidates run under (else "triton")
MIN_GAIN = 0.98  # a candidate must beat the defaults by 2% to be written


def attention_keys(device: str) -> list[tuple[str, list[Shape]]]:
    def shape(batch: int, ctx: int) -> Shape:
        return f"batch {batch} ctx {ctx}", lambda: attention_case(batch, 1, ctx, torch.bfloat16, device)
    contexts = (1024, 4096, 16384)
    prefill = [(f"batch 4 q {q} ctx {c}", lambda q=q, c=c: attention_case(4, q, c, torch.bfloat16, device))
               for q, c in ((1024, 1024), (512, 2048))]  # fresh, and chunked over a cached prefix
    return [("decode-g4-d128", [shape(64, c) for c in contexts]),
            ("decode-split-g4-d128", [shape(1, c) for c in contexts]), ("prefill-g4-d128", prefill)]


def gemm_keys(device: str) -> list[tuple[str, list[Shape]]]:
    def shape(bits: int, m: int, n: int, k: int) -> Shape:
        return f"m {m} n {n} k {k}", lambda: gemm_case(bits, m, n, k, torch.bfloat16, device)
    return [(f"w{bits}-g{128 if bits == 4 else 0}-m{m}", [shape(bits, m, n, k) for n, k in GEMM_SHAPES])
            for bits in (4, 8) for m in (1, 16, 64)]


def gemv_keys(device: str) -> list[tuple[str, list[Shape]]]:
    """One key a weight shape; candidate 0 (None: no entry) is cuBLAS."""
    def shape(n: int, k: int) -> Shape:
        return f"m 1 n {n} k {k}", lambda: gemv_case(n, k, torch.bfloat16, device)
    return [(f"n{n}-k{k}", [shape(n, k)]) for n, k in GEMV_SHAPES]


def matches(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Loose bf16 agreement: only the summation order may differ."""
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)
    return bool(out.isfinite().all()) and float(err) <= 2e-2


def time_candidates(kernel: str, key: str, candidates: list[dict], shapes: list[Shape],
                    deadline: float) -> list[list[float]]:
    """ms[candidate][shape]; inf where a candidate failed, mismatched or ran past the deadline."""
    from kiln.engine.kernels import tuned
    ms = [[] for _ in candidates]
    for label, build in shapes:
        case = build()
        impl = TUNED_IMPL.get(kernel, "triton")
        ops = [impls[impl] for impls in case.input_copies()]
        with tuned.override(kernel, key, candidates[0]):  # the defaults, whatever a tuned file holds
            ref = ops[0]()
        for i, config in enumerate(candidates):
            if i and time.monotonic() > deadline:
                ms[i].append(math.inf)
                continue
            try:
                with tuned.override(kernel, key, config):
                    ok = matches(ops[0](), ref)
                    ms[i].append(graph_ms(ops, rep_ms=10, replays=3) if ok else math.inf)
                if not ok:
                    print(f"  {key} {label} {config}: output differs from the defaults; skipped")
            except Exception as error:  # e.g. out of shared memory: the candidate just does not count
                print(f"  {key} {label} {config}: {type(error).__name__}: {str(error)[:200]}")
                ms[i].append(math.inf)
        del case, ops, ref
        torch.cuda.empty_cache()
    return ms


def choose(ms: list[list[float]]) -> int:
    """The candidate with the lowest geometric-mean time relative to the defaults (candidate 0)."""
    def score(i: int) -> float:
        return math.exp(sum(math.log(t / d) for t, d in zip(ms[i], ms[0])) / len(ms[0]))
    best = min(range(len(ms)), key=score)
    return best if score(best) < MIN_GAIN else 0


def finite(times: list[float]) -> list[float | None]:
    return [None if math.isinf(t) else t for t in times]


def candidates_for(key: str, group: int, candidates: list[dict | None]) -> list[dict | None]:
    """K tiles stay inside one quantization group; MAGIC and WORDS only change int4 kernels; one row never
    pays for dequantizing a whole weight; above 16 rows (where DEQUANT is the default) the tile
    candidates switch it off and GEMV (a row a program) is left out."""
    def fits(c: dict) -> bool:
        return ((not group or c.get("BLOCK_K", 0) <= group)
                and not (key.startswith("w8") and (c.get("MAGIC") or c.get("WORDS")))
                and not (key.endswith("-m1") and c.get("DEQUANT")) and not (key.endswith("-m64") and c.get("GEMV")))
    def tile_candidate(c: dict | None) -> dict | None:
        if key.endswith("-m64") and c and "DEQUANT" not in c:
            return {**c, "DEQUANT": 0}
        return c
    return [tile_candidate(c) for c in candidates if c is None or fits(c)]


def tune(kernel: str, keys: list[tuple[str, list[Shape]]], candidates: list[dict], deadline: float,
         configs: dict[str, dict], report: list[dict]) -> None:
    for key, shapes in keys:
        if time.monotonic() > deadline:  # untimed: whatever the file holds for it stays
            print(f"{kernel} {key}: skipped, past the budget")
            report.append({"kernel": kernel, "key": key, "skipped": "past the budget"})
            continue
        group = int(key.split("-g")[1].split("-")[0]) if "-g" in key else 0
        fitting = candidates_for(key, group, candidates)
        # What the file holds is timed too: no slower candidate replaces it (the defaults still do
        # when it is not MIN_GAIN faster than they are).
        incumbent = configs.get(kernel, {}).get(key)
        if incumbent and len(fitting) > 1 and incumbent not in fitting:
            fitting.append(incumbent)
        if len(fitting) < 2:  # --with left only the defaults: nothing to compare, the file's entry stays
            report.append({"kernel": kernel, "key": key, "skipped": "no candidates"})
            continue
        ms = time_candidates(kernel, key, fitting, shapes, deadline)
        if time.monotonic() > deadline:  # candidates cut short are inf, not slow: the file's entry stays
            print(f"{kernel} {key}: cut short by the budget; the file's entry stays")
            report.append({"kernel": kernel, "key": key, "skipped": "cut short by the budget"})
            continue
        best = choose(ms)
        if best:
            configs.setdefault(kernel, {})[key] = fitting[best]
        else:
            configs.get(kernel, {}).pop(key, None)
        per_shape = ", ".join(f"{label} {d:.4f}->{b:.4f} ms" for (label, _), d, b in zip(shapes, ms[0], ms[best]))
        print(f"{kernel} {key}: default {sum(ms[0]):.4f} ms, best {sum(ms[best]):.4f} ms "
              f"(x{sum(ms[0]) / sum(ms[best]):.2f}) {fitting[best] or 'defaults'}\n  {per_shape}")
        report.append({"kernel": kernel, "key": key, "shapes": [label for label, _ in shapes],
                       "chosen": fitting[best], "default_ms": finite(ms[0]), "best_ms": finite(ms[best]),
                       "candidates": [{"config": c, "ms": finite(times)} for c, times in zip(fitting, ms)]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="tuned configs (default engine/kiln/engine/kernels/tuned/<gpu slug>.json)")
    parser.add_argument("--report", type=Path, help="summary JSON (default bench/results/tune_kernels-<gpu slug>.json, "
                        "e.g. tune_kernels-nvidia-h200.json, undated: the next run on that GPU replaces it; "
                        "bench/gpu_all.sh passes OUT/tune-report.json)")
    parser.add_argument("--budget-s", type=float, default=150, help="skip remaining candidates after this long")
    parser.add_argument("--keys", nargs="+", metavar="KEY", help="tune only these keys (e.g. w4-g128-m1); "
                        "the others keep what the file holds")
    parser.add_argument("--with", dest="switch", metavar="NAME", help="time only the defaults and the candidates "
                        "that set this switch (e.g. WORDS), to spend a short GPU lease on one kernel")
    args = parser.parse_args(argv)
    known = [key for key, _ in gemm_keys("cuda") + gemv_keys("cuda") + attention_keys("cuda")]
    if set(args.keys or ()) - set(known):
        parser.error(f"unknown --keys {sorted(set(args.keys) - set(known))}; the keys are {known}")
    require_cuda("bench/tune_kernels.py")
    from kiln.engine.kernels import tuned
    gpu = torch.cuda.get_device_name(0)
    out = args.out or tuned.FOLDER / f"{tuned.slug(gpu)}.json"
    # Keys not tuned here keep what the file already holds.
    configs = json.loads(out.read_text())["configs"] if out.exists() else {}
    deadline = time.monotonic() + args.budget_s
    report: list[dict] = []
    torch.manual_seed(0)
    with torch.inference_mode():
        # Batch-1 decode's keys first: the goals (W4A16 at M=1, the 8B model's decode).
        def chosen(keys: list[tuple[str, list[Shape]]]) -> list[tuple[str, list[Shape]]]:
            return [(key, shapes) for key, shapes in keys if not args.keys or key in args.keys]
        def having(candidates: list[dict | None]) -> list[dict | None]:
            return [c for i, c in enumerate(candidates) if not args.switch or i == 0 or (c or {}).get(args.switch)]
        gemm, attention = chosen(gemm_keys("cuda")), attention_keys("cuda")
        tune(GEMM, gemm[:1], having(GEMM_CANDIDATES), deadline, configs, report)
        tune(GEMV, chosen(gemv_keys("cuda")), having([None] + GEMV_CANDIDATES), deadline, configs, report)
        tune(ATTENTION, chosen(attention[1:2]), having(SPLIT_CANDIDATES), deadline, configs, report)
        tune(GEMM, gemm[1:], having(GEMM_CANDIDATES), deadline, configs, report)
        tune(ATTENTION, chosen(attention[:1]), having(ATTENTION_CANDIDATES), deadline, configs, report)
        tune(ATTENTION, chosen(attention[2:]), having(PREFILL_CANDIDATES), deadline, configs, report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": gpu, "machine": machine(), "tuned_by": "bench/tune_kernels.py",
                               "configs": {k: v for k, v in configs.items() if v}}, indent=2) + "\n")
    print(f"wrote {out}")
    write_results(args.report, "tune_kernels", {"machine": machine(), "out": str(out), "keys": report,
                                                "note": "ms per shape (device time under a CUDA graph over input copies "
                                                        "spanning 4x the L2, median of 3 replays); "
                                                        "null: failed, mismatched or past the budget"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
