"""Function calling on /v1/chat/completions: `tools` with a `tool_choice`.

"required" (a call must come) and a named function are served as vLLM serves them without a
model-specific parser: the output is constrained with structured outputs to the calls' JSON, so
it always parses (unless max_tokens cuts it), and is answered as the message's `tool_calls`.

"auto" (the default with tools), the model deciding between text and calls, needs a parser that
knows how the model writes a call (`kiln serve --tool-call-parser`, kiln.engine.tool_parsers):
the text before the calls is the message's content, and calls that do not parse leave the whole
output as content, so nothing the model wrote is lost. Without a parser "auto" is a 400
that says what to send instead, as vLLM answers without --enable-auto-tool-choice. "none" passes
the tools to the chat template and lets the model answer in text."""
from __future__ import annotations

import json
from typing import Any

from kiln.engine.api_errors import APIError
from kiln.engine.openai_protocol import ChatCompletionRequest, NamedToolChoice
from kiln.engine.sampling_params import StructuredOutputs
from kiln.engine.tool_parsers import PARSERS, arguments_json, openai_call_id, unicode

NAMED_CHOICE = '{"type": "function", "function": {"name": ...}}'  # chat's shape of a named tool_choice

# A function that takes no arguments: its call's arguments are "{}".
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolCalls:
    """What one request's calls must look like, and how its output becomes `tool_calls`."""

    def __init__(self, req: ChatCompletionRequest, parser: str | None = None) -> None:
        choice = req.tool_choice
        self.named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self.parser = PARSERS[parser] if parser is not None and choice in (None, "auto") else None
        self.call_id = PARSERS[parser].call_id if parser is not None else openai_call_id
        self.parameters = {t.function.name: _arguments_schema(t.function.parameters, f"tools[{i}].function.parameters")
                           for i, t in enumerate(req.tools)}
        if len(self.parameters) < len(req.tools):  # one would shadow the other's schema
            names = [t.function.name for t in req.tools]
            raise APIError(400, f"tools name the function {next(n for n in names if names.count(n) > 1)!r} twice: "
                                "each function's name must be unique", param="tools")
        self.parallel = req.parallel_tool_calls
        if self.named is not None and self.named not in self.parameters:
            raise APIError(400, f"tool_choice names the function {self.named!r}, which is not among the tools "
                                f"({', '.join(self.parameters)})", param="tool_choice")

    def structured_outputs(self) -> StructuredOutputs | None:
        """A named call's arguments object, or "required"'s array of calls (vLLM's shape: each item
        a tool's name and its parameters; one item unless parallel_tool_calls); None for "auto"."""
        if self.parser is not None:
            return None
        if self.named is not None:
            return StructuredOutputs(json=self.parameters[self.named])
        # Each tool's schema moves under the array's $defs, its local $refs ("#/$defs/Loc", as
        # pydantic and openai.pydantic_function_tool write them) rebased there: left inside the
        # array they pointed at its root, which has no such definitions (a 400).
        defs = {f"tool{i}": _rebased(schema, f"#/$defs/tool{i}") for i, schema in enumerate(self.parameters.values())}
        calls = {"type": "array", "minItems": 1, "$defs": defs, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/tool{i}"}},
             "required": ["name", "parameters"], "additionalProperties": False}
            for i, name in enumerate(self.parameters)]}}
        return StructuredOutputs(json={**calls, "maxItems": 1} if not self.parallel else calls)

    def streamable(self, text: str) -> int:
        """How much of the output so far a stream sends as content before it ends: with "auto",
        the text before a call; else none (the calls go out whole at the end)."""
        return self.parser.streamable(text) if self.parser is not None else 0

    def message(self, text: str, finish_reason: str | None, streamed: bool = False) -> tuple[dict[str, Any], str | None]:
        """The message's fields for this output, and the finish reason to answer: "tool_calls"
        for "required" and for "auto" calls (OpenAI's), the engine's own for a named call (as
        OpenAI answers a forced one). An output cut short keeps its text as content and makes no
        call, except a named call, whose arguments are the text whatever it holds."""
        content = None
        if self.named is not None:
            calls = [(self.named, text)]
        elif self.parser is not None:
            parsed = self.parser.parse(text)
            if parsed is None:
                return {"content": text}, finish_reason
            content, calls = parsed
            calls = calls if self.parallel else calls[:1]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        else:
            try:
                calls = [(unicode(call["name"]), arguments_json(call["parameters"])) for call in json.loads(text)]
            except (ValueError, RecursionError):  # cut short by max_tokens, a number beyond float (1e400:
                # no JSON again), or nested past the parser's depth
                return {"content": text}, finish_reason
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        tool_calls = [{"id": self.call_id(), "type": "function",
                       "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
        if streamed:  # a stream's calls carry their place, as OpenAI's chunks do
            tool_calls = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        return {"content": content, "tool_calls": tool_calls}, finish_reason


def _arguments_schema(parameters: dict[str, Any] | None, param: str) -> dict[str, Any]:
    """The schema a call's arguments follow: always an object, as clients json.loads them into one.
    Left out, {} or an object with no properties (as MCP and LangChain write it), parameters mean
    none (OpenAI's "an empty parameter list"): any object let a model write keys until max_tokens
    cut the call short, so it was never made."""
    if not parameters or (not parameters.get("properties") and not parameters.get("required")
                          and parameters.keys() <= {"type", "properties", "required", "title", "description", "$schema"}
                          and parameters.get("type", "object") == "object"):
        return NO_PARAMETERS
    if parameters.get("type", "object") != "object":
        raise APIError(400, f"{param}: a function's parameters are a JSON schema of type \"object\", "
                            f"got type {parameters['type']!r}", param=param)
    return {"type": "object", **parameters}


def _rebased(schema: dict[str, Any], base: str) -> dict[str, Any]:
    """schema with its local $refs ("#" and "#/...") made to point into `base`, where it is put.
    Its own $id goes: kept, local refs resolved against it, not the document, and none was found
    (an anchor, "#name", is the document's wherever it sits, so it stays). Through JSON and an
    object hook, not a recursive walk: a schema nested as deep as the request's JSON may be would
    pass Python's recursion limit (a 500)."""
    def rebase(node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        local = isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))
        return {**node, "$ref": base + ref[1:]} if local else node
    return json.loads(json.dumps({k: v for k, v in schema.items() if k != "$id"}), object_hook=rebase)


def tool_calls(req: ChatCompletionRequest, parser: str | None = None) -> ToolCalls | None:
    """The request's calls, None where it makes none; 400 for a choice it cannot be served with.
    parser: how the served model writes a call (a name in tool_parsers.PARSERS), which "auto" needs."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice in (None, "auto") and parser is None:
        raise APIError(400, 'tool_choice "auto" (the default with tools) needs a parser for how this model writes '
                            'a call, and this server has none (kiln serve --tool-call-parser): send '
                            f'tool_choice "required", a named function ({NAMED_CHOICE}) or "none"', param="tool_choice")
    if choice == "none":
        return None
    if req.structured_outputs is not None or (req.response_format is not None and req.response_format.type != "text"):
        raise APIError(400, "tools that may be called cannot be combined with response_format or "
                            "structured_outputs (the output is a call's or the model's own): leave those out, or "
                            'send tool_choice "none"', param="tool_choice")
    return ToolCalls(req, parser)
