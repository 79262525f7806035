"""OpenAI's Responses API, POST /v1/responses, as vLLM serves it: the request's instructions and
input items become a chat conversation, which runs through the chat path (its template, tool
calls, structured outputs), and the assistant message that comes back becomes output items: a
`message` of output_text, and a `function_call` per tool call. With stream=true it is sent as the
Responses events (response.created ... response.completed), in the order the openai SDK's stream
helper reads them.

Stateless, as this server keeps no responses: `previous_response_id` and `store: true` are a 400
(send the whole conversation as input: earlier output items, and function_call_output items for
the calls' results)."""
from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from kiln.engine import cache_salt
from kiln.engine.async_engine import RequestStream
from kiln.engine.api_errors import APIError, parse_request
from kiln.engine.openai_protocol import ChatCompletionRequest
from kiln.engine.openai_responses import new_id
from kiln.engine.openai_serving import ChatShape, OpenAIServing, broken_stream
from kiln.engine.output_streams import EventStream, until_finished
from kiln.engine.responses_protocol import NamedFunction, ResponsesRequest, TextFormat
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.tool_calls import NAMED_CHOICE


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The conversation the request stands for, as a chat completion request."""
    if req.previous_response_id is not None:
        raise APIError(400, "this server keeps no responses: send the whole conversation as input",
                       param="previous_response_id")
    if req.store:
        raise APIError(400, "this server keeps no responses: leave store out or send false", param="store")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += [{"role": "user", "content": req.input}] if isinstance(req.input, str) else _messages(req.input)
    body = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
            "user": req.user, "cache_salt": req.cache_salt,
            "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                      for t in req.tools] if req.tools else None,
            "tool_choice": {"type": "function", "function": {"name": req.tool_choice.name}}
            if isinstance(req.tool_choice, NamedFunction) else req.tool_choice,
            "response_format": _response_format(req.text.format if req.text is not None else None)}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        raise APIError(400, f"invalid input: {'.'.join(map(str, err['loc']))}: {err['msg']}", param="input") from None


def _response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    """text.format as chat's response_format (None: plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.json_schema}}


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a message item each, a function_call joined to the assistant
    turn before it (or opening one), a function_call_output as the tool's answer."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message" and "role" not in item:  # it said the type was not supported
            raise APIError(400, "a message input item needs a role (user, assistant, system or developer)",
                           param=f"input.{i}.role")
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            _strings(item, i, "call_id", "name", "arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            # One turn, as the model wrote it: its text (an output message item) and its calls.
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            _strings(item, i, "call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"input.{i}.output")})
        else:
            raise APIError(400, f"input item of type {kind!r} is not supported (message, function_call and "
                                "function_call_output are)", param=f"input.{i}")
    return messages


def _strings(item: dict[str, Any], i: int, *fields: str) -> None:
    """A 400 naming the first of `fields` that the input item lacks or has as other than a string."""
    for field in fields:
        if not isinstance(item.get(field), str) or (field == "name" and not item[field]):
            raise APIError(400, f"a {item['type']} input item needs {field} as a string", param=f"input.{i}.{field}")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)  # as chat's text parts
    raise APIError(400, f"{param.rsplit('.', 1)[1]} must be text, or a list of input_text / output_text parts",
                   param=param)


# Chat's names for fields a responses request names otherwise: an error names the field sent.
OUR_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input"}


def _in_our_names(e: APIError) -> APIError:
    if e.param == "tool_choice" and NAMED_CHOICE in e.message:  # it showed chat's shape
        return APIError(e.status, e.message.replace(NAMED_CHOICE, '{"type": "function", "name": ...}'),
                        param=e.param, code=e.code, type_=e.type)
    if e.param not in OUR_NAMES:
        return e
    ours = OUR_NAMES[e.param]
    return APIError(e.status, e.message.replace(e.param, ours), param=ours, code=e.code, type_=e.type)


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: web.Request) -> web.StreamResponse:
        req: ResponsesRequest = parse_request(ResponsesRequest, await request.read())
        cache_salt.apply(req, request.headers)
        chat = chat_request(req)
        try:
            ids, params, tools, lora = await self.serving.chat_inputs(chat)
        except APIError as e:
            raise _in_our_names(e) from None
        answer = Answer(req, params, lora or self.serving.model_name, len(ids), ChatShape(None, False, 0, tools))
        (stream,) = await self.serving.submit([(answer.id, ids, params)], lora)
        try:
            if not req.stream:
                async for out in until_finished(stream.outputs):
                    answer.cached_tokens = out.num_cached_tokens
                    if out.finished:
                        answer.finish(out.text, out.finish_reason, len(out.token_ids))
                return web.json_response(answer.response())
            return await self._stream(request, answer, stream)
        finally:
            self.serving.engine.abort(stream.request_id)

    async def _stream(self, request: web.Request, answer: Answer, stream: RequestStream) -> web.StreamResponse:
        resp = EventStream(request, self.serving.write_timeout)
        await resp.prepare(request)
        opening = answer.opening()  # with the first output: sent at admission, the router timed it as the first token
        try:
            async with contextlib.aclosing(until_finished(stream.outputs)) as outputs:
                async for out in outputs:
                    for event in opening:
                        await resp.write(event)
                    opening = []
                    answer.cached_tokens = out.num_cached_tokens
                    for event in answer.step(out.new_text, out.finish_reason, len(out.token_ids)):
                        await resp.write(event)
        except APIError as e:  # headers are gone: an error event, as OpenAI sends one
            for event in opening:
                await resp.write(event)
            await resp.write(answer.event("error", code=e.code, message=e.message, param=e.param))
            await resp.write(answer.failed(e))  # the SDK's stream ends on a response event
            if e.status >= 500:
                return broken_stream(request, resp)
        except ConnectionResetError:
            return resp
        await resp.write_eof()
        return resp


