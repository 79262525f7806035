"""Engine death is loud (issue 18, item 2): an exception inside the engine loop of a real
`kiln serve` (SmolLM2, fp32), raised by the test-only hook KILN_FAULT_INJECT=step:N, fails every
request in flight with a 5xx naming the cause, refuses new ones with 503, turns /health and
/ready to 503, releases the KV cache, and leaves nothing hanging: every wait here is bounded."""
from __future__ import annotations

import asyncio
import json
import signal
import threading

import aiohttp
import pytest
from aiohttp import web

from kiln.cli import main as cli_main
from kiln.engine import startup
from kiln.engine.async_engine import InjectedFault
from kiln.engine.config import Config
from kiln.engine.server import Server
from load_support import is_openai_error, session, sse_data
from lora_support import SMOLLM2, write_adapter
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


async def stream(client: aiohttp.ClientSession, url: str, body: dict, first_chunks: asyncio.Semaphore) -> list:
    """One streamed request's events, "broken" for a cut end; its first releases `first_chunks`."""
    events = []
    async with client.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200
        try:
            async for data in sse_data(r):
                events.append(data)
                if len(events) == 1:
                    first_chunks.release()
        except aiohttp.ClientPayloadError:  # the end a failed stream has: no final chunk
            events.append("broken")
    return events


async def requests_in_flight(url: str, first_chunks: asyncio.Semaphore) -> tuple[list, list, list]:
    """Completions streamed and whole, and one streamed /v1/responses request."""
    def body(i: int) -> dict:
        return {"model": MODEL, "prompt": f"{i}. {PROMPT}", "max_tokens": 400, "ignore_eos": True}

    # An answer that cannot end before the fault (no ignore_eos there): 150 numbers at least.
    numbers = {"type": "array", "items": {"type": "integer"}, "minItems": 150}
    response = {"model": MODEL, "input": f"R. {PROMPT}", "max_output_tokens": 400,
                "text": {"format": {"type": "json_schema", "name": "numbers", "schema": numbers}}}

    async with session(timeout=120) as client:
        async def whole(i: int) -> tuple[int, dict]:
            async with client.post(url, json=body(i)) as r:
                return r.status, await r.json()

        streams = [asyncio.create_task(stream(client, url, body(i), first_chunks)) for i in range(STREAMS)]
        wholes = [asyncio.create_task(whole(STREAMS + i)) for i in range(WHOLE)]
        responses = asyncio.create_task(
            stream(client, url.replace("/v1/completions", "/v1/responses"), response, first_chunks))
        return await asyncio.gather(*streams), await asyncio.gather(*wholes), await responses


def test_engine_death_fails_every_request_frees_the_cache_and_turns_health_to_503(doomed):
    url = doomed.url + "/v1/completions"
    rss: dict[str, float] = {}

    async def run() -> tuple[list, list, list]:
        first_chunks = asyncio.Semaphore(0)
        traffic = asyncio.create_task(requests_in_flight(url, first_chunks))
        for _ in range(STREAMS + 1):  # every stream is generating: its prompt's KV pages are touched
            await asyncio.wait_for(first_chunks.acquire(), 120)
        rss["serving"] = rss_mib(doomed)
        return await asyncio.wait_for(traffic, 120)

    streams, wholes, responses = asyncio.run(run())
    cause = f"InjectedFault: fault injected in engine step {FAULT_STEP}"
    # Tokens, then one error event naming the cause and [DONE] (as vLLM), then a broken end: ended
    # cleanly, a router counted the failed stream a 200.
    for events in streams:
        *tokens, last, done, end = events
        assert (done, end) == ("[DONE]", "broken"), events[-3:]
        assert tokens and all("choices" in e for e in tokens), events[:3] + events[-2:]
        assert is_openai_error(last) and last["error"]["code"] == "engine_dead", last
        assert cause in last["error"]["message"], last
    # The responses stream ends as OpenAI's does: an error event, then response.failed saying why.
    *_, error, failed, end = responses
    assert (error["type"], failed["type"], end) == ("error", "response.failed", "broken"), responses[-3:]
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["code"] == "engine_dead"
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
    print(f"killed {killed:.0f} of {STREAMS + WHOLE + 1} requests in flight at step {FAULT_STEP}; "
          f"new requests 503; RSS {rss['serving']:.0f} MiB serving -> {rss['dead']:.0f} MiB dead")
    assert killed == STREAMS + WHOLE + 1  # the responses stream too
    assert m["kiln:kv_cache_bytes"] == 0 and m["kiln:num_requests_running"] == 0, m
    assert rss["serving"] - rss["dead"] > 60, rss
    assert "the engine loop failed" in "".join(doomed.log)

    doomed.proc.send_signal(signal.SIGTERM)  # nothing in flight holds the shutdown
    assert doomed.proc.wait(timeout=30) == 0


