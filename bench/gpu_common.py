"""What the GPU benchmarks share: the CUDA check, the machine's two ceilings measured in the
same run (copy bandwidth, matmul FLOP/s), timing, and the results file.

Two timings. `median_ms`: triton's do_bench, one eager call at a time after an L2 flush; a
small kernel's figure there is mostly the host's launch cost. `graph_ms`: device time per call
with no launch cost, the calls captured in one CUDA graph (as the engine runs decode), each over
its own copy of the inputs so that consecutive calls read HBM, not the L2 the last one filled."""
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


def l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 50 << 20


def copies_for(op_bytes: int, most: int = 32) -> int:
    """How many copies of an op's inputs span 4x the L2, so a graph cycling through them reads HBM."""
    return max(1, min(most, -(-4 * l2_bytes() // max(op_bytes, 1))))


def graph_ms(ops: list[Callable[[], Any]], rep_ms: float = 40, replays: int = 5) -> float:
    """Median device ms per call of `ops` (one op over distinct copies of its inputs), captured
    round-robin in one CUDA graph. Raises where an op cannot be captured (one that syncs the host)."""
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):  # warm up (compile, cuBLAS workspaces) off the default stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for op in ops:
            op()
        start.record()
        for op in ops:
            op()
        end.record()
        torch.cuda.synchronize()
        rounds = max(1, min(500, int(rep_ms / max(start.elapsed_time(end), 1e-3))))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(rounds):
                for op in ops:
                    op()
        times = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / (rounds * len(ops)))
    del graph
    return sorted(times)[len(times) // 2]


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
