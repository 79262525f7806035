"""Kernel backend switch: one namespace of ops, Triton kernels or their torch references.

"auto" picks Triton on CUDA and torch elsewhere. The torch attention ops are the model's
own CPU path (kiln.engine.attention); the other torch ops are the kernels' references.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelBackend:
    name: str
    store_kvcache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    w8a16_gemm: Callable[..., torch.Tensor]
    w4a16_gemm: Callable[..., torch.Tensor]


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """'auto' -> 'triton' on CUDA, else 'torch'; rejects Triton where it cannot run."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    # The interpreter (tests) runs Triton kernels on CPU tensors.
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton backend needs a CUDA device, got {device.type!r}; "
                         "use attention_backend='torch' (or TRITON_INTERPRET=1 to interpret kernels in tests)")
    return name


def get_backend(name: str, device: torch.device | str) -> KernelBackend:
    """The ops of backend `name` ("auto" | "torch" | "triton") for `device`."""
    name = resolve_backend_name(name, device)
    # Imported here: kiln.engine.attention imports this module, and Triton modules must be
    # defined after a test has set TRITON_INTERPRET.
    from kiln.engine.kernels import kv_store, norm_rope, paged_attention, quant_gemm
    if name == "triton":
        return KernelBackend("triton", kv_store.store_kvcache, paged_attention.paged_attention,
                             norm_rope.rms_norm, norm_rope.rope, quant_gemm.w8a16_gemm, quant_gemm.w4a16_gemm)
    from kiln.engine import attention
    return KernelBackend("torch", attention.store_kvcache, attention.paged_attention, norm_rope.rms_norm_ref,
                         norm_rope.rope_ref, quant_gemm.w8a16_gemm_ref, quant_gemm.w4a16_gemm_ref)
