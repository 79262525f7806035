"""The errors the router answers itself, shaped like OpenAI's so OpenAI clients show the
message, aiohttp's own (unknown path, wrong method) included."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

RETRY_AFTER_S = 1  # every 429's and 503's Retry-After: slots free as requests finish, so soon is right


def error_response(status: int, message: str, type_: str, code: str) -> web.Response:
    """A 429 or 503 says when to come back (OpenAI's clients honour Retry-After)."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    retry = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return web.json_response(body, status=status, headers=retry)


@web.middleware
async def http_errors(request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
    """aiohttp answers a path or method the router has no route for in plain text; this
    answers it in the same JSON as every other router error (the engine does too)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                  "invalid_request_error", exc.reason.lower().replace(" ", "_"))
        if "Allow" in exc.headers:  # a 405's list of the methods that would do
            response.headers["Allow"] = exc.headers["Allow"]
        return response
