"""The OpenAPI 3.1 document of `kiln serve`, served at GET /openapi.json.

Request bodies are the pydantic models the server validates with (kiln.engine.openai_protocol),
so the document cannot drift from what is accepted; responses are the small models below,
written from what the handlers send. tests/test_fuzz_api.py fuzzes a real server against it."""
from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from kiln.engine.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                         LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from kiln.engine.responses_protocol import ResponseObject, ResponsesRequest

JSON, SSE, TEXT = "application/json", "text/event-stream", "text/plain"
FinishReason = Literal["stop", "length"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, OpenAI's shape."""
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0)  # of the prompt's tokens, those the prefix cache held


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int = Field(ge=1)
    decoded_token: str


class _VllmFields(BaseModel):
    """vLLM's additions to a choice: stop_reason (the stop string or stop token id that ended it,
    null for EOS and other finishes), and, only when asked for (return_token_ids, prompt_logprobs),
    the token fields: keyed by token id, one entry per prompt token, None for the first."""
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_VllmFields):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice] = Field(min_length=1)  # n per prompt, prompt by prompt
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    """Text, or (with tools) the calls and any text before them."""
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_VllmFields):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice] = Field(min_length=1)  # n of them
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(default=None, ge=1)  # once the model is loaded
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "dead"]
    error: str | None = None  # why the engine died


class Readiness(BaseModel):
    status: Literal["ready", "loading", "draining", "dead"]


class SleepState(BaseModel):
    is_sleeping: bool


class SleepChange(SleepState):
    seconds: float = Field(ge=0)  # what releasing or allocating the KV cache took


class Tokens(BaseModel):
    count: int = Field(ge=0)
    max_model_len: int = Field(ge=1)
    tokens: list[int]
    token_strs: list[str] | None  # with return_token_strs


class Detokenized(BaseModel):
    prompt: str


MODELS: list[type[BaseModel]] = [
    CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, ErrorResponse, Completion,
    ChatCompletion, ModelList, Tokens, Detokenized, Health, Readiness, SleepState, SleepChange,
    LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, ResponsesRequest, ResponseObject]


def ref(model: type[BaseModel] | str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model if isinstance(model, str) else model.__name__}"}


def response(description: str, model: type[BaseModel] | None = None, media: str = JSON) -> dict[str, Any]:
    """One documented response; a model's JSON, or text of `media` when there is none."""
    schema = ref(model) if model is not None else {"type": "string"}
    return {"description": description, "content": {media: {"schema": schema}}}


def error(description: str) -> dict[str, Any]:
    return response(description, ErrorResponse)


def retry_later(description: str) -> dict[str, Any]:
    """A 429: an error with a Retry-After (seconds)."""
    return {**error(description), "headers": {"Retry-After": {
        "description": "seconds to wait before retrying", "schema": {"type": "integer", "minimum": 0}}}}


_NOT_READY = error("the model is still loading, the server is draining, or the engine died")
_NOT_SERVED = error("no such model on this server (code model_not_found)")
_GENERATION_ERRORS = {
    "400": error("invalid request: a bad or unsupported parameter, a prompt too long for the context"),
    "404": _NOT_SERVED,
    "413": error("the request body is over 16 MiB"),
    "429": retry_later("too many requests or prompt tokens already wait for the engine, or the request's "
                       "LoRA adapter must be loaded again and requests hold every loaded one (--max-cpu-loras)"),
    "500": error("the engine failed while generating"),
    "503": _NOT_READY,
}


# One server-sent event (OpenAPI 3.1: a text/event-stream schema describes each event): `data`
# is a JSON chunk, or an error object once the status line is gone, and `[DONE]` last.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
    "data": {"anyOf": [{"const": "[DONE]"},
                       {"type": "string", "pattern": "^\\{", "contentMediaType": JSON}]}}}


def _with_body(summary: str, request: type[BaseModel], responses: dict[str, Any]) -> dict[str, Any]:
    """A POST whose JSON body is `request`; its operationId is the request's name."""
    return {"post": {"summary": summary, "operationId": request.__name__.removesuffix("Request"),
                     "requestBody": {"required": True, "content": {JSON: {"schema": ref(request)}}},
                     "responses": responses}}


def _generation(summary: str, request: type[BaseModel], answer: type[BaseModel],
                stream: str = "chunks ending with `data: [DONE]`") -> dict[str, Any]:
    ok = response(f"the whole answer; with stream=true, server-sent events of {answer.__name__} {stream}", answer)
    ok["content"][SSE] = {"schema": SSE_EVENT}
    return _with_body(summary, request, {"200": ok, **_GENERATION_ERRORS})


def get(summary: str, op_id: str, responses: dict[str, Any],
        parameters: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"get": {"summary": summary, "operationId": op_id, "responses": responses,
                    **({"parameters": list(parameters)} if parameters else {})}}


