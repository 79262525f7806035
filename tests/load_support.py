"""Helpers for the overload, abort and engine-fault tests: many requests at once over aiohttp,
and SSE streams read event by event (the processes they talk to: kiln_process)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp



@dataclass
class Answer:
    status: int
    retry_after: str | None
    body: dict[str, Any]


def session(timeout: float = 120) -> aiohttp.ClientSession:
    """No connection limit (aiohttp's default 100 would queue the burst in the client) and a bound
    on every request, so nothing can hang a test."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout))


async def burst(url: str, bodies: list[dict[str, Any]]) -> list[Answer]:
    """POST every body to url at once; each answer's status, Retry-After and JSON body."""
    async with session() as client:
        async def one(body: dict[str, Any]) -> Answer:
            async with client.post(url, json=body) as r:
                return Answer(r.status, r.headers.get("Retry-After"), await r.json(content_type=None))
        return await asyncio.gather(*(one(b) for b in bodies))


async def sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The payload of each `data:` line: parsed JSON, or the string "[DONE]"."""
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].decode().strip()
            yield data if data == "[DONE]" else json.loads(data)


def is_openai_error(body: Any) -> bool:
    return isinstance(body, dict) and set(body) == {"error"} and \
        set(body["error"]) == {"message", "type", "param", "code"}
