"""The router's OpenAPI 3.1 document, served at GET /openapi.json: the engine's /v1 operations,
which it passes through, with the errors the router answers itself, and its own probes."""
from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import BaseModel, Field

from kiln.engine import openapi
from kiln.engine.openapi import error, response, retry_later

# What the router itself may answer on any /v1 request (kiln.router.proxy).
ROUTER_ERRORS = {
    "401": error("API keys are on and the request has no valid `Authorization: Bearer <key>` "
                 "(code invalid_api_key)"),
    "408": error("the request body did not arrive within --body-timeout (code request_timeout)"),
    "413": error("the request body is over the router's --max-body-bytes (code request_too_large)"),
    "429": retry_later("the router is at --max-in-flight with its queue full, holds "
                       "--max-body-bytes-in-flight of request bodies, or --max-held requests already "
                       "wait for a replica"),
    "502": error("the replica failed before answering (code upstream_error)"),
    "503": error("no replica could take the request, or none became ready within "
                 "--activation-timeout (codes no_ready_endpoint, activation_timeout)"),
    "504": error("the replica sent no response headers within --first-byte-timeout "
                 "(code upstream_timeout)"),
}


class RouterReadiness(BaseModel):
    status: Literal["ready"]
    endpoints: int = Field(ge=0)  # ready replicas
    revisions: dict[str, int]  # ready replicas per revision


def _with_router_errors(paths: dict[str, Any]) -> dict[str, Any]:
    for path in paths.values():
        for operation in path.values():
            for status, answer in ROUTER_ERRORS.items():
                # An error the engine answers too is the same shape; the router's wording wins.
                operation["responses"][status] = answer
    return paths


@functools.cache
def router_document() -> dict[str, Any]:
    return openapi.document("kiln router", {
        **_with_router_errors({**openapi.v1_paths(), **openapi.tokenizer_paths()}),
        "/health": openapi.get("Liveness", "health", {"200": response("alive", openapi.Health)}),
        "/ready": openapi.get("Ready as soon as it serves, with or without ready replicas", "ready",
                              {"200": response("serving", RouterReadiness)}),
        "/metrics": openapi.get("Prometheus metrics", "metrics",
                                {"200": response("the exposition", media=openapi.TEXT)}),
        "/openapi.json": openapi.self_path(),
    }, extra_models=[RouterReadiness])
