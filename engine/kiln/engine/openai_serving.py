"""The /v1/completions and /v1/chat/completions handlers: validate, tokenize, submit to the
engine, then answer with one JSON body or an SSE stream of OpenAI-format chunks."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kiln.engine import RequestOutput, SamplingParams, cache_salt
from kiln.engine.api_errors import APIError, model_not_found, parse_request, queue_full
from kiln.engine.async_engine import AsyncEngine, QueueFullError, RequestStream
from kiln.engine.lora import LoRANotLoadedError
from kiln.engine.lora_cache import LoRACapacityError
from kiln.engine.lora_serving import capacity_error
from kiln.engine.openai_protocol import (
    INT64_MIN, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, template_messages)
from kiln.engine.openai_responses import (
    Cached, chat_logprobs, completion_logprobs, echoed_entries, envelope, new_id, sse, top_of, usage)
from kiln.engine.output_streams import DEFAULT_WRITE_TIMEOUT_S, EventStream, merged, new_entries
from kiln.engine.tokenizer import Tokenizer
from kiln.engine.tool_calls import ToolCalls, tool_calls

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A prompt this long or longer is tokenized beside the event loop (a few ms of tokenizing below it:
# a thread's hop would cost more than it saves).
OFF_LOOP_CHARS = 1 << 15
MAX_SCORED_ENTRIES = 1 << 22  # prompt logprob entries a completion request may ask for, over its choices
# What the server itself gives the chat template or its rendering (kiln.engine.tokenizer): no request's
# chat_template_kwargs override them.
TEMPLATE_VARIABLES = {"messages", "add_generation_prompt", "continue_final_message", "tools", "bos_token",
                      "eos_token"}


class _TokenFields:
    """vLLM's additions to a choice: the prompt's ids as the engine ran them and the generated ids
    (return_token_ids), and the prompt's logprobs with prompt_logprobs alternatives (None: not
    asked for). The prompt's fields go once: on the full choice, or on a stream's first chunk."""

    def __init__(self, return_token_ids: bool, prompt_logprobs: int | None) -> None:
        self.return_token_ids, self.prompt_logprobs = return_token_ids, prompt_logprobs
        self.prompt_sent = False

    def prompt(self, prompt_token_ids: list[int], out: RequestOutput | None) -> dict[str, Any]:
        """The prompt's fields, the first time only; out: the request's output, None before the
        engine made one (a chat stream's opening chunk), which only happens without prompt logprobs."""
        if self.prompt_sent:
            return {}
        self.prompt_sent = True
        fields: dict[str, Any] = {"prompt_token_ids": prompt_token_ids} if self.return_token_ids else {}
        if self.prompt_logprobs is not None:  # int keys become JSON strings, as in vLLM
            fields["prompt_logprobs"] = [None if p is None else top_of(p, t, self.prompt_logprobs)
                                         for t, p in zip(prompt_token_ids, out.prompt_logprobs)]
        return fields

    def generated(self, token_ids: list[int]) -> dict[str, Any]:
        return {"token_ids": token_ids} if self.return_token_ids else {}


class _CompletionShape:
    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, token_text, want_logprobs: bool, index: int) -> None:
        self.token_text, self.want_logprobs, self.index, self.offset = token_text, want_logprobs, index, 0

    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta(self, text: str, entries: list[dict], finish_reason: str | None) -> dict[str, Any]:
        logprobs = completion_logprobs(entries, self.token_text, self.offset) if self.want_logprobs else None
        self.offset += sum(len(t) for t in logprobs["tokens"]) if logprobs else 0
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    full = delta


