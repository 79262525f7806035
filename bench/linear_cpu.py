"""Kiln's bf16 GEMM op for decode steps (csrc/linear_cpu.cpp) against torch's bf16 F.linear and
oneDNN's GEMM on a packed weight (what the cpu backend runs above cpu_kernels.MAX_ROWS), on
SmolLM2-135M's weight shapes (qkv, o, gate_up, down, lm_head), rows M = 1..64: microseconds and
the weight-read rate (GB/s) each reaches, beside the machine's read ceiling. Weights are cycled
through ~60 MB so every call reads them from memory, as a decode step does. Best of 5 passes.

    .venv/bin/python bench/linear_cpu.py                    # -> bench/results/linear-cpu-<date>-<cpu kind>.json
    .venv/bin/python bench/linear_cpu.py --threads 1 --rows 1,4
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cpu_common import ceilings, machine, write_result

SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}  # (K, N)


def rate(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Best seconds per call over 5 passes through `weights`."""
    for w in weights:
        fn(x, w)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kiln.engine import cpu_kernels
    if not cpu_kernels.linear_op_supported():
        raise SystemExit("no bf16 GEMM op on this CPU (it needs AVX512-BF16): the engine uses torch's GEMM")
    op = lambda x, w: torch.ops.kiln.linear_bf16(x, w, None)  # noqa: E731
    onednn = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in SHAPES.items():
            weights = [torch.randn(n, k).bfloat16() for _ in range(max(1, 60_000_000 // (n * k * 2)))]
            x = torch.randn(m, k).bfloat16()
            packed = [cpu_kernels.packed_weight(w) for w in weights]
            seconds = {"kiln": rate(op, weights, x), "torch": rate(F.linear, weights, x),
                       "onednn_packed": rate(onednn, packed, x)}
            row = {"rows": m, "weight": name, "K": k, "N": n}
            for peer, s in seconds.items():
                row[f"{peer}_us"], row[f"{peer}_GBps"] = round(s * 1e6, 1), round(n * k * 2 / s / 1e9, 1)
            rows.append(row)
            print(f"M={m:3d} {name:13s} " + "   ".join(f"{peer} {row[peer + '_us']:8.1f} us {row[peer + '_GBps']:5.1f} GB/s"
                                                     for peer in seconds), flush=True)
    record = {"machine": machine(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "max_rows": cpu_kernels.MAX_ROWS, "ceilings": ceilings("bfloat16"), "rows": rows}
    record["machine"]["load_average_end"] = machine()["load_average"]
    print(f"read ceiling {record['ceilings']['read_GBps']} GB/s; wrote {write_result('linear-cpu', record)}")


if __name__ == "__main__":
    main()
