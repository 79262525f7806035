"""Abort is exact (issue 18, item 3): 100 concurrent streams to a real `kiln serve` (SmolLM2,
fp32), 10 closed by their clients after their first chunks. The other 90 each get exactly
max_tokens tokens, the KV pool goes back to its idle block count, and the engine answers the
same afterwards as before. The pool is sized below what all 100 need, so preemption runs too."""
from __future__ import annotations

import asyncio
import time

from load_support import session, sse_data
from test_server import MODEL, ServerProcess, complete

STREAMS, CANCELLED, MAX_TOKENS = 100, 10, 20
# 120 blocks of 16 tokens (737,280 bytes each): 100 prompts of ~10 tokens growing by 20 need
# ~200, so the scheduler preempts and recomputes while the clients cancel.
KV_CACHE = f"{120 * 737_280}"


async def one(client, url: str, i: int, cancel_after: int | None) -> dict:
    """One stream read to its end, or closed once it has `cancel_after` tokens."""
    body = {"model": MODEL, "prompt": f"Write one sentence about the number {i}.", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    seen = {"tokens": 0, "finish": None, "usage": None, "done": False}
    async with client.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        async for data in sse_data(r):
            if data == "[DONE]":
                seen["done"] = True
                continue
            assert "error" not in data, data
            if data["choices"]:
                seen["tokens"] += len(data["choices"][0]["token_ids"])
                seen["finish"] = data["choices"][0]["finish_reason"] or seen["finish"]
            if data.get("usage"):
                seen["usage"] = data["usage"]["completion_tokens"]
            if cancel_after is not None and seen["tokens"] >= cancel_after:
                r.close()  # the client hangs up mid-stream
                break
    return seen


def test_ten_of_a_hundred_streams_cancelled_the_rest_exact_and_the_pool_idle_after():
    s = ServerProcess("--max-model-len", "128", "--kv-cache-memory", KV_CACHE)
    try:
        baseline = complete(s, "The capital of France is", max_tokens=8)
        before = s.wait_metrics(kiln__num_requests_running=0)
        # Cancelled after 1 to 10 tokens: before, during and after the pool runs short.
        cancel = {i: 1 + n for n, i in enumerate(range(0, STREAMS, STREAMS // CANCELLED))}

        async def run() -> list[dict]:
            async with session(timeout=300) as client:
                return await asyncio.gather(*(one(client, s.url + "/v1/completions", i, cancel.get(i))
                                              for i in range(STREAMS)))

        started = time.monotonic()
        results = asyncio.run(run())
        took = time.monotonic() - started
        after = s.wait_metrics(kiln__num_requests_running=0, kiln__num_requests_waiting=0)
        after = s.wait_metrics(kiln__num_free_kv_cache_blocks=after["kiln:num_kv_cache_blocks"])

        finished = [r for i, r in enumerate(results) if i not in cancel]
        exact = [r for r in finished if r["tokens"] == r["usage"] == MAX_TOKENS and r["finish"] == "length"
                 and r["done"]]
        delta = {reason: after[f"kiln:request_success_total{{finished_reason={reason}}}"]
                 - before[f"kiln:request_success_total{{finished_reason={reason}}}"]
                 for reason in ("length", "abort", "stop", "error")}
        preempted = after["kiln:num_preemptions_total"] - before["kiln:num_preemptions_total"]
        print(f"{STREAMS} streams in {took:.1f}s: {len(cancel)} cancelled after "
              f"{[results[i]['tokens'] for i in cancel]} tokens, {len(exact)} of {len(finished)} got "
              f"exactly {MAX_TOKENS}; finished by reason {delta}; {preempted:.0f} preemptions; "
              f"free blocks {after['kiln:num_free_kv_cache_blocks']:.0f} of {after['kiln:num_kv_cache_blocks']:.0f}")
        assert len(exact) == len(finished) == STREAMS - CANCELLED, [r for r in finished if r not in exact][:3]
        assert delta == {"length": STREAMS - CANCELLED, "abort": CANCELLED, "stop": 0, "error": 0}, delta
        assert all(results[i]["tokens"] == n and not results[i]["done"] for i, n in cancel.items())
        assert preempted > 0  # the pool was short: aborts met preempted sequences too
        assert after["kiln:kv_cache_usage_perc"] == 0

        again = complete(s, "The capital of France is", max_tokens=8)
        assert again.choices[0].text == baseline.choices[0].text and again.usage == baseline.usage
    finally:
        s.stop()
