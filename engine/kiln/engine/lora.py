"""LoRA adapters served beside their base model, as vLLM's `--enable-lora` does: a request names an
adapter (the OpenAI `model` field) and its tokens run the base weights plus the adapter's low-rank
update; requests of other adapters and of the base model share the batch.

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors) for the attention and
MLP projections. Each projection's update is kept as two matrices in the model's fused layout: A
[r_total, in] stacks the shards' A (q, k, v into qkv_proj; gate, up into gate_up_proj), and B
[out, r_total] holds each shard's B, times the adapter's scale, in its own rows and columns. A
forward hook on each projection adds (x A^T) B^T to the rows of each adapter in the step, read from
the step's Context (`LoRAMapping`): no module is swapped, so quantized and float projections take
adapters alike, and a model with no adapter loaded runs no hook at all.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from kiln.engine.context import get_context

# PEFT's module path in a layer -> (the model's fused projection, shard index)
_TARGETS = {
    "self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1), "self_attn.v_proj": ("qkv_proj", 2),
    "self_attn.o_proj": ("o_proj", 0),
    "mlp.gate_proj": ("gate_up_proj", 0), "mlp.up_proj": ("gate_up_proj", 1), "mlp.down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight$")
_ids = itertools.count(1)  # never reused: a reloaded name must not meet the old adapter's cached prefixes


class LoRAError(ValueError):
    """An adapter that cannot be served: missing files, unsupported PEFT options, wrong shapes."""


class LoRANotLoadedError(ValueError):
    """A request names no loaded adapter (it may have been unloaded since the server checked it)."""


@dataclass(eq=False)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    id: int  # unique per load: the prefix cache's salt
    # (layer index, fused projection) -> (A [r_total, in], B [out, r_total] scaled)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LoRAMapping:
    """Which rows of a step each adapter's update goes to; rows None: every row of the step."""
    groups: list[tuple[LoRAAdapter, torch.Tensor | None]]


def adapter_files(name: str, path: str) -> tuple[Path, Path]:
    """A PEFT folder's adapter_config.json and adapter_model.safetensors; LoRAError if either is missing."""
    folder = Path(path)
    config_file, tensors_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not os.path.isfile(config_file) or not os.path.isfile(tensors_file):  # False, not OSError, for a name too long
        raise LoRAError(f"LoRA adapter {name!r}: {path} must hold adapter_config.json and adapter_model.safetensors")
    return config_file, tensors_file


def load_adapter(name: str, path: str, model: nn.Module, max_rank: int) -> LoRAAdapter:
    """Read a PEFT LoRA folder into the model's fused layout, in the model's dtype and device."""
    config_file, tensors_file = adapter_files(name, path)
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, or not UTF-8; Recursion: nested deep
        raise LoRAError(f"LoRA adapter {name!r}: {config_file} is not JSON: {e}") from None
    if not isinstance(config, dict):  # the options are read by name: a list or null has none
        raise LoRAError(f"LoRA adapter {name!r}: {config_file} is not a JSON object")
    scale = _scale(name, config, max_rank)
    try:
        # The names first, from the header alone: a path to a whole model's checkpoint read every
        # tensor into host memory (enough to OOM-kill the pod) before it was refused.
        with safe_open(str(tensors_file), framework="pt") as f:
            for key in f.keys():
                _lora_key(name, key)
        tensors = load_file(str(tensors_file))
    except LoRAError:
        raise
    except Exception as e:  # safetensors' own errors name no file
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {tensors_file}: {e}") from None
    shards: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _lora_key(name, key)
        if not tensor.is_floating_point():  # PEFT writes float weights: integers cast to floats are not an adapter
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} in {tensors_file} is {tensor.dtype}, not a "
                            "floating-point type")
        layer, (fused, shard) = int(match.group(1)), _TARGETS[match.group(2)]
        halves = shards.setdefault((layer, fused), {}).setdefault(shard, {})
        if match.group(3) in halves:  # PEFT's prefix and the bare one: which would win is the file's order
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer}'s {match.group(2)} lora_{match.group(3)} is in "
                            f"{tensors_file} twice (tensor {key!r})")
        halves[match.group(3)] = tensor
    if not shards:
        raise LoRAError(f"LoRA adapter {name!r}: {tensors_file} holds no LoRA weights")
    weights = {key: _fuse(name, model, key, parts, config["r"], scale) for key, parts in sorted(shards.items())}
    return LoRAAdapter(name, str(path), int(config["r"]), next(_ids), weights)


def _lora_key(name: str, key: str) -> re.Match[str]:
    """The match of a tensor name that is a LoRA weight of a projection taking adapters; LoRAError if not."""
    match = _KEY.match(key)
    if match is None or match.group(2) not in _TARGETS:
        raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of an attention or MLP "
                        f"projection ({', '.join(_TARGETS)}): only those take adapters here")
    return match


def _scale(name: str, config: dict, max_rank: int) -> float:
    """The update's factor (lora_alpha / r, or / sqrt(r) with rsLoRA), after refusing what the
    update here does not compute."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "rank_pattern": "per-module ranks",
               "alpha_pattern": "per-module alphas", "modules_to_save": "fully trained modules (modules_to_save)",
               "lora_bias": "LoRA biases (lora_B.bias)",  # PEFT >= 0.14; its tensors would be refused unnamed
               # Its layer indices are those of the stacked copy, not the base model's: applied here,
               # each update would land on another layer than it was trained for.
               "layer_replication": "replicated layers (layer_replication)"}
    for option, what in refused.items():
        if config.get(option):
            raise LoRAError(f"LoRA adapter {name!r}: {what} are not supported ({option} is set)")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or not _finite(alpha):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json needs a positive integer r and a finite "
                        "lora_alpha")
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {rank}, more than --max-lora-rank {max_rank}")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _finite(number: object) -> bool:
    """A JSON number a float holds: Python's JSON reads NaN, Infinity and integers of any size."""
    if not isinstance(number, (int, float)) or isinstance(number, bool):
        return False
    try:
        return math.isfinite(number)
    except OverflowError:  # an integer past float's range
        return False


