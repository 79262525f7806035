"""Prefix affinity in the router (kiln.router.affinity): the keys of a prompt's prefixes, and
requests sent through a real router to fake engines, which say who answered: a conversation's
turns stay on the replica that holds its prefix, a replica too busy for the slack spills the
prefix to the least busy one, and with the slack at -1 the router balances on load alone."""
from __future__ import annotations

import asyncio
import json

import pytest

from kiln.router.affinity import CHUNK, MAX_BODY, MAX_CHARS, prefix_keys
from kiln.router.proxy import Limits
from kiln.router.traffic import StaticTraffic, Traffic
from router_fakes import metric, on_event_loop, service, until

pytestmark = pytest.mark.timeout(60)
SYSTEM = "You are a careful assistant for the accounts team. " * 4  # 208 characters: 3 whole pieces


def chat(*turns: str, **extra: object) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": t} for t in turns]
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def test_prefix_keys_are_shared_exactly_as_far_as_prompts_agree():
    first, longer = prefix_keys("/v1/chat/completions", chat("a" * 100)), prefix_keys("/v1/chat/completions",
                                                                                        chat("a" * 100, "b" * 300))
    assert len(first) == (len("system\n" + SYSTEM + "\nuser\n" + "a" * 100 + "\n")) // CHUNK
    assert longer[:len(first)] == first and len(longer) > len(first)
    other_user = prefix_keys("/v1/chat/completions", chat("z" * 100))
    shared = sum(a == b for a, b in zip(first, other_user))
    assert shared == len("system\n" + SYSTEM + "\nuser\n") // CHUNK  # the system prompt's whole pieces
    # Another model (a LoRA adapter), tenant salt or tool list has caches of its own: no key in common.
    for changed in (json.dumps({"model": "sql", "messages": json.loads(chat("a" * 100))["messages"]}).encode(),
                    chat("a" * 100, cache_salt="tenant-b"), chat("a" * 100, tools=[{"type": "function"}])):
        assert not set(prefix_keys("/v1/chat/completions", changed)) & set(first)
    assert not set(prefix_keys("/v1/chat/completions", chat("a" * 100), "another key's salt")) & set(first)
    # The Responses API's instructions and input, as the chat messages they stand for.
    response = {"model": "m", "instructions": SYSTEM, "input": [{"role": "user", "content": "a" * 100}]}
    assert prefix_keys("/v1/responses", json.dumps(response).encode()) == first
    assert prefix_keys("/v1/responses", json.dumps({**response, "input": "a" * 100}).encode()) == first
    completion = json.dumps({"model": "m", "prompt": "x" * (3 * CHUNK + 5)}).encode()
    assert len(prefix_keys("/v1/completions", completion)) == 3
    # On the router's event loop: a prompt's first MAX_CHARS are hashed, a body over MAX_BODY not parsed.
    assert len(prefix_keys("/v1/completions", json.dumps({"prompt": "x" * 10 * MAX_CHARS}).encode())) == \
        MAX_CHARS // CHUNK
    assert prefix_keys("/v1/completions", json.dumps({"prompt": "x" * MAX_BODY}).encode()) == []
    # Any body reaches the router, which leaves judging it to the engine (found by the fuzz test: a 500).
    odd = {"messages": [{"role": 7, "content": [{"type": "text", "text": False}, "part", {"text": "x" * 200}]},
                        {"content": {"not": "text"}}], "instructions": 5, "input": None, "tools": "none"}
    assert len(prefix_keys("/v1/chat/completions", json.dumps(odd).encode())) == 3
    for path, body in (("/v1/completions", b'{"prompt": "short"}'), ("/v1/completions", b"not json"),
                       ("/v1/completions", b"[1, 2]"), ("/tokenize", completion),
                       ("/v1/chat/completions", b'{"messages": "no list"}')):
        assert prefix_keys(path, body) == [], (path, body)


async def ask(svc, body: bytes, script: str = "answer") -> str:
    payload = {**json.loads(body), "fake": script}
    response = await svc.client.post("/v1/completions", json=payload)  # the fakes serve this path only
    return (await response.json())["engine"]


@on_event_loop
async def test_a_conversation_stays_where_its_prefix_is_cached():
    async with service(2) as svc:
        first = await ask(svc, chat("Question one, about invoices, in some detail please."))
        for turn in range(2, 6):  # least-in-flight alone would alternate these between the replicas
            turns = [f"Question {i}, about invoices, in some detail please." for i in range(1, turn + 1)]
            assert await ask(svc, chat(*turns)) == first
        other = await ask(svc, json.dumps({"model": "m", "prompt": "another document " * 10}).encode())
        assert other != first  # a new prefix goes to the least busy (here: by rotation, the other)
        samples = await svc.metrics()
        assert metric(samples, "kiln_router_prefix_routed_total", outcome="hit") == 4
        assert metric(samples, "kiln_router_prefix_routed_total", outcome="none") == 2


@on_event_loop
async def test_a_busy_replica_spills_its_prefix_to_the_least_busy_one():
    async with service(2, limits=Limits(prefix_slack=2)) as svc:
        held = [asyncio.create_task(ask(svc, chat("Summarize this quarter."), "hold")) for _ in range(5)]
        await until(lambda: sum(svc.hits()) == 5)
        # 1st: no prefix known; 2nd, 3rd: its replica is at most 2 busier; 4th spills; 5th follows it
        assert sorted(svc.hits()) == [2, 3]
        for engine in svc.engines:
            engine.release.set()
        await asyncio.gather(*held)
        samples = await svc.metrics()
        assert [metric(samples, "kiln_router_prefix_routed_total", outcome=o) for o in ("none", "hit", "spill")] \
            == [1, 3, 1]


@on_event_loop
async def test_slack_minus_one_balances_on_load_alone():
    async with service(2, limits=Limits(prefix_slack=-1)) as svc:
        answered = [await ask(svc, chat("Same question every time, about invoices.")) for _ in range(4)]
        assert sorted(answered) == ["engine-0", "engine-0", "engine-1", "engine-1"]
        assert not [s for s in await svc.metrics() if s[0] == "kiln_router_prefix_routed_total"]


@on_event_loop
async def test_each_revision_of_a_rollout_keeps_its_own_prefix_memory():
    """A 50/50 split sends a conversation's turns to both revisions: each turn still finds the
    replica of its revision that served the prefix, which a turn on the other revision does
    not make it forget."""
    traffic = StaticTraffic(Traffic({"stable": 50, "canary": 50}, "stable", "canary"))
    async with service(4, revisions=["stable", "stable", "canary", "canary"], traffic=traffic) as svc:
        by_revision: dict[str, set[str]] = {"stable": set(), "canary": set()}
        for turn in range(1, 9):
            turns = [f"Question {i}, about invoices, in some detail please." for i in range(1, turn + 1)]
            engine = await ask(svc, chat(*turns))
            by_revision["stable" if engine in ("engine-0", "engine-1") else "canary"].add(engine)
        assert [len(engines) for engines in by_revision.values()] == [1, 1]  # one replica per revision
        samples = await svc.metrics()
        # Each revision's first turn finds no prefix of its own; every later turn is a hit.
        assert metric(samples, "kiln_router_prefix_routed_total", outcome="none") == 2
        assert metric(samples, "kiln_router_prefix_routed_total", outcome="hit") == 6
