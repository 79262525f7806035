"""Function calling on /v1/chat/completions: `tools` and a `tool_choice` that says a call must
come ("required") or which function it calls (a named choice), as vLLM serves them without a
model-specific parser: the output is constrained with structured outputs to the calls' JSON, so
it always parses (unless max_tokens cuts it), and is answered as the message's `tool_calls`.

"auto", the model deciding between text and a call, needs a parser that knows how the model
writes a call (vLLM's --tool-call-parser); Kiln has none yet, so it is a 400 that says what to
send instead, as vLLM answers without --enable-auto-tool-choice. "none" passes the tools to the
chat template and lets the model answer in text."""
from __future__ import annotations

import json
import uuid
from typing import Any

from kiln.engine.openai_protocol import APIError, ChatCompletionRequest, NamedToolChoice
from kiln.engine.sampling_params import StructuredOutputs


class ToolCalls:
    """What one request's calls must look like, and how its output becomes `tool_calls`."""

    def __init__(self, req: ChatCompletionRequest) -> None:
        choice = req.tool_choice
        self.named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self.parameters = {t.function.name: t.function.parameters or {"type": "object"} for t in req.tools}
        self.parallel = req.parallel_tool_calls
        if self.named is not None and self.named not in self.parameters:
            raise APIError(400, f"tool_choice names the function {self.named!r}, which is not among the tools "
                                f"({', '.join(self.parameters)})", param="tool_choice")

    def structured_outputs(self) -> StructuredOutputs:
        """A named call's arguments object, or "required"'s array of calls (vLLM's shape: each item
        a tool's name and its parameters; one item unless parallel_tool_calls)."""
        if self.named is not None:
            return StructuredOutputs(json=self.parameters[self.named])
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, schema in self.parameters.items()]}}
        return StructuredOutputs(json={**calls, "maxItems": 1} if not self.parallel else calls)

    def message(self, text: str, finish_reason: str | None, streamed: bool = False) -> tuple[dict[str, Any], str | None]:
        """The message's fields for this output, and the finish reason to answer: "tool_calls"
        for "required" (OpenAI's), the engine's own for a named call (as OpenAI answers a forced
        one). An output cut short keeps its text as content and makes no call, except a named
        call, whose arguments are the text whatever it holds."""
        if self.named is not None:
            calls = [(self.named, text)]
        else:
            try:
                calls = [(call["name"], json.dumps(call["parameters"])) for call in json.loads(text)]
            except ValueError:  # cut short by max_tokens
                return {"content": text}, finish_reason
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
        if streamed:  # a stream's calls carry their place, as OpenAI's chunks do
            tool_calls = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        return {"content": None, "tool_calls": tool_calls}, finish_reason


def tool_calls(req: ChatCompletionRequest) -> ToolCalls | None:
    """The request's calls, None where it makes none; 400 for a choice it cannot be served with."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice in (None, "auto"):
        raise APIError(400, 'tool_choice "auto" (the default with tools) needs a parser for how this model writes '
                            'a call, which Kiln does not have: send tool_choice "required", a named function '
                            '({"type": "function", "function": {"name": ...}}) or "none"', param="tool_choice")
    if choice == "none":
        return None
    if req.structured_outputs is not None or (req.response_format is not None and req.response_format.type != "text"):
        raise APIError(400, "a tool call's output is already constrained: leave out response_format and "
                            "structured_outputs", param="tool_choice")
    return ToolCalls(req)
