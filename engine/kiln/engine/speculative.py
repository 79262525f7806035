"""Speculative decoding: n-gram prompt lookup, as vLLM's `{"method": "ngram"}` (here), or a
draft model, `{"method": "draft_model", "model": ...}` (kiln.engine.draft_model).

A decoding sequence whose last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
occurred earlier in its own text guesses that what followed then follows again: up to
num_speculative_tokens draft tokens, appended to it for one step. That step runs the drafts
like a short prefill and samples at every position; the engine keeps the drafts the model
agrees with plus the model's own next token, so one forward yields 1 to k + 1 tokens and the
output is exactly what plain decoding gives. Repetitive text (code edits, extraction, quoting
the prompt) gains most; a weight-bound decode step costs about the same for k + 1 tokens.

A greedy row agrees when the draft is its argmax; a sampled row accepts the draft with the
probability the model gives it and otherwise draws from the rest (kiln.engine.sampler), so
sampled output is distributed exactly as without speculation. Requests with penalties decode
as before in the same batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from kiln.engine.sequence import Sequence


METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    # draft_model: the draft (a name, folder or .gguf, as --model takes; the same vocabulary as the
    # target), and the quantization it runs with (the target's dtype; "none" by default).
    model: str | None = None
    quantization: str = "none"
    # Neither given: 4 and 2; one given: the other takes its value (vLLM's rule).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # No drafts while more sequences than this run (vLLM's name): a busy batch is compute-bound,
    # where checking drafts costs more than it saves. None: always.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        high, low = self.prompt_lookup_max, self.prompt_lookup_min
        if high is None and low is None:
            high, low = 4, 2
        object.__setattr__(self, "prompt_lookup_max", low if high is None else high)
        object.__setattr__(self, "prompt_lookup_min", high if low is None else low)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is None and name == "disable_by_batch_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative config: {name} must be a positive integer, got {value!r}")
        if self.method not in METHODS:
            raise ValueError(f"speculative config: method {self.method!r} is not supported "
                             f"({', '.join(map(repr, METHODS))})")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative config: model must be the draft's name, folder or .gguf, got {self.model!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative config: method 'draft_model' takes a model (the draft), and only it does")
        from kiln.engine.config import QUANTIZATION_METHODS  # here: config.py imports this module
        if self.quantization not in QUANTIZATION_METHODS or (self.method == "ngram" and self.quantization != "none"):
            # refused before the server listens, not once the target has loaded (minutes, on a large one)
            raise ValueError(f"speculative config: quantization {self.quantization!r} is not one of "
                             f"{', '.join(QUANTIZATION_METHODS)}" + (" (the draft model's; ngram has none)"
                                                                     if self.method == "ngram" else ""))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) is more than "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """vLLM's --speculative-config: '{"method": "ngram", "num_speculative_tokens": 4, ...}' or
        '{"model": "<draft>", "num_speculative_tokens": 4}'."""
        try:
            fields = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested past Python's limit
            raise ValueError(f"speculative config is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError("speculative config must be a JSON object")
        # vLLM's rule: a config that names a model means a draft model.
        fields.setdefault("method", "draft_model" if "model" in fields else "ngram")
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative config: unknown field(s) {', '.join(unknown)}")
        return cls(**fields)


def propose(token_ids: list[int], config: SpeculativeConfig, room: int) -> list[int]:
    """Up to min(room, k) tokens that followed the latest earlier occurrence of the longest
    suffix n-gram (n in [prompt_lookup_min, prompt_lookup_max]); [] when none recurs."""
    k = min(room, config.num_speculative_tokens)
    if k < 1 or len(token_ids) <= config.prompt_lookup_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1), config.prompt_lookup_min - 1, -1):
        # Windows that start early enough to have a token after them, compared with the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start:start + k]
    return []


def may_speculate(seq: Sequence) -> bool:
    """Decoding (one token to run), unpenalized (a penalty would differ row by row with the
    drafts before it) and past min_tokens."""
    return seq.num_pending_tokens == 1 and not seq.params.penalized and seq.may_stop
