"""The Responses API's request (POST /v1/responses, kiln.engine.responses_api), and the
response's documented shape: pydantic models alone, so the OpenAPI documents (the router's too)
need nothing of the engine."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from kiln.engine.openai_protocol import FunctionDefinition, _Request


class FunctionTool(FunctionDefinition):
    """A chat tool's function, flattened into the tool as the Responses API writes it."""
    type: Literal["function"]


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")  # "schema" is BaseModel's
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    # [] too: the Agents SDK sends it for an agent without tools (OpenAI takes it), as no tools
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    # Extra output to include: none of it exists here (no reasoning items, no built-in tools),
    # so only what would be empty anyway is accepted (the Agents SDK may send it).
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None  # billing: one tier here
    # vLLM's prefix-cache salt, which the router sets per tenant (kiln.router.auth)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class OutputItem(BaseModel):
    """A `message` (content: output_text parts) or a `function_call` (call_id, name, arguments)."""
    id: str
    type: Literal["message", "function_call"]
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(BaseModel):
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]  # failed: a stream's response.failed
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