class ChatShape:
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer: Tokenizer | None, want_logprobs: bool, index: int,
                 tools: ToolCalls | None = None) -> None:
        self.tokenizer, self.want_logprobs, self.index, self.tools = tokenizer, want_logprobs, index, tools
        self.held, self.sent = "", 0  # with tools: the text so far, and how much of it went out as content

    def opening(self) -> list[dict[str, Any]]:
        return [{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]

    def _logprobs(self, entries: list[dict]) -> dict | None:
        return chat_logprobs(entries, self.tokenizer) if self.want_logprobs else None

    def delta(self, text: str, entries: list[dict], finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        if self.tools is not None:  # a call goes out whole: its arguments parse only at the end
            self.held += text
            if finish_reason is None:
                upto = max(self.sent, self.tools.streamable(self.held))
                delta, self.sent = ({"content": self.held[self.sent:upto]} if upto > self.sent else {}), upto
            else:  # the content not sent yet, and the calls
                message, finish_reason = self.tools.message(self.held, finish_reason, streamed=True)
                rest = (message["content"] or "")[self.sent:]
                delta = {k: v for k, v in (("content", rest), ("tool_calls", message.get("tool_calls"))) if v}
        return {"index": self.index, "delta": delta, "logprobs": self._logprobs(entries), "finish_reason": finish_reason}

    def full(self, text: str, entries: list[dict], finish_reason: str | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            calls, finish_reason = self.tools.message(text, finish_reason)
            message.update(calls)
        return {"index": self.index, "message": message, "logprobs": self._logprobs(entries),
                "finish_reason": finish_reason}


@dataclass
class _Choice:
    """One choice of a response, generated by one engine request. Each has its own shape and
    token fields: what a stream sent so far is per choice."""
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    shape: Any  # _CompletionShape | ChatShape
    fields: _TokenFields
    echo: str | None = None  # the prompt's text, to send before the first of the choice's own
    stream: RequestStream | None = None
    prompt_only: bool = False  # echo with max_tokens 0: what the engine generates is not sent
    prompt: int = 0  # which of the request's prompts it answers

    def seen(self, out: RequestOutput) -> RequestOutput:
        return _PromptOnly(out) if self.prompt_only else out  # type: ignore[return-value]

    def echoed(self, out: RequestOutput, text: str, entries: list[dict]) -> tuple[str, list[dict]]:
        """`text` and `entries` with the echoed prompt before them, the first time only."""
        if self.echo is None:
            return text, entries
        echo, self.echo = self.echo, None
        if self.params.logprobs is not None:  # the prompt was scored for them (completions() saw to it)
            entries = echoed_entries(self.prompt_ids, out.prompt_logprobs, self.params.logprobs) + entries
        return echo + text, entries


class _PromptOnly:
    """An output without what was generated: vLLM's echo without generation (max_tokens 0 with
    echo: the prompt, scored, and no completion). The engine makes one token, which is dropped."""
    text = new_text = ""
    token_ids: list[int] = []
    new_token_ids: list[int] = []
    logprobs = None
    finish_reason = "length"  # the budget of 0 is spent

    def __init__(self, out: RequestOutput) -> None:
        self._out = out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def check_scored(entries: int) -> None:
    """Each choice scores its prompt itself and answers with its own copy (about 300 bytes an
    entry as Python objects): n=128 of an 8k-token prompt at prompt_logprobs 20 came to GiBs."""
    if entries > MAX_SCORED_ENTRIES:
        raise APIError(400, f"the prompt's logprobs for every choice would be {entries} entries (prompt tokens x n "
                            f"x (logprobs + 1)); at most {MAX_SCORED_ENTRIES} are served: ask fewer choices or "
                            "alternatives", param="prompt_logprobs")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, tool_call_parser: str | None = None,
                 sampling_defaults: dict[str, float | int] | None = None,
                 write_timeout: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        """sampling_defaults: request field -> value for requests that leave it out (sampling_defaults.py);
        write_timeout: the seconds a stream's write may wait for its client (EventStream)."""
        self.engine, self.model_name, self.tool_call_parser = engine, model_name, tool_call_parser
        self.write_timeout = write_timeout
        self.defaults = sampling_defaults or {}
        core = engine.engine
        self.tokenizer, self.max_model_len = core.tokenizer, core.config.max_model_len
        self.vocab_size = core.model_config.vocab_size
        self.token_text = self.tokenizer.decode_token

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req: CompletionRequest = parse_request(CompletionRequest, await request.read())
        cache_salt.apply(req, request.headers)
        lora = self._check_model(req.model)
        prompts = req.prompts()
        self._check_choices(len(prompts), req.n)
        prompt_ids = [await self._prompt_ids(p) for p in prompts]
        self._check_bias(req)
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise APIError(400, "max_tokens=0 generates nothing: it is for echo (the prompt, with logprobs its "
                                "scores)", param="max_tokens")
        # Echoed logprobs are the prompt's: scored once with the more alternatives of the two asked
        # (echo's logprobs, prompt_logprobs), each cut to its own (top_of).
        scored = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            scored = max(scored or 0, req.logprobs)
        if scored is not None:
            check_scored(sum(map(len, prompt_ids)) * req.n * (scored + 1))
        params = [self._sampling(req, self._max_tokens(len(ids), "prompt", 1 if prompt_only else req.max_tokens,
                                                  "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS), req.logprobs, scored)
                  for ids in prompt_ids]
        echo = [p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=False)
                for p in prompts] if req.echo else None
        return await self._generate(request, req, prompt_ids, params, lambda index: _CompletionShape(
            self.token_text, req.logprobs is not None, index), req.prompt_logprobs, lora, echo,
            prompt_only)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.read())
        cache_salt.apply(req, request.headers)
        ids, params, tools, lora = await self.chat_inputs(req)
        return await self._generate(request, req, [ids], [params], lambda index: ChatShape(
            self.tokenizer, req.logprobs, index, tools), None, lora)

    async def chat_inputs(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams, ToolCalls | None, str | None]:
        """A conversation's prompt ids, sampling parameters, tool calls and LoRA adapter; a 400 or
        404 (APIError) for what the engine cannot take."""
        lora = self._check_model(req.model)
        self._check_choices(1, req.n)
        self._check_bias(req)
        tools = tool_calls(req, self.tool_call_parser)
        # The template already wrote the special tokens.
        ids = await self._encode(self._chat_text(req.template_messages(), req), "messages", add_special_tokens=False)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        # As vLLM: the model's max_new_tokens bounds a chat that names no limit; completions keep 16.
        max_tokens = self._max_tokens(len(ids), "messages", req.requested_max_tokens(), param,
                                      self.defaults.get("max_tokens"))
        params = self._sampling(req, max_tokens, req.top_logprobs_count())
        if tools is not None and (constraint := tools.structured_outputs()) is not None:
            params.structured_outputs = constraint
        if tools is not None and tools.parser is not None:
            # A call's opening may be a special token of the model's vocabulary (Mistral's
            # [TOOL_CALLS]); skipped, the parser would never see it (vLLM's parsers ask the same).
            params.skip_special_tokens = False
        return ids, params, tools, lora

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize: a prompt's (or a conversation's) token ids as this model runs them."""
        req: TokenizeRequest = parse_request(TokenizeRequest, await request.read())
        self._check_model(req.model)
        if req.messages is not None:
            text = self._chat_text(template_messages(req.messages), req)
            ids = await self._encode(text, "messages", add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = await self._encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens is not False)
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                  "token_strs": [self.token_text(t) for t in ids] if req.return_token_strs else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /detokenize: token ids back to text."""
        req: DetokenizeRequest = parse_request(DetokenizeRequest, await request.read())
        self._check_model(req.model)
        # Special tokens kept (as vLLM's): the text of /tokenize's ids, which a chat template wrote.
        text = self.tokenizer.decode(self._in_vocabulary(req.tokens, "tokens"), skip_special_tokens=False)
        return web.json_response({"prompt": text})

    def _chat_text(self, messages: list[dict[str, Any]], req: TokenizeRequest | ChatCompletionRequest) -> str:
        tools = getattr(req, "tools", None)  # to the template, which may describe them to the model
        extra = req.chat_template_kwargs or {}
        if taken := sorted(set(extra) & TEMPLATE_VARIABLES):
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields do)",
                           param="chat_template_kwargs")
        described = [t.model_dump(exclude_none=True) for t in tools or ()] or None
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      continue_final_message=req.continue_final_message,
                                                      tools=described, **extra)
        except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
            raise APIError(400, f"the model's chat template rejected the messages: {e}", param="messages") from None

    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await self._encode(prompt, "prompt", add_special_tokens=True)
        return self._in_vocabulary(prompt, "prompt")

    def _in_vocabulary(self, ids: list[int], param: str) -> list[int]:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"{param}: token ids must lie in [0, {self.vocab_size})", param=param)
        return ids

    def _check_bias(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.logit_bias:  # before the engine, whose ValueError would not name the field
            self._in_vocabulary([int(t) for t in req.logit_bias], "logit_bias")

    def _check_choices(self, prompts: int, n: int) -> None:
        """Every choice is an engine request, admitted together: more than the engine holds at
        once could never be, and a 429 would make the client retry for ever. A full engine's 429
        comes here, before the prompts are tokenized and a chat template rendered: work wasted on
        a refused request under overload (submit checks again, with the prompt tokens)."""
        if prompts * n > self.engine.capacity:
            raise APIError(400, f"{prompts} prompt(s) x n={n} make {prompts * n} choices; this server holds at "
                                f"most {self.engine.capacity} requests at once (--max-num-seqs + --max-queue)",
                           param="n" if prompts == 1 else "prompt")
        try:
            self.engine.check_room(prompts * n)
        except QueueFullError as e:
            raise queue_full(e) from None

    async def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        # Text longer than the context's tokens could cover is refused untokenized (x2: Unicode
        # normalization may merge up to 3 characters into 2).
        if len(text) > 2 * self.max_model_len * self.tokenizer.most_chars_per_token:
            raise APIError(400, f"the prompt has {len(text)} characters, more than the model's context of "
                                f"{self.max_model_len} tokens can hold", param=param, code="context_length_exceeded")
        if len(text) < OFF_LOOP_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        # Under that bound a long-context model still takes a megabyte prompt, seconds to tokenize:
        # on the event loop, every stream, /health and /metrics stalled past the probes' timeout.
        return await asyncio.to_thread(self.tokenizer.encode_letting_threads_run, text, add_special_tokens)

    def _check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's model names, or None for the base model (also when not
        given: optional, as in vLLM)."""
        loras = self.engine.engine.loras.paths
        if model is None or model == self.model_name:
            return None
        if model in loras:
            return model
        raise self._model_not_found(model)

    def _sampling(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for req: what it set, else the model's defaults, else the API's."""
        unset = {k: v for k, v in self.defaults.items() if k != "max_tokens" and k not in req.model_fields_set}
        try:
            return req.model_copy(update=unset).sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def _model_not_found(self, model: str) -> APIError:
        return model_not_found(model, [self.model_name, *self.engine.engine.loras.paths])

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

    async def _generate(self, request: web.Request, req, prompts: list[list[int]], params: list[SamplingParams],
                        shape: Callable[[int], Any], prompt_logprobs: int | None, lora: str | None,
                        echo: list[str] | None = None, prompt_only: bool = False) -> web.StreamResponse:
        """Choices n at a time per prompt, indexed prompt by prompt as OpenAI and vLLM do; with a
        seed, choice j of a prompt draws with seed + j, so the n differ and each is reproducible.
        prompt_logprobs: the alternatives the client asked them with (None: not asked); lora: the adapter they run with; echo: each
        prompt's text, to send first; prompt_only: that alone (max_tokens 0)."""
        choices = [_Choice(i * req.n + j, ids, _nth_seed(params[i], j), shape(i * req.n + j),
                           _TokenFields(req.return_token_ids, prompt_logprobs), echo[i] if echo else None,
                           prompt_only=prompt_only, prompt=i)
                   for i, ids in enumerate(prompts) for j in range(req.n)]
        request_id = new_id(choices[0].shape.id_prefix)
        # Whatever ends this handler early (a choice refused, client gone, cancelled, write failed)
        # frees every choice's request.
        try:
            streams = await self.submit([(request_id if len(choices) == 1 else f"{request_id}-{c.index}",
                                           c.prompt_ids, c.params) for c in choices], lora)
            for choice, stream in zip(choices, streams):
                choice.stream = stream
            prompt_tokens = sum(map(len, prompts))  # once per prompt, however many choices (vLLM)
            model = lora or self.model_name  # answered under the name asked for, as vLLM does
            if req.stream:
                return await self._stream(request, req, request_id, model, choices, prompt_tokens)
            return await self._collect(request_id, model, choices, prompt_tokens)
        finally:
            for choice in choices:
                if choice.stream is not None:
                    self.engine.abort(choice.stream.request_id)

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]],
                      lora: str | None) -> list[RequestStream]:
        try:  # EngineDeadError is left to the server's middleware, which answers it alike on every route
            return await self.engine.submit_all(requests, lora)
        except QueueFullError as e:
            raise queue_full(e) from None
        except LoRANotLoadedError:  # unloaded between _check_model and the engine's turn: as if never loaded
            raise self._model_not_found(lora) from None
        except LoRACapacityError as e:
            raise capacity_error(e) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def _collect(self, request_id: str, model: str, choices: list[_Choice], prompt_tokens: int) -> web.Response:
        echoes: dict[int, str] = {c.index: "" for c in choices}
        entries: dict[int, list[dict]] = {c.index: [] for c in choices}
        done: dict[int, dict[str, Any]] = {}
        completion_tokens, cached = 0, Cached()
        async with contextlib.aclosing(merged(choices)) as outputs:
            async for choice, out in outputs:
                cached.saw(choice.prompt, out.num_cached_tokens)
                out = choice.seen(out)
                echo, new = choice.echoed(out, "", new_entries(out))
                echoes[choice.index] += echo
                entries[choice.index] += new
                if out.finished:
                    completion_tokens += len(out.token_ids)
                    text = echoes[choice.index] + out.text
                    done[choice.index] = {**choice.shape.full(text, entries[choice.index], out.finish_reason),
                                          "stop_reason": out.stop_reason,
                                          **choice.fields.prompt(out.prompt_token_ids, out),
                                          **choice.fields.generated(out.token_ids)}
        body = envelope(request_id, choices[0].shape.object_full, model, [done[i] for i in sorted(done)],
                        usage=usage(prompt_tokens, completion_tokens, cached.tokens()))
        return web.json_response(body)

    async def _stream(self, request: web.Request, req, request_id: str, model: str, choices: list[_Choice],
                      prompt_tokens: int) -> web.StreamResponse:
        resp = EventStream(request, self.write_timeout)
        await resp.prepare(request)
        extra: dict[str, Any] = {"created": int(time.time())}
        if req.include_usage:  # null on the chunks before the last, unless continuous
            extra["usage"] = usage(prompt_tokens, 0) if req.continuous_usage else None

        def chunk(choices: list[dict[str, Any]], **fields: Any) -> bytes:
            return sse(envelope(request_id, object_chunk, model, choices, **{**extra, **fields}))

        object_chunk = choices[0].shape.object_chunk
        completion_tokens = made = 0  # made: the tokens so far, for continuous usage
        opened, cached = False, Cached()
        try:
            async with contextlib.aclosing(merged(choices)) as outputs:
                async for c, out in outputs:
                    if not opened:
                        # The choices' openings (chat's role) go with the first output, as vLLM's: sent
                        # at admission, they were the first bytes the router timed as the first token.
                        opened = True
                        for o in choices:
                            for opening in o.shape.opening():
                                await resp.write(chunk([{**opening, **o.fields.prompt(o.prompt_ids, None)}]))
                    cached.saw(c.prompt, out.num_cached_tokens)
                    out = c.seen(out)
                    made += len(out.new_token_ids)
                    if req.continuous_usage:
                        extra["usage"] = usage(prompt_tokens, made, cached.tokens())
                    text, entries = c.echoed(out, out.new_text, new_entries(out))
                    # A chunk for every step that made a token, even when its text is empty (a special
                    # token, text held back as it may begin a stop string, half a character), as vLLM
                    # and llama-server send them: the client sees each token when it is made.
                    if text or entries or out.finished or out.new_token_ids:
                        choice = {**c.shape.delta(text, entries, out.finish_reason), "stop_reason": out.stop_reason,
                                  **c.fields.prompt(c.prompt_ids, out), **c.fields.generated(out.new_token_ids)}
                        if "tool_calls" in choice.get("delta", ()):  # the finish in a chunk of its own, as
                            # OpenAI's: the openai SDK's stream helper fires tool_calls.function.arguments.done
                            # for the last call only on a finish that comes after it
                            finish = {"index": c.index, "delta": {}, "logprobs": None,
                                      "finish_reason": choice["finish_reason"], "stop_reason": out.stop_reason}
                            await resp.write(chunk([{**choice, "finish_reason": None, "stop_reason": None}]))
                            choice = finish
                        await resp.write(chunk([choice]))
                    completion_tokens += len(out.token_ids) if out.finished else 0
            if req.include_usage:
                await resp.write(chunk([], usage=usage(prompt_tokens, completion_tokens, cached.tokens())))
            await resp.write(sse("[DONE]"))
        except APIError as e:  # headers are gone: report in-band, as OpenAI does
            await resp.write(sse(e.body()))
            # [DONE] after the error too, as vLLM: clients read to it. A 5xx still breaks the stream.
            await resp.write(sse("[DONE]"))
            if e.status >= 500:
                return broken_stream(request, resp)
        except ConnectionResetError:
            return resp  # client gone; the caller's finally aborts the request
        await resp.write_eof()
        return resp


def broken_stream(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """End a stream that failed on the server's side (the engine died) without its final chunk,
    after its error event: ended cleanly, the router counted it a 200, and a canary that crashed
    mid-generation showed no errors. A router ends a broken upstream's stream the same way."""
    if request.transport is not None:
        request.transport.close()
    return resp


def _nth_seed(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j's parameters: seed + j, wrapped into int64 (the first choice keeps the seed)."""
    if j == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j - INT64_MIN) % 2**64 + INT64_MIN)
