"""`kiln serve --tensor-parallel-size 2` (tiny random Llama, gloo on the CPU), end to end over
real HTTP: it answers with the TP=1 greedy text; SIGTERM drains the request in flight and stops
every rank; a worker rank killed mid-generation, or while the engine idles, makes the engine
report itself dead within seconds (the stream ends with engine_dead, new requests and /health get
503) and no process is left behind. Every wait is bounded."""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import psutil
import pytest

from kiln.engine.llm import LLM
from kiln.engine.sampling_params import SamplingParams
from kiln_process import spawned_ranks
from test_server import MODEL, ServerProcess, get, post

PROMPT = " ".join(f"w{i % 90}" for i in range(12))
DEAD_WITHIN_S = 5.0


def tp_server(tiny_llama_dir) -> ServerProcess:
    return ServerProcess("--model", str(tiny_llama_dir), "--tensor-parallel-size", "2", "--max-model-len", "256",
                         "--kv-cache-memory", "4Mi")


def ranks(server: ServerProcess) -> list[psutil.Process]:
    return spawned_ranks(server.proc.pid)


def stream(url: str, max_tokens: int, first: threading.Event, events: list) -> None:
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(json.loads(line[6:]))
                first.set()


def start_stream(server: ServerProcess, max_tokens: int) -> tuple[threading.Thread, list]:
    first, events = threading.Event(), []
    t = threading.Thread(target=stream, args=(server.url, max_tokens, first, events), daemon=True)
    t.start()
    assert first.wait(60), "no token streamed"
    return t, events


def running(pid: int) -> bool:
    """Neither gone nor a zombie; one that exits between the two looks (pid_exists, then status)
    raised NoSuchProcess."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 15
    while (left := [p for p in pids if running(p)]):
        assert time.monotonic() < deadline, f"processes left behind: {left}"
        time.sleep(0.1)


def test_tp2_server_answers_like_tp1_and_sigterm_drains_then_stops_every_rank(tiny_llama_dir):
    want = LLM(str(tiny_llama_dir), dtype="float32", device="cpu").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].text
    server = tp_server(tiny_llama_dir)
    try:
        workers = ranks(server)
        assert len(workers) == 1
        descendants = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        code, reply = post(server.url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 16,
                                                            "temperature": 0, "ignore_eos": True})
        assert code == 200 and reply["choices"][0]["text"] == want, reply
        t, events = start_stream(server, max_tokens=200)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, "".join(server.log)
        t.join(10)
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # drained: all 200 tokens came
        assert_all_gone(descendants + [server.proc.pid])
    finally:
        server.stop()


def test_a_worker_killed_mid_generation_kills_the_engine_loudly_and_leaves_no_process(tiny_llama_dir):
    server = tp_server(tiny_llama_dir)
    try:
        (worker,) = ranks(server)
        descendants = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        t, events = start_stream(server, max_tokens=240)
        worker.kill()
        killed = time.monotonic()
        while get(server.url + "/health")[0] != 503:
            assert time.monotonic() - killed < DEAD_WITHIN_S, "the engine did not notice the dead rank"
            time.sleep(0.05)
        print(f"/health 503 {time.monotonic() - killed:.2f} s after the worker was killed")
        t.join(30)
        assert not t.is_alive()
        last = events[-1]
        assert "error" in last and last["error"]["code"] == "engine_dead", last
        assert f"tensor-parallel rank 1 (pid {worker.pid}) exited with code -9" in last["error"]["message"], last
        code, reply = post(server.url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert code == 503 and reply["error"]["code"] == "engine_dead", reply
        assert get(server.url + "/ready")[0] == 503
        assert not ranks(server)  # the broken group's ranks are gone while rank 0 still serves 503s
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        assert_all_gone(descendants + [server.proc.pid])
    finally:
        server.stop()


def test_a_worker_dying_while_the_engine_idles_turns_health_to_503(tiny_llama_dir):
    server = tp_server(tiny_llama_dir)
    try:
        (worker,) = ranks(server)
        descendants = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        worker.kill()  # no request in flight: only the watchdog can notice
        killed = time.monotonic()
        while get(server.url + "/health")[0] != 503:
            assert time.monotonic() - killed < DEAD_WITHIN_S, "the idle engine did not notice the dead rank"
            time.sleep(0.05)
        status, health = get(server.url + "/health")
        assert f"tensor-parallel rank 1 (pid {worker.pid}) exited with code -9" in json.loads(health)["error"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        assert_all_gone(descendants + [server.proc.pid])
    finally:
        server.stop()


@pytest.mark.parametrize("size", ["0", "x"])
def test_a_bad_tensor_parallel_size_is_refused(size):
    from kiln.cli import main as cli_main
    with pytest.raises(SystemExit) as exit_:
        cli_main(["serve", "--tensor-parallel-size", size])
    assert exit_.value.code == 2
