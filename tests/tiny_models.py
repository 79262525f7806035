"""Tiny random Llama-family models in the Hugging Face layout, for tests that need a model fast
(tests/ through conftest's tiny_hf_models; e2e/ writes one for a hostpath:// source)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

TINY_HF_CONFIGS = {
    # llama3 rope scaling, untied head, GQA 4:2
    "llama": ("LlamaForCausalLM", dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=2)),
    # q/k/v biases, tied embeddings, GQA 4:1
    "qwen2": ("Qwen2ForCausalLM", dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=1e6, bos_token_id=1, eos_token_id=2)),
}


def write_tiny_model(kind: str, folder: Path, **overrides) -> Path:
    """Write TINY_HF_CONFIGS[kind] (config fields changed by overrides) with random weights (seed 0:
    the same model every time) by transformers' save_pretrained, with a word-level tokenizer.json
    ("w0".."w92") and a chat template, into folder; returns it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    arch, kwargs = TINY_HF_CONFIGS[kind]
    # A copy: transformers' config writes into the dicts it is given (rope_theta into rope_scaling),
    # which changed every later model of this kind.
    kwargs = copy.deepcopy({**kwargs, **overrides})
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(93)]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config_cls(**kwargs))
    with torch.no_grad():  # random everything, biases and norms included, so each one is tested
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "bos_token": "<s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant{% endif %}"}))
    return folder
