"""The engine's one backend switch: attention, KV store, fused residual-add + RMSNorm, RoPE, the
float GEMM and the MLP's SiLU-and-multiply, chosen together by one name (Config.attention_backend,
`--attention-backend`).
Quantized GEMMs follow the weights' device (kiln.engine.quantization): Triton's W8A16/W4A16 on
CUDA, torch's packed ops on CPU, which is what "auto" pairs them with.

  torch   the reference: pure torch everywhere (kiln.engine.attention, kiln.engine.cpu_ops)
  cpu     Kiln's C++ ops (kiln.engine.cpu_library): the fused paged attention (cpu_attention),
          norm, RoPE and KV store (cpu_kernels) and, where the CPU has AVX512-BF16, the bf16 GEMM
          (cpu_kernels.linear: Kiln's op for decode rows, oneDNN's on packed weights above them);
          torch's GEMM for float32; the sampler's argmax (cpu_kernels.argmax_rows); and a decode
          step's decoder layers in one call of those ops (cpu_decoder)
  triton  the Triton kernels of this package (CUDA, or the interpreter in tests)
  auto    triton on CUDA; on CPU "cpu" where its op builds, else torch
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "torch", "triton", "cpu")


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [N, 2I], in place in gate_up's gate half (no [N, I] buffer)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


@dataclass(frozen=True)
class Backend:
    name: str
    # the kernels' own signatures (tests call them directly)
    store_kvcache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # (x, weight, eps, residual=None) -> (norm(x + residual) * weight, x + residual)
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # rope_prepare(positions, cos_sin table) once per step; rope(qk [N, Hq+Hkv, D], Hq, prepared) -> (q, k)
    rope_prepare: Callable[[torch.Tensor, torch.Tensor], Any]
    rope: Callable[[torch.Tensor, int, Any], tuple[torch.Tensor, torch.Tensor]]
    # store_kvcache for slots the step has already dropped the -1s from (no host sync): the
    # torch and cpu paths, which derive the step's metadata on the host (attention.prepare_step)
    write_kvcache: Callable[..., None]
    # (x [M, K], weight [N, K], bias [N] or None) -> [M, N]: F.linear's signature
    linear: Callable[..., torch.Tensor] = F.linear
    # logits [M, V] float32 -> the first index of each row's largest value [M] int64 (the sampler's)
    argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax
    # (layers, x, rope prepared, attention.StepAttention) -> (hidden, residual) after every decoder
    # layer in one call, or None where the step or the layers need the module loop (cpu_decoder)
    decoder_layers: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # gate_up [N, 2I] -> silu(gate) * up [N, I], the MLP's activation
    silu_mul: Callable[[torch.Tensor], torch.Tensor] = torch_silu_mul
    # rope and the float-cache store in one: (qk, v, Hq, rope prepared, k_cache, v_cache, slot_mapping)
    # -> rotated q; None where the backend runs them apart
    rope_store: Callable[..., torch.Tensor] | None = None


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """'auto' -> 'triton' on CUDA, on CPU 'cpu' where its op builds (else 'torch'); a clear error
    for a backend that cannot run on `device`."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    if name == "auto" and device.type == "cuda":
        return "triton"
    if name in ("auto", "cpu"):
        if device.type != "cpu":
            if name == "cpu":
                raise ValueError(f"attention_backend='cpu' needs a CPU device, got {device.type!r}")
            return "torch"
        from kiln.engine import cpu_library
        if name == "cpu" and not cpu_library.available():
            raise ValueError(f"attention_backend='cpu' could not build its op ({cpu_library.unavailable_reason()}); "
                             "use attention_backend='torch'")
        return "cpu" if cpu_library.available() else "torch"
    # The interpreter (tests) runs Triton kernels on CPU tensors.
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton backend needs a CUDA device, got {device.type!r}; "
                         "use attention_backend='torch' (or TRITON_INTERPRET=1 to interpret kernels in tests)")
    return name


def get_backend(name: str, device: torch.device | str) -> Backend:
    """The ops of backend `name` (see the module docstring) for `device`."""
    name = resolve_backend_name(name, device)
    # Imported here: Triton modules must be defined after a test has set TRITON_INTERPRET.
    from kiln.engine import attention, cpu_ops
    if name == "triton":
        from kiln.engine.kernels import activation, kv_store, norm_rope, paged_attention, quant_gemm
        return Backend("triton", kv_store.store_kvcache, paged_attention.paged_attention, norm_rope.rms_norm,
                       _triton_rope_prepare, _triton_rope, attention.write_kvcache, quant_gemm.linear,
                       silu_mul=activation.silu_mul, rope_store=_triton_rope_store)
    if name == "cpu":
        from kiln.engine import cpu_attention, cpu_decoder, cpu_kernels as k
        return Backend(name, attention.store_kvcache, cpu_attention.paged_attention, k.rms_norm, k.rope_prepare,
                       k.rope, k.write_kvcache, k.linear if k.linear_op_supported() else F.linear,
                       k.argmax_rows, cpu_decoder.run_layers)
    return Backend(name, attention.store_kvcache, attention.paged_attention, cpu_ops.rms_norm, cpu_ops.rope_prepare,
                   cpu_ops.rope, attention.write_kvcache)


def _triton_rope_prepare(positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return positions, cos_sin  # the kernel reads each token's row of the table itself


def _triton_rope(qk: torch.Tensor, num_q_heads: int, prepared: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    from kiln.engine.kernels.norm_rope import rope
    positions, cos_sin = prepared
    return rope(positions, qk[:, :num_q_heads], qk[:, num_q_heads:], cos_sin)


def _triton_rope_store(qk: torch.Tensor, v: torch.Tensor, num_q_heads: int, prepared: tuple[torch.Tensor, torch.Tensor],
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    from kiln.engine.kernels.norm_rope import rope_store
    positions, cos_sin = prepared
    return rope_store(positions, qk[:, :num_q_heads], qk[:, num_q_heads:], v, cos_sin, k_cache, v_cache, slot_mapping)
