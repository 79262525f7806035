"""API keys at the router: `Authorization: Bearer <key>` on every path but the probes,
/metrics and /openapi.json (deny by default, so no route is a side door), and a prefix-cache
salt per key, so one tenant's requests never reuse another's cached prefix blocks (whose hit
or miss shows in the time to first token: PromptPeek, NDSS 2025). The salt goes to the engine
in a header (kiln.engine.cache_salt), which joins it to the body's own cache_salt. `kiln serve --api-key`
checks keys the same way (no salt: as vLLM's, its keys only authenticate).

Keys come from `--api-key` (repeatable) or the KILN_API_KEYS environment variable (one per
line; '#' at the start of a line or after a space starts a comment), which the operator fills from
`spec.auth.apiKeySecretRef`. A '#' or ',' inside a key is part of it: generated keys have them,
and a key cut there would let its first part in."""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

ENV = "KILN_API_KEYS"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json"})
SALT = web.RequestKey("kiln.cache_salt", str)  # where the middleware leaves a request's salt


def parse_keys(text: str) -> list[str]:
    """Keys from the environment variable's text; ValueError on a key with spaces inside."""
    keys = []
    for line in text.splitlines():
        key = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
        if any(c.isspace() for c in key):
            raise ValueError("an API key must not contain whitespace (one key a line)")
        if key:
            keys.append(key)
    return keys


def api_keys(flags: list[str]) -> ApiKeys | None:
    """The keys of --api-key flags and $KILN_API_KEYS; None: none given (open). ValueError with a
    message for the user: a key variable that is set but holds no key must not leave it open."""
    keys = list(flags)
    if ENV in os.environ:
        from_env = parse_keys(os.environ[ENV])
        if not from_env:
            raise ValueError(f"${ENV} is set but holds no API key")
        keys += from_env
    if any(not key.strip() or any(c.isspace() for c in key) for key in flags):
        raise ValueError("--api-key must not be empty or contain whitespace")
    return ApiKeys(keys) if keys else None


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        # Each key's salt: a digest of the key, so it reveals nothing and is the same on every
        # router replica.
        self.salts = {key.encode(): hashlib.sha256(b"kiln-cache-salt:" + key.encode()).hexdigest()[:32]
                      for key in keys}
        if not self.salts:
            raise ValueError("no API key given")

    def salt_of(self, authorization: str | None) -> str | None:
        """The tenant's salt when the header carries a known key, else None. Every key is
        compared in constant time, so timing says nothing about how much of a key was right."""
        scheme, _, token = (authorization or "").partition(" ")
        # aiohttp decodes header bytes that are not UTF-8 to surrogates: encode them back to
        # the bytes sent (a wrong key), where a strict encode would raise (a 500).
        given = token.strip().encode(errors="surrogateescape") if scheme.lower() == "bearer" else b""
        found = None
        for key, salt in self.salts.items():
            if hmac.compare_digest(given, key):
                found = salt
        return found


def middleware(keys: ApiKeys) -> Callable:
    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        salt = keys.salt_of(request.headers.get("Authorization"))
        if salt is None:
            body = {"error": {"message": "a valid API key is required: Authorization: Bearer <key>",
                              "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
            return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
        request[SALT] = salt
        return await handler(request)
    return check
