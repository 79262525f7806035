"""Sleep mode of `kiln serve` (a warm-pool standby's KV cache released while idle): a real server
process on SmolLM2, its resident memory read from /proc, its answers compared before and after."""
from __future__ import annotations

import threading

import pytest

from test_server import MODEL, ServerProcess, complete, get, post

# Long enough that its full blocks go to the prefix cache (block size 16).
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 3


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "512", "--max-num-seqs", "16", "--kv-cache-memory", "512Mi")
    yield s
    s.stop()


def rss_mib(server: ServerProcess) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def sleeping(server: ServerProcess) -> bool:
    status, body = get(server.url + "/is_sleeping")
    assert status == 200, body
    return '"is_sleeping": true' in body


def test_sleep_gives_the_kv_cache_back_and_a_request_wakes_it(server):
    before = complete(server, PROMPT, max_tokens=8).choices[0].text
    # Touch ~84 MB of the pool (8 sequences x ~230 tokens x 30 layers x K,V x 3 heads x 64 x fp32).
    threads = [threading.Thread(target=complete, args=(server, f"{i} " + PROMPT * 4),
                                kwargs={"max_tokens": 1}) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loaded = rss_mib(server)
    hits = server.metrics()["kiln:prefix_cache_hits_total"]

    status, body = post(server.url + "/sleep", {})
    assert status == 200 and body["is_sleeping"] is True, body
    asleep = rss_mib(server)
    print(f"RSS {loaded:.0f} MiB serving -> {asleep:.0f} MiB asleep; sleep took {body['seconds']}s")
    assert loaded - asleep > 60, (loaded, asleep)
    assert sleeping(server) and server.metrics()["kiln:engine_sleep_state"] == 1
    assert get(server.url + "/ready")[0] == 200  # a standby stays Ready while it sleeps

    # The first request wakes it: same greedy answer, and nothing found in the forgotten prefix cache.
    assert complete(server, PROMPT, max_tokens=8).choices[0].text == before
    assert not sleeping(server)
    assert server.metrics()["kiln:prefix_cache_hits_total"] == hits
    assert server.metrics()["kiln:engine_sleep_state"] == 0


def test_wake_up_is_explicit_and_both_are_idempotent(server):
    for _ in range(2):
        assert post(server.url + "/sleep", {})[0] == 200
    assert sleeping(server)
    for _ in range(2):
        status, body = post(server.url + "/wake_up", {})
        assert status == 200 and body["is_sleeping"] is False, body
    assert not sleeping(server)
    assert complete(server, "The capital of France is", max_tokens=4).choices[0].text


def test_sleep_is_refused_while_a_request_runs(server):
    stream = server.client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0,
                                              max_tokens=64, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # the request is running
    status, body = post(server.url + "/sleep", {})
    assert status == 409 and body["error"]["code"] == "busy", body
    assert "in flight" in body["error"]["message"]
    tokens = 1 + sum(1 for _ in chunks)
    assert tokens >= 64 - 1  # the stream ran to its end (a final chunk may carry only the finish reason)
    assert not sleeping(server)
    assert post(server.url + "/sleep", {})[0] == 200
