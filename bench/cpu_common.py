"""What the CPU benchmarks record about the machine they ran on (BENCHMARKS.md)."""
from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """CPU model, cores, the SIMD flags that matter for bf16, and the load when measured."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = lambda key: next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.startswith(key)), "")  # noqa: E731
    return {"cpu": field("model name"), "cores": os.cpu_count(), "load_average": os.getloadavg(),
            "cpu_flags": sorted(f for f in field("flags").split() if f.startswith(("avx", "amx", "fma")))}


def write_result(name: str, record: dict) -> Path:
    """record as bench/results/<name>-<today, YYYYMMDD>.json; the path written."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}-{datetime.date.today():%Y%m%d}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


def ceilings(dtype: str = "bfloat16") -> dict:
    """The machine's two limits, measured now: read bandwidth and matmul throughput in `dtype`
    (bfloat16 or float32: the one the benchmark runs its activations in)."""
    import torch

    torch_dtype = getattr(torch, dtype)
    x = torch.ones(128 << 20, dtype=torch_dtype)  # 256 MiB in bf16, 512 MiB in float32
    x.sum()
    start = time.perf_counter()
    for _ in range(5):
        x.sum()
    bandwidth = 5 * x.numel() * x.element_size() / (time.perf_counter() - start)
    a = torch.randn(2048, 2048, dtype=torch_dtype)
    a @ a
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    flops = 5 * 2 * 2048**3 / (time.perf_counter() - start)
    short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    return {"read_GBps": round(bandwidth / 1e9, 1), f"{short}_matmul_GFLOPs": round(flops / 1e9, 1)}
