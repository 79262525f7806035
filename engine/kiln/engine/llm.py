"""Offline generation over an LLMEngine, as vLLM's `LLM`: prompts in, final outputs back in order."""
from __future__ import annotations

import itertools
from typing import Any

from kiln.engine.config import Config
from kiln.engine.llm_engine import LLMEngine, RequestOutput
from kiln.engine.loader import resolve_model_path
from kiln.engine.sampling_defaults import sampling_defaults
from kiln.engine.sampling_params import SamplingParams


class LLM:
    """Offline generation: `LLM().generate(["Hello"], SamplingParams(temperature=0))`."""

    def __init__(self, model: str = "smollm2-135m", generation_config: str = "auto", **config_kwargs: Any):
        """generation_config: where generate() without params takes its defaults, as `kiln serve
        --generation-config` (the model's generation_config.json, 'vllm' for SamplingParams')."""
        self.engine = LLMEngine(Config(model=model, **config_kwargs))
        self.tokenizer = self.engine.tokenizer
        self.default_params = SamplingParams(**sampling_defaults(generation_config, resolve_model_path(model)))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop a tensor-parallel engine's worker ranks (at exit otherwise): a process runs one
        tensor-parallel engine at a time. Safe to call again; nothing to stop at one rank."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter (needs enable_lora=True) that generate(lora=name) runs with."""
        self.engine.add_lora(name, path)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora: str | None = None,
    ) -> list[RequestOutput]:
        """Final outputs, in input order; lora: an adapter added with add_lora, for every prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or self.default_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        final: dict[str, RequestOutput] = {}
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, p, lora)
            while len(final) < len(ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests unfinished")
                for output in self.engine.step():
                    if output.finished:
                        final[output.request_id] = output
        finally:
            # A bad prompt, an error in a step or a Ctrl-C: nothing of this call is left in the
            # engine for the next call to meet.
            for request_id in ids:
                if request_id not in final:
                    self.engine.abort_request(request_id)
        return [final[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora: str | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        # The template wrote the special tokens: a tokenizer that adds BOS would double it.
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c, add_generation_prompt=True),
                                         add_special_tokens=False) for c in conversations]
        return self.generate(prompts, params, lora)
