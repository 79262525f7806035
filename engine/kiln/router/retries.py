"""When a request may go to another replica: the first cannot have acted on it (no connection,
a pooled connection found closed, or its engine refused it unread), or its revision does not
serve the model asked for."""
from __future__ import annotations

import json
from types import SimpleNamespace

import aiohttp
from aiohttp import web

ATTEMPTS = 2  # the first try and at most one retry
# Raised before a single byte of the request left.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# What a connection the replica had already closed gives; a sure sign only on a reused one.
DEAD_CONNECTION_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                          aiohttp.ClientConnectionResetError)
RETRYABLE = frozenset({"connect", "stale_connection", "refused"})
# A pooled connection the replica had closed fails within a round trip. One failing later broke
# while the replica worked on the request: sent whole, it is not sent again (as Go's net/http
# resends no POST it wrote), or it would run twice.
STALE_WITHIN_S = 1.0
# The engine's 503 codes from its admission, before the request reached the model: it died
# (engine_dead; a request running then gets a 500) or is loading or draining (not_ready). The
# EndpointSlice may not know yet, another replica can take the request.
REFUSED_CODES = frozenset({"engine_dead", "not_ready"})


class Retryable(Exception):
    """The replica cannot have acted on the request: another one may take it."""

    def __init__(self, reason: str, answer: web.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.stale = reason == "stale_connection"
        self.answer = answer  # the replica's refusal, for when no other replica takes it


class NotServedHere(Exception):
    """The replica's revision does not serve the model the request names (a LoRA adapter that
    one revision of a rollout adds or still has): another revision may."""

    def __init__(self, answer: web.Response) -> None:
        super().__init__("model_not_found")
        self.answer = answer  # the 404, for when no other revision can take it


def is_refusal(status: int, body: bytes) -> bool:
    """The replica's answer says it did not take the request (REFUSED_CODES)."""
    return status == 503 and error_code(body) in REFUSED_CODES


def failure_reason(exc: Exception, reused: bool, waited: float) -> str:
    """Why a replica gave no response, `waited` seconds after the request went out: the errors
    label, and in RETRYABLE if safe to retry."""
    if isinstance(exc, CONNECT_ERRORS):
        return "connect"
    if reused and waited < STALE_WITHIN_S and isinstance(exc, DEAD_CONNECTION_ERRORS):
        return "stale_connection"
    if isinstance(exc, TimeoutError):
        return "first_byte_timeout"
    return "upstream_error"


async def mark_reused(session: aiohttp.ClientSession, context: SimpleNamespace,
                      params: aiohttp.TraceConnectionReuseconnParams) -> None:
    """A trace hook: the attempt used a pooled connection. Only client requests carry an attempt
    to mark (proxy.Router._relay); the mirror's shadows do not."""
    if context.trace_request_ctx is not None:
        context.trace_request_ctx.reused = True


def error_code(body: bytes) -> str | None:
    """The code of an OpenAI-shaped error body, if it is one."""
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