def test_a_malformed_fault_spec_stops_the_server_at_start(monkeypatch, caplog):
    monkeypatch.setenv("KILN_FAULT_INJECT", "step:soon")
    assert cli_main(["serve", "--host", "127.0.0.1", "--port", "0"]) == 2
    assert "KILN_FAULT_INJECT='step:soon': expected step:N" in caplog.text


async def _dead_while_queued(smollm2_path, adapters) -> tuple[list, dict]:
    """A real server in this process (so the test can line commands up behind the fatal one) on
    a real port: sleep, wake_up, an adapter load and unload and a completion are queued for the
    engine thread, behind a failure (as a tensor-parallel rank's death reports itself); then the
    same endpoints once the server knows it is dead. Every wait is bounded."""
    config = Config(model=str(smollm2_path), dtype="float32", device="cpu", max_model_len=128,
                    kv_cache_memory=16 << 20, enable_lora=True, lora_modules=(("sql", str(adapters / "sql")),))
    server = Server(config, MODEL, max_queue=8, timer=startup.StartupTimer())
    await server.load()
    runner = web.AppRunner(server.app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    calls = [("POST", "/sleep", {}), ("POST", "/wake_up", {}),
             ("POST", "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(adapters / "poet")}),
             ("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"}),
             ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})]
    try:
        async with session(timeout=60) as client:
            async def answer(method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
                async with client.request(method, url + path, json=body) as r:
                    return r.status, await r.json(content_type=None)

            entered, gate = threading.Event(), threading.Event()
            # Hold the engine thread, so what follows is queued behind it in this order.
            held = asyncio.ensure_future(server.engine.call(lambda: (entered.set(), gate.wait(60))))
            assert await asyncio.to_thread(entered.wait, 60)
            server.engine.fail(InjectedFault("rank 1 exited"))
            racing = [asyncio.ensure_future(answer(*call)) for call in calls]
            async with asyncio.timeout(60):
                while server.engine._commands.qsize() < 1 + len(calls):  # each handler's command is in
                    await asyncio.sleep(0.01)
            gate.set()
            await asyncio.wait_for(held, 60)
            _, lost = await asyncio.wait(racing, timeout=30)
            assert not lost, f"{len(lost)} of {len(racing)} requests queued behind the failure were never answered"
            raced = [task.result() for task in racing]
            after = {path: await asyncio.wait_for(answer(method, path, body), 60)
                     for method, path, body in [*calls, ("GET", "/is_sleeping", None), ("GET", "/v1/models", None)]}
            return raced, after
    finally:
        await runner.cleanup()
        await server.engine.stop()


def test_every_endpoint_reaching_a_dead_engine_answers_503_engine_dead(smollm2_path, tmp_path):
    write_adapter(tmp_path / "sql", SMOLLM2, seed=1, rank=4, targets=("q_proj",), layers=range(2))
    write_adapter(tmp_path / "poet", SMOLLM2, seed=2, rank=4, targets=("v_proj",), layers=range(2))
    raced, after = asyncio.run(_dead_while_queued(smollm2_path, tmp_path))
    for status, body in [*raced, *after.values()]:  # the generation endpoints' 503, everywhere
        assert status == 503 and is_openai_error(body), (raced, after)
        assert body["error"]["code"] == "engine_dead" and body["error"]["type"] == "server_error", body
        assert "InjectedFault: rank 1 exited" in body["error"]["message"], body
