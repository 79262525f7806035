"""Which dtype `--dtype auto` runs in, from what the hardware does fast.

bf16 is the fast dtype on CUDA (tensor cores) and on CPUs with native bf16 arithmetic
(AVX512_BF16, AMX). Elsewhere torch emulates bf16 matmuls through fp32 conversions: on an
AVX2-only server that measured under 1 GFLOP/s against ~56 GFLOP/s in fp32 (issue 16), so
float32 is the default there.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import torch

# /proc/cpuinfo flag names (torch's own probes are mapped onto the same names).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "amx_tile"})


def auto_dtype(device_type: str, cpu_flags: Iterable[str]) -> torch.dtype:
    """The dtype `auto` resolves to on this device type, given the CPU's feature flags."""
    if device_type != "cpu":
        return torch.bfloat16  # CUDA (tensor cores); other accelerators kept their bf16 default
    return torch.bfloat16 if BF16_CPU_FLAGS & {f.lower() for f in cpu_flags} else torch.float32


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """This CPU's bf16-relevant feature flags: /proc/cpuinfo where there is one (Linux x86),
    plus torch's own capability probes (which also work without /proc)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.partition(":")[2].split())
                break
    except OSError:
        pass
    for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_tile", "_is_amx_tile_supported")):
        check = getattr(torch.cpu, probe, None)  # private probes: absent in some torch builds
        if check is not None and check():
            flags.add(name)
    return frozenset(flags & BF16_CPU_FLAGS)


def describe_dtype(requested: str, dtype: torch.dtype, device_type: str, cpu_flags: Iterable[str]) -> str:
    """One line for the start-up log: the dtype and why it was chosen."""
    name = str(dtype).removeprefix("torch.")
    if requested != "auto":
        return f"{name} (--dtype {requested})"
    if device_type != "cpu":
        return f"{name} (auto: {device_type})"
    found = sorted(BF16_CPU_FLAGS & set(cpu_flags))
    if found:
        return f"{name} (auto: the CPU has {', '.join(found)})"
    return f"{name} (auto: the CPU has no AVX512_BF16 or AMX, where bf16 matmuls are emulated and many times slower)"