def _fuse(name: str, model: nn.Module, key: tuple[int, str], parts: dict[int, dict[str, torch.Tensor]],
          rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B of one fused projection from its shards' (A, B); B's rows of a shard without an
    adapter stay zero."""
    layer, fused = key
    layers = model.model.layers
    if layer >= len(layers):
        raise LoRAError(f"LoRA adapter {name!r} has weights for layer {layer}; the model has {len(layers)}")
    sizes = model.shard_sizes(fused) if fused in ("qkv_proj", "gate_up_proj") else None
    cfg = model.config
    in_features = cfg.intermediate_size if fused == "down_proj" else \
        cfg.num_attention_heads * cfg.head_dim if fused == "o_proj" else cfg.hidden_size
    out_sizes = sizes or [cfg.hidden_size]
    weight = model.model.embed_tokens.weight
    a_rows, b_blocks, cols = [], [], 0
    for shard, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {fused} (shard {shard}) has lora_{''.join(ab)} "
                            "without its other half")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_sizes[shard], a.shape[0]):
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {fused} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}; this model needs [r, {in_features}] and [{out_sizes[shard]}, r]: "
                            "an adapter of another base model?")
        if a.shape[0] != rank:  # the scale is alpha / r: a tensor of another rank would be scaled wrongly
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {fused} has rank {a.shape[0]}, "
                            f"adapter_config.json says r={rank}")
        a_rows.append(a)
        b_blocks.append((sum(out_sizes[:shard]), cols, b))
        cols += a.shape[0]
    big_b = torch.zeros(sum(out_sizes), cols, dtype=torch.float32)
    for row, col, b in b_blocks:
        big_b[row:row + b.shape[0], col:col + b.shape[1]] = b.float() * scale
    a = torch.cat(a_rows).float()
    # An AWQ-quantized model divided the norm before qkv / gate_up by s: those projections see
    # x / s, so A takes diag(s) to give the adapter's update on x (it was off by 1/s per channel).
    norm = {"qkv_proj": "input_layernorm", "gate_up_proj": "post_attention_layernorm"}.get(fused)
    folded = getattr(getattr(layers[layer], norm), "folded_scale", None) if norm else None
    if folded is not None:
        a = a * folded.to(a.device)
    a, b = a.to(weight.dtype), big_b.to(weight.dtype)
    # Checked in the model's dtype (a scaled B may overflow float16): a NaN or inf would only give
    # its requests garbage text, sampled from logits the sampler had to clamp.
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {fused} has weights that are not finite "
                        f"(NaN or inf) in {weight.dtype}")
    return a.to(weight.device).contiguous(), b.to(weight.device).contiguous()


def install_hooks(model: nn.Module) -> None:
    """Make every layer's projections add the step's adapters' updates (once per model). On a
    tensor-parallel rank (a ShardedModel around the model) a row-parallel projection's update goes
    on its `local` part, the rank's partial sum, before the all-reduce that adds the ranks' up."""
    for index, layer in enumerate(getattr(model, "inner", model).model.layers):
        for module, fused in ((layer.self_attn.qkv_proj, "qkv_proj"), (layer.self_attn.o_proj, "o_proj"),
                              (layer.mlp.gate_up_proj, "gate_up_proj"), (layer.mlp.down_proj, "down_proj")):
            getattr(module, "local", module).register_forward_hook(_hook((index, fused), model.backend.linear))


def _hook(key: tuple[int, str], linear: Callable[..., torch.Tensor]):
    """linear: the backend's GEMM (F.linear's signature; A and B are in its weight layout), which
    on the CPU is 3x faster than torch's matmul for bf16 decode rows."""
    def add_updates(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        mapping = get_context().lora
        if mapping is None:
            return out
        x = args[0]
        for adapter, rows in mapping.groups:
            ab = adapter.weights.get(key)
            if ab is None:
                continue
            a, b = ab
            if rows is None:
                out.add_(linear(linear(x, a), b))
            else:
                out.index_add_(0, rows, linear(linear(x.index_select(0, rows), a), b))
        return out
    return add_updates


def on_device(adapter: LoRAAdapter, device: torch.device | str) -> LoRAAdapter:
    """The adapter with its weights on `device` (a copy where they are elsewhere)."""
    return replace(adapter, weights={key: (a.to(device), b.to(device)) for key, (a, b) in adapter.weights.items()})


def lora_mapping(adapters: list[tuple[LoRAAdapter | None, int]], device: torch.device) -> LoRAMapping | None:
    """The step's mapping from each sequence's adapter and its row count, in flat-batch order;
    None when no sequence has one (the hooks then do nothing)."""
    rows: dict[LoRAAdapter, list[int]] = {}
    start = 0
    for adapter, count in adapters:
        if adapter is not None:
            rows.setdefault(adapter, []).extend(range(start, start + count))
        start += count
    if not rows:
        return None
    return LoRAMapping([(adapter, None if len(taken) == start else torch.tensor(taken, device=device))
                        for adapter, taken in rows.items()])
