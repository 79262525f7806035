"""Prefix affinity: a request whose prompt begins as an earlier one did goes to the replica that
served that beginning last, whose prefix cache holds its KV blocks (SGLang's cache-aware router
and llm-d's prefix scorer do the same), unless that replica has more than `slack` requests in
flight beyond the least busy one: then load wins, and the prefix is remembered at the replica
that took it, so a prefix every request shares (a system prompt) ends up cached on each.

The prompt text (a completion's prompt; a chat's messages, role and text, after its tools; a
response's instructions and input items, as messages) is
cut into CHUNK-character pieces, about one KV block of tokens each. Piece i's key is a digest
of the model, the cache salt (a tenant's blocks are never shared) and pieces 0..i, so one key
stands for a whole prefix; a prompt shorter than a piece has no key and is balanced on load
alone. A bounded LRU map remembers each key's last replica in each revision: during a rollout
the split sends a conversation's turns to either revision, and each keeps its own cache."""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from kiln.router.endpoints import Endpoint

CHUNK = 64  # characters: ~16 tokens, one KV block of the engine's default size
MAX_KEYS = 1 << 18  # remembered prefixes (a key and an endpoint each, ~100 bytes)
# The work is on the router's one event loop: a body over MAX_BODY is balanced on load without
# being parsed, and only a prompt's first MAX_CHARS (~8k tokens) are hashed.
MAX_BODY = 1 << 20
MAX_CHARS = 32768
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def prefix_keys(path: str, body: bytes, tenant: str | None = None) -> list[bytes]:
    """The keys of a request's prompt prefixes, shortest first; none for other paths and for
    bodies that are not a request the engine would take (it answers those with a 400).
    `tenant`: the API key's cache salt, which the engine joins to the body's."""
    if path not in PATHS or len(body) > MAX_BODY:
        return []
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return []
    if not isinstance(request, dict):
        return []
    try:
        text = _prompt_text(request)[:MAX_CHARS]
    except RecursionError:  # tools nested as deep as the parser allows, too deep to write out again
        return []
    if not text:
        return []
    digest = hashlib.blake2b(repr((request.get("model"), tenant, request.get("cache_salt"))).encode(),
                             digest_size=16)
    keys = []
    for start in range(0, len(text) - CHUNK + 1, CHUNK):
        digest.update(text[start:start + CHUNK].encode(errors="surrogatepass"))
        keys.append(digest.copy().digest())
    return keys


def _prompt_text(request: dict[str, Any]) -> str:
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt[0]  # a batch of prompts: the first decides, as they go to one replica
    messages = request.get("messages")
    if isinstance(request.get("input"), (str, list)):  # the Responses API: instructions, then the input items
        given = request["input"]
        messages = ([{"role": "system", "content": request["instructions"]}] if request.get("instructions") else []) \
            + ([{"role": "user", "content": given}] if isinstance(given, str) else given)
    if not isinstance(messages, list):
        return ""
    parts = [json.dumps(request["tools"], sort_keys=True)] if request.get("tools") else []
    for message in messages:
        if not isinstance(message, dict):
            return ""
        content = message.get("content")
        if isinstance(content, list):  # content parts: their text (any body reaches here: the engine judges it)
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        parts.append(f"{message.get('role')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def _scoped(key: bytes, revision: str) -> bytes:
    """A prefix key within one revision (keys are digests of one size: no revision's is another's)."""
    return key + revision.encode()


class Affinity:
    def __init__(self, slack: int, max_keys: int = MAX_KEYS) -> None:
        self.slack = slack
        self.max_keys = max_keys
        self._last: OrderedDict[bytes, Endpoint] = OrderedDict()

    def choose(self, keys: Sequence[bytes], candidates: Sequence[Endpoint],
               in_flight: Mapping[Endpoint, int]) -> tuple[Endpoint | None, str]:
        """The candidate that served the longest of these prefixes last, if it is no more than
        `slack` requests busier than the least busy candidate, else None (balance on load); and
        the outcome: "hit", "spill" (too busy) or "none" (no prefix known among the candidates)."""
        revisions = {e.revision for e in candidates}
        for key in reversed(keys):
            endpoint = next((found for revision in revisions
                             if (found := self._last.get(_scoped(key, revision))) in candidates), None)
            if endpoint is not None:
                least = min(in_flight.get(e, 0) for e in candidates)
                if in_flight.get(endpoint, 0) - least <= self.slack:
                    return endpoint, "hit"
                return None, "spill"
        return None, "none"

    def remember(self, keys: Sequence[bytes], endpoint: Endpoint) -> None:
        """These prefixes are now in `endpoint`'s cache (it takes the request)."""
        for key in keys:
            key = _scoped(key, endpoint.revision)
            self._last[key] = endpoint
            self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
