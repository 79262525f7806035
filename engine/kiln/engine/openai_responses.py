"""The shapes of OpenAI-compatible responses: ids, usage, SSE framing, the envelope of a
response or stream chunk, and logprobs in the chat and legacy completion forms."""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kiln.engine.tokenizer import Tokenizer


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """cached_tokens: of the prompt tokens, those the prefix cache held (OpenAI's prompt_tokens_details)."""
    counts: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


class Cached:
    """The prompt tokens a response's prefix cache held, each prompt counted once as its tokens
    are: of a prompt's n choices, what all of them found cached."""

    def __init__(self) -> None:
        self._by_prompt: dict[int, int] = {}

    def saw(self, prompt: int, cached_tokens: int) -> None:
        self._by_prompt[prompt] = min(self._by_prompt.get(prompt, cached_tokens), cached_tokens)

    def tokens(self) -> int:
        return sum(self._by_prompt.values())


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def envelope(id_: str, object_: str, model: str, choices: list[dict[str, Any]], created: int | None = None,
             **extra: Any) -> dict[str, Any]:
    """A response or stream chunk; a stream passes its start time as `created` so every chunk carries
    the same one, as OpenAI's do."""
    return {"id": id_, "object": object_, "created": int(time.time()) if created is None else created,
            "model": model, "choices": choices, **extra}


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": tokenizer.decode_token(token_id), "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id))}


def chat_logprobs(entries: list[dict[str, Any]], tokenizer: Tokenizer) -> dict[str, Any]:
    """Engine logprob entries -> a chat choice's `logprobs` ({"content": [...]})."""
    return {"content": [
        {**_token_entry(tokenizer, e["token_id"], e["logprob"]),
         "top_logprobs": [_token_entry(tokenizer, t, lp) for t, lp in e["top"]]}
        for e in entries]}


def completion_logprobs(entries: list[dict[str, Any]], token_text: Callable[[int], str],
                        text_offset: int) -> dict[str, Any]:
    """Engine logprob entries -> a completion choice's legacy `logprobs` object; `text_offset`
    is where the first of these tokens starts in the generated text. Each position's top_logprobs
    holds the token taken too, as OpenAI's do ("up to logprobs+1 elements") and an echoed prompt's."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        tokens.append(token_text(e["token_id"]))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
        tops.append(None if e["top"] is None else _top(tokens[-1], e["logprob"], e["top"], token_text))
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def _top(text: str, logprob: float, top: list[tuple[int, float]], token_text: Callable[[int], str]) -> dict[str, float]:
    """A position's legacy top_logprobs, keyed by text: the token taken keeps its own logprob and
    of other tokens with the same text (byte pieces of one character all read "\ufffd") the
    likeliest stays; a later one overwrote the token taken's figure."""
    entries = {text: logprob}
    for token_id, value in top:
        entries.setdefault(token_text(token_id), value)
    return entries


def top_of(position: dict[int, dict[str, Any]], token_id: int, n: int) -> dict[int, dict[str, Any]]:
    """A scored prompt position cut to its token and the top n: a completion scores its prompt
    once, with the most alternatives that echo's logprobs or prompt_logprobs ask for."""
    return {t: e for t, e in position.items() if t == token_id or e["rank"] <= n}


def echoed_entries(prompt_ids: list[int], prompt_logprobs: list[dict[int, dict[str, Any]] | None],
                   top: int) -> list[dict[str, Any]]:
    """A prompt's logprobs as completion logprob entries, for `echo`: the first token has no
    logprob (nothing comes before it), each other its own and its position's `top` best tokens."""
    entries = [{"token_id": prompt_ids[0], "logprob": None, "top": None}]
    for token_id, position in zip(prompt_ids[1:], prompt_logprobs[1:]):
        entries.append({"token_id": token_id, "logprob": position[token_id]["logprob"],
                        "top": [(t, e["logprob"]) for t, e in top_of(position, token_id, top).items()]})
    return entries
