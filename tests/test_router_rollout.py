"""The router during a rollout: requests split by the revisions' weights from status, and the
quality gate's mirror (the stable revision answers greedily, the canary scores its tokens),
against fake engines on 127.0.0.1 that speak the engine's token-id and prompt-logprob
extension (the real engine's side is tested in test_server.py)."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web

from kiln.engine.openai_protocol import ChatCompletionRequest, CompletionRequest
from kiln.router.mirror import Credit, agreement, greedy_request
from kiln.router.traffic import Mirror, StaticTraffic, Traffic, WeightedChoice, traffic_of
from kiln.router.endpoints import ReadyEndpoints
from router_fakes import ChangingEndpoints, FakeEngine, FirstRefuses, metric, on_event_loop, service, until, until_held

PROMPT_IDS = [5, 6, 7]
OUTPUT_IDS = [11, 12, 13, 14]


class ScoringEngine(FakeEngine):
    """Answers as FakeEngine does, plus the two calls of a mirrored comparison: a greedy
    request with return_token_ids (always OUTPUT_IDS), and a scoring request with
    prompt_logprobs, where it agrees on the first `agrees` output positions. A scoring
    request waits for `release` when `slow`."""
    agrees = len(OUTPUT_IDS)
    slow = False
    short = False  # a scoring answer one entry short
    key: str | None = None  # demanded of every request, as an engine's KILN_API_KEYS does

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.scored = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        payload = await request.json()
        if payload.get("return_token_ids"):
            return web.json_response({"choices": [{"text": "shadow", "token_ids": OUTPUT_IDS,
                                                   "prompt_token_ids": PROMPT_IDS}]})
        if "prompt_logprobs" in payload:
            if self.slow:
                await self.release.wait()
            self.scored += 1
            prompt = payload["prompt"]
            entries = [None] + [{str(t): {"logprob": -0.1, "rank": 1 if i - len(PROMPT_IDS) < self.agrees else 2}}
                                for i, t in enumerate(prompt) if i > 0]
            return web.json_response({"choices": [{"text": "", "prompt_logprobs": entries[:-1] if self.short else entries}]})
        return await super().completions(request)


def split(weights: dict[str, int], mirror: Mirror | None = None) -> StaticTraffic:
    return StaticTraffic(Traffic(weights, "stable", "canary", mirror))


@on_event_loop
async def test_requests_split_by_weight_within_five_points_and_metrics_count_per_revision() -> None:
    traffic = split({"stable": 70, "canary": 30, "old": 0})
    async with service(3, revisions=["stable", "canary", "old"], traffic=traffic) as svc:
        statuses = [(await svc.complete()).status for _ in range(400)]
        assert statuses == [200] * 400
        stable, canary, old = svc.hits()
        assert abs(canary / 400 - 0.30) <= 0.05 and old == 0 and stable + canary == 400
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="canary", code="200") == canary
        assert metric(samples, "kiln_router_requests_total", revision="stable", code="200") == stable
        # The operator moves the weights (as a status update would): the split follows at once.
        traffic.traffic = Traffic({"stable": 0, "canary": 100}, "canary")
        before = svc.hits()
        for _ in range(20):
            assert (await svc.complete()).status == 200
        assert [a - b for a, b in zip(svc.hits(), before)] == [0, 20, 0]


@on_event_loop
async def test_one_at_a_time_requests_rotate_over_each_revisions_replicas() -> None:
    """Ties rotated on one count of every pick: a 50/50 split alternates revisions, so each
    two-replica revision got turns 0, 2, 4... and all of its requests went to its first replica."""
    async with service(4, revisions=["stable", "stable", "canary", "canary"],
                       traffic=split({"stable": 50, "canary": 50})) as svc:
        for _ in range(8):
            assert (await svc.complete()).status == 200
        assert svc.hits() == [2, 2, 2, 2]


@on_event_loop
async def test_requests_wait_for_the_split_when_several_revisions_are_ready_and_it_is_unknown() -> None:
    """The router's first read of its InferenceService failed (the API server away as it started):
    with a stable and a canary ready it cannot tell their weights, so requests wait for the split
    (a canary at weight 0 took its per-pod share); one revision alone serves at once."""
    traffic = StaticTraffic(Traffic(known=False))
    async with service(2, revisions=["stable", "canary"], traffic=traffic) as svc:
        waiting = asyncio.create_task(svc.complete())
        async with asyncio.timeout(30):  # answered at once instead, it is never held
            await until_held(svc.client, 1)
        assert svc.hits() == [0, 0]
        traffic.traffic = Traffic({"stable": 100, "canary": 0}, "stable", "canary")  # read at last
        assert (await waiting).status == 200 and svc.hits() == [1, 0]
        # Replicas were ready all along: no cold start, whose time status.autoscaling reports.
        assert metric(await svc.metrics(), "kiln_router_cold_start_seconds_count") == 0
    async with service(1, revisions=["stable"], traffic=StaticTraffic(Traffic(known=False))) as svc:
        assert (await svc.complete()).status == 200


@on_event_loop
async def test_the_split_is_unknown_until_the_inference_service_is_read() -> None:
    from kubernetes import client
    from kiln.router.traffic import InferenceServiceTraffic
    nowhere = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))  # discard port: refused
    followed = InferenceServiceTraffic(nowhere, "ml", "chat")
    await followed.start()  # the first list failed
    try:
        assert not followed.current().known
    finally:
        await followed.stop()


@on_event_loop
async def test_a_weighted_revision_without_ready_replicas_gives_its_share_to_the_others() -> None:
    async with service(1, revisions=["stable"], traffic=split({"stable": 50, "canary": 50})) as svc:
        assert [(await svc.complete()).status for _ in range(10)] == [200] * 10
        assert svc.hits() == [10]


@on_event_loop
async def test_the_stable_revision_without_a_replica_gives_its_share_to_no_canary() -> None:
    """The stable revision at zero (or all its pods restarting) beside a ready canary at a 10%
    step: requests wait for it, or the canary, not yet vetted, took every request."""
    traffic = split({"stable": 90, "canary": 10})
    async with service(2, revisions=["stable", "canary"], traffic=traffic, source=ChangingEndpoints) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        stable, canary = svc.endpoints
        svc.source.set(ReadyEndpoints.of([canary]))
        pending = [asyncio.create_task(svc.complete()) for _ in range(3)]
        async with asyncio.timeout(30):  # sent to the canary instead, they are never held
            await until_held(svc.client, 3)
        assert svc.hits() == [0, 0]
        svc.source.set(ReadyEndpoints.of([stable, canary]))
        assert [r.status for r in await asyncio.gather(*pending)] == [200, 200, 200]
        assert sum(svc.hits()) == 3 and svc.hits()[0] >= 2


@on_event_loop
async def test_a_revision_at_weight_zero_takes_nothing_and_requests_wait_for_a_weighted_one() -> None:
    """A canary not yet vetted (weight 0) is ready while the stable revision is at zero: requests
    are held, as at zero replicas (the held count is what scales the stable revision up), and go
    to the stable replica once it is ready, or to the canary once the split gives it weight."""
    traffic = split({"stable": 100, "canary": 0})
    async with service(2, revisions=["stable", "canary"], traffic=traffic, source=ChangingEndpoints) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        stable, canary = svc.endpoints
        svc.source.set(ReadyEndpoints.of([canary]))
        pending = asyncio.create_task(svc.complete())
        await until_held(svc.client, 1)
        svc.source.set(ReadyEndpoints.of([stable, canary]))
        answer = await pending
        assert answer.status == 200 and (await answer.json())["engine"] == "engine-0"
        svc.source.set(ReadyEndpoints.of([canary]))
        pending = asyncio.create_task(svc.complete())
        await until_held(svc.client, 1)
        traffic.traffic = Traffic({"stable": 0, "canary": 100}, "canary")  # no endpoint changes
        answer = await pending
        assert answer.status == 200 and (await answer.json())["engine"] == "engine-1"
        assert svc.hits() == [1, 1]
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_cold_start_seconds_count") == 2


@on_event_loop
async def test_a_refusal_is_never_retried_on_a_revision_at_weight_zero() -> None:
    """A stable replica that refuses (dead or draining before its EndpointSlice says so) leaves
    its request to the other stable replicas, never to a canary the split gives nothing."""
    traffic = split({"stable": 100, "canary": 0})
    async with service(2, revisions=["stable", "canary"], traffic=traffic, fake=FirstRefuses) as svc:
        for code in ("engine_dead", "not_ready"):
            answer = await svc.client.post("/v1/completions", json={"prompt": "x", "refuse_code": code})
            assert answer.status == 503 and (await answer.json())["error"]["code"] == code
        assert svc.hits() == [2, 0]


@on_event_loop
async def test_a_held_request_tried_twice_is_one_cold_start() -> None:
    """Held at zero, then asked of the revision without its model (a 404) and answered by the
    other: one cold start, timed to the answer the client got."""
    traffic = split({"stable": 100, "canary": 0})
    async with service(2, revisions=["stable", "canary"], traffic=traffic, source=ChangingEndpoints) as svc:
        assert isinstance(svc.source, ChangingEndpoints)
        svc.engines[0].serves, svc.engines[1].serves = {"base"}, {"base", "sql"}
        svc.source.set(ReadyEndpoints.of([]))
        pending = asyncio.create_task(svc.client.post("/v1/completions", json={"model": "sql", "prompt": "x"}))
        await until_held(svc.client, 1)
        svc.source.set(ReadyEndpoints.of(svc.endpoints))
        answer = await pending
        assert answer.status == 200 and svc.hits() == [1, 1]
        assert metric(await svc.metrics(), "kiln_router_cold_start_seconds_count") == 1


@on_event_loop
async def test_a_model_only_one_revision_serves_is_answered_there() -> None:
    """A LoRA adapter the canary adds (or the stable revision still has) is never a 404 for the
    share of requests the split sends to the revision without it."""
    traffic = split({"stable": 50, "canary": 50})
    async with service(3, revisions=["stable", "stable", "canary"], traffic=traffic) as svc:
        for fake in svc.engines[:2]:
            fake.serves = {"base"}
        svc.engines[2].serves = {"base", "sql"}
        for _ in range(20):
            answer = await svc.client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
            assert answer.status == 200 and (await answer.json())["engine"] == "engine-2"
        stable_hits = sum(svc.hits()[:2])
        assert stable_hits > 0  # some went to the stable revision first, and were answered by the canary
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_requests_total", revision="canary", code="200") == 20
        # A model no revision serves: the engine's 404, after asking each revision once.
        answer = await svc.client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert answer.status == 404 and (await answer.json())["error"]["code"] == "model_not_found"
        assert answer.headers["X-Engine"].startswith("engine-")  # the replica's own headers come too
        assert sum(svc.hits()) == stable_hits + 20 + 2
        # Asked again elsewhere, a model a revision lacks is no retry it is blamed for (the canary
        # analysis counts retries as the revision's errors): a client's typo would roll one back.
        assert metric(await svc.metrics(), "kiln_router_retries_total", revision="stable") == 0
        assert metric(await svc.metrics(), "kiln_router_retries_total", revision="canary") == 0
        # Another 404 (no such route on the engine; another code) is passed on, not retried.
        before = sum(svc.hits())
        answer = await svc.client.post("/v1/embeddings", json={"model": "base"})
        assert answer.status == 404 and sum(svc.hits()) == before
        answer = await svc.client.post("/v1/completions", json={"model": "base", "fake": "missing"})
        assert answer.status == 404 and (await answer.json())["error"]["code"] == "not_found"
        assert answer.headers["X-Engine"].startswith("engine-") and sum(svc.hits()) == before + 1


@on_event_loop
async def test_mirrored_comparisons_score_the_canary_and_the_noise_floor() -> None:
    ScoringEngine.agrees = 3  # the canary's argmax matches 3 of the 4 stable tokens
    traffic = split({"stable": 50, "canary": 50}, Mirror(sample_rate=0.5, floor_sample_rate=0.5))
    async with service(3, revisions=["stable", "stable", "canary"], traffic=traffic, fake=ScoringEngine) as svc:
        for _ in range(8):
            response = await svc.complete()
            assert response.status == 200 and "engine" in await response.json()  # never the shadow's answer
        await until(lambda: sum(e.scored for e in svc.engines) == 4 + 2)
        samples = await svc.metrics()
        # 4 of 8 requests mirrored; 2 of those also scored by stable (the other replica).
        assert metric(samples, "kiln_router_mirror_tokens_total", revision="canary") == 4 * 4
        assert metric(samples, "kiln_router_mirror_agreed_total", revision="canary") == 4 * 3
        assert metric(samples, "kiln_router_mirror_tokens_total", revision="stable") == 2 * 4
        assert metric(samples, "kiln_router_mirrored_requests_total", outcome="scored") == 4
        # Client metrics count client requests only.
        assert sum(metric(samples, "kiln_router_requests_total", revision=r, code="200")
                   for r in ("stable", "canary")) == 8
    ScoringEngine.agrees = len(OUTPUT_IDS)


@contextlib.asynccontextmanager
async def every_request_mirrored(**flags: bool | str) -> AsyncIterator:
    """A stable and a canary ScoringEngine (with these class flags set) behind a router that
    mirrors every request to the canary and none to the noise floor."""
    saved = {name: getattr(ScoringEngine, name) for name in flags}
    for name, value in flags.items():
        setattr(ScoringEngine, name, value)
    try:
        traffic = split({"stable": 100, "canary": 0}, Mirror(sample_rate=1.0, floor_sample_rate=0.0))
        async with service(2, revisions=["stable", "canary"], traffic=traffic, fake=ScoringEngine) as svc:
            yield svc
    finally:
        for name, value in saved.items():
            setattr(ScoringEngine, name, value)


@on_event_loop
async def test_one_comparison_at_a_time_is_scored_by_each_canary_replica_in_turn() -> None:
    """Whether a canary replica was there to score was asked by picking one: each comparison took
    two canary turns, and every score went to the same replica (the other was never judged)."""
    traffic = split({"stable": 100, "canary": 0}, Mirror(sample_rate=1.0, floor_sample_rate=0.0))
    async with service(3, revisions=["stable", "canary", "canary"], traffic=traffic, fake=ScoringEngine) as svc:
        for scored in range(1, 5):
            assert (await svc.complete()).status == 200
            await until(lambda: sum(e.scored for e in svc.engines) == scored)  # bounded by the test timeout
        assert [e.scored for e in svc.engines] == [0, 2, 2]


@on_event_loop
async def test_a_comparison_that_cannot_be_scored_counts_no_tokens() -> None:
    # Its tokens were counted before the scoring raised, with none agreed: a canary's greedy
    # agreement fell with every malformed answer, and could fail the quality gate.
    async with every_request_mirrored(short=True) as svc:
        for _ in range(3):
            assert (await svc.complete()).status == 200
        while metric(await svc.metrics(), "kiln_router_mirrored_requests_total", outcome="failed") != 3:
            await asyncio.sleep(0.01)  # bounded by the test timeout
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_mirror_tokens_total", revision="canary") == 0
        assert metric(samples, "kiln_router_mirror_agreed_total", revision="canary") == 0


@on_event_loop
async def test_shadows_carry_the_clients_api_key_to_engines_that_demand_one() -> None:
    """Engines checking API keys (KILN_API_KEYS in spec.engine.env) answered every keyless shadow
    401: the canary analysis got no mirrored tokens, and stayed inconclusive."""
    async with every_request_mirrored(key="key-a") as svc:
        canary = svc.engines[1]
        response = await svc.client.post("/v1/completions", json={"prompt": "hi"},
                                         headers={"Authorization": "Bearer key-a"})
        assert response.status == 200
        mirrored = "kiln_router_mirrored_requests_total"
        samples = await svc.metrics()
        while not metric(samples, mirrored, outcome="scored") + metric(samples, mirrored, outcome="failed"):
            await asyncio.sleep(0.01)  # bounded by the test timeout
            samples = await svc.metrics()
        assert metric(samples, mirrored, outcome="scored") == 1 and canary.scored == 1
        assert metric(samples, "kiln_router_mirror_tokens_total", revision="canary") == len(OUTPUT_IDS)


@on_event_loop
async def test_a_slow_shadow_never_delays_the_client() -> None:
    async with every_request_mirrored(slow=True) as svc:
        stable, canary = svc.engines
        for _ in range(3):
            response = await asyncio.wait_for(svc.complete(), 10)
            assert response.status == 200 and await response.json() == {"engine": stable.name}
        assert canary.scored == 0  # the shadows wait at the canary; the clients did not
        canary.release.set()
        await until(lambda: canary.scored == 3)
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_mirror_tokens_total", revision="canary") == 12


@on_event_loop
async def test_a_body_too_large_to_parse_on_the_event_loop_is_not_mirrored() -> None:
    from kiln.router.affinity import MAX_BODY
    async with every_request_mirrored() as svc:
        stable, canary = svc.engines
        # (the fake engine answers it 413: aiohttp's own 1 MiB limit; the mirror's choice came first)
        await svc.client.post("/v1/completions", json={"prompt": "x" * MAX_BODY, "fake": "answer"})
        assert metric(await svc.metrics(), "kiln_router_mirrored_requests_total", outcome="skipped") == 1
        assert (await svc.complete()).status == 200  # a small one still is
        await until(lambda: canary.scored == 1)


def test_weighted_choice_is_exact_over_each_cycle() -> None:
    choice = WeightedChoice()
    picks = [choice.choose({"a": 30, "b": 70}) for _ in range(10)]
    assert picks.count("a") == 3 and picks.count("b") == 7
    assert choice.choose({"a": 0}) is None


def test_credit_takes_its_rate_evenly() -> None:
    credit = Credit()
    assert [credit.take(0.25) for _ in range(8)] == [False, False, False, True] * 2
    assert not any(Credit().take(0.0) for _ in range(100))


def test_traffic_comes_from_status_and_mirrors_only_while_a_canary_runs() -> None:
    status = {"revisions": [{"name": "a", "role": "stable", "weight": 90}, {"name": "b", "role": "canary", "weight": 10}],
              "rollout": {"phase": "Progressing", "stable": "a", "canary": "b",
                          "mirror": {"sampleRate": 0.1, "floorSampleRate": 0.5}}}
    assert traffic_of(status) == Traffic({"a": 90, "b": 10}, "a", "b", Mirror(0.1, 0.5))
    done = {**status, "rollout": {**status["rollout"], "phase": "RolledBack"}}
    assert traffic_of(done).mirror is None and traffic_of(done).canary is None
    assert traffic_of({"revisions": [{"name": "a", "role": "stable"}]}) == Traffic()
    assert traffic_of(None) == Traffic()


def test_greedy_request_and_agreement_follow_the_eval_definition() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.8,
                       "max_tokens": 500, "stream": True, "logprobs": True}).encode()
    assert greedy_request(body) == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 32, "temperature": 0, "stream": False, "return_token_ids": True}
    assert greedy_request(b"not json") is None and greedy_request(b'{"model": "m"}') is None
    assert greedy_request(b"[" * 100_000) is None  # skipped, not a failed comparison
    # A batch of prompts, or of n choices: its first prompt, once (the stable answer is one choice).
    for prompt, first in ((["a", "b"], "a"), ([[1, 2], [3]], [1, 2]), ([1, 2], [1, 2]), ("a", "a")):
        request = greedy_request(json.dumps({"model": "m", "prompt": prompt, "n": 4}).encode())
        assert request["prompt"] == first and "n" not in request
    scored = {"choices": [{"prompt_logprobs": [None, {"6": {"rank": 3}}, {"11": {"rank": 1}}, {"12": {"rank": 2}}]}]}
    assert agreement(scored, [5, 6], [11, 12]) == 1


def test_the_greedy_request_keeps_what_shapes_the_prompt_and_the_output() -> None:
    """Only the model and the prompt or messages were kept: the stable revision answered a chat
    without its tools (the template writes them into the prompt) and unconstrained, so a canary
    breaking tool calls passed the gate."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    shape = {"messages": [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Let"}],
             "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
             "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False,
             "continue_final_message": True}
    sampling = {"temperature": 0.7, "presence_penalty": 1.0, "logit_bias": {"5": 10}, "min_tokens": 4, "n": 2,
                "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    request = greedy_request(json.dumps({"model": "m", **shape, **sampling}).encode())
    assert request == {"model": "m", **shape, "max_tokens": 32, "temperature": 0, "stream": False,
                       "return_token_ids": True}
    ChatCompletionRequest.model_validate(request)  # a shadow the engine takes (no stream_options without stream)
    completion = {"prompt": "{", "response_format": {"type": "json_object"}, "echo": True, "logprobs": 1}
    request = greedy_request(json.dumps(completion).encode())
    assert request == {"prompt": "{", "response_format": {"type": "json_object"}, "max_tokens": 32, "temperature": 0,
                       "stream": False, "return_token_ids": True}
    CompletionRequest.model_validate(request)
