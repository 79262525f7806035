"""Quantized model folders, written by `kiln quantize` and served with `--model DIR`.

A folder is a Hugging Face-style model folder that Kiln's loader reads:
  config.json            the model's config (read_hf_config reads it back)
  tokenizer.json, tokenizer_config.json   the fast tokenizer, bos/eos tokens and chat template
  model.safetensors      the float tensors (embeddings, norms, lm_head) under their HF names, and
                         each quantized projection under Kiln's fused name (`...qkv_proj.qweight`,
                         `.scales`, `.zeros`, `.act_scale`, `.bias`: Quantizer's state dict)
  kiln_quantization.json method, int4 group sizes, the source weights' sha256, format version;
                         moved in last; while the files are moved in it says "unfinished",
                         so a folder cut short there is refused at load, not served as a mix
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from kiln.engine.config import GENERATION_CONFIG, ModelConfig, ModelLoadError
from kiln.engine.awq import scale_tensor
from kiln.engine.quantization import ACTIVATION_AWARE, Quantizer, check_method, quantizable_linears
from kiln.engine.tokenizer import Tokenizer
from kiln.engine.variants import FORMAT_VERSION, atomic_write

MARKER = "kiln_quantization.json"
WEIGHTS = "model.safetensors"
UNFINISHED = {"unfinished": True}  # the marker while write_quantized_folder moves files in


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The folder's kiln_quantization.json, or None when it is not a quantized folder."""
    path = folder / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable: {e}") from None
    if marker == UNFINISHED:
        raise ModelLoadError(f"{path}: left by a kiln quantize that did not finish (cut short, or still running)")
    if not isinstance(marker, dict) or marker.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{path}: not a format-version-{FORMAT_VERSION} Kiln quantized folder (one written by "
                             "another Kiln version is quantized again with kiln quantize)")
    try:
        if check_method(marker.get("method")) == "none":
            raise ValueError("method 'none' is no quantized variant")
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return marker


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """cfg as a Hugging Face config.json (the inverse of loader.read_hf_config)."""
    qwen2 = cfg.attention_bias and not cfg.o_proj_bias  # Qwen2: q/k/v biases only
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        **({} if qwen2 else {"attention_bias": cfg.attention_bias}),
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write_quantized_folder(out: Path, model: nn.Module, model_config: ModelConfig, tokenizer: Tokenizer,
                           method: str, state: dict[str, torch.Tensor], source_sha256: str,
                           source: Path | None = None) -> None:
    """Write model's variant (state, from Quantizer) as a folder `--model out` serves, with the
    source folder's generation_config.json (its sampling defaults: kiln serve's --generation-config
    auto reads them there, and the variant must sample as its model does). The files are
    written to a staging folder beside out, then moved in, the marker last: a write cut short
    (Ctrl-C, a full disk) leaves out as it was, never new files vouched for by an old marker."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        _write_files(staging, model, model_config, tokenizer, method, state, source_sha256)
        if source is not None and (source / GENERATION_CONFIG).is_file():
            shutil.copyfile(source / GENERATION_CONFIG, staging / GENERATION_CONFIG)
        out.mkdir(exist_ok=True)
        _move_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_in(staging: Path, out: Path) -> None:
    # Locked: two runs into one out interleaved their renames, and the last marker vouched for
    # the other run's weights.
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Unfinished, not absent, while files change: cut short, out is refused at load and
        # --overwrite replaces it (kiln quantize refuses a folder of files with no marker at all).
        atomic_write(out / MARKER, json.dumps(UNFINISHED).encode())
        (out / GENERATION_CONFIG).unlink(missing_ok=True)  # the earlier source's, should this one have none
        for path in sorted(staging.iterdir(), key=lambda p: p.name == MARKER):
            os.replace(path, out / path.name)
    finally:
        os.close(fd)


def _write_files(out: Path, model: nn.Module, model_config: ModelConfig, tokenizer: Tokenizer,
                 method: str, state: dict[str, torch.Tensor], source_sha256: str) -> None:
    dtype = next(model.parameters()).dtype
    atomic_write(out / "config.json", json.dumps(hf_config(model_config, dtype), indent=2).encode())
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    template: str | list | None = tokenizer.chat_template
    if tokenizer.tool_use_template is not None:  # named, as transformers and load_hf_tokenizer read them
        named = {"default": tokenizer.chat_template, "tool_use": tokenizer.tool_use_template}
        template = [{"name": name, "template": text} for name, text in named.items() if text is not None]
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
                  "bos_token": tokenizer.token_text(tokenizer.bos_token_id), "eos_token": tokenizer.token_text(eos)}
    atomic_write(out / "tokenizer_config.json", json.dumps(tok_config, indent=2).encode())
    linears = dict(quantizable_linears(model))
    tensors = {name: p.detach() for name, p in model.named_parameters() if name.rpartition(".")[0] not in linears}
    tensors.update(state)  # the quantized projections, and AWQ's rescaled norms over the float ones
    atomic_write(out / WEIGHTS, safetensors.torch.save({k: v.cpu().contiguous() for k, v in tensors.items()}))
    group_sizes = sorted({int(linears[k.removesuffix(".scales")].weight.shape[1] // v.shape[1])
                          for k, v in state.items() if k.endswith(".scales") and v.dim() == 2})
    marker = {"format_version": FORMAT_VERSION, "method": method, "group_sizes": group_sizes or None,
              "source_sha256": source_sha256}
    atomic_write(out / MARKER, json.dumps(marker, indent=2).encode())


def load_quantized_folder(model: nn.Module, state: dict[str, torch.Tensor], marker: dict[str, Any],
                          requested: str, source: str) -> None:
    """Fill model from a quantized folder's tensors: QuantLinears built from the stored codes
    (no quantization at load), float tensors copied. requested is Config.quantization."""
    method = marker["method"]
    if requested not in ("none", method):
        raise ModelLoadError(f"{source} holds a {method} variant; quantization {requested!r} disagrees "
                             f"(leave it out or ask for {method!r})")
    linears = dict(quantizable_linears(model))
    floats = {n: p for n, p in model.named_parameters() if n.rpartition(".")[0] not in linears}
    parts = ("qweight", "scales", "zeros") if method.startswith("int4") else ("qweight", "scales")
    missing = [f"{n}.{part}" for n in linears for part in parts if f"{n}.{part}" not in state]
    # A projection's bias (Qwen2's q/k/v): left out, the model loaded and answered wrong, silently.
    missing += [f"{n}.bias" for n, linear in linears.items() if linear.bias is not None and f"{n}.bias" not in state]
    missing += [n for n in floats if n not in state]
    if method in ACTIVATION_AWARE:  # W diag(s) needs its input / s: left out, it loaded and answered wrong
        missing += [scale_tensor(n) for n in linears if scale_tensor(n) not in state]
    if missing:
        raise ModelLoadError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    expected = {f"{n}.{part}" for n in linears for part in parts} | {f"{n}.bias" for n in linears} | set(floats)
    if method in ACTIVATION_AWARE:
        expected |= {scale_tensor(n) for n in linears}
    unexpected = sorted(set(state) - expected)
    if unexpected:  # a mixed-up folder: loaded, and the tensors ignored in silence
        raise ModelLoadError(f"{source}: unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for name, linear in linears.items():
        if not bool(state[f"{name}.scales"].isfinite().all()):
            raise ModelLoadError(f"{source}: tensor {name}.scales holds values that are not finite")
        # The probe below runs zeros through each layer: a scale of the wrong length broadcast as one.
        scale = scale_tensor(name) if method in ACTIVATION_AWARE else None
        if scale is not None and tuple(state[scale].shape) != (linear.weight.shape[1],):
            raise ModelLoadError(f"{source}: tensor {scale} has shape {tuple(state[scale].shape)}, the model "
                                 f"expects ({linear.weight.shape[1]},)")
    for name, param in floats.items():
        if state[name].shape != param.shape:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(state[name].shape)}, "
                                 f"the model expects {tuple(param.shape)}")
    for name, linear in linears.items():
        if state[f"{name}.qweight"].shape[0] != linear.weight.shape[0]:
            raise ModelLoadError(f"{source}: tensor {name}.qweight has {state[f'{name}.qweight'].shape[0]} rows, "
                                 f"the model expects {linear.weight.shape[0]}")
    try:
        Quantizer(model, method).convert_for_runtime(state)
    except (ValueError, TypeError, RuntimeError, IndexError) as e:
        raise ModelLoadError(f"{source}: the {method} tensors do not fit the model: {e}") from None
    for name, linear in linears.items():  # a row through each: codes or scales of the wrong size or
        # kind fail here, named, not in the first request (a hand-edited or mixed-up folder)
        quantized = model.get_submodule(name)
        try:
            out = quantized(torch.zeros(1, linear.weight.shape[1], dtype=quantized.dtype, device=linear.weight.device))
            if out.shape != (1, linear.weight.shape[0]):
                raise ValueError(f"it gives {out.shape[1]} outputs, the model expects {linear.weight.shape[0]}")
        except (ValueError, TypeError, RuntimeError, IndexError) as e:
            raise ModelLoadError(f"{source}: the {method} tensors of {name} do not fit the model: {e}") from None
