"""How one request wants its tokens chosen and when it wants to stop."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Beyond this many alternatives per token the response gets huge for no use (OpenAI caps at 20).
MAX_LOGPROBS = 20
# A seed seeds a torch.Generator, which takes an int64.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Below this temperature sampling is greedy (vLLM's epsilon): dividing logits by a temperature
# near 0 overflows them to inf, and the softmax of inf is NaN, which drew token 0 every time.
GREEDY_BELOW = 1e-5

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputs:
    """What the output must follow (vLLM's StructuredOutputsParams; kiln.engine.structured_output
    enforces it), exactly one of: json, a JSON schema (a dict, or its JSON text); regex, a regular
    expression the whole output matches; choice, the output is one of these strings; grammar, a
    Lark grammar in llguidance's dialect (`start: ...`); json_object, any JSON object.
    disable_any_whitespace: JSON without whitespace between its tokens (vLLM's option); by
    default JSON may be spaced and indented as the model likes."""
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if len(self.kinds) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                             f"{', '.join(self.kinds) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured outputs: choice must be a list of non-empty strings, got {self.choice!r}")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs: {kind} must be a non-empty string, got {value!r}")

    @property
    def kinds(self) -> list[str]:
        return [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context ends (max_model_len), as vLLM takes it
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # vLLM's: no stop (EOS, stop token or stop string) before this many tokens; EOS and the stop
    # tokens are not drawn until then.
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text
    skip_special_tokens: bool = True  # False: special tokens' text (e.g. <|im_end|>) is in the output
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    # Score the prompt itself: each prompt token's logprob and rank, plus this many top
    # alternatives per position (0: the prompt token alone). See kiln.engine.prompt_logprobs.
    prompt_logprobs: int | None = None
    # Prefix-cache isolation: blocks are shared only between requests with the same salt.
    cache_salt: str | None = None
    # OpenAI's logit_bias: token id -> a number in [-100, 100] added to its logit before choosing
    # (greedy too) and, as vLLM, before the penalties; -100 all but bans a token, 100 all but
    # forces it. Logprobs stay the model's.
    logit_bias: dict[int, float] | None = None
    # The output follows a JSON schema, regex, choice or grammar (kiln.engine.structured_output).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1 and _is_int(self.top_k):  # vLLM's "off", its old default: scripts pass it
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed range."""
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or math.inf):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        # NaN passes every comparison (`nan < 0` is False): it sampled from NaN probabilities.
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.logit_bias is not None and any(
            not _is_int(t) or t < 0 or not -100.0 <= b <= 100.0
            for t, b in self.logit_bias.items()
        ):
            raise ValueError(f"logit_bias maps token ids (>= 0) to numbers in [-100, 100], got {self.logit_bias!r}")
        if self.stop_token_ids is not None and any(
            not _is_int(t) or t < 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got {self.structured_outputs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


def _is_int(x: object) -> bool:
    """An int that is not a bool (True is an int to Python, and would pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)
