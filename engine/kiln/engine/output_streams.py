"""Reading what the engine sends for a request: its outputs until it finishes, several requests'
at once (the choices of one response), and each step's logprob entries; and the SSE response
that streams them to the client."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Protocol

from aiohttp import web

from kiln.engine import RequestOutput
from kiln.engine.async_engine import RequestStream
from kiln.engine.api_errors import APIError

log = logging.getLogger("kiln.serve")
DEFAULT_WRITE_TIMEOUT_S = 60.0  # --write-timeout: EventStream's bound


class Choice(Protocol):
    stream: RequestStream | None  # set once submitted


async def merged(choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Every choice's outputs as they come, until each has finished; an engine failure in any
    ends them all. Close it (contextlib.aclosing) to stop its readers at once."""
    arrived: asyncio.Queue = asyncio.Queue()

    async def read(choice: Choice) -> None:
        try:
            async for out in until_finished(choice.stream.outputs):
                arrived.put_nowait((choice, out))
        except APIError as e:
            arrived.put_nowait((choice, e))

    readers = [asyncio.create_task(read(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            choice, out = await arrived.get()
            if isinstance(out, APIError):
                raise out
            left -= out.finished
            yield choice, out
    finally:
        for reader in readers:
            reader.cancel()


async def until_finished(outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    while True:
        out = await outputs.get()
        if isinstance(out, Exception):  # EngineDeadError: the engine loop failed
            raise APIError(500, f"the engine failed while generating: {out}", type_="server_error",
                           code="engine_dead")
        if out.finish_reason == "error":  # the request's own fault, met while generating: the same
            # request fails again, so a 4xx; its text so far is not sent as if it were an answer
            raise APIError(400, out.error, code="generation_failed")
        yield out
        if out.finished:
            return


def new_entries(out: RequestOutput) -> list[dict]:
    """This step's logprob entries, whether the engine reports them per step or cumulatively."""
    if not out.logprobs or not out.new_token_ids:
        return []
    return list(out.logprobs[-len(out.new_token_ids):])


class EventStream(web.StreamResponse):
    """An SSE response whose every write must reach the client within write_timeout seconds.
    aiohttp's write waits without a bound for the client to take the bytes: a client that stopped
    reading but kept its connection open held its request in the batch (KV blocks and a seat) to
    the end of its generation, then its handler, connection and outputs for ever. Past the bound
    the connection is dropped and write raises ConnectionResetError, as when a client goes: the
    handler then aborts its requests. write_eof drops it without raising: the stream is over."""

    def __init__(self, request: web.Request, write_timeout: float) -> None:
        super().__init__(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.request, self.write_timeout = request, write_timeout

    async def write(self, data: bytes) -> None:
        if not await self._within_timeout(super().write(data)):
            raise ConnectionResetError(f"the client read nothing for {self.write_timeout}s")

    async def write_eof(self, data: bytes = b"") -> None:
        await self._within_timeout(super().write_eof(data))

    async def _within_timeout(self, writing: Awaitable[None]) -> bool:
        """False if the write timed out, and the connection is dropped."""
        try:
            async with asyncio.timeout(self.write_timeout):
                await writing
            return True
        except TimeoutError:
            log.warning("%s %s: the client read nothing for %gs (--write-timeout): connection dropped",
                        self.request.method, self.request.path, self.write_timeout)
            if self.request.transport is not None:
                self.request.transport.abort()  # close() would wait to hand the client what it does not read
            return False
