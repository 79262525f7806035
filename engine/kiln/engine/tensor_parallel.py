"""Megatron-style tensor parallelism for a loaded Llama-family model, applied after load as a
module swap (the way quantization swaps its Linears): every rank loads the full weights, then
keeps its slice.

  qkv_proj, gate_up_proj  column-parallel: this rank's query heads (and KV heads), its slice of I
  o_proj, down_proj       row-parallel: a partial sum, all-reduced across the ranks
  (float, int8 and fp8 weights: the quantized codes and their per-channel or per-group scales
  are cut the same way, so every rank computes exactly its part of the TP=1 quantized model)
  embed_tokens, lm_head   vocabulary-parallel: each rank a contiguous slice of the vocabulary
                          (padded to equal slices); logits are all-gathered
  LoRA adapters           cut like the projection they update (shard_adapter)

With fewer KV heads than ranks, each KV head is replicated on tp / num_kv_heads ranks: a rank's
query heads all read the one KV head their group shares.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kiln.engine.config import ModelConfig
from kiln.engine.llama import Linear, LlamaAttention, LlamaForCausalLM, LlamaMLP
from kiln.engine.loader import read_hf_config, resolve_model_path
from kiln.engine.lora import LoRAAdapter
from kiln.engine.quantization import Fp8Linear, Int4Linear, Int8Linear, pack_int4, unpack_int4

SHARDABLE = (Linear, Int8Linear, Int4Linear, Fp8Linear)
ROW_PARALLEL = ("o_proj", "down_proj")  # split along their input channels (the rest along outputs)

log = logging.getLogger(__name__)


class ShardingError(ValueError):
    """A model shape the tensor-parallel size cannot split."""


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int


def check_shardable(cfg: ModelConfig, tp: int) -> None:
    """One clear error naming the dimension that tp cannot split."""
    if cfg.num_attention_heads % tp:
        raise ShardingError(f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by "
                            f"tensor_parallel_size ({tp})")
    kv = cfg.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ShardingError(f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}): one must divide "
                            f"the other (KV heads are split, or replicated when fewer than the ranks)")
    if cfg.intermediate_size % tp:
        raise ShardingError(f"intermediate_size ({cfg.intermediate_size}) is not divisible by "
                            f"tensor_parallel_size ({tp})")


def check_before_load(model: str, tp: int) -> None:
    """check_shardable from a model folder's config.json, before rank 0 reads any weight: said only
    after the whole model had loaded. A GGUF file's config is read with its tensors: check_model
    refuses it once loaded."""
    path = resolve_model_path(model)
    if path.is_dir():
        check_shardable(read_hf_config(path), tp)


def local_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank holds: what its KV cache is sized from."""
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                   num_key_value_heads=max(1, cfg.num_key_value_heads // tp))


def _kv_heads(cfg: ModelConfig, shard: Shard) -> tuple[int, int]:
    """(first KV head, count) this rank holds."""
    kv = cfg.num_key_value_heads
    if kv >= shard.size:
        n = kv // shard.size
        return shard.rank * n, n
    return shard.rank * kv // shard.size, 1  # replicated: the KV head of this rank's query heads


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)  # a copy: the full tensor is freed


