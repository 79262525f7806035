"""The cpu backend's decoder layers in one op call (csrc/decoder_cpu.cpp, torch.ops.kiln.decoder_layers)
for the steps whose every layer is the same few ops: batch-1 decode spent 4-5 ms of a ~20 ms step on
2 cores in Python's module calls and dispatches around them.

It runs when the step and the layers allow it, and the module path (LlamaDecoderLayer) runs otherwise:
  the step   every sequence attends over the cache with the fused op (decodes, and prefills and
             chunks of up to cpu_attention.SDPA_ABOVE tokens) and stores every row's K/V; no
             sequence has a LoRA adapter
  the layers plain `Linear`s with the backend's GEMM and no bias (not quantized, not tensor-parallel)
             and a float cache in the activations' dtype (not int8/fp8)
The op calls the same C++ functions the module path reaches, in the same order: the same bits.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from kiln.engine import cpu_kernels
from kiln.engine.attention import StepAttention
from kiln.engine.context import get_context
from kiln.engine.cpu_attention import CpuPlan
from kiln.engine.llama import Linear, LlamaDecoderLayer

# Each layer's weights in the op's order (GEMMS: the slots that are GEMM weights), or None where the
# layers are not ones the op runs: checked once per model, at its first step that could use the op
# (reading them per step took ~0.8 ms of a ~18 ms batch-1 step). Quantization and tensor
# parallelism swap modules at load, before any step.
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layers -> (dtype, weights or None)
GEMMS = (1, 2, 4, 5)


def run_layers(layers: nn.ModuleList, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               step: StepAttention | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hidden, residual) after every layer, as the module loop returns them; None when this step or
    these layers need the module path (see the module docstring)."""
    ctx = get_context()
    if step is None or step.keep is not None or not isinstance(step.plan, CpuPlan) or step.plan.long \
            or ctx.lora is not None:  # LoRA updates are added by hooks on the modules
        return None
    kept = _WEIGHTS.get(layers)
    if kept is None or kept[0] != x.dtype:
        kept = _WEIGHTS[layers] = (x.dtype, layer_weights(layers, x.dtype))
    weights = kept[1]
    caches = [layer.self_attn.attn for layer in layers]
    if weights is None or any(c.k_scales is not None or c.k_cache.numel() == 0 or c.k_cache.dtype != x.dtype
                              for c in caches):
        return None
    first = layers[0]
    attn = first.self_attn
    gemm = attn.qkv_proj.gemm
    # cpu_kernels.linear's split of the rows, as its own calls would make it
    max_rows = cpu_kernels.op_rows() if x.dtype == torch.bfloat16 and gemm is cpu_kernels.linear else 0
    packed = []
    if max_rows and cpu_kernels.PACKING and x.shape[0] > max_rows:
        packed = [cpu_kernels.packed_weight(w) for i, w in enumerate(weights) if i % 6 in GEMMS]
    return torch.ops.kiln.decoder_layers(
        x, weights, packed, [c.k_cache for c in caches], [c.v_cache for c in caches], *rope, ctx.slot_mapping,
        ctx.cu_seqlens_q, ctx.seq_lens, ctx.block_tables, attn.num_heads, attn.num_kv_heads,
        first.input_layernorm.eps, attn.attn.scale, max_rows)


def layer_weights(layers: nn.ModuleList, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Each layer's input norm, qkv, o, post-attention norm, gate/up and down weights, in the op's
    order; None if any layer is not one the op runs (its KV cache is run_layers' to check, per step)."""
    weights: list[torch.Tensor] = []
    gemm = getattr(layers[0].self_attn.qkv_proj, "gemm", None) if len(layers) else None  # quantized: none
    for layer in layers:
        if type(layer) is not LlamaDecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        gemms = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(type(g) is not Linear or g.bias is not None or g.gemm is not gemm or g.weight.dtype != dtype
               for g in gemms):
            return None
        if {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {layers[0].input_layernorm.eps}:
            return None  # the op takes one epsilon
        weights += [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.o_proj.weight,
                    layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
    return weights or None
