"""The /v1/completions and /v1/chat/completions handlers: validate, tokenize, submit to the
engine, then answer with one JSON body or an SSE stream of OpenAI-format chunks."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from aiohttp import web

from kiln.engine import RequestOutput, SamplingParams
from kiln.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from kiln.engine.openai_protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, chat_logprobs, completion_logprobs, envelope,
    new_id, parse_request, sse, usage)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _TokenFields:
    """vLLM's additions to a choice: the prompt's ids as the engine ran them and the generated ids
    (return_token_ids), and the prompt's logprobs (prompt_logprobs). The prompt's fields go once:
    on the full choice, or on a stream's first chunk."""

    def __init__(self, return_token_ids: bool, prompt_logprobs: bool) -> None:
        self.return_token_ids, self.prompt_logprobs = return_token_ids, prompt_logprobs
        self.prompt_sent = False

    def prompt(self, prompt_token_ids: list[int], out: RequestOutput | None) -> dict[str, Any]:
        """The prompt's fields, the first time only; out: the request's output, None before the
        engine made one (a chat stream's opening chunk), which only happens without prompt logprobs."""
        if self.prompt_sent:
            return {}
        self.prompt_sent = True
        fields: dict[str, Any] = {"prompt_token_ids": prompt_token_ids} if self.return_token_ids else {}
        if self.prompt_logprobs:
            fields["prompt_logprobs"] = out.prompt_logprobs  # int keys become JSON strings, as in vLLM
        return fields

    def generated(self, token_ids: list[int]) -> dict[str, Any]:
        return {"token_ids": token_ids} if self.return_token_ids else {}


class _CompletionShape:
    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, token_text, want_logprobs: bool) -> None:
        self.token_text, self.want_logprobs, self.offset = token_text, want_logprobs, 0

    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta(self, text: str, entries: list[dict], finish_reason: str | None) -> dict[str, Any]:
        logprobs = completion_logprobs(entries, self.token_text, self.offset) if self.want_logprobs else None
        self.offset += sum(len(t) for t in logprobs["tokens"]) if logprobs else 0
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    full = delta