def _column_slice(module: nn.Module, rows: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """The module keeping only the output channels `rows` picks (from any [N, ...] tensor)."""
    bias = None if module.bias is None else rows(module.bias).clone()
    if isinstance(module, Linear):
        module.weight = _param(rows(module.weight))
        module.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return module
    if isinstance(module, Int8Linear):  # scales per output channel [N] or per (row, group) [N, K/G]
        return Int8Linear(rows(module.qweight).clone(), rows(module.scales).clone(), bias, module.act_scale,
                          module.dtype, module.kernel, scale_dtype=module.scales.dtype)
    if isinstance(module, Int4Linear):  # every tensor [N, ...]
        packed, scales, zeros, mins = _int4_parts(module)
        return Int4Linear(rows(packed).clone(), rows(scales).clone(), _cut(rows, zeros), bias, module.act_scale,
                          module.dtype, module.kernel, mins=_cut(rows, mins), scale_dtype=scales.dtype)
    if isinstance(module, Fp8Linear):
        return Fp8Linear(rows(module.weight).clone(), rows(module.scales).clone(), bias, module.act_scale,
                         module.dtype)
    raise ShardingError(f"{type(module).__name__} weights do not shard")


def _row_slice(module: nn.Module, start: int, size: int) -> nn.Module:
    """The module over input channels [start, start + size) only, without its bias."""
    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(-1, start, size).clone()

    act_scale = None if getattr(module, "act_scale", None) is None else cols(module.act_scale)
    if isinstance(module, Linear):
        local = Linear(size, module.weight.shape[0], gemm=module.gemm)
        local.weight = _param(cols(module.weight))
        return local
    def groups(t: torch.Tensor) -> torch.Tensor:  # whole groups only: check_model saw to it
        return t.narrow(1, start // module.group_size, size // module.group_size).clone()

    if isinstance(module, Int8Linear):
        scales = groups(module.scales) if module.group_size else module.scales.clone()
        return Int8Linear(cols(module.qweight), scales, None, act_scale, module.dtype, module.kernel,
                          scale_dtype=module.scales.dtype)
    if isinstance(module, Int4Linear):  # two codes a byte along the input channels
        packed, scales, zeros, mins = _int4_parts(module)
        return Int4Linear(packed.narrow(1, start // 2, size // 2).clone(), groups(scales), _cut(groups, zeros),
                          None, act_scale, module.dtype, module.kernel, mins=_cut(groups, mins),
                          scale_dtype=scales.dtype)
    if isinstance(module, Fp8Linear):
        return Fp8Linear(cols(module.weight), module.scales.clone(), None, act_scale, module.dtype)
    raise ShardingError(f"{type(module).__name__} weights do not shard")


def _cut(cut: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else cut(t)


@functools.cache  # one per weight shape, cleared when shard_model is done
def _int4pack_order(n: int, k: int) -> torch.Tensor:
    """For each code of the CPU op's packed layout (tinygemm's int4pack) of an [n, k] matrix, as
    unpack_int4 reads it, the index (row * k + col) of the code it holds. The layout only moves
    codes, so packing every code's own index, 4 bits at a time, and reading them back tells where."""
    index = torch.arange(n * k, dtype=torch.int32).reshape(n, k)
    order = torch.zeros(n * k, dtype=torch.int32)
    for shift in range(0, max(1, (n * k - 1).bit_length()), 4):
        packed = torch._convert_weight_to_int4pack_for_cpu((index >> shift) & 15, 2)
        order |= unpack_int4(packed).flatten().to(torch.int32) << shift
    if not torch.bincount(order, minlength=n * k).eq(1).all():
        raise ShardingError("this torch's CPU int4 layout does more than move codes: int4 weights in it do not shard")
    return order


def _int4_parts(module: Int4Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(codes packed [N, K/2], scales [N, K/G], zeros, mins) in the canonical layout, which cuts;
    the CPU op's own layout is unpacked exactly (its codes put back where they came from)."""
    if module.kernel != "weight_int4pack_mm_for_cpu":
        return module.qweight, module.scales, module.zeros, module.mins
    n, k = module.out_features, module.in_features
    codes = torch.empty(n * k, dtype=torch.uint8)
    codes[_int4pack_order(n, k)] = unpack_int4(module.qweight).flatten()
    sz = module.scales_and_zeros  # [K/G, N, 2]: W = (q - 8) * scale + offset
    scales, offsets = sz[..., 0].T.float(), sz[..., 1].T.float()
    return pack_int4(codes.reshape(n, k)), scales, None, offsets - 8 * scales


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: x arrives split along the input features."""

    def __init__(self, full: nn.Module, start: int, size: int) -> None:
        super().__init__()
        self.local = _row_slice(full, start, size)
        self.bias = full.bias  # added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        dist.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary (padded with zeros to an equal slice); the other ranks'
    tokens embed as zeros here and the all-reduce fills them in."""

    def __init__(self, weight: torch.Tensor, shard: Shard) -> None:
        super().__init__()
        self.weight = nn.Parameter(vocab_slice(weight, shard), requires_grad=False)
        self.start = shard.rank * self.weight.shape[0]
        self.end = min(self.start + self.weight.shape[0], weight.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill_(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        dist.all_reduce(out)
        return out


def vocab_slice(weight: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Rows [r*s, (r+1)*s) of a [V, H] weight, s = ceil(V / tp), zero-padded past V."""
    rows = -(-weight.shape[0] // shard.size)
    start = shard.rank * rows
    out = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    part = weight[start:start + rows]
    out[:part.shape[0]] = part
    return out


def _output_rows(fused: str, cfg: ModelConfig, shard: Shard) -> Callable[[torch.Tensor], torch.Tensor]:
    """This rank's rows of a column-parallel projection's [N, ...] tensor: its q, k, v rows of
    qkv_proj; its gate rows, then its up rows, of gate_up_proj."""
    if fused == "gate_up_proj":
        i = cfg.intermediate_size // shard.size
        return lambda t: torch.cat([t.narrow(0, shard.rank * i, i),
                                    t.narrow(0, cfg.intermediate_size + shard.rank * i, i)])
    d, hq = cfg.head_dim, cfg.num_attention_heads // shard.size
    kv_start, hkv = _kv_heads(cfg, shard)
    q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def rows(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t[:q_size], t[q_size:q_size + kv_size], t[q_size + kv_size:]
        return torch.cat([q.narrow(0, shard.rank * hq * d, hq * d),
                          k.narrow(0, kv_start * d, hkv * d), v.narrow(0, kv_start * d, hkv * d)])
    return rows


def _input_range(fused: str, cfg: ModelConfig, shard: Shard) -> tuple[int, int]:
    """(start, size) of the input channels a row-parallel projection (o_proj, down_proj) keeps."""
    size = (cfg.intermediate_size if fused == "down_proj" else cfg.num_attention_heads * cfg.head_dim) // shard.size
    return shard.rank * size, size


def _shard_attention(attn: LlamaAttention, cfg: ModelConfig, shard: Shard) -> None:
    hq, (_, hkv) = cfg.num_attention_heads // shard.size, _kv_heads(cfg, shard)
    attn.qkv_proj = _column_slice(attn.qkv_proj, _output_rows("qkv_proj", cfg, shard))
    attn.o_proj = RowParallelLinear(attn.o_proj, *_input_range("o_proj", cfg, shard))
    attn.num_heads, attn.num_kv_heads = hq, hkv
    attn.q_size, attn.kv_size = hq * cfg.head_dim, hkv * cfg.head_dim
    attn.attn.num_heads, attn.attn.num_kv_heads = hq, hkv


def _shard_mlp(mlp: LlamaMLP, cfg: ModelConfig, shard: Shard) -> None:
    mlp.gate_up_proj = _column_slice(mlp.gate_up_proj, _output_rows("gate_up_proj", cfg, shard))
    mlp.down_proj = RowParallelLinear(mlp.down_proj, *_input_range("down_proj", cfg, shard))


def shard_adapter(adapter: LoRAAdapter, cfg: ModelConfig, shard: Shard) -> LoRAAdapter:
    """This rank's part of a LoRA adapter read for the whole model (kiln.engine.lora's layout):
    a column-parallel projection keeps A whole and its own rows of B; a row-parallel one its own
    columns of A and B whole, so that its update (x_r A_r^T) B^T is a partial sum like its output
    and the same all-reduce completes both."""
    weights = {}
    for (layer, fused), (a, b) in adapter.weights.items():
        if fused in ROW_PARALLEL:
            a = a.narrow(1, *_input_range(fused, cfg, shard))
        else:
            b = _output_rows(fused, cfg, shard)(b)
        weights[layer, fused] = (a.contiguous().clone(), b.contiguous().clone())  # the whole adapter is freed
    return replace(adapter, weights=weights)


class ShardedModel(nn.Module):
    """A rank's slice of the model, with the interface of LlamaForCausalLM the runner uses. Every
    rank must call forward and compute_logits together (they hold collectives)."""

    def __init__(self, model: LlamaForCausalLM, shard: Shard) -> None:
        super().__init__()
        self.inner, self.shard = model, shard
        self.vocab_size = model.config.vocab_size
        self.backend = model.backend  # the runner's sampler takes its argmax

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] (the same on every rank) -> logits [M, vocab] float32, on every rank."""
        local = self.inner.compute_logits(hidden)
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=1)[:, :self.vocab_size]


def check_model(model: LlamaForCausalLM, tp: int) -> None:
    """ShardingError for shapes tp cannot split or weights it cannot shard (quantized ones)."""
    check_shardable(model.config, tp)
    unsupported = sorted({type(m).__name__ for name, m in model.named_modules()
                          if name.endswith(("_proj", "lm_head")) and not isinstance(m, SHARDABLE)})
    if unsupported:
        raise ShardingError(f"tensor parallelism shards float, int8, int4 and fp8 weights; this model holds "
                            f"{', '.join(unsupported)}")
    for name, m in model.named_modules():
        group = getattr(m, "group_size", None)
        if name.endswith(ROW_PARALLEL) and group and (m.in_features // tp) % group:
            raise ShardingError(f"{name}: its {m.method} groups of {group} input channels do not split into "
                                f"{tp} slices of {m.in_features // tp}")


def shard_model(model: LlamaForCausalLM, shard: Shard) -> ShardedModel:
    """Cut a loaded float model down to this rank's slice, in place (check_model's errors first)."""
    cfg = model.config
    check_model(model, shard.size)
    if cfg.num_key_value_heads < shard.size and shard.rank == 0:
        log.warning("%d KV heads for %d ranks: each KV head is replicated on %d ranks",
                    cfg.num_key_value_heads, shard.size, shard.size // cfg.num_key_value_heads)
    with torch.no_grad():
        try:
            for layer in model.model.layers:
                _shard_attention(layer.self_attn, cfg, shard)
                _shard_mlp(layer.mlp, cfg, shard)
        finally:
            _int4pack_order.cache_clear()
        embed = model.model.embed_tokens
        model.model.embed_tokens = VocabParallelEmbedding(embed.weight, shard)
        if model.lm_head is not None:
            model.lm_head.weight = _param(vocab_slice(model.lm_head.weight, shard))
    return ShardedModel(model, shard)
