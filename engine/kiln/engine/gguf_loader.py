"""GGUF files: model config from metadata, tensors dequantized and renamed to the Hugging Face
layout (undoing llama.cpp's Q/K row permutation), and the tokenizer from tokenizer.ggml.*. The file
is read by kiln.engine.gguf_file: a memory map, every tensor a view of it.

With keep_quantized, decoder projections stored as Q8_0, Q4_0 or Q4_1 are not dequantized: they
become QuantLinear modules holding the file's own blocks (kiln.engine.gguf_quant)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import gguf
import numpy as np
import torch
from torch import nn

from kiln.engine import startup
from kiln.engine.config import ModelConfig, ModelLoadError, layer_count
from kiln.engine.gguf_file import GGUFFile, GGUFTensor, read_gguf
from kiln.engine.gguf_quant import PACKED_TYPES, PackedWeight, dequantize_blocks, read_packed
from kiln.engine.tokenizer import Tokenizer, build_gguf_tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Q4_K_M and Q5_K_M files mix Q4_K/Q5_K with Q6_K, and fall back to Q5_0/Q5_1/Q8_0 for rows
# whose length 256 does not divide.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Kiln's decoder projections (llama.py) and the GGUF weights each is built from, in shard order.
_PROJECTIONS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
                "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}

# One kept-quantized projection: its GGUF weights in shard order, each with the head count to
# undo llama.cpp's q/k row permutation by (None: rows as stored).
PackedPlan = list[tuple[GGUFTensor, int | None]]


class GGUFModel(NamedTuple):
    config: ModelConfig
    tokenizer: Tokenizer
    weights: Iterator[tuple[str, torch.Tensor]]  # HF-named float tensors, the packed ones left out
    packed: dict[str, PackedPlan]  # projection module name -> its GGUF weights; see install_packed


def open_gguf(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except Exception as e:  # ValueError, struct.error, UnicodeDecodeError ... on bad bytes
        raise ModelLoadError(f"{path}: not a readable GGUF file (corrupt or truncated?): {e}") from None


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF name; None for a name this loader does not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    return None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of q/k rows (interleaved RoPE pairs) back to
    HF's rotate-half layout. Works for weights [out, in] and biases [out]."""
    rest = weight.shape[1:]
    if weight.shape[0] % (2 * num_heads):  # (a torch RuntimeError naming neither file nor tensor)
        raise ValueError(f"its {weight.shape[0]} rows do not split into {num_heads} heads of rotary pairs")
    return weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def dequantize(tensor: GGUFTensor | gguf.ReaderTensor, source: str, heads: int | None = None) -> torch.Tensor:
    """A GGUF tensor as float32 (F16 kept as is) in row-major HF shape [rows, cols]. With heads,
    llama.cpp's q/k row permutation is undone first, on the stored rows: a block never spans two
    rows, and a stored row is a fraction of a float32 one."""
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{source}: tensor {tensor.name!r} has type {kind}, not supported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    try:
        array = np.asarray(tensor.data)
        if heads is not None:
            array = unpermute_qk(torch.from_numpy(array), heads).numpy()
        if kind in PACKED_TYPES:
            array = dequantize_blocks(array, kind)
        elif kind not in ("F32", "F16"):
            array = gguf.quants.dequantize(array, tensor.tensor_type)
        array = array.reshape(shape)
        # F32/F16 may still be the memory map itself: gguf_file's is writable copy-on-write and
        # used as is, while GGUFReader's (bench/bf16_gguf.py) is read-only and torch wants a copy.
        return torch.from_numpy(array if array.flags.writeable and array.flags.c_contiguous else array.copy())
    except (ValueError, IndexError, AssertionError) as e:
        raise ModelLoadError(f"{source}: tensor {tensor.name!r} cannot be decoded "
                             f"(corrupt or truncated?): {e}") from None