def post(summary: str, op_id: str, responses: dict[str, Any]) -> dict[str, Any]:
    return {"post": {"summary": summary, "operationId": op_id, "responses": responses}}


def _tokenizing(summary: str, request: type[BaseModel], answer: type[BaseModel]) -> dict[str, Any]:
    return _with_body(summary, request, {"200": response("the result", answer), **{
        status: _GENERATION_ERRORS[status] for status in ("400", "404", "413", "503")}})


def tokenizer_paths() -> dict[str, Any]:
    """vLLM's tokenizer endpoints, which a router passes through too (a new dict each call)."""
    return {"/tokenize": _tokenizing("Token ids of a prompt or a conversation", TokenizeRequest, Tokens),
            "/detokenize": _tokenizing("Text of token ids", DetokenizeRequest, Detokenized)}


def self_path() -> dict[str, Any]:
    return get("This document", "openapi", {
        "200": {"description": "OpenAPI 3.1", "content": {JSON: {"schema": {"type": "object"}}}}})


def v1_paths() -> dict[str, Any]:
    """The OpenAI-compatible operations, which a router passes through as they are (a new dict
    each call: callers extend it)."""
    return {
        "/v1/completions": _generation("Complete a prompt", CompletionRequest, Completion),
        "/v1/chat/completions": _generation("Answer a conversation", ChatCompletionRequest, ChatCompletion),
        "/v1/responses": _generation("Answer input items (OpenAI's Responses API)", ResponsesRequest, ResponseObject,
                                     "events, `event:` naming each, response.completed (or .incomplete) last"),
        "/v1/models": get("The served model", "listModels", {"200": response("the served model", ModelList)}),
        "/v1/models/{model}": get("One served model (the base model or a LoRA adapter) by its id", "retrieveModel",
                                  {"200": response("the model's card", ModelCard), "404": _NOT_SERVED},
                                  [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]),
    }


def document(title: str, paths: dict[str, Any], extra_models: Sequence[type[BaseModel]] = ()) -> dict[str, Any]:
    """An OpenAPI 3.1 document whose components are MODELS' (and `extra_models'`) JSON schemas."""
    _, schemas = models_json_schema([(m, "validation") for m in [*MODELS, *extra_models]],
                                    ref_template="#/components/schemas/{model}")
    return {"openapi": "3.1.0", "info": {"title": title, "version": "1"}, "paths": paths,
            "components": {"schemas": schemas["$defs"]}}


@functools.cache
def engine_document() -> dict[str, Any]:
    return document("kiln serve", {
        **v1_paths(),
        **tokenizer_paths(),
        "/health": get("Liveness: answers while weights load", "health", {
            "200": response("alive", Health), "503": response("the engine died", Health)}),
        "/ready": get("Readiness: the model is loaded and warmed up", "ready", {
            "200": response("ready", Readiness), "503": response("loading or draining", Readiness)}),
        "/metrics": get("Prometheus metrics", "metrics", {"200": response("the exposition", media=TEXT)}),
        "/sleep": post("Release the KV cache until woken (a warm-pool standby)", "sleep", {
            "200": response("asleep", SleepChange), "409": error("requests are in flight (code busy)"),
            "503": _NOT_READY}),
        "/wake_up": post("Allocate the KV cache again", "wakeUp", {
            "200": response("awake", SleepChange), "503": _NOT_READY}),
        "/is_sleeping": get("Whether the KV cache is released", "isSleeping", {
            "200": response("the state", SleepState), "503": _NOT_READY}),
        "/v1/load_lora_adapter": _lora("Load a LoRA adapter (a PEFT folder), served under its name",
                                       LoadLoRAAdapterRequest, "400", "a bad adapter or name, or LoRA not enabled",
                                       "429", "requests hold every loaded adapter (--max-cpu-loras)"),
        "/v1/unload_lora_adapter": _lora("Unload a LoRA adapter (requests already using it finish with it)",
                                         UnloadLoRAAdapterRequest, "404", "no adapter of that name"),
        "/openapi.json": self_path(),
    })


def _lora(summary: str, request: type[BaseModel], *errors: str) -> dict[str, Any]:
    """vLLM's adapter endpoints: a line of text on success; `errors`: status, description pairs."""
    statuses = {"400": "a bad request body, or LoRA not enabled (--enable-lora)",
                **dict(zip(errors[::2], errors[1::2]))}
    return _with_body(summary, request, {"200": response("done", media=TEXT),
                                         **{code: (retry_later if code == "429" else error)(why)
                                            for code, why in statuses.items()},
                                         "413": _GENERATION_ERRORS["413"], "503": _NOT_READY})


def handler(document: Callable[[], dict[str, Any]]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The GET /openapi.json route for `document`, built once."""
    body = document()

    async def openapi_json(request: web.Request) -> web.Response:
        return web.json_response(body)
    return openapi_json
