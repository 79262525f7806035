"""The "cpu" attention backend: a fused C++/OpenMP paged-attention op (csrc/paged_attention_cpu.cpp),
registered with torch.library as torch.ops.kiln.paged_attention.

The op is compiled with torch.utils.cpp_extension on first use and cached under
$KILN_CACHE/ops/<hash> (~/.cache/kiln/ops/...): the hash covers the source, the compiler flags,
torch's version and the CPU's flags (-march=native), so a changed source, torch or machine
rebuilds and nothing else does. A file lock makes concurrent builders (test workers, pods on
one volume) wait for one build. If the build fails (no compiler, say) the reason is logged once
and `available()` is False: "auto" then runs the torch path.

Only a float cache is read here; an int8/fp8 cache (kv_quant.py) goes to the torch path.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# Sequences with more query tokens than this (prefill chunks) go to SDPA, whose GEMMs beat the op's
# per-row loops there: 256 tokens over 1024 cached, 2x (bench/results/cpu-attention-*.json).
SDPA_ABOVE = 16
_lock = threading.Lock()
_state: dict[str, str | bool] = {}  # "loaded": True, or "error": why the op could not be had


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where this source, these flags, this torch and this CPU's build lives."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join(CFLAGS), torch.__version__, _cpu_flags()):
        digest.update(part.encode())
    root = Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln")
    return root / "ops" / f"paged_attention_cpu-{digest.hexdigest()[:16]}"


def _load() -> None:
    folder = build_dir()
    name = "kiln_paged_attention_cpu"
    library = folder / f"{name}.so"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others then find the .so
        if library.exists():
            torch.ops.load_library(str(library))  # no ninja run, no version checks: milliseconds
            return
        from torch.utils.cpp_extension import load
        log.info("building the CPU paged-attention op in %s (once per source, torch and CPU)", folder)
        load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
             build_directory=str(folder), is_python_module=False, verbose=False)


def _why(message: str) -> str:
    """The compiler's first error line, else the message's last line (ninja's is uninformative)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or ["(no message)"]
    return next((line for line in lines if "error:" in line), lines[-1])


def available() -> bool:
    """Whether the op is loaded, building it on the first call; False (logged once) if it cannot be."""
    with _lock:
        if not _state:
            try:
                _load()
                _state["loaded"] = True
            except Exception as e:  # a missing compiler or ninja, a failed build: the torch path still runs
                _state["error"] = f"{type(e).__name__}: {_why(str(e))}"
                log.warning("the CPU paged-attention op is unavailable, using the torch path: %s", _state["error"])
        return bool(_state.get("loaded"))


def unavailable_reason() -> str | None:
    return None if available() else str(_state["error"])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_seqlen_q: int, max_seqlen_k: int, *, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None, partition_size: int = 0,
                    sdpa_above: int = SDPA_ABOVE) -> torch.Tensor:
    """Causal attention of q [N,Hq,D] over the paged cache -> [N,Hq,D], the Triton kernel's
    signature (max_seqlen_* unused: the lengths are read from the tensors). The op attends to every
    sequence with at most `sdpa_above` query tokens; longer prefill chunks go to SDPA over their
    gathered keys, as on the torch path. An int8/fp8 cache runs the torch path.
    partition_size > 0 forces the keys per context split (tests); 0 lets the op choose."""
    from kiln.engine import attention
    if k_scales is not None or v_scales is not None:
        return attention.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                         max_seqlen_q, max_seqlen_k, k_scales=k_scales, v_scales=v_scales)
    plan = plan_cpu_attention(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1], sdpa_above)
    return run_cpu_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, plan, partition_size)


@dataclass
class CpuPlan:
    """What the op's call derives from the step's metadata alone, built once per step
    (kiln.engine.attention.prepare_step): the sequences SDPA takes, with their keys and masks."""
    sdpa_above: int  # passed to the op: it skips sequences with more query tokens (0: none are)
    long: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (lo, hi, slots [1, S], mask or None=causal)


def plan_cpu_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int, sdpa_above: int = SDPA_ABOVE, bounds: list[int] | None = None) -> CpuPlan:
    from kiln.engine.attention import sequence_keys
    bounds = cu_seqlens_q.tolist() if bounds is None else bounds
    long = [b for b in range(len(bounds) - 1) if bounds[b + 1] - bounds[b] > sdpa_above]
    lens = seq_lens.tolist() if long else []
    return CpuPlan(sdpa_above if long else 0,
                   [sequence_keys(bounds, lens, seq_lens, block_tables, b, block_size) for b in long])


def run_cpu_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, plan: CpuPlan,
                      partition_size: int = 0) -> torch.Tensor:
    """The op over a float cache, then SDPA for the plan's long sequences: no host sync."""
    from kiln.engine import attention
    if not available():
        raise RuntimeError(f"the CPU paged-attention op is unavailable: {unavailable_reason()}")
    out = torch.ops.kiln.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                         float(scale), int(partition_size), plan.sdpa_above)
    for lo, hi, slots, mask in plan.long:
        keys, values = (attention._gather(cache, slots, None, q.dtype) for cache in (k_cache, v_cache))
        out[lo:hi] = attention._attend(q[None, lo:hi], keys, values, scale, mask, mask is None)[0]
    return out