def _rope_scaling(meta: dict[str, Any], arch: str, tensors: list[GGUFTensor], source: str) -> dict[str, Any] | None:
    rope_freqs = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        # llama3 scaling arrives baked into per-frequency divisors of the base frequencies.
        return {"rope_type": "freq_factors", "factors": dequantize(rope_freqs, source).reshape(-1).tolist()}
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ModelLoadError(f"{source}: rope scaling {kind!r} is not supported")


def read_model_config(meta: dict[str, Any], tensors: list[GGUFTensor], source: str) -> ModelConfig:
    shards = meta.get("split.count", 1)  # llama-gguf-split's keys: later shards hold tensors only
    if isinstance(shards, int) and shards > 1:
        raise ModelLoadError(f"{source}: shard {int(meta.get('split.no', 0)) + 1} of {shards} of a split GGUF; "
                             f"merge them into one file first (llama-gguf-split --merge FIRST-SHARD OUT.gguf)")
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{source}: architecture {arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    tensor_names = {t.name for t in tensors}
    try:
        heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [int(eos)] if eos is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else int(meta[f"{arch}.vocab_size"])
        config = ModelConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_hidden_layers=int(meta[f"{arch}.block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads if heads > 0 else 0)),
            rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(meta, arch, tensors, source),
            max_position_embeddings=int(meta[f"{arch}.context_length"]),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: GGUF metadata lacks {e.args[0]!r}") from None
    except (ValueError, TypeError, ArithmeticError) as e:  # ModelConfig's checks name the field; int(inf)
        raise ModelLoadError(f"{source}: GGUF metadata: {e}") from None
    _check_sizes(config, tensors, arch, source)
    _check_types(tensors, source)
    return config


def _check_types(tensors: list[GGUFTensor], source: str) -> None:
    """Every tensor's type, before a model is allocated and half its tensors decoded for nothing."""
    unsupported = [t for t in tensors if t.tensor_type.name not in SUPPORTED_TYPES]
    if unsupported:
        kinds = sorted({t.tensor_type.name for t in unsupported})
        raise ModelLoadError(f"{source}: {len(unsupported)} tensors have types this loader does not decode "
                             f"({', '.join(kinds)}; the first {unsupported[0].name!r}); "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")


def _check_sizes(config: ModelConfig, tensors: list[GGUFTensor], arch: str, source: str) -> None:
    """The metadata's sizes against the tensors the file holds, before a model is built from them:
    a feed_forward_length of 2**40 asked the allocator for terabytes, 20,000 blocks took seconds and
    GiBs before any tensor was compared."""
    shapes = {t.name: t.shape[::-1] for t in tensors}  # GGUF lists the fastest dimension first
    found = {"embedding_length": shapes.get("token_embd.weight", (None, None))[1:],
             "block_count": (layer_count(shapes, "blk."),),
             "feed_forward_length": shapes.get("blk.0.ffn_gate.weight", (None,))[:1]}
    said = {"embedding_length": (config.hidden_size,), "block_count": (config.num_hidden_layers,),
            "feed_forward_length": (config.intermediate_size,)}
    for key, shape in found.items():
        if None not in shape and shape != said[key]:
            raise ModelLoadError(f"{source}: GGUF metadata {arch}.{key} is {said[key][0]}, the tensors hold "
                                 f"{shape[0] if shape else shape}")


def _qk_heads(cfg: ModelConfig, arch: str) -> dict[str, int]:
    # convert_hf_to_gguf permutes q/k for the llama architecture only.
    return {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads} if arch == "llama" else {}


def plan_packed(tensors: list[GGUFTensor], cfg: ModelConfig, arch: str, kinds: tuple[str, ...]) -> dict[str, PackedPlan]:
    """The decoder projections whose GGUF weights all share one of `kinds` (of PACKED_TYPES). A
    fused module whose parts differ in type (q Q4_1, v Q8_0, say) is left to dequantize."""
    by_name = {t.name: t for t in tensors}
    heads = _qk_heads(cfg, arch)
    plans = {}
    for layer in range(cfg.num_hidden_layers):
        for module, parts in _PROJECTIONS.items():
            tensors = [by_name.get(f"blk.{layer}.{part}.weight") for part in parts]
            if None in tensors:
                continue  # load_weights names what is missing
            types = {t.tensor_type.name for t in tensors}
            if len(types) == 1 and types.pop() in kinds:
                plans[f"model.layers.{layer}.{module}"] = [(t, heads.get(p)) for t, p in zip(tensors, parts)]
    return plans


@startup.phase("quantize")  # Kiln's own form of the file's blocks
def install_packed(model: nn.Module, plans: dict[str, PackedPlan], source: str) -> None:
    """Swap each planned Linear for a QuantLinear built from its GGUF blocks, on the Linear's device
    and in its dtype. The Linear's (still empty) bias moves over, for load_weights to fill."""
    for name, plan in plans.items():
        linear = model.get_submodule(name)
        # Checked here as load_weights checks the tensors it copies: built from the file's own
        # shapes, a projection that disagrees with the config loaded and answered garbage.
        rows = model.shard_sizes(name.rpartition(".")[2]) if len(plan) > 1 else [linear.weight.shape[0]]
        for (tensor, _), want in zip(plan, rows):
            shape, expected = tuple(int(d) for d in reversed(tensor.shape)), (want, linear.weight.shape[1])
            if shape != expected:
                raise ModelLoadError(f"{source}: tensor {tensor.name!r} has shape {shape}, the model expects {expected}")
        parts = []
        for tensor, heads in plan:
            try:
                packed = read_packed(tensor)
            except ValueError as e:
                raise ModelLoadError(f"{source}: {e} (corrupt or truncated?)") from None
            parts.append(packed if heads is None else packed.map_rows(lambda t, h=heads: unpermute_qk(t, h)))
        quant = PackedWeight.cat(parts).to_linear(linear.bias, linear.weight.dtype, linear.weight.device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, quant)


def iter_weights(tensors: list[GGUFTensor], cfg: ModelConfig, arch: str, source: str,
                 skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs, dequantized one at a time so peak memory stays one tensor;
    the GGUF tensors named in skip (kept quantized) are left out."""
    heads = _qk_heads(cfg, arch)
    for tensor in tensors:
        if tensor.name == "rope_freqs.weight" or tensor.name in skip:
            continue  # rope_freqs is already in cfg.rope_scaling
        name = hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{source}: unexpected tensor {tensor.name!r}")
        kind = tensor.name.split(".")[-2]  # attn_q, attn_k ... (q/k biases are permuted too)
        with startup.phase("quantize"):  # the bytes are already read (gguf_file.map_file)
            weight = dequantize(tensor, source, heads.get(kind) if tensor.name.startswith("blk.") else None)
        yield name, weight


def load_gguf(path: Path, keep_quantized: tuple[str, ...] = ()) -> GGUFModel:
    """Config, tokenizer, a lazy weight iterator and the projections to serve packed: those stored
    as one of the types in `keep_quantized` (of PACKED_TYPES)."""
    source = str(path)
    file = open_gguf(path)
    meta = file.metadata
    cfg = read_model_config(meta, file.tensors, source)
    tokenizer = Tokenizer(build_gguf_tokenizer(meta, source), cfg.eos_token_ids, cfg.bos_token_id,
                          meta.get("tokenizer.chat_template"), source, meta.get("tokenizer.chat_template.tool_use"))
    arch = meta["general.architecture"]
    plans = plan_packed(file.tensors, cfg, arch, keep_quantized)
    skip = frozenset(tensor.name for plan in plans.values() for tensor, _ in plan)
    return GGUFModel(cfg, tokenizer, iter_weights(file.tensors, cfg, arch, source, skip), plans)
