"""Kiln's inference engine: paged KV cache, continuous batching, Llama-family models.

Exports resolve on first use (PEP 562), so `kiln generate --help` and bad-input errors answer
without importing torch."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Config": "kiln.engine.config",
    "LLM": "kiln.engine.llm",
    "LLMEngine": "kiln.engine.llm_engine",
    "RequestOutput": "kiln.engine.llm_engine",
    "EngineStats": "kiln.engine.llm_engine",
    "SamplingParams": "kiln.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
