"""Slow and stalled clients of a real `kiln serve` (SmolLM2, fp32): a stream whose client stops
reading without closing is aborted after --write-timeout, its seat freed and its connection
dropped; and a server full of them refuses more with 429 before tokenizing their prompts."""
from __future__ import annotations

import json
import socket
import time

import pytest

from kiln_process import refused_at_start
from test_server import MODEL, ServerProcess, complete, post

WRITE_TIMEOUT_S = 1
ABORTED = "kiln:request_success_total{finished_reason=abort}"
# ~300 tokens: with prompt_logprobs=20 a stream's first chunk is some 400 KiB.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 30


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "1024", "--max-num-seqs", "1", "--max-queue", "1",
                      "--kv-cache-memory", "64Mi", "--write-timeout", str(WRITE_TIMEOUT_S))
    yield s
    s.stop()


def unread_stream(port: int, body: dict, small_buffers: bool = False) -> socket.socket:
    """Send a completion request, then read nothing. small_buffers: a small receive buffer and
    small segments (the server's send buffer is sized by the segment: 64 KiB ones on loopback let
    it hold megabytes), so a few hundred KiB fill the path and the server's writes wait."""
    sock = socket.socket()
    if small_buffers:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def read_until_closed(sock: socket.socket, timeout: float = 30) -> bytes:
    """What the server had sent, up to its end of the connection."""
    received, deadline = b"", time.monotonic() + timeout
    for _ in range(10_000):
        assert time.monotonic() < deadline, f"the server never closed; {len(received)} bytes so far"
        try:
            part = sock.recv(1 << 16)
        except ConnectionResetError:
            return received
        if not part:
            return received
        received += part
    raise AssertionError(f"the server never closed; {len(received)} bytes so far")


def test_a_stream_whose_client_stops_reading_is_aborted_after_the_write_timeout(server):
    before = server.wait_metrics(kiln__num_requests_running=0)
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 600, "ignore_eos": True, "temperature": 0,
            "stream": True, "prompt_logprobs": 20}
    sock = unread_stream(server.port, body, small_buffers=True)
    try:
        # 600 tokens take far longer than the timeout: the abort is the timeout's, before the end.
        want = {"kiln__num_requests_running": 0, ABORTED.replace(":", "__"): before[ABORTED] + 1}
        after = server.wait_metrics(timeout=60, **want)
        length = "kiln:request_success_total{finished_reason=length}"
        assert after[length] == before[length]
        received = read_until_closed(sock)  # the server dropped the connection: the read ends
        assert received.startswith(b"HTTP/1.1 200") and b"prompt_logprobs" in received
        assert b"[DONE]" not in received
    finally:
        sock.close()
    assert "--write-timeout" in "".join(server.log)
    # The seat is free, and a client that reads takes the same big first chunk within the timeout.
    chunks = list(complete(server, LONG_PROMPT, max_tokens=4, stream=True, extra_body={"prompt_logprobs": 20}))
    assert len(chunks[0].choices[0].model_extra["prompt_logprobs"]) > 200
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_full_server_refuses_with_429_before_tokenizing(server):
    """Refused before tokenizing: a prompt longer than the context, which only its tokens tell,
    gets the 429 of a full server (batch and queue), not the 400 it gets once there is room."""
    too_long = "hello " * 1500  # ~1500 tokens of a 1024-token context
    requests = [("/v1/completions", {"model": MODEL, "prompt": too_long, "max_tokens": 1}),
                ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": too_long}],
                                          "max_tokens": 1})]
    # Small chunks, taken by the client's buffers: these streams run until closed.
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    holders = [unread_stream(server.port, body) for _ in range(2)]  # the one seat and the one place in the queue
    try:
        server.wait_metrics(kiln__num_requests_running=1, kiln__num_requests_waiting=1)
        for path, request in requests:
            status, answer = post(server.url + path, request)
            assert (status, answer["error"]["code"]) == (429, "queue_full"), answer
    finally:
        for sock in holders:
            sock.close()
    server.wait_metrics(kiln__num_requests_running=0, kiln__num_requests_waiting=0)
    for path, request in requests:
        status, answer = post(server.url + path, request)
        assert (status, answer["error"]["code"]) == (400, "context_length_exceeded"), answer


def test_write_timeout_must_be_positive(capsys, caplog):
    assert "--write-timeout: must be > 0" in refused_at_start(["--write-timeout", "0"], capsys, caplog)
