"""The two configurations: `Config` (how to run, chosen by the user) and `ModelConfig`
(what the model is, read from its files)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any

import torch

from kiln.engine.dtype_choice import auto_dtype, describe_dtype, host_cpu_flags
from kiln.engine.kernels.backend import BACKENDS, resolve_backend_name
from kiln.engine.kv_quant import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from kiln.engine.speculative import SpeculativeConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_MODEL_LEN_CAP = 8192
# Weight-only quantization at load (kiln.engine.quantization); int8, int4, fp8 AWQ-scaled, "int4-rtn" plain.
QUANTIZATION_METHODS = ("none", "int8", "int4", "int4-rtn", "fp8")
GENERATION_CONFIG = "generation_config.json"  # a model folder's eos ids and sampling defaults
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights, as vLLM's --load-format dummy
CPU_KV_CACHE_MEMORY = 1 << 30  # the CPU's default KV budget (no free-memory query to size it by)


class ModelLoadError(ValueError):
    """A model that cannot be loaded: missing file, unsupported architecture, corrupt tensor."""


@dataclass
class Config:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # KV cache bytes; None: on CUDA what gpu_memory_utilization leaves once the weights and a
    # max-size step's activations are counted (model_runner.gpu_kv_budget), on CPU 1 GiB.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9  # the share of the GPU's memory this engine may take
    # CUDA graphs replay decode steps (Triton backend on CUDA); True runs every step eagerly.
    enforce_eager: bool = False
    load_format: str = "auto"  # "dummy": random weights, no weight files read (benchmarks)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    device: str = "auto"
    seed: int = 0
    quantization: str = "none"
    # With quantization "none", whether a GGUF's Q8_0/Q4_0/Q4_1 projections are dequantized on load
    # (True) or served packed, as stored (False). None: packed where a packed matmul exists (CUDA,
    # bfloat16/float16 on the CPU); float32 on the CPU dequantizes, since dequantizing per matmul
    # there made decode ~8x slower.
    gguf_dequantize: bool | None = None
    kv_cache_dtype: str = "auto"  # "auto" = the model's dtype; "int8" / "fp8" halve the KV cache (kv_quant.py)
    # Where quantized variants are cached (kiln.engine.variants): None = $KILN_CACHE/variants
    # (~/.cache/kiln/variants), "off" = never cached, else a directory.
    quantization_cache: str | None = None
    # Ranks the model is split over (kiln.engine.tensor_parallel): 1 = one process, no collectives.
    tensor_parallel_size: int = 1
    # N-gram speculative decoding (kiln.engine.speculative); None: off.
    speculative: SpeculativeConfig | None = None
    # LoRA adapters (kiln.engine.lora), as vLLM's --enable-lora: the most distinct adapters one
    # batch mixes (requests of others wait), and the largest rank an adapter may have.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # The most adapters loaded at once (vLLM's --max-cpu-loras; kiln.engine.lora_cache); None:
    # max(max_loras, 8), see lora_capacity.
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) loaded at start
    chat_template: str | None = None  # a Jinja chat template replacing the model's (vLLM's --chat-template)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty name or path")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory",
                     "tensor_parallel_size", "max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if name in ("kv_cache_memory", "max_cpu_loras") and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        for name in ("enforce_eager", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"chat_template must be the template's text, got {self.chat_template!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:  # vLLM's rule too
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                             "a batch's adapters are all loaded")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules (--lora-modules) need enable_lora (--enable-lora)")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.device != "auto":
            try:
                device = torch.device(self.device)
            except RuntimeError as e:
                raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
            # Said now, not as a driver's traceback once loading has begun.
            if device.type == "cuda" and torch.cuda.device_count() == 0:
                raise ValueError(f"device {self.device!r}: this process sees no CUDA device (torch {torch.__version__} "
                                 f"is built for CUDA {torch.version.cuda}: it needs an NVIDIA driver that supports "
                                 "that and a container runtime that exposes the GPU)")
            if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        # Each rank's profile forward (the GPU pool's sizing) would wait on collectives the others
        # are not running yet.
        if self.tensor_parallel_size > 1 and self.kv_cache_memory is None and self.torch_device.type == "cuda":
            raise ValueError("tensor parallelism on CUDA needs kv_cache_memory (per rank): the pool is not sized "
                             "from free GPU memory across ranks")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"unknown quantization method {self.quantization!r}; "
                             f"choose one of {', '.join(QUANTIZATION_METHODS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization_cache is not None and (not isinstance(self.quantization_cache, str)
                                                    or not self.quantization_cache):
            raise ValueError(f"quantization_cache must be a directory or 'off', got {self.quantization_cache!r}")
        if not 0 <= self.seed <= 2**63 - 1:  # it seeds a torch.Generator (an int64 here, as a request's)
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig or None, got {self.speculative!r}")

    @property
    def lora_capacity(self) -> int:
        """max_cpu_loras, by default max_loras but at least 8: requests of a few adapters more than a
        batch mixes may wait at once (a waiting request holds its adapter loaded)."""
        return self.max_cpu_loras or max(self.max_loras, 8)

    @property
    def keeps_gguf_packed(self) -> bool:
        if self.quantization != "none" or self.gguf_dequantize:
            return False
        if self.gguf_dequantize is False:
            return True
        return self.torch_device.type == "cuda" or self.torch_dtype != torch.float32

    @property
    def gguf_packed_types(self) -> tuple[str, ...]:
        """The GGUF types whose decoder projections are served packed. On the CPU Q8_0 is not,
        unless asked (gguf_dequantize=False): its per-block scales have no packed CPU matmul, and
        dequantizing at every matmul made a decode row 5-10x slower than the float weight made once."""
        if not self.keeps_gguf_packed:
            return ()
        if self.torch_device.type == "cpu" and self.gguf_dequantize is None:
            return ("Q4_0", "Q4_1")
        return ("Q8_0", "Q4_0", "Q4_1")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        # auto: bf16 where it is fast (CUDA; CPUs with AVX512_BF16 or AMX), else float32 (dtype_choice).
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        device_type = self.torch_device.type
        return auto_dtype(device_type, host_cpu_flags() if device_type == "cpu" else ())

    @property
    def dtype_reason(self) -> str:
        """The dtype and why, for the start-up log."""
        return describe_dtype(self.dtype, self.torch_dtype, self.torch_device.type, host_cpu_flags())

    @property
    def resolved_attention_backend(self) -> str:
        # The engine's one backend (attention, norm, RoPE): "auto" -> triton on CUDA, the fused C++
        # op on CPU where it builds (else torch); a clear error for triton without CUDA or "cpu"
        # without a CPU or a build.
        return resolve_backend_name(self.attention_backend, self.torch_device)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        # A clear error where fp8 cannot run (no float8 in torch, or Triton on a pre-Ada GPU).
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype, self.torch_device,
                                      self.resolved_attention_backend)


# The sizes a model is built from: a string or 0 there failed deep inside torch.
POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2; Llama with attention_bias)
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    o_proj_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not

    def __post_init__(self) -> None:
        # Whichever file they came from (config.json, GGUF metadata): a bad value is named here,
        # not met later as a division by zero, a cast error or NaN logits.
        for name in POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            _positive_number(name, getattr(self, name))
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, self.head_dim)
        if not isinstance(self.tie_word_embeddings, bool):
            raise ModelLoadError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")


# What each rope_scaling type reads (kiln.engine.llama.rope_inv_freq), all positive numbers.
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _positive_number(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ModelLoadError(f"{name} must be a positive number, got {value!r}")


def _check_rope_scaling(scaling: Any, head_dim: int) -> None:
    """A KeyError, a TypeError or NaN frequencies (llama3 divides by high - low) otherwise."""
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: a divisor per frequency
        factors = scaling.get("factors")
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise ModelLoadError(f"rope_freqs must hold head_dim / 2 = {head_dim // 2} factors")
        for factor in factors:
            _positive_number("a rope_freqs factor", factor)
        return
    if kind not in ROPE_SCALING_KEYS:
        raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    for key in ROPE_SCALING_KEYS[kind]:
        _positive_number(f"rope_scaling.{key}", scaling.get(key))
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelLoadError(f"rope_scaling: high_freq_factor ({scaling['high_freq_factor']}) must be greater than "
                             f"low_freq_factor ({scaling['low_freq_factor']})")


def layer_count(names: Iterable[str], prefix: str) -> int | None:
    """1 + the highest N of the tensor names `prefix`N..., None if there is none (the HF folder's
    and the GGUF file's layers, checked against their configs before a model is built)."""
    numbers = [name[len(prefix):].split(".")[0] for name in names if name.startswith(prefix)]
    found = [int(n) for n in numbers if n.isascii() and n.isdigit()]  # "²" is a digit to isdigit(), not to int()
    return max(found) + 1 if found else None


def resolve_max_model_len(config: Config, model_config: ModelConfig) -> int:
    """The context length to run with: the user's choice, else the model's (capped)."""
    model_max = model_config.max_position_embeddings
    if config.max_model_len is None:
        return min(model_max, DEFAULT_MAX_MODEL_LEN_CAP)
    if config.max_model_len > model_max:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's maximum of {model_max}")
    return config.max_model_len
