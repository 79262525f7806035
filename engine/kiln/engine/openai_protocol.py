"""OpenAI-compatible request validation and response shapes for `kiln serve`.

Requests are pydantic models that forbid unknown fields, so a parameter Kiln does not
implement is a clear 400 rather than something silently ignored. They are also the request
schemas of the OpenAPI document (kiln.engine.openapi): where code checks a field (a validator,
prompts), its json_schema says what that code accepts, so generated clients and fuzzers
see the real contract."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from kiln.engine.api_errors import APIError
from kiln.engine.sampling_params import SamplingParams, StructuredOutputs

MAX_TOP_LOGPROBS = 20
# Integers that reach torch (seed, top_k) must fit its int64; larger ones overflowed inside the
# engine loop, which killed the engine (found while fuzzing the API: tests/test_fuzz_api.py).
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_CHOICES = 128  # n's bound in the schema; the server also bounds prompts x n by what it holds at once
# JSON numbers only: no NaN or Infinity, which no field means (a penalty of Infinity made NaN logits).
STRICT_NUMBERS = ConfigDict(extra="forbid", allow_inf_nan=False)

# A token id as a JSON object key (keys are strings), as OpenAI's logit_bias takes it.
_TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_TEXT = {"type": "string", "minLength": 1}
# What prompts() accepts: one prompt, as text or token ids, or a batch of either.
_PROMPT_SCHEMA = {"anyOf": [_TEXT, _TOKEN_IDS, {"type": "array", "items": _TEXT, "minItems": 1},
                            {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]}
# OpenAI takes 4 stop strings, vLLM any number; evaluation harnesses send a task's whole list
# (lm-eval's `until`). A bound keeps each step's search over the text bounded.
MAX_STOPS = 32
_STOP_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": MAX_STOPS}, {"type": "null"}],
                "default": None}
# What ChatMessage.text accepts: a string or text parts.
_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"]}}]}


def _nullable_optionals(schema: dict[str, Any]) -> None:
    """The document's side of _null_means_default: every optional field also takes null."""
    required = set(schema.get("required", ()))
    for name, prop in schema["properties"].items():
        if name in required or prop.get("type") == "null" or {"type": "null"} in prop.get("anyOf", ()):
            continue
        outer = {key: prop.pop(key) for key in ("default", "title") if key in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **outer}


