"""Tune Kiln's Triton launch configs on this GPU; write kiln/engine/kernels/tuned/<gpu>.json.

Each shape key (kiln.engine.kernels.tuned) has a small candidate grid, timed on the issue's
shapes: decode attention at batch 64 (key decode-g4-d128) and batch 1 (split-KV,
decode-split-g4-d128) over 1k/4k/16k contexts, GQA 32/8, head 128; W4A16 (group 128) and W8A16
(per channel) at M=1 and M=16 on (N, K) = (4096, 14336), (14336, 4096), (4096, 4096).
A candidate counts only where its output matches the default config's. A key keeps the
candidate with the lowest geometric mean of (time / default time) over its shapes, if that
beats the default by more than 2%; otherwise the key keeps the defaults (no entry). Times are
do_bench medians, shorter than bench/kernels.py's so the whole run stays near 2 minutes; past
--budget-s the remaining candidates are skipped. Needs CUDA; exits 2 without it.

    python bench/tune_kernels.py [--out FILE] [--report FILE] [--budget-s 150]
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

from gpu_common import machine, require_cuda, write_results
from kernels import GEMM_SHAPES, attention_args, gemm_case

Op = Callable[[], torch.Tensor]
Shape = tuple[str, Callable[[], Op]]  # label, builder of the op (called once; tensors live while it is timed)

ATTENTION = "paged_attention"
GEMM = "quant_gemm"
# Decode attention: KV tile length and warps (the rows are the GQA group's heads, fixed). The
# gathered K/V loads are not software-pipelined, so num_stages barely matters.
ATTENTION_CANDIDATES = [
    {}, {"num_warps": 2}, {"num_warps": 8},
    {"BLOCK_N": 64}, {"BLOCK_N": 64, "num_warps": 2}, {"BLOCK_N": 64, "num_warps": 8}, {"BLOCK_N": 64, "num_stages": 2},
    {"BLOCK_N": 128}, {"BLOCK_N": 128, "num_warps": 8}, {"BLOCK_N": 128, "num_stages": 2},
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
]
MIN_GAIN = 0.98  # a candidate must beat the defaults by 2% to be written


def attention_keys(device: str) -> list[tuple[str, list[Shape]]]:
    def shape(batch: int, ctx: int) -> Shape:
        def build() -> Op:
            from kiln.engine.kernels.paged_attention import paged_attention
            args = attention_args(batch, 1, ctx, torch.bfloat16, device)
            return lambda: paged_attention(**args)
        return f"batch {batch} ctx {ctx}", build
    contexts = (1024, 4096, 16384)
    return [("decode-g4-d128", [shape(64, c) for c in contexts]),
            ("decode-split-g4-d128", [shape(1, c) for c in contexts])]


def gemm_keys(device: str) -> list[tuple[str, list[Shape]]]:
    def shape(bits: int, m: int, n: int, k: int) -> Shape:
        return f"m {m} n {n} k {k}", lambda: gemm_case(bits, m, n, k, torch.bfloat16, device).impls["triton"]
    return [(f"w{bits}-g{128 if bits == 4 else 0}-m{m}", [shape(bits, m, n, k) for n, k in GEMM_SHAPES])
            for bits in (4, 8) for m in (1, 16)]


def median_ms(fn: Op) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median"))


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
        op = build()
        with tuned.override(kernel, key, {}):  # the defaults, whatever a tuned file holds
            ref = op()
        for i, config in enumerate(candidates):
            if i and time.monotonic() > deadline:
                ms[i].append(math.inf)
                continue
            try:
                with tuned.override(kernel, key, config):
                    ok = matches(op(), ref)
                    ms[i].append(median_ms(op) if ok else math.inf)
                if not ok:
                    print(f"  {key} {label} {config}: output differs from the defaults; skipped")
            except Exception as error:  # e.g. out of shared memory: the candidate just does not count
                print(f"  {key} {label} {config}: {type(error).__name__}: {str(error)[:200]}")
                ms[i].append(math.inf)
        del op, ref
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


def tune(kernel: str, keys: list[tuple[str, list[Shape]]], candidates: list[dict], deadline: float,
         configs: dict[str, dict], report: list[dict]) -> None:
    for key, shapes in keys:
        group = int(key.split("-g")[1].split("-")[0]) if "-g" in key else 0
        fitting = [c for c in candidates if not group or c.get("BLOCK_K", 0) <= group]
        ms = time_candidates(kernel, key, fitting, shapes, deadline)
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
    parser.add_argument("--out", type=Path, help="tuned configs (default engine/kiln/engine/kernels/tuned/<gpu>.json)")
    parser.add_argument("--report", type=Path, help="summary JSON (default bench/results/tune_kernels-<gpu>.json)")
    parser.add_argument("--budget-s", type=float, default=150, help="skip remaining candidates after this long")
    args = parser.parse_args(argv)
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
        tune(GEMM, gemm_keys("cuda"), GEMM_CANDIDATES, deadline, configs, report)
        tune(ATTENTION, attention_keys("cuda"), ATTENTION_CANDIDATES, deadline, configs, report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": gpu, "machine": machine(), "tuned_by": "bench/tune_kernels.py",
                               "configs": {k: v for k, v in configs.items() if v}}, indent=2) + "\n")
    print(f"wrote {out}")
    write_results(args.report, "tune_kernels", {"machine": machine(), "out": str(out), "keys": report,
                                                "note": "ms per shape (do_bench medians, warmup 10 ms, rep 30 ms); "
                                                        "null: failed, mismatched or past the budget"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
