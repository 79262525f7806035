"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flattened varlen batch.

Weights follow the Hugging Face layout; q/k/v and gate/up are fused into one matmul each,
which `load_weights` fills shard by shard from the separate HF tensors.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.engine.attention import Attention, prepare_step
from kiln.engine.config import ModelConfig, ModelLoadError
from kiln.engine.context import get_context
from kiln.engine.kernels.backend import Backend, get_backend


class Linear(nn.Module):
    """y = x W^T (+ b) by `gemm` (the backend's, F.linear's signature), parameters left
    uninitialised: weights always come from a file."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 gemm: Callable[..., torch.Tensor] = F.linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """The backend's fused residual-add + RMSNorm. With a residual, x (a layer's fresh output) may be
    overwritten with the sum, which is returned as the next residual."""

    def __init__(self, hidden_size: int, eps: float, backend: Backend) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise x; with a residual, first add it and also return the sum (the next residual)."""
        out, summed = self.backend.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, summed)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Rotary frequencies, with linear, llama3 (wavelength-banded) or GGUF freq-factor scaling."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    # freq_factors (ModelConfig admits no other kind): GGUF's rope_freqs, the scaled frequencies as divisors
    return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves). cos/sin are computed in float32 for every position and
    stored in the model's dtype (as HF does), so the rotation itself runs without upcasts.
    `prepare` gathers the step's rows once; each layer then rotates with the backend's `rope`."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.get_default_dtype())
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def prepare(self, positions: torch.Tensor) -> object:
        return self.backend.rope_prepare(positions, self.cos_sin)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, backend.linear)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, backend.linear)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, backend)

    def forward(self, x: torch.Tensor, rope: object) -> torch.Tensor:
        """rope: this step's RotaryEmbedding.prepare."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k sit side by side in qkv, so one rotary call covers both.
        qk = qkv[:, :self.q_size + self.kv_size].view(n, -1, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        o = self.attn.rotate_and_attend(qk, v, rope)
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, gemm=backend.linear)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, gemm=backend.linear)
        self.silu_mul = backend.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = LlamaAttention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = LlamaMLP(cfg, backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: object
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, backend: Backend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.backend = backend
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, backend)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Everything the layers share is derived here, once per step: the attention metadata
        # (with its host syncs) and the tokens' RoPE rows. The layer loop never syncs.
        step = prepare_step(get_context(), self.layers[0].self_attn.attn)
        rope = self.rotary.prepare(positions)
        x, residual = self.embed_tokens(input_ids), None
        fused = self.backend.decoder_layers
        out = fused(self.layers, x, rope, step) if fused is not None else None
        if out is not None:  # the backend ran every layer in one call
            x, residual = out
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, rope)
        x, _ = self.norm(x, residual)
        return x


# HF tensor name fragment -> (fused parameter fragment, shard index)
_PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_NUM_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, attention_backend: str = "torch") -> None:
        """attention_backend: the engine's one backend switch (kiln.engine.kernels.backend), resolved
        for the default device, under which the model is built."""
        super().__init__()
        self.config = cfg
        self.backend = get_backend(attention_backend, torch.get_default_device())
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings, self.backend)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, gemm=self.backend.linear)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [N] int64 (flattened batch) -> hidden [N, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] -> logits [M, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.backend.linear(hidden, weight).float()

    def shard_sizes(self, fused: str) -> list[int]:
        cfg = self.config
        if fused == "qkv_proj":
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "weights") -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be filled once."""
        params = dict(self.named_parameters())
        filled: dict[str, set[int]] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, shard = name, None
            for part, (fused, index) in _PACKED.items():
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), index
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"{source}: unexpected tensor {name!r} for this Llama-family model")
            dest = param.data
            if shard is not None:
                sizes = self.shard_sizes(target.split(".")[-2])
                dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
            if not tensor.is_floating_point():  # an int32 q_proj was cast into the model in silence
                raise ModelLoadError(f"{source}: tensor {name!r} is {tensor.dtype}, not floating point")
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled.setdefault(target, set()).add(0 if shard is None else shard)
        missing = [n for n in params if len(filled.get(n, ())) < _NUM_SHARDS.get(n.split(".")[-2], 1)]
        if missing:
            raise ModelLoadError(f"{source}: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
