"""What the CPU benchmarks record about the machine they ran on (BENCHMARKS.md)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent
# The shared mixed workload (BENCHMARKS.md), beside the repository.
WORKLOAD = REPO.parent / "shared" / "bench" / "mixed_workload_seed0.json"


def machine() -> dict:
    """CPU model, cores, the SIMD flags that matter for bf16, the load when measured, and the software
    measured (versions())."""
    return {"cpu": _cpuinfo("model name"), "cores": os.cpu_count(), "load_average": os.getloadavg(),
            "cpu_flags": sorted(f for f in _cpuinfo("flags").split() if f.startswith(("avx", "amx", "fma"))),
            **versions()}


def versions() -> dict:
    """Python, torch and the kiln commit. torch is imported here, not at the module's top: the
    control-plane benchmarks (autoscale, operator_handover) need no torch of their own, and its
    version is None where it is not installed (a venv with the operator extra only)."""
    try:
        import torch

        torch_version = str(torch.__version__)  # keeps the build's label (+cu132, +cpu): pip's metadata drops it
    except ImportError:
        torch_version = None
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    return {"python": platform.python_version(), "torch": torch_version, "kiln_git": rev.strip()}


def _cpuinfo(key: str) -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.startswith(key)), "")


def cpu_kind() -> str:
    """'xeon', 'epyc', ...: the CPU model's family word, so that runs of one day on the different
    machines sessions get (BENCHMARKS.md) are kept apart rather than written over each other."""
    words = re.findall(r"[a-z]+", _cpuinfo("model name").lower())
    return next((w for w in words if w in ("xeon", "epyc", "core", "ryzen", "neoverse")), "cpu")


_written: dict[str, Path] = {}  # name -> the file this process writes it to


def write_result(name: str, record: dict) -> Path:
    """record as bench/results/<name>-<today, YYYYMMDD>-<cpu kind>.json, or -2, -3, ... where an
    earlier run of the day has that file: a run's later writes (partial results) replace its own
    file, never another run's. The path written."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = _written.get(name)
    if out is None:
        stem = f"{name}-{datetime.date.today():%Y%m%d}-{cpu_kind()}"
        out = RESULTS / f"{stem}.json"
        run = 1
        while out.exists():
            run += 1
            out = RESULTS / f"{stem}-{run}.json"
        _written[name] = out
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


def ceilings(dtype: str = "bfloat16") -> dict:
    """The machine's two limits, measured now: read bandwidth and matmul throughput in `dtype`
    (bfloat16 or float32: the one the benchmark runs its activations in). Each is the best of 5
    timings: on a shared machine the slower ones measure the neighbours, not the hardware."""
    import torch

    # Read bandwidth from a float32 sum whatever the dtype: a bf16 sum is bound by its conversions,
    # not by memory (it measured 6.6 GB/s where llama.cpp's bf16 decode read 17 GB/s).
    x = torch.ones(128 << 20, dtype=torch.float32)  # 512 MiB
    a = torch.randn(2048, 2048, dtype=getattr(torch, dtype))
    bandwidth = x.numel() * x.element_size() / _best_time(x.sum)
    flops = 2 * 2048**3 / _best_time(lambda: a @ a)
    short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    return {"read_GBps": round(bandwidth / 1e9, 1), f"{short}_matmul_GFLOPs": round(flops / 1e9, 1)}


def _best_time(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
