"""LoRA adapters for tests: PEFT folders with random weights for a Llama-family model, and the
reference meaning of one (its update merged into a transformers model's weights)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# SmolLM2-135M's shapes, for adapters written without loading the model
SMOLLM2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                          num_hidden_layers=30)


def projection_shape(hf_config, projection: str) -> tuple[int, int]:
    """(out, in) of a projection of a Llama-family model."""
    hidden, heads, kv_heads = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim, inter = hidden // heads, hf_config.intermediate_size
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}[projection]


def write_adapter(folder: Path, hf_config, seed: int, rank: int = 8, alpha: float = 16,
                  targets: tuple[str, ...] = tuple(PROJECTIONS), layers: range | None = None,
                  **config: object) -> dict[str, torch.Tensor]:
    """A PEFT LoRA folder with random A and B (large enough to change greedy text); its tensors."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers if layers is not None else range(hf_config.num_hidden_layers):
        for projection in targets:
            out, inp = projection_shape(hf_config, projection)
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[projection]}.{projection}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.03
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
         **config}))
    return tensors


def merged_into(hf_model, tensors: dict[str, torch.Tensor], scale: float) -> None:
    """Add scale * B A into the HF model's weights: what the adapter means."""
    modules = dict(hf_model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith("lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace("lora_A", "lora_B")]
                modules[name].weight += scale * (b @ a)


def make_one_tensor_integer(folder: Path) -> str:
    """Rewrite one tensor of the folder's adapter as int8 (PEFT never writes one); its name."""
    tensors_file = folder / "adapter_model.safetensors"
    tensors = load_file(str(tensors_file))
    key = "base_model.model.model.layers.2.self_attn.o_proj.lora_B.weight"
    tensors[key] = (tensors[key] * 100).round().to(torch.int8)
    save_file(tensors, str(tensors_file))
    return key