class _Request(BaseModel):
    """A request body: unknown fields refused, JSON numbers only, null for "not set"."""
    model_config = ConfigDict(**STRICT_NUMBERS, json_schema_extra=_nullable_optionals)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's spec makes the optional fields nullable and SDKs send null for "not set"
        # (`"temperature": null`, `"n": null`); vLLM takes it as the default, Kiln answered 400.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Request):
    include_usage: bool = True  # vLLM's default: stream_options given at all asks for the usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far on every chunk

    @model_validator(mode="before")  # runs before _Request's, which would make null the default (True)
    @classmethod
    def _null_usage_is_none(cls, data: Any) -> Any:
        # vLLM keeps an explicit null, which asks for no usage; left out, the default above holds.
        if isinstance(data, dict) and "include_usage" in data and data["include_usage"] is None:
            return {**data, "include_usage": False}
        return data


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs`: exactly one constraint (kiln.engine.structured_output)."""
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")  # "json" is BaseModel's
    regex: str | None = Field(default=None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)  # Lark, llguidance's dialect
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsRequest:
        self.params()  # its ValueError becomes this field's 400
        return self

    def params(self) -> StructuredOutputs:
        return StructuredOutputs(json=self.json_schema, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                 json_object=bool(self.json_object), disable_any_whitespace=self.disable_any_whitespace)


class JSONSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" is BaseModel's name. OpenAI's schema is optional: left out, any JSON object.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema


class ResponseFormat(_Request):
    """OpenAI's response_format: plain text, any JSON object, or JSON following a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def params(self) -> StructuredOutputs | None:
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.json_schema is None:
            return StructuredOutputs(json_object=True)
        return StructuredOutputs(json=self.json_schema.json_schema)


class _SamplingFields(_Request):
    """Fields shared by both endpoints; the extensions (top_k, min_p, ...) follow vLLM's names."""

    model: str | None = None  # optional, as in vLLM: this server's one model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT64_MAX)  # -1 and 0 both mean "off"
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = None
    # As many as logit_bias takes: each choice builds a set of them and the sampler walks it every
    # step while min_tokens holds (two million ids cost seconds of the engine a choice, and GiBs).
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(default=None, max_length=2048)
    ignore_eos: bool = False
    # vLLM's extensions: no stop before min_tokens; the stop string kept in the text; special
    # tokens' text (e.g. the chat template's end-of-turn) written out.
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[_TokenKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(default=None, max_length=2048)
    # vLLM's extension: the choice also carries prompt_token_ids (what the engine ran) and token_ids.
    return_token_ids: bool = False
    # vLLM's extension: requests share cached prefix blocks only with requests of the same salt
    # (the router sets one per API key, so tenants cannot time each other's prompts).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Choices per prompt, each its own engine request (a seed gives choice j seed + j).
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    # The output follows a JSON schema, regex, choice or grammar: OpenAI's or vLLM's way of saying so.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI and vLLM: options for a stream that is not one are a mistake, not ignored.
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return options

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS or not all(stops):  # "" too: it was a 400 naming no param, from SamplingParams
            raise ValueError(f"stop takes at most {MAX_STOPS} non-empty strings")
        return stop

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={self.min_tokens} is more than the {max_tokens} tokens this request "
                                "may generate (max_tokens, or what the context leaves)", param="min_tokens")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        structured = self.structured_outputs.params() if self.structured_outputs is not None else \
            self.response_format.params() if self.response_format is not None else None
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, stop=stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, cache_salt=self.cache_salt,
            logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
            structured_outputs=structured)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], WithJsonSchema(_PROMPT_SCHEMA)]
    # 0 with echo: the prompt alone, scored (OpenAI's legacy and vLLM's way to get its logprobs).
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's extension (completions only): score every prompt token, with this many alternatives.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # The prompt's text before the completion's (and, with logprobs, its tokens' logprobs first:
    # the first token has none), as OpenAI's legacy completions and vLLM answer it.
    echo: bool = False
    best_of: Literal[1] | None = None
    suffix: None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (a list of strings or of token id lists)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if not all(batch):
            raise APIError(400, "prompt must not be empty" if len(batch) == 1 else
                           "prompt: every prompt of a batch must be non-empty", param="prompt")
        return batch


class ChatMessage(_Request):
    # A _Request for null's sake: the openai SDK's message.model_dump() of an answer carries
    # "refusal", "audio", "function_call" and "annotations" as null, sent back as the next turn.
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # null only for an assistant's turn that called tools (OpenAI's shape)
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(_CONTENT_SCHEMA)] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as a response gave them
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="after")
    def _content_unless_calling(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "\n".join(parts)  # as vLLM gives a text-only template list content


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as a chat template takes them (tool calls and call ids where a message has them)."""
    # "developer" is OpenAI's newer name for the system role; model templates know "system".
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
             **({"tool_calls": [_with_arguments_object(c) for c in m.tool_calls]} if m.tool_calls is not None else {}),
             **({"tool_call_id": m.tool_call_id} if m.tool_call_id is not None else {}),
             **({"name": m.name} if m.name is not None else {})}  # templates that name speakers read it
            for m in messages]


def _with_arguments_object(call: dict[str, Any]) -> dict[str, Any]:
    """A call as templates take it: OpenAI sends `arguments` as a JSON string, the models' templates
    write `arguments | tojson` (an object, as transformers and vLLM give them). Text that is no JSON
    object stays as it was."""
    function = call.get("function")
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):  # nested past the parser's depth: no object either
        return call
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # calls always follow the schema


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: _FunctionName


class _TemplateFields(BaseModel):
    """How the conversation goes through the chat template (vLLM's names and rule)."""
    add_generation_prompt: bool = True  # open the assistant's turn after the messages
    # Leave the final message open: the model continues it (e.g. an assistant reply begun for it).
    continue_final_message: bool = False
    # More variables for the template (vLLM's; e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _not_both(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message needs add_generation_prompt: false (a final message "
                             "cannot be continued in a new turn)")
        return value


class ChatCompletionRequest(_SamplingFields, _TemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Functions the model may call (kiln.engine.tool_calls): "required" or a named one is enforced
    # with structured outputs; "auto" needs a model-specific parser, which Kiln does not have.
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's, accepted and not used: one tier here, and no completion is kept.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None

    @field_validator("store")
    @classmethod
    def _not_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError("this server keeps no completions: leave store out or send false")
        return store

    def template_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request, _TemplateFields):
    """vLLM's POST /tokenize: a prompt, or messages through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # Default: a prompt gets the tokenizer's special tokens, messages none (their template writes them).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=128)  # as the template writes them

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Request):
    """vLLM's POST /detokenize."""
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter."""
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # replace a loaded adapter of that name (requests already using it keep the old)


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter."""
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; names are unique here, so it is taken and not needed
