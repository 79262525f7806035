"""The quality gate's mirror. During a rollout a share of requests is copied, in the
background, into a teacher-forced comparison: the stable revision answers the prompt greedily
(returning its token ids), then the canary scores those tokens (prompt logprobs) and every
position where its argmax is the stable revision's token counts as agreed. It is the
definition `kiln eval` uses (kiln.engine.evaluate.greedy_agreement). A share of the mirrored
requests is also scored by a stable replica, ideally another one: stable against itself is
the noise floor (batching changes floating-point order, so greedy outputs of one model are
not always identical), and the gate compares the canary with that floor.

The client never waits for any of this: its request goes on as usual, shadow responses are
never sent to it, and at most `max_in_flight` comparisons run at once (more are skipped)."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from kiln.router.affinity import MAX_BODY
from kiln.router.balancer import LeastInFlight
from kiln.router.endpoints import Endpoint
from kiln.router.metrics import RouterMetrics
from kiln.router.traffic import Traffic

log = logging.getLogger("kiln.router")

MIRRORED_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_TOKENS = 32  # greedy tokens the stable revision generates for one comparison
TIMEOUT_S = 120.0  # one whole comparison
# Kept from the client's request: what makes the prompt the model sees (the chat template writes
# the tools and its kwargs in) and what constrains its output (a required or named tool call,
# response_format, structured_outputs), so the stable revision answers what the client ran: a
# canary that breaks tool-call formatting must disagree. Everything else goes: greedy is forced
# (the canary's argmax is the measure; penalties, logit_bias, min_tokens would bend the stable
# tokens away from its own argmax); the answer is read as one JSON body of one choice (stream,
# stream_options, n); logprobs and echo change neither prompt nor output tokens, only cost.
# The canary scores without the constraint; where it overrides the argmax, the noise floor (stable
# scored the same way) disagrees too.
KEPT = ("model", "prompt", "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
        "add_generation_prompt", "continue_final_message", "response_format", "structured_outputs")


class Credit:
    """Takes `rate` of the calls, evenly and without randomness (0.25: every fourth)."""

    def __init__(self) -> None:
        self._credit = 0.0

    def take(self, rate: float) -> bool:
        self._credit += rate
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False


def greedy_request(body: bytes) -> dict[str, Any] | None:
    """The client's prompt, with its output constraint (KEPT), as a greedy request that returns
    token ids; None when the body is no JSON object with a prompt or messages."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    if not isinstance(payload, dict) or not ({"prompt", "messages"} & payload.keys()):
        return None
    asked = payload.get("max_completion_tokens") or payload.get("max_tokens") or MAX_TOKENS
    request = {k: payload[k] for k in KEPT if k in payload}
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        request["prompt"] = prompt[0]  # a batch: its first prompt stands for it (one choice is scored)
    return {**request, "max_tokens": min(int(asked), MAX_TOKENS), "temperature": 0, "stream": False,
            "return_token_ids": True}


def agreement(scored: dict[str, Any], prompt: list[int], output: list[int]) -> int:
    """How many of `output`'s tokens were the scorer's argmax, from its prompt_logprobs over
    prompt + output (each position's entry holds the actual token with its rank, 1 = argmax)."""
    entries = scored["choices"][0]["prompt_logprobs"][len(prompt):]
    if len(entries) != len(output):
        raise ValueError(f"{len(entries)} prompt logprobs for {len(output)} tokens")
    return sum(1 for token, entry in zip(output, entries) if entry[str(token)]["rank"] == 1)


class Mirroring:
    def __init__(self, balancer: LeastInFlight, metrics: RouterMetrics,
                 session: Callable[[], aiohttp.ClientSession], max_in_flight: int = 4) -> None:
        self._balancer = balancer
        self._metrics = metrics
        self._session = session
        self._max_in_flight = max_in_flight
        self._tasks: set[asyncio.Task] = set()
        self._sample = Credit()
        self._floor = Credit()

    def offer(self, path: str, body: bytes, traffic: Traffic, authorization: str | None) -> None:
        """Maybe mirror this request (called as it arrives; returns at once). `authorization`: the
        client's header, which shadows carry too: engines with API keys refuse a request without."""
        if traffic.mirror is None or traffic.stable is None or traffic.canary is None \
                or path not in MIRRORED_PATHS or not self._sample.take(traffic.mirror.sample_rate):
            return
        # Too many shadows already, or a body too large to parse on the router's one event loop
        # (every stream would stall meanwhile), as prefix hashing leaves it.
        if len(self._tasks) >= self._max_in_flight or len(body) > MAX_BODY:
            self._metrics.mirrored.labels("skipped").inc()
            return
        floor = self._floor.take(traffic.mirror.floor_sample_rate)
        task = asyncio.get_running_loop().create_task(self._compare(path, body, traffic, floor, authorization))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _compare(self, path: str, body: bytes, traffic: Traffic, floor: bool,
                       authorization: str | None) -> None:
        assert traffic.stable is not None and traffic.canary is not None
        try:
            async with asyncio.timeout(TIMEOUT_S):
                await self._score_against_stable(path, body, traffic.stable, traffic.canary, floor,
                                                authorization)
        except Exception as exc:  # noqa: BLE001 - a failed shadow only costs a sample
            log.info("mirrored comparison failed: %r", exc)
            self._metrics.mirrored.labels("failed").inc()

    async def _score_against_stable(self, path: str, body: bytes, stable: str, canary: str,
                                    floor: bool, authorization: str | None) -> None:
        request = greedy_request(body)
        if request is None:
            self._metrics.mirrored.labels("skipped").inc()
            return
        generator = self._balancer.pick(revision=stable)
        # The canary's scorer is picked once, here: a pick made only to see that one is there took
        # a turn of the rotation, and every comparison was scored by the same canary replica.
        canary_scorer = self._balancer.pick(revision=canary)
        if generator is None or canary_scorer is None:
            self._metrics.mirrored.labels("skipped").inc()
            return
        answer = await self._post(generator, path, request, authorization)
        choice = answer["choices"][0]
        prompt = choice.get("prompt_token_ids") or answer.get("prompt_token_ids")
        output = choice["token_ids"]
        scorers = [canary] + ([stable] if floor else [])
        for revision in scorers:
            # The floor is scored by another stable replica where there is one.
            scorer = canary_scorer if revision == canary else \
                self._balancer.pick(revision=stable, exclude=[generator]) or self._balancer.pick(revision=stable)
            if scorer is None:
                continue
            scored = await self._post(scorer, "/v1/completions", {
                "model": request.get("model"), "prompt": prompt + output, "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 0}, authorization)
            agreed = agreement(scored, prompt, output)  # first: one that raises counts no tokens either
            self._metrics.mirror_tokens.labels(revision).inc(len(output))
            self._metrics.mirror_agreed.labels(revision).inc(agreed)
        self._metrics.mirrored.labels("scored").inc()

    async def _post(self, endpoint: Endpoint, path: str, payload: dict[str, Any],
                    authorization: str | None) -> dict[str, Any]:
        headers = {"Authorization": authorization} if authorization else None
        with self._balancer.busy(endpoint):
            async with self._session().post(endpoint.url + path, json=payload, headers=headers,
                                          allow_redirects=False) as response:
                if response.status != 200:
                    raise RuntimeError(f"{endpoint} answered {response.status}: {(await response.text())[:200]}")
                return await response.json()
