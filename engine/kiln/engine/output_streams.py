"""Reading what the engine sends for a request: its outputs until it finishes, several requests'
at once (the choices of one response), and each step's logprob entries."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from kiln.engine import RequestOutput
from kiln.engine.async_engine import RequestStream
from kiln.engine.api_errors import APIError


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