class Answer:
    """One response, built as it is generated: its output items, and the events that tell them."""

    def __init__(self, req: ResponsesRequest, params: SamplingParams, model: str, prompt_tokens: int,
                 shape: ChatShape) -> None:
        self.req, self.model, self.prompt_tokens, self.shape = req, model, prompt_tokens, shape
        self.params = params  # what it runs with: the request's settings over the server's defaults
        self.id, self.message_id, self.created = new_id("resp"), new_id("msg"), int(time.time())
        self.text, self.output, self.sequence = "", [], 0
        self.status, self.incomplete, self.output_tokens, self.opened = "in_progress", None, 0, False
        self.cached_tokens = 0  # of the prompt, found in the prefix cache
        self.error: dict[str, str] | None = None  # why it failed, once it did

    def finish(self, text: str, finish_reason: str | None, output_tokens: int) -> None:
        message = self.shape.full(text, [], finish_reason)["message"]
        self._finished(message.get("content") or "", message.get("tool_calls") or [], finish_reason, output_tokens)

    def _finished(self, text: str, calls: list[dict], finish_reason: str | None, output_tokens: int) -> None:
        self.output_tokens = output_tokens
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        # A call cut short (a named call's arguments at max_output_tokens) is as incomplete as its response.
        self.output = ([self._message(text, self.status)] if text or not calls else []) + [
            {"id": new_id("fc"), "type": "function_call", "status": self.status, "call_id": c["id"],
             "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]

    def _open_message(self) -> list[bytes]:
        """The message item's opening events, the first time only."""
        if self.opened:
            return []
        self.opened = True
        return [self.event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
                self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []})]

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def response(self) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "error": self.error,
            "incomplete_details": self.incomplete, "instructions": req.instructions, "model": self.model,
            # As sent (null when unset), as OpenAI echoes it: not the budget it ran with.
            "output": self.output, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None, "store": False,
            # The settings it ran with: a server's --generation-config defaults too, as told.
            "temperature": self.params.temperature, "top_p": self.params.top_p, "truncation": "disabled",
            "text": req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {"format": {"type": "text"}},
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction)
            else req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "user": req.user,
            "metadata": req.metadata or {}, "reasoning": {"effort": None, "summary": None},
            "usage": None if self.status == "in_progress" else {
                "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.output_tokens}}

    def event(self, type_: str, **fields: Any) -> bytes:
        self.sequence += 1
        payload = {"type": type_, "sequence_number": self.sequence - 1, **fields}
        return f"event: {type_}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def failed(self, error: APIError) -> bytes:
        """response.failed, as OpenAI ends a stream whose generation failed."""
        self.status, self.error = "failed", {"code": error.code or "server_error", "message": error.message}
        return self.event("response.failed", response=self.response())

    def opening(self) -> list[bytes]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def step(self, new_text: str, finish_reason: str | None, output_tokens: int) -> list[bytes]:
        """The events of one engine step: text deltas as the chat shape lets them out (not what may
        be a tool call), then, at the end, the items closed and the calls."""
        chunk = self.shape.delta(new_text, [], finish_reason)  # with tools, the calls come at the end
        delta, events = chunk["delta"], []
        if delta.get("content"):
            events += self._open_message()
            self.text += delta["content"]
            events.append(self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                     content_index=0, delta=delta["content"], logprobs=[]))
        if finish_reason is None:
            return events
        self._finished(self.text, delta.get("tool_calls") or [], chunk["finish_reason"], output_tokens)
        for index, item in enumerate(self.output):
            if item["type"] == "message":
                part = item["content"][0]
                events += [*self._open_message(),
                           self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]),
                           self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part)]
            else:
                events += [self.event("response.output_item.added", output_index=index,
                                      item={**item, "arguments": "", "status": "in_progress"}),
                           self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=item["arguments"]),
                           self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"])]
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return events + [self.event(kind, response=self.response())]
