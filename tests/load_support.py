"""Helpers for the overload, abort and engine-fault tests: a real `kiln router` process in
front of a real `kiln serve` (test_server.ServerProcess), many requests at once over aiohttp,
and SSE streams read event by event."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from test_server import REPO, get


class RouterProcess:
    """`python -m kiln.cli router --endpoints 127.0.0.1:<engine_port> ...` on a free port."""

    def __init__(self, engine_port: int, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kiln.cli", "router", "--endpoints", f"127.0.0.1:{engine_port}",
               "--host", "127.0.0.1", "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 60
        while get(self.url + "/ready")[0] != 200:
            assert self.proc.poll() is None, "router died:\n" + "".join(self.log)
            assert time.monotonic() < deadline, "router never became ready:\n" + "".join(self.log)
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


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
