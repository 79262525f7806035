"""API keys and tenants at the router: a real `kiln router` process (keys from KILN_API_KEYS, as
the operator passes a Secret) in front of a real `kiln serve` on SmolLM2. Every path but the
probes, /metrics and /openapi.json demands a key; each key's requests share cached prefix blocks
only with each other, which the engine's own prefix-cache counters show. Odd headers and bodies
go to a router in front of a fake engine (router_fakes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest

from kiln.router.auth import ApiKeys, parse_keys
from kiln_process import REPO, RouterProcess
from router_fakes import on_event_loop, raw_post, service
from test_server import MODEL, ServerProcess, get, post

KEYS = "key-tenant-a  # team a\nkey-tenant-b\n"
# Several full blocks (block size 16), so a prefix hit is many tokens.
PROMPT = "In the harbour town the lighthouse keeper wrote down every ship that passed, " * 6


@pytest.fixture(scope="module")
def engine():
    s = ServerProcess("--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory", "256Mi")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def front(engine):
    router = RouterProcess(f"127.0.0.1:{engine.port}", env={"KILN_API_KEYS": KEYS})
    yield router.url
    router.stop(graceful=True)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_every_model_path_demands_a_key_and_the_probes_do_not(front):
    for path in ("/v1/completions", "/v1/chat/completions", "/invocations", "/tokenize", "/v1/unknown"):
        status, body = post(front + path, {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, body)
    assert get(front + "/v1/models")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        client(front, "key-tenant-c").models.list()
    with pytest.raises(openai.AuthenticationError):
        client(front, "key-tenant").completions.create(model=MODEL, prompt="hi", max_tokens=1)  # a prefix of a key
    for path in ("/health", "/ready", "/metrics"):
        assert get(front + path)[0] == 200, path
    answer = client(front, "key-tenant-b").completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert answer.choices[0].text


def test_the_responses_api_goes_through_with_a_key_and_its_salt(front):
    """The router salts /v1/responses as it does every /v1 generation: the engine takes the field."""
    answer = client(front, "key-tenant-a").responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    assert answer.status == "incomplete" and answer.output_text


def test_tokenize_and_detokenize_go_through_with_a_key(front):
    """The tenant's salt goes on generation requests only: /tokenize has no cache to split."""
    import urllib.request
    for path, body, field in (("/tokenize", {"model": MODEL, "prompt": "Hello there"}, "tokens"),
                              ("/detokenize", {"tokens": [19556, 665]}, "prompt")):
        request = urllib.request.Request(front + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": "Bearer key-tenant-a"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200 and json.loads(answer.read())[field], path


def test_tenants_never_share_cached_prefixes(front, engine):
    texts: list[str] = []

    def hits_after(key: str) -> float:
        answer = client(front, key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
        texts.append(answer.choices[0].text)
        return engine.metrics()["kiln:prefix_cache_hits_total"]
    start = engine.metrics()["kiln:prefix_cache_hits_total"]
    first_a = hits_after("key-tenant-a")
    b = hits_after("key-tenant-b")  # the same prompt from another tenant: nothing found
    second_a = hits_after("key-tenant-a")  # tenant a's own blocks are found again
    print(f"prefix-cache hits: tenant a first {first_a - start:.0f}, tenant b {b - first_a:.0f}, "
          f"tenant a again {second_a - b:.0f} tokens")
    assert b == first_a
    assert second_a - b >= 64  # at least 4 of its blocks
    # A client's own cache_salt splits its tenant's cache further; it never joins another's.
    salted = client(front, "key-tenant-a").completions.create(  # 252 characters of its own still fit once joined
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"cache_salt": "session-1" * 28})
    # Greedy, with the whole prompt computed afresh as tenant a's first request was: the same token.
    assert salted.choices[0].text == texts[0]
    assert engine.metrics()["kiln:prefix_cache_hits_total"] == second_a


def test_the_engine_refuses_a_bad_cache_salt(engine):
    for salt in ("", 7, "x" * 257):
        status, body = post(engine.url + "/v1/completions",
                            {"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": salt})
        assert status == 400 and "cache_salt" in body["error"]["message"], (salt, body)
    import urllib.error
    import urllib.request
    for path, field in (("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        request = urllib.request.Request(engine.url + path, data=json.dumps({"model": MODEL, **field}).encode(),
                                         headers={"Content-Type": "application/json", "X-Kiln-Cache-Salt": "x" * 129})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400 and "X-Kiln-Cache-Salt" in json.loads(refused.value.read())["error"]["message"]


def test_a_key_variable_holding_no_key_does_not_open_the_router():
    for env, args in (({"KILN_API_KEYS": "# nobody yet\n"}, ()), ({}, ("--api-key", "")),
                      ({"KILN_API_KEYS": "two words"}, ())):
        proc = subprocess.run([sys.executable, "-m", "kiln.cli", "router", "--endpoints", "127.0.0.1:9", *args],
                              cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and ("API key" in out or "api-key" in out), out


@pytest.mark.timeout(60)
@on_event_loop
async def test_a_key_header_that_is_not_utf8_is_a_401_and_any_bearer_casing_will_do() -> None:
    async with service(1, api_keys=ApiKeys(["key-a"])) as svc:
        status, body = await raw_post(svc.port, b"/v1/completions", b"{}",
                                      b"Authorization: Bearer \xff\xfe\r\n")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _ = await raw_post(svc.port, b"/v1/completions", b"{}",
                                   b"Authorization: bEARER key-a\r\n")
        assert status == 200 and svc.hits() == [1]


@pytest.mark.timeout(60)
@on_event_loop
async def test_the_tenants_salt_goes_in_a_header_and_the_body_byte_for_byte() -> None:
    """The router parsed and wrote every body again to salt it: many times its size in memory
    (402 MiB for 16 MiB of [{},{},...]) and its event loop held meanwhile. A salt header a client
    sends is dropped, keys or none: only the router says whose cache a request may use."""
    keys = ApiKeys(["key-a", "key-b"])
    async with service(1, api_keys=keys) as svc:
        for sent in (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                     json.dumps({"prompt": "half a pair: \ud800", "cache_salt": "own"}).encode()):
            status, _ = await raw_post(svc.port, b"/v1/completions", sent, b"Authorization: Bearer key-a\r\n"
                                       b"X-Kiln-Cache-Salt: forged\r\n")
            assert status == 200 and svc.engines[0].body == sent
            assert svc.engines[0].headers.getall("X-Kiln-Cache-Salt") == [keys.salt_of("Bearer key-a")]
    async with service(1) as svc:
        status, _ = await raw_post(svc.port, b"/v1/completions", b'{"prompt": "x"}', b"X-Kiln-Cache-Salt: forged\r\n")
        assert status == 200 and "X-Kiln-Cache-Salt" not in svc.engines[0].headers


def test_a_key_file_is_one_whole_key_a_line():
    """A '#' or ',' inside a key is part of it (generated keys have them): cut there, the key
    itself was refused and its first part let in. Comments start a line or follow a space."""
    text = "key-a  # team a\n# rotated out: old-key\n\nTenant#A-s3cr3t-9f8e\nsk-live,Zq\n"
    assert parse_keys(text) == ["key-a", "Tenant#A-s3cr3t-9f8e", "sk-live,Zq"]
    keys = ApiKeys(parse_keys(text))
    assert keys.salts.keys() == {b"key-a", b"Tenant#A-s3cr3t-9f8e", b"sk-live,Zq"}
    with pytest.raises(ValueError, match="one key a line"):
        parse_keys("key-a key-b")
