"""Kiln's C++ ops for the CPU, one library built from csrc/ and registered with torch.library
(torch.ops.kiln.*): the fused paged attention (cpu_attention.py), the fused residual-add +
RMSNorm, RoPE, the bf16 GEMM of decode steps and greedy sampling's argmax (cpu_kernels.py).

The library is compiled with torch.utils.cpp_extension on first use and cached under
$KILN_CACHE/ops/<hash> (~/.cache/kiln/ops/...): the hash covers the sources, the compiler flags,
torch's version and the CPU's flags (-march=native), so a changed source, torch or machine
rebuilds and nothing else does. A file lock makes concurrent builders (test workers, pods on
one volume) wait for one build, and a "built" marker, written once it loaded, tells a whole build from a
link cut short. If the build fails (no compiler, say) the reason is logged once
and `available()` is False: "auto" then runs the torch path.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in (
    "paged_attention_cpu.cpp", "norm_rope_cpu.cpp", "linear_cpu.cpp", "argmax_cpu.cpp", "decoder_cpu.cpp")]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_lock = threading.Lock()
_state: dict[str, str | bool] = {}  # "loaded": True, or "error": why the library could not be had


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where the build of these sources (every file in csrc/), flags, torch and CPU lives."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(SOURCES[0].parent.glob("*.[ch]*"))))
    for part in (" ".join(CFLAGS), torch.__version__, _cpu_flags()):
        digest.update(part.encode())
    root = Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln")
    return root / "ops" / f"kiln_cpu_ops-{digest.hexdigest()[:16]}"


def _load() -> None:
    folder = build_dir()
    name = "kiln_cpu_ops"
    library = folder / f"{name}.so"
    # Written once a build has loaded: the linker writes the .so in place, so one killed mid-link
    # (OOM, eviction) left a file whose dlopen died of SIGBUS in every later process, no fallback.
    built = folder / "built"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others then find the .so
        if built.exists():
            torch.ops.load_library(str(library))  # no ninja run, no version checks: milliseconds
            return
        library.unlink(missing_ok=True)  # a link cut short: ninja links it again (its objects are kept)
        # torch's lock file before it took a file lock (FileBaton): a build killed mid-way left it and
        # every later load waited on it forever. Builds here are one at a time (build.lock): it is stale.
        (folder / "lock").unlink(missing_ok=True)
        from torch.utils.cpp_extension import load
        log.info("building Kiln's CPU ops in %s (once per source, torch and CPU)", folder)
        load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
             build_directory=str(folder), is_python_module=False, verbose=False)
        built.touch()


def _why(message: str) -> str:
    """The compiler's first error line, else the message's last line (ninja's is uninformative)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or ["(no message)"]
    return next((line for line in lines if "error:" in line), lines[-1])


def available() -> bool:
    """Whether the library is loaded, building it on the first call; False (logged once) if it cannot be."""
    with _lock:
        if not _state:
            try:
                _load()
                _state["loaded"] = True
            except Exception as e:  # a missing compiler or ninja, a failed build: the torch path still runs
                _state["error"] = f"{type(e).__name__}: {_why(str(e))}"
                log.warning("Kiln's CPU ops are unavailable, using the torch path: %s", _state["error"])
        return bool(_state.get("loaded"))


def unavailable_reason() -> str | None:
    return None if available() else str(_state["error"])
