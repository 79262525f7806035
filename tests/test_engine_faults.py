"""Engine death is loud (issue 18, item 2): an exception inside the engine loop of a real
`kiln serve` (SmolLM2, fp32), raised by the test-only hook KILN_FAULT_INJECT=step:N, fails every
request in flight with a 5xx naming the cause, refuses new ones with 503, turns /health and
/ready to 503, releases the KV cache, and leaves nothing hanging: every wait here is bounded."""
from __future__ import annotations

import asyncio
import json
import signal

import pytest

from kiln.cli import main as cli_main
from load_support import is_openai_error, session, sse_data
from test_server import MODEL, ServerProcess, get, post
from test_sleep import rss_mib

FAULT_STEP = 60  # late enough that all requests below are running, early enough that none finished
STREAMS, WHOLE = 6, 2
# ~320 tokens each, none shared (each starts with its own number, so the prefix cache shares no
# block): 8 prompts touch ~120 MB of the pool, which the dead engine must give back.
PROMPT = "In a quiet harbour town the fishermen mended their nets and told old stories. " * 20


@pytest.fixture
def doomed(monkeypatch):
    monkeypatch.setenv("KILN_FAULT_INJECT", f"step:{FAULT_STEP}")
    s = ServerProcess("--max-model-len", "1024", "--kv-cache-memory", "256Mi")
    yield s
    s.stop()


async def requests_in_flight(url: str, first_chunks: asyncio.Semaphore) -> tuple[list, list]:
    def body(i: int) -> dict:
        return {"model": MODEL, "prompt": f"{i}. {PROMPT}", "max_tokens": 400, "ignore_eos": True}

    async with session(timeout=120) as client:
        async def stream(i: int) -> list:
            events = []
            async with client.post(url, json={**body(i), "stream": True}) as r:
                assert r.status == 200
                async for data in sse_data(r):
                    events.append(data)
                    if len(events) == 1:
                        first_chunks.release()
            return events

        async def whole(i: int) -> tuple[int, dict]:
            async with client.post(url, json=body(i)) as r:
                return r.status, await r.json()

        streams = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
        wholes = [asyncio.create_task(whole(STREAMS + i)) for i in range(WHOLE)]
        return await asyncio.gather(*streams), await asyncio.gather(*wholes)


def test_engine_death_fails_every_request_frees_the_cache_and_turns_health_to_503(doomed):
    url = doomed.url + "/v1/completions"
    rss: dict[str, float] = {}

    async def run() -> tuple[list, list]:
        first_chunks = asyncio.Semaphore(0)
        traffic = asyncio.create_task(requests_in_flight(url, first_chunks))
        for _ in range(STREAMS):  # every stream is generating: its prompt's KV pages are touched
            await asyncio.wait_for(first_chunks.acquire(), 120)
        rss["serving"] = rss_mib(doomed)
        return await asyncio.wait_for(traffic, 120)

    streams, wholes = asyncio.run(run())
    cause = f"InjectedFault: fault injected in engine step {FAULT_STEP}"
    for events in streams:  # tokens, then one error event naming the cause, then the end
        *tokens, last = events
        assert tokens and all("choices" in e for e in tokens), events[:3]
        assert is_openai_error(last) and last["error"]["code"] == "engine_dead", last
        assert cause in last["error"]["message"], last
    for status, reply in wholes:
        assert status == 500 and is_openai_error(reply) and reply["error"]["code"] == "engine_dead", reply
        assert cause in reply["error"]["message"], reply

    status, health = get(doomed.url + "/health")
    assert status == 503 and cause in json.loads(health)["error"], health
    status, ready = get(doomed.url + "/ready")
    assert status == 503 and json.loads(ready) == {"status": "dead"}
    code, reply = post(url, {"model": MODEL, "prompt": "anyone there?", "max_tokens": 2})
    assert code == 503 and reply["error"]["code"] == "engine_dead" and cause in reply["error"]["message"]
    assert post(doomed.url + "/wake_up", {})[0] == 503

    m = doomed.metrics()
    killed = m["kiln:request_success_total{finished_reason=error}"]
    rss["dead"] = rss_mib(doomed)
    print(f"killed {killed:.0f} of {STREAMS + WHOLE} requests in flight at step {FAULT_STEP}; "
          f"new requests 503; RSS {rss['serving']:.0f} MiB serving -> {rss['dead']:.0f} MiB dead")
    assert killed == STREAMS + WHOLE
    assert m["kiln:kv_cache_bytes"] == 0 and m["kiln:num_requests_running"] == 0, m
    assert rss["serving"] - rss["dead"] > 60, rss
    assert "the engine loop failed" in "".join(doomed.log)

    doomed.proc.send_signal(signal.SIGTERM)  # nothing in flight holds the shutdown
    assert doomed.proc.wait(timeout=30) == 0


def test_a_malformed_fault_spec_stops_the_server_at_start(monkeypatch, caplog):
    monkeypatch.setenv("KILN_FAULT_INJECT", "step:soon")
    assert cli_main(["serve", "--host", "127.0.0.1", "--port", "0"]) == 2
    assert "KILN_FAULT_INJECT='step:soon': expected step:N" in caplog.text