class _ChatShape:
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, token_text, want_logprobs: bool) -> None:
        self.token_text, self.want_logprobs = token_text, want_logprobs

    def opening(self) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]

    def _logprobs(self, entries: list[dict]) -> dict | None:
        return chat_logprobs(entries, self.token_text) if self.want_logprobs else None

    def delta(self, text: str, entries: list[dict], finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": self._logprobs(entries),
                "finish_reason": finish_reason}

    def full(self, text: str, entries: list[dict], finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": self._logprobs(entries), "finish_reason": finish_reason}


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        core = engine.engine
        self.tokenizer, self.max_model_len = core.tokenizer, core.config.max_model_len
        self.vocab_size = core.model_config.vocab_size
        self.token_text = self.tokenizer.decode_token

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req: CompletionRequest = parse_request(CompletionRequest, await request.read())
        self._check_model(req.model)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt", add_special_tokens=True)
        else:
            ids = prompt
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must lie in [0, {self.vocab_size})", param="prompt")
        max_tokens = self._max_tokens(len(ids), "prompt", req.max_tokens, "max_tokens",
                                      COMPLETION_DEFAULT_MAX_TOKENS)
        params = _sampling(req, max_tokens, req.logprobs, req.prompt_logprobs)
        shape = _CompletionShape(self.token_text, req.logprobs is not None)
        return await self._generate(request, req, ids, params, shape)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.read())
        self._check_model(req.model)
        top = req.top_logprobs_count()
        try:
            text = self.tokenizer.apply_chat_template(req.template_messages(), add_generation_prompt=True)
        except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
            raise APIError(400, f"the model's chat template rejected the messages: {e}", param="messages") from None
        # The template already wrote the special tokens.
        ids = self._encode(text, "messages", add_special_tokens=False)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(len(ids), "messages", req.requested_max_tokens(), param, None)
        params = _sampling(req, max_tokens, top)
        return await self._generate(request, req, ids, params, _ChatShape(self.token_text, top is not None))

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        # Tokenizing holds the GIL, so a prompt of megabytes stalled every stream and /health for
        # seconds only to be refused for its length. Text longer than the context's tokens could
        # cover is refused first (x2: Unicode normalization may merge up to 3 characters into 2).
        if len(text) > 2 * self.max_model_len * self.tokenizer.most_chars_per_token:
            raise APIError(400, f"the prompt has {len(text)} characters, more than the model's context of "
                                f"{self.max_model_len} tokens can hold", param=param, code="context_length_exceeded")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _max_tokens(self, prompt_len: int, prompt_param: str, requested: int | None, param: str,
                    default: int | None) -> int:
        """The generation budget: what was asked (checked against the context) or the default."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the model's context is {self.max_model_len} "
                                "tokens and at least one must be left to generate",
                           param=prompt_param,
                           code="context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise APIError(400, f"{param}={requested} is too large: the prompt has {prompt_len} tokens and the "
                                f"model's context is {self.max_model_len}, so at most {room} can be generated",
                           param=param, code="context_length_exceeded")
        return requested

    async def _generate(self, request: web.Request, req, ids: list[int], params: SamplingParams,
                        shape) -> web.StreamResponse:
        request_id = new_id(shape.id_prefix)
        fields = _TokenFields(req.return_token_ids, params.prompt_logprobs is not None)
        try:
            stream = await self.engine.submit(request_id, ids, params)
        except QueueFullError as e:
            raise APIError(429, str(e), code="queue_full", type_="rate_limit_error") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type_="server_error", code="engine_dead") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        # Whatever ends this handler early (client gone, cancelled, write failed) frees the request.
        try:
            if req.stream:
                return await self._stream(request, req, request_id, ids, stream.outputs, shape, fields)
            return await self._collect(request_id, stream.outputs, shape, fields)
        finally:
            self.engine.abort(request_id)

    async def _collect(self, request_id: str, outputs: asyncio.Queue, shape, fields: _TokenFields) -> web.Response:
        entries: list[dict] = []
        async for out in _until_finished(outputs):
            entries += _new_entries(out)
        choice = {**shape.full(out.text, entries, out.finish_reason), **fields.prompt(out.prompt_token_ids, out),
                  **fields.generated(out.token_ids)}
        body = envelope(request_id, shape.object_full, self.model_name, [choice],
                        usage=usage(len(out.prompt_token_ids), len(out.token_ids)))
        return web.json_response(body)

    async def _stream(self, request: web.Request, req, request_id: str, prompt_ids: list[int],
                      outputs: asyncio.Queue, shape, fields: _TokenFields) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        extra: dict[str, Any] = {"created": int(time.time()), **({"usage": None} if req.include_usage else {})}

        def chunk(choices: list[dict[str, Any]], **fields: Any) -> bytes:
            return sse(envelope(request_id, shape.object_chunk, self.model_name, choices, **{**extra, **fields}))

        try:
            for choice in shape.opening():
                await resp.write(chunk([{**choice, **fields.prompt(prompt_ids, None)}]))
            async for out in _until_finished(outputs):
                entries = _new_entries(out)
                # A chunk for every step that made a token, even when its text is empty (a special
                # token, text held back as it may begin a stop string, half a character), as vLLM
                # and llama-server send them: the client sees each token when it is made.
                if out.new_text or entries or out.finished or out.new_token_ids:
                    choice = {**shape.delta(out.new_text, entries, out.finish_reason),
                              **fields.prompt(prompt_ids, out), **fields.generated(out.new_token_ids)}
                    await resp.write(chunk([choice]))
            if req.include_usage:
                await resp.write(chunk([], usage=usage(len(out.prompt_token_ids), len(out.token_ids))))
            await resp.write(sse("[DONE]"))
        except APIError as e:  # headers are gone: report in-band, as OpenAI does
            await resp.write(sse(e.body()))
        except ConnectionResetError:
            return resp  # client gone; the caller's finally aborts the request
        await resp.write_eof()
        return resp


async def _until_finished(outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    while True:
        out = await outputs.get()
        if isinstance(out, Exception):  # EngineDeadError: the engine loop failed
            raise APIError(500, f"the engine failed while generating: {out}", type_="server_error",
                           code="engine_dead")
        yield out
        if out.finished:
            return


def _new_entries(out: RequestOutput) -> list[dict]:
    """This step's logprob entries, whether the engine reports them per step or cumulatively."""
    if not out.logprobs or not out.new_token_ids:
        return []
    return list(out.logprobs[-len(out.new_token_ids):])


def _sampling(req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None
