"""Kiln's inference engine: paged KV cache, continuous batching, Llama-family models."""
from kiln.engine.config import Config
from kiln.engine.llm_engine import LLM, EngineStats, LLMEngine, RequestOutput
from kiln.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "Config", "RequestOutput", "EngineStats"]
