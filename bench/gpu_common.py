"""What the GPU benchmarks share: the CUDA check, the machine's two ceilings measured in the
same run (copy bandwidth, matmul FLOP/s), timing, and the results file."""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.autograd import DeviceType

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def require_cuda(script: str) -> None:
    """Exit 2 with a clear message where there is no GPU to measure."""
    if not torch.cuda.is_available():
        print(f"{script}: no CUDA device found; this benchmark measures GPU kernels and needs one. "
              "(Kernel correctness runs on CPU: pytest tests/test_kernels.py.)", file=sys.stderr)
        raise SystemExit(2)


def median_ms(fn: Callable[[], Any]) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure_peaks(dtype: torch.dtype) -> dict[str, float]:
    """Copy bandwidth (read + write bytes / time, 1 GiB buffers: far beyond L2) and dense matmul."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=dtype, device="cuda")
    b = torch.randn(n, n, dtype=dtype, device="cuda")
    mm_ms = median_ms(lambda: a @ b)
    return {"copy_GBps": 2 * (1 << 30) / copy_ms / 1e6, "matmul_TFLOPs": 2 * n ** 3 / mm_ms / 1e9}


def device_costs(averages: Iterable[Any], steps: int, top: int = 10) -> dict[str, Any]:
    """The kernels (and copies) with the most device time, from a profiler's key_averages(), which
    groups events by name. Device-side events only: a CPU op's device time repeats its kernels', and
    so does a GPU user-annotation range's."""
    rows = []
    for e in averages:
        if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False):
            us = getattr(e, "self_device_time_total", None)
            rows.append((e.self_cuda_time_total if us is None else us, e.key, e.count))
    rows.sort(key=lambda r: r[0], reverse=True)
    total = sum(us for us, _, _ in rows)
    return {"device_ms_per_step": total / 1e3 / steps,
            "kernels": [{"name": name[:200], "calls_per_step": count / steps, "ms_per_step": us / 1e3 / steps,
                         "share": us / (total or 1)} for us, name, count in rows[:top]]}


def machine() -> dict[str, Any]:
    import triton
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "memory_GiB": round(props.total_memory / 2 ** 30, 1),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "python": platform.python_version()}


def device_slug() -> str:
    from kiln.engine.kernels.tuned import slug
    return slug(torch.cuda.get_device_name(0))


def write_results(path: Path | None, default_name: str, payload: dict[str, Any]) -> Path:
    path = path or RESULTS / f"{default_name}-{device_slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path
