"""`kiln serve` end to end: a real server process on real SmolLM2 (fp32, so greedy outputs do not
depend on batch composition), driven by the official openai client and by raw HTTP."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.engine.gguf_loader import load_gguf
from kiln.engine.loader import resolve_model_path
from kiln.cli import main as cli_main
from kiln_process import KilnProcess, get
from kiln.engine.cli import parse_size
from kiln.engine.startup import PHASES

MODEL = "smol"
PROMPTS = [f"Write one sentence about the number {i}." for i in range(32)]


class ServerProcess(KilnProcess):
    """`python -m kiln.cli serve ...` (SmolLM2, float32) on a free port; waits for /ready."""

    def __init__(self, *extra: str) -> None:
        super().__init__(["serve", "--model", "smollm2-135m", "--served-model-name", MODEL, "--dtype", "float32",
                          *extra], env={"OMP_NUM_THREADS": "2"})
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        self.aclient = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def metrics(self) -> dict[str, float]:
        """Every sample as 'name{label=value,...}' (model_name left out) -> value."""
        out = {}
        for family in text_string_to_metric_families(get(self.url + "/metrics")[1]):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_metrics(self, timeout: float = 60, **want: float) -> dict[str, float]:
        """Poll /metrics until each named gauge (':' written as '__') has its wanted value."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if all(m[k.replace("__", ":")] == v for k, v in want.items()):
                return m
            assert time.monotonic() < deadline, f"metrics never reached {want}: {m}"
            time.sleep(0.1)



def post(url: str, body: bytes | dict, method: str = "POST") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "256", "--max-num-seqs", "64", "--kv-cache-memory", "512Mi")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf(resolve_model_path("smollm2-135m"))[1]


def complete(server: ServerProcess, prompt: str, **kw):
    return server.client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def test_models_and_probes(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    card = server.client.models.retrieve(MODEL)  # OpenAI's GET /v1/models/{id}
    assert card.id == MODEL and card.max_model_len == server.client.models.list().data[0].max_model_len
    with pytest.raises(openai.NotFoundError) as missing:
        server.client.models.retrieve("org/no-such-model")  # an id with a slash is one id, not a sub-path
    assert missing.value.code == "model_not_found" and "'org/no-such-model'" in missing.value.message
    assert get(server.url + "/health")[0] == 200
    assert json.loads(get(server.url + "/ready")[1]) == {"status": "ready"}
    assert server.metrics()["kiln:model_load_seconds"] > 0
    log = "".join(server.log)
    assert "warm-up generation took" in log and "allocated the KV cache" in log


def test_completion_stream_reassembles_to_greedy_text_with_usage(server, tokenizer):
    prompt = "The capital of France is"
    full = complete(server, prompt, max_tokens=12, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.choices[0].text
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(server.client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, extra_body={"ignore_eos": True},
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert len({(c.id, c.created) for c in chunks}) == 1  # one response: one id and one creation time
    # vLLM's continuous_usage_stats: the usage so far on every chunk, two choices' tokens together.
    chunks = list(server.client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, n=2, extra_body={"ignore_eos": True},
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    made = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in chunks)
    assert made == sorted(made) and made[0] <= 2 and made[-1] == 24 and made[-2] == 24
    assert chunks[-1].usage.total_tokens == full.usage.prompt_tokens + 24


def test_include_usage_null_sends_no_usage_chunk_as_vllm(server):
    """vLLM keeps an explicit null, which asks for no usage; read as the default (true), a stream
    ended in a usage chunk without choices. stream_options without the key keeps the default."""
    def chunks(options: dict) -> list:
        return list(complete(server, "Hi", max_tokens=2, stream=True, stream_options=options,
                             extra_body={"ignore_eos": True}))
    assert all(c.choices and c.usage is None for c in chunks({"include_usage": None}))
    usage = chunks({})[-1]
    assert not usage.choices and usage.usage.completion_tokens == 2


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_held(server):
    """As /v1/responses did: chat and completions never said, so clients saw no cache hit."""
    prompt = "A long shared preamble about the weather in Oslo, Lima and Cairo, repeated. " * 4 + "Now: "
    cold = complete(server, prompt + "one", max_tokens=2, n=2)  # both choices computed it: none cached for both
    warm = complete(server, prompt + "two", max_tokens=2)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < warm.usage.prompt_tokens_details.cached_tokens < warm.usage.prompt_tokens
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt + "three", temperature=0, max_tokens=2,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens_details.cached_tokens
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=2)
    again = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > chat.usage.prompt_tokens_details.cached_tokens


def test_chat_stream_matches_nonstream(server, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_completion_tokens=20)
    msg = full.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert full.usage.prompt_tokens == len(ids)
    chunks = list(server.client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_completion_tokens=20, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_string_cuts_text_before_it(server):
    prompt = "Count: one, two, three,"
    text = complete(server, prompt, max_tokens=16).choices[0].text
    stop = text.strip().split()[2]  # a word in the middle of the greedy continuation
    cut = complete(server, prompt, max_tokens=16, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    # More than OpenAI's four, as evaluation harnesses send a task's list (vLLM takes them).
    many = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "zzz", stop]
    assert complete(server, prompt, max_tokens=16, stop=many).choices[0].text == cut.choices[0].text
    streamed = complete(server, prompt, max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_completion_logprobs(server):
    out = complete(server, "The sky is", max_tokens=8, logprobs=3).choices[0]
    lp = out.logprobs
    assert "".join(lp.tokens) == out.text and len(lp.token_logprobs) == 8
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy picks the top token
        assert token in top
    # Sampled, a token outside the top 1 is still in its position's top_logprobs (OpenAI: up to
    # logprobs+1 entries), with its own logprob, as an echoed prompt token is.
    sampled = server.client.completions.create(model=MODEL, prompt="The sky is", max_tokens=24, logprobs=1,
                                               temperature=1.5, seed=7).choices[0].logprobs
    assert all(top[token] == logprob and len(top) <= 2
               for token, logprob, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs))
    assert any(len(top) == 2 for top in sampled.top_logprobs)  # some token drawn was not the best


def test_chat_logprobs(server):
    out = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=6,
        logprobs=True, top_logprobs=2).choices[0]
    content = out.logprobs.content
    assert "".join(t.token for t in content) == out.message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert bytes(t.bytes).decode() == t.token


def test_seed_makes_sampling_reproducible(server):
    def sample(seed: int) -> str:
        return server.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                                temperature=1.0, seed=seed).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_32_concurrent_streams_match_solo_runs(server):
    solo = [complete(server, p, max_tokens=10).choices[0].text for p in PROMPTS]

    async def one(prompt: str) -> str:
        stream = await server.aclient.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                         max_tokens=10, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(all_at_once()) == solo


BAD = [
    ("malformed json", "/v1/completions", b'{"model": "smol", "prompt": ', 400, None),
    ("body not an object", "/v1/completions", b'[1, 2]', 400, None),
    ("wrong type", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "hello " * 400}, 400, "prompt"),
    ("max_tokens too large", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1000}, 400,
     "max_tokens"),
    ("unsupported parameter", "/v1/completions", {"model": MODEL, "prompt": "hi", "guided_json": {}}, 400,
     "guided_json"),
    ("logit_bias out of range", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": 101}}, 400,
     "logit_bias.1"),
    ("logit_bias key not a token id", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"a": 1}},
     400, "logit_bias.a"),
    ("logit_bias key beyond the vocabulary", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"9999999999": 5}}, 400,
     "logit_bias"),
    ("n of 0", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("n over the bound", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 129}, 400, "n"),
    ("empty prompt in a batch", "/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt"),
    ("one prompt of a batch too long", "/v1/completions", {"model": MODEL, "prompt": ["a", "hello " * 400]},
     400, "prompt"),
    ("mixed batch", "/v1/completions", {"model": MODEL, "prompt": ["a", [1, 2]]}, 400, "prompt.0"),
    ("prompt as an object", "/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ("fraction in a batch of token ids", "/v1/completions", {"model": MODEL, "prompt": [[1, 2], [1, 2.5]]}, 400,
     "prompt.1.1"),
    ("stream options without a stream", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("empty stop string", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ""}, 400, "stop"),
    ("too many stop strings", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["x"] * 33}, 400, "stop"),
    ("too many stop token ids", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "stop_token_ids": list(range(2049))}, 400, "stop_token_ids"),
    ("temperature out of range", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400,
     "temperature"),
    ("token id out of vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat max_completion_tokens too large", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 999}, 400,
     "max_completion_tokens"),
    ("tools", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools"),
    ("min_tokens over max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                       "min_tokens": 4}, 400, "min_tokens"),
    ("continue_final_message in a new turn", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("json_schema format without its schema", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     400, "response_format"),
    ("response_format of an unknown type", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("two structured outputs at once", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400,
     "structured_outputs"),
    ("structured outputs and a JSON response_format", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
     400, "structured_outputs"),
    ("an empty choice", "/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"choice": [""]}},
     400, "structured_outputs.choice.0"),
    ("tools with the default (auto) tool_choice", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice"),
    ("tool_choice naming a function not among the tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("tool_choice without tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice"),
    ("a required call and a response_format", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("a function name with a space", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}],
      "tool_choice": "required"}, 400, "tools.0.function.name"),
    ("null content outside a tool-calling turn", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": None}]}, 400, "messages.0"),
    ("a LoRA adapter on a server without --enable-lora", "/v1/load_lora_adapter",
     {"lora_name": "a", "lora_path": "/tmp"}, 400, None),
    ("unknown route", "/v1/embeddings", {"model": MODEL, "input": "x"}, 404, None),
    ("wrong method", "/v1/models", {}, 405, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(server, name, path, body, status, param):
    code, reply = post(server.url + path, body)
    assert code == status, reply
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param


def test_n_choices_of_batched_prompts_are_each_prompts_own_seeded_runs(server, tokenizer):
    """Choice i*n + j answers prompt i with seed + j: the same text as that prompt sent alone
    with that seed, streamed or not; usage counts each prompt once and every choice's tokens."""
    prompts, n, seed = ["Once upon a time", "The best fruit is"], 3, 41
    sampling = dict(model=MODEL, temperature=1.0, max_tokens=8, extra_body={"ignore_eos": True})
    alone = [server.client.completions.create(prompt=p, seed=seed + j, **sampling).choices[0].text
             for p in prompts for j in range(n)]
    assert len(set(alone[:n])) > 1  # the seeds differ, so do the choices
    out = server.client.completions.create(prompt=prompts, n=n, seed=seed, **sampling)
    assert [c.index for c in out.choices] == list(range(len(prompts) * n))
    assert [c.text for c in out.choices] == alone
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == len(prompts) * n * 8
    chunks = list(server.client.completions.create(prompt=prompts, n=n, seed=seed, stream=True,
                                                   stream_options={"include_usage": True}, **sampling))
    texts, finished = [""] * len(alone), {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finished[choice.index] = choice.finish_reason
    assert texts == alone and finished == {i: "length" for i in range(len(alone))}
    assert chunks[-1].usage == out.usage
    # Token-id prompts in a batch, with the ids each choice ran.
    ids = [tokenizer.encode(p) for p in prompts]
    code, reply = post(server.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2,
                                                        "temperature": 0, "return_token_ids": True})
    assert code == 200 and [c["prompt_token_ids"] for c in reply["choices"]] == ids


def test_echo_puts_the_prompt_and_its_logprobs_first(server, tokenizer):
    """As lm-eval-harness scores a continuation: a batch, echo, logprobs, one token generated."""
    prompts = ["The capital of France is Paris", "Two plus two is four"]
    out = server.client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=2, max_tokens=1,
                                           temperature=0)
    for prompt, choice in zip(prompts, out.choices):
        ids = tokenizer.encode(prompt)
        alone = complete(server, prompt, max_tokens=1, logprobs=2).choices[0]
        assert choice.text == prompt + alone.text
        lp = choice.logprobs
        assert lp.tokens[:len(ids)] == [tokenizer.decode_token(t) for t in ids] and lp.tokens[len(ids):] == alone.logprobs.tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[len(ids):] == pytest.approx(alone.logprobs.token_logprobs, abs=1e-4)
        scored = post(server.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                        "temperature": 0, "prompt_logprobs": 2})[1]["choices"][0]
        assert "prompt_logprobs" not in choice.model_extra  # not asked for: echo's logprobs are in logprobs
        for i, token in enumerate(ids[1:], start=1):
            position = scored["prompt_logprobs"][i]
            assert lp.token_logprobs[i] == pytest.approx(position[str(token)]["logprob"], abs=1e-4)
            assert set(lp.top_logprobs[i]) == {e["decoded_token"] for e in position.values()}
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    # Streamed, and from token ids: the prompt's text first, then the same continuation.
    ids = tokenizer.encode(prompts[0])
    chunks = list(server.client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=4,
                                                   temperature=0, stream=True))
    assert chunks[0].choices[0].text.startswith(tokenizer.decode(ids))
    whole = complete(server, ids, echo=True, max_tokens=4).choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == whole == tokenizer.decode(ids) + complete(
        server, ids, max_tokens=4).choices[0].text


def test_echo_logprobs_and_prompt_logprobs_each_keep_their_own_count(server, tokenizer):
    """The prompt is scored once with the more alternatives of the two; each answered all of them:
    echo's top_logprobs past OpenAI's logprobs + 1, prompt_logprobs past its own k."""
    prompt = "The capital of France is Paris"
    ids = tokenizer.encode(prompt)

    def ask(logprobs: int, prompt_logprobs: int) -> dict:
        code, reply = post(server.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                            "temperature": 0, "echo": True, "logprobs": logprobs,
                                                            "prompt_logprobs": prompt_logprobs})
        assert code == 200, reply
        return reply["choices"][0]
    few = ask(1, 5)
    assert all(1 <= len(top) <= 2 for top in few["logprobs"]["top_logprobs"][1:len(ids)])
    assert all(str(t) in p and 5 <= len(p) <= 6 for t, p in zip(ids[1:], few["prompt_logprobs"][1:]))
    many = ask(5, 0)
    assert [list(p) for p in many["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    assert max(len(top) for top in many["logprobs"]["top_logprobs"][1:len(ids)]) > 2


def test_echo_with_max_tokens_zero_is_the_prompt_alone_scored(server, tokenizer):
    """OpenAI's legacy way (and vLLM's, lm-eval's older backends') to score a prompt: echo, logprobs,
    max_tokens 0. The answer is the prompt and its logprobs, no completion token."""
    prompts = ["The capital of France is Paris", "Two plus two is four"]
    out = server.client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    one = server.client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                           temperature=0)
    assert out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    for prompt, choice, longer in zip(prompts, out.choices, one.choices):
        n = len(tokenizer.encode(prompt))
        assert (choice.text, choice.finish_reason) == (prompt, "length")
        assert choice.logprobs.tokens == longer.logprobs.tokens[:n]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(longer.logprobs.token_logprobs[1:n], abs=1e-4)
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompts[0], echo=True, max_tokens=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompts[0]
    assert chunks[-1].usage.completion_tokens == 0
    code, reply = post(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 0})
    assert code == 400 and reply["error"]["param"] == "max_tokens" and "echo" in reply["error"]["message"]


def test_tokenize_and_detokenize_as_vllm_answers_them(server, tokenizer):
    prompt = "The capital of France is Paris."
    code, reply = post(server.url + "/tokenize", {"prompt": prompt, "return_token_strs": True})
    ids = tokenizer.encode(prompt)
    assert code == 200 and reply == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                                     "token_strs": [tokenizer.decode_token(t) for t in ids]}
    # A conversation through the chat template: the ids a chat completion runs.
    messages = [{"role": "user", "content": "Hi"}]
    code, reply = post(server.url + "/tokenize", {"model": MODEL, "messages": messages})
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=1,
                                                 extra_body={"return_token_ids": True})
    assert code == 200 and reply["tokens"] == chat.choices[0].model_extra["prompt_token_ids"]
    assert reply["token_strs"] is None and reply["count"] == chat.usage.prompt_tokens
    chat_ids = reply["tokens"]
    code, reply = post(server.url + "/detokenize", {"model": MODEL, "tokens": ids})
    assert code == 200 and reply == {"prompt": tokenizer.decode(ids)}
    # The template's special tokens are text too: /detokenize inverts /tokenize.
    code, reply = post(server.url + "/detokenize", {"tokens": chat_ids})
    assert code == 200 and "<|im_start|>user" in reply["prompt"]
    assert tokenizer.encode(reply["prompt"], add_special_tokens=False) == chat_ids
    # A tool request's prompt counted beforehand: the tools as the template writes them.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    code, reply = post(server.url + "/tokenize", {"messages": messages, "tools": tools})
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=1,
                                                 tools=tools, tool_choice="required")
    assert code == 200 and reply["count"] == chat.usage.prompt_tokens  # (SmolLM2's template writes no tools)
    # OpenAI's metadata, store and service_tier are taken; a completion is not kept, though.
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=1,
                                                 metadata={"team": "search"}, store=False, service_tier="auto")
    assert chat.usage.completion_tokens == 1
    code, reply = post(server.url + "/v1/chat/completions", {"messages": messages, "store": True})
    assert code == 400 and reply["error"]["param"] == "store" and "keeps no completions" in reply["error"]["message"]
    for path, body, status, param in (
            ("/tokenize", {"prompt": "x", "messages": messages}, 400, None),
            ("/tokenize", {}, 400, None),
            ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
            ("/tokenize", {"prompt": "x", "temperature": 1}, 400, "temperature"),
            ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens.0")):
        code, reply = post(server.url + path, body)
        assert code == status and reply["error"]["param"] == param, (path, body, reply)


def test_continue_final_message_and_vllm_stop_options(server, tokenizer):
    # A reply begun for the model: the prompt ends in its text (no end-of-turn), as /tokenize
    # says, and the answer is the plain completion of those ids. No model named: the served one.
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit I pick is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    code, reply = post(server.url + "/tokenize", {"messages": messages, **flags})
    assert code == 200 and tokenizer.decode(reply["tokens"]).endswith("assistant\nThe fruit I pick is")
    code, chat = post(server.url + "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 8,
                                                             "return_token_ids": True, **flags})
    choice = chat["choices"][0]
    assert code == 200 and chat["model"] == MODEL and choice["prompt_token_ids"] == reply["tokens"]
    plain = complete(server, reply["tokens"], max_tokens=8, extra_body={"return_token_ids": True}).choices[0]
    assert choice["message"]["content"] == plain.text and choice["token_ids"] == plain.model_extra["token_ids"]
    # An empty reply continued is the assistant's turn opened, as transformers renders it.
    code, opened = post(server.url + "/tokenize", {"messages": [messages[0], {"role": "assistant", "content": ""}],
                                                    **flags})
    assert code == 200 and opened["tokens"] == post(server.url + "/tokenize", {"messages": messages[:1]})[1]["tokens"]
    # The stop string kept (streamed too); a chat's end-of-turn written out.
    text = complete(server, "Count: 1, 2, 3,", max_tokens=20).choices[0].text
    stop = text[text.index("5"):][:3]
    kept = {"stop": [stop], "include_stop_str_in_output": True}
    whole = complete(server, "Count: 1, 2, 3,", max_tokens=20, extra_body=kept).choices[0]
    streamed = complete(server, "Count: 1, 2, 3,", max_tokens=20, extra_body=kept, stream=True)
    assert whole.text == text[: text.index(stop) + len(stop)] == "".join(c.choices[0].text for c in streamed)
    said = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 temperature=0, max_completion_tokens=64,
                                                 extra_body={"skip_special_tokens": False,
                                                             "include_stop_str_in_output": True})
    assert said.choices[0].finish_reason == "stop" and said.choices[0].message.content.endswith("<|im_end|>")


def test_stop_reason_names_the_stop_string_or_token_and_is_null_for_eos_and_length(server):
    """vLLM's stop_reason: a client that stops on several strings or tokens reads which one ended
    the answer (streamed too, on the finishing chunk); EOS and the length limit leave it null."""
    prompt = "Count: 1, 2, 3,"
    free = complete(server, prompt, max_tokens=20, extra_body={"return_token_ids": True}).choices[0]
    stop = free.text[free.text.index("5"):][:3]
    hit = complete(server, prompt, max_tokens=20, stop=["never said", stop]).choices[0]
    assert (hit.finish_reason, hit.model_extra["stop_reason"]) == ("stop", stop)
    streamed = list(complete(server, prompt, max_tokens=20, stop=[stop], stream=True))
    assert [c.choices[0].model_extra["stop_reason"] for c in streamed] == [None] * (len(streamed) - 1) + [stop]
    token = free.model_extra["token_ids"][3]
    by_token = complete(server, prompt, max_tokens=20, extra_body={"stop_token_ids": [token]}).choices[0]
    assert (by_token.finish_reason, by_token.model_extra["stop_reason"]) == ("stop", token)
    short = complete(server, prompt, max_tokens=2).choices[0]
    assert (short.finish_reason, short.model_extra["stop_reason"]) == ("length", None)
    said = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 temperature=0, max_completion_tokens=64).choices[0]
    assert (said.finish_reason, said.model_extra["stop_reason"]) == ("stop", None)  # the model's EOS


def test_chat_template_kwargs_may_not_set_continue_final_message(server):
    """The request's own field: as a template variable it was a TypeError, answered as the
    template rejecting the messages."""
    code, reply = post(server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"continue_final_message": True}})
    assert code == 400 and reply["error"]["param"] == "chat_template_kwargs", reply
    assert "chat_template_kwargs may not set continue_final_message" in reply["error"]["message"]


def test_logit_bias_forces_and_bans_tokens(server, tokenizer):
    def first_token(**kw) -> int:
        out = complete(server, "The capital of France is", max_tokens=2, extra_body={"return_token_ids": True}, **kw)
        return out.choices[0].model_extra["token_ids"][0]
    first = first_token()
    assert first_token(logit_bias={str(first): -100}) != first
    forced = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   temperature=0, max_completion_tokens=3, logit_bias={"42": 100},
                                                   extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [42, 42, 42]


def test_chat_n_choices_streamed_each_open_with_the_role(server):
    messages = [{"role": "user", "content": "Name a colour."}]
    greedy = server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                   max_completion_tokens=10).choices[0].message.content
    out = server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                max_completion_tokens=10, n=2)
    assert [(c.index, c.message.content) for c in out.choices] == [(0, greedy), (1, greedy)]
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                        max_completion_tokens=10, n=2, stream=True))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    for index in (0, 1):
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == index) == greedy


def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(server, tokenizer):
    # 256 tokens of context: text beyond what 256 of the longest tokens could cover is refused on
    # its length alone. A prompt near the bound is still tokenized and refused on its token count.
    bound = 2 * 256 * tokenizer.most_chars_per_token
    for path, body in (("/v1/completions", {"prompt": "x" * (bound + 1)}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (bound + 1)}]})):
        code, reply = post(server.url + path, {"model": MODEL, **body})
        assert code == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        assert "characters" in reply["error"]["message"], reply
    code, reply = post(server.url + "/v1/completions", {"model": MODEL, "prompt": "x" * (bound - 1)})
    assert code == 400 and "tokens" in reply["error"]["message"] and "characters" not in reply["error"]["message"]


def test_a_long_prompt_is_tokenized_while_the_event_loop_runs_on(tokenizer):
    """Under the length bound of a long-context model (a megabyte of text at 8k tokens), tokenizing
    took seconds on the event loop, with the GIL held: every stream, /health and /metrics stalled,
    past the probes' timeout. The loop (a ticker here) now runs on while a long prompt tokenizes."""
    from types import SimpleNamespace

    from kiln.engine.openai_serving import OFF_LOOP_CHARS, OpenAIServing
    text = "A long prompt, as a pasted document would be. " * 10_000
    assert len(text) >= 10 * OFF_LOOP_CHARS
    serving = SimpleNamespace(max_model_len=8192, tokenizer=tokenizer)

    async def tokenize_and_tick() -> tuple[list[int], int]:
        ticks, done = 0, asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.001)
                ticks += 1
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)  # the ticker's first turn
        ids = await OpenAIServing._encode(serving, text, "prompt", True)
        done.set()
        await task
        return ids, ticks
    ids, ticks = asyncio.run(tokenize_and_tick())
    assert ids == tokenizer.encode(text)
    assert ticks >= 10  # with the GIL held throughout: 0 or 1


def test_bad_input_through_openai_client(server):
    with pytest.raises(openai.BadRequestError, match="unsupported parameter: guided_json"):
        server.client.completions.create(model=MODEL, prompt="hi", extra_body={"guided_json": {}})
    with pytest.raises(openai.BadRequestError, match=r"logit_bias: token ids must lie in \[0, 49152\)"):
        server.client.completions.create(model=MODEL, prompt="hi", logit_bias={"49152": 5})
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="(?s)the regex does not compile: .*unclosed character class"):
        server.client.completions.create(model=MODEL, prompt="hi", extra_body={"structured_outputs": {"regex": "[a-"}})
    with pytest.raises(openai.BadRequestError, match="the json does not compile"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}}})
    assert get(server.url + "/health")[0] == 200  # nothing crashed


def test_response_format_and_structured_outputs_through_the_openai_client(server):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1}},
              "required": ["colour", "count"], "additionalProperties": False}
    ask = [{"role": "user", "content": "How many apples are on the table, and what colour? Answer in JSON."}]
    chat = server.client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=60, temperature=1.0, seed=3, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "apples", "schema": schema, "strict": True}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    # Streamed, vLLM's own field: the pieces make one of the choices.
    stream = server.client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=10, stream=True,
                                              extra_body={"structured_outputs": {"choice": ["sunny", "rainy weather"]}})
    assert "".join(c.choices[0].text for c in stream) in ("sunny", "rainy weather")
    text = server.client.completions.create(model=MODEL, prompt="Say hi:", max_tokens=8,
                                            extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text  # plain text is no constraint
    # A json_schema without its (optional) schema: any JSON object, as json_object.
    bare = server.client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0,
                                                 response_format={"type": "json_schema", "json_schema": {"name": "any"}})
    if bare.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(bare.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the beginning of an object
        assert bare.choices[0].message.content.lstrip().startswith("{")


# It compiles, then outgrows llguidance's lexer after a token.
FAILS_WHILE_GENERATING = {"model": MODEL, "max_tokens": 20, "temperature": 0,
                          "structured_outputs": {"regex": "(a{1000}){1000}"}}


def test_a_constraint_that_fails_while_generating_is_a_400_not_a_stop(server):
    # The client hears why instead of a "stop" with text that does not follow the regex.
    body = {**FAILS_WHILE_GENERATING, "prompt": "Write the letter a many times:"}
    status, answer = post(server.url + "/v1/completions", body)
    assert status == 400 and "constraint failed while generating" in answer["error"]["message"], answer


def sse_payloads(url: str, body: dict) -> list:
    """A stream's `data:` payloads: parsed JSON, or the string "[DONE]"."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        data = [line[len(b"data: "):].strip() for line in r if line.startswith(b"data: ")]
    return [d.decode() if d == b"[DONE]" else json.loads(d) for d in data]


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"prompt": "Write the letter a many times:"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write the letter a many times."}]}),
])
def test_a_stream_that_fails_part_way_ends_with_its_error_then_done(server, path, fields):
    # The error event, never a finish_reason, then [DONE] as vLLM sends it (clients read to it).
    *chunks, error, done = sse_payloads(server.url + path, {**FAILS_WHILE_GENERATING, **fields})
    assert done == "[DONE]" and "constraint failed while generating" in error["error"]["message"], error
    assert not any(c["choices"][0]["finish_reason"] for c in chunks), chunks


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
    "additionalProperties": False}}}


def test_tool_calls_named_required_streamed_and_answered(server):
    tools = [WEATHER, CLOCK]
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    named = server.client.chat.completions.create(
        model=MODEL, messages=ask, tools=tools, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    (call,) = named.message.tool_calls
    assert named.finish_reason == "stop" and named.message.content is None and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = server.client.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice="required",
                                                     parallel_tool_calls=False, max_tokens=80, temperature=1.0,
                                                     seed=4).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    (call,) = required.message.tool_calls
    schema = next(t for t in tools if t["function"]["name"] == call.function.name)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # Streamed: the calls come whole in the last chunk, which a client reassembles as it would pieces.
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=ask, tools=tools, stream=True,
                                                        tool_choice="required", max_tokens=120, temperature=0))
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and calls and [c.index for c in calls] == \
        list(range(len(calls)))
    for c in calls:
        schema = next(t for t in tools if t["function"]["name"] == c.function.name)["function"]["parameters"]
        jsonschema.validate(json.loads(c.function.arguments), schema)
    # The call and the tool's answer go back into the conversation; tool_choice "none" answers in text.
    answer = server.client.chat.completions.create(model=MODEL, tools=tools, tool_choice="none", max_tokens=8,
                                                   temperature=0, messages=ask + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump() for call in named.message.tool_calls]},
        {"role": "tool", "tool_call_id": named.message.tool_calls[0].id, "content": "18 C and sunny"}]).choices[0]
    assert answer.message.content and answer.message.tool_calls is None


def test_null_means_the_default_as_openai_and_vllm_take_it(server):
    # The openai SDK sends an explicit None as null, as other SDKs do for every unset field: was a 400.
    unset = dict(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None, frequency_penalty=None,
                 extra_body={"ignore_eos": True})
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, logprobs=None, **unset)
    text = server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, echo=None, best_of=None, **unset)
    assert chat.usage.completion_tokens == text.usage.completion_tokens == 3
    code, reply = post(server.url + "/v1/completions", {"model": MODEL, "prompt": None})
    assert code == 400 and reply["error"]["param"] == "prompt"  # a required field stays required


def test_undecodable_body_is_a_400(server):
    # aiohttp fails reading a body sent as gzip that is not gzip: that was an unhandled 500.
    req = urllib.request.Request(server.url + "/v1/completions", data=b"not gzip", method="POST",
                                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(req, timeout=60)
    reply = json.loads(answer.value.read())
    assert answer.value.code == 400 and "could not be read" in reply["error"]["message"], reply


def test_disconnect_mid_stream_frees_blocks(server):
    before = server.metrics()
    stream = server.client.completions.create(model=MODEL, prompt="Tell me a long story.", temperature=0,
                                              max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    assert server.metrics()["kiln:kv_cache_usage_perc"] > 0
    stream.close()
    m = server.wait_metrics(kiln__kv_cache_usage_perc=0, kiln__num_requests_running=0)
    abort = "kiln:request_success_total{finished_reason=abort}"
    assert m[abort] == before[abort] + 1
    # A non-streamed request whose client gives up is aborted too.
    with pytest.raises(openai.APITimeoutError):
        server.client.with_options(timeout=0.5).completions.create(
            model=MODEL, prompt="Tell me a long story.", max_tokens=240, extra_body={"ignore_eos": True})
    m = server.wait_metrics(kiln__kv_cache_usage_perc=0, kiln__num_requests_running=0)
    assert m[abort] == before[abort] + 2
    # Every choice of an n-choice stream is aborted with it.
    stream = server.client.completions.create(model=MODEL, prompt="Tell me a long story.", temperature=1.0,
                                              max_tokens=200, n=3, stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(6), stream):
        pass
    stream.close()
    m = server.wait_metrics(kiln__kv_cache_usage_perc=0, kiln__num_requests_running=0)
    assert m[abort] == before[abort] + 5


def test_metrics_count_requests_and_tokens(server):
    keys = ["kiln:request_success_total{finished_reason=length}", "kiln:prompt_tokens_total",
            "kiln:generation_tokens_total", "kiln:time_to_first_token_seconds_count",
            "kiln:e2e_request_latency_seconds_count", "kiln:request_queue_time_seconds_count",
            "kiln:prefix_cache_queries_total"]
    before = server.metrics()
    outs = [complete(server, p, max_tokens=5, extra_body={"ignore_eos": True}) for p in PROMPTS[:3]]
    after = server.metrics()
    delta = {k: after[k] - before[k] for k in keys}
    assert delta[keys[0]] == 3 and delta[keys[3]] == 3 and delta[keys[4]] == 3 and delta[keys[5]] == 3
    assert delta["kiln:prompt_tokens_total"] == sum(o.usage.prompt_tokens for o in outs)
    assert delta["kiln:generation_tokens_total"] == 15
    assert delta["kiln:prefix_cache_queries_total"] > 0
    assert after["kiln:inter_token_latency_seconds_count"] - before["kiln:inter_token_latency_seconds_count"] == 12
    # The engine thread's time in steps and between them (bench/serving_path.py) both moved.
    assert after["kiln:engine_step_seconds_total"] > before["kiln:engine_step_seconds_total"]
    assert after["kiln:engine_gap_seconds_total"] > before["kiln:engine_gap_seconds_total"]


def test_latency_histograms_tell_minutes_apart():
    """A long generation or a backlog takes minutes: with buckets up to 160 s every p99 past that
    read as 160 s."""
    from prometheus_client.parser import text_string_to_metric_families
    from kiln.engine.metrics import ServerMetrics
    metrics = ServerMetrics("m")
    metrics.e2e_request_latency.observe(1000.0)
    (family,) = [f for f in text_string_to_metric_families(metrics.exposition().decode())
                 if f.name == "kiln:e2e_request_latency_seconds"]
    counts = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert (counts["640.0"], counts["1280.0"]) == (0, 1)


def test_cold_start_phases_in_metrics(server):
    m = server.metrics()
    phases = {p: m[f"kiln:startup_phase_seconds{{phase={p}}}"] for p in (*PHASES, "total")}
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert phases["total"] >= sum(phases[p] for p in PHASES), phases  # the phases never overlap
    # float32 on the CPU dequantizes the GGUF's Q4_1 projections; importing torch alone takes > 0.1 s.
    assert phases["quantize"] > 0 and phases["imports"] > 0.1 and phases["warmup"] > 0, phases
    # What the engine's build counts happens inside the build, and the process started after Popen
    # and was ready before /ready said so (its start time is known to a 10 ms clock tick).
    assert phases["weights_read"] + phases["quantize"] + phases["kv_alloc"] <= m["kiln:model_load_seconds"]
    assert phases["total"] <= server.ready_after + 0.01, (phases, server.ready_after)
    assert "cold start: process_start" in "".join(server.log)
    assert "torch threads: " in "".join(server.log)  # sized from the CPUs this process may use (kiln.engine.cpus)


def test_queue_full_gives_429_and_waiting_metric_moves():
    s = ServerProcess("--max-model-len", "512", "--max-num-seqs", "1", "--max-queue", "2")
    try:
        # More choices than the server ever holds: not a 429 (a retry could never succeed).
        code, reply = post(s.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 4})
        assert code == 400 and reply["error"]["param"] == "n" and "holds at most 3" in reply["error"]["message"]
        code, reply = post(s.url + "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 2})
        assert code == 400 and reply["error"]["param"] == "prompt"
        streams = [s.client.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True}) for i in range(3)]
        s.wait_metrics(kiln__num_requests_waiting=2, kiln__num_requests_running=1)
        code, reply = post(s.url + "/v1/completions", {"model": MODEL, "prompt": "one more"})
        assert code == 429 and reply["error"]["type"] == "rate_limit_error"
        streams[2].close()  # one place free: a request of two choices gets one, then is refused whole
        s.wait_metrics(kiln__num_requests_waiting=1)
        aborts = s.metrics()["kiln:request_success_total{finished_reason=abort}"]
        code, reply = post(s.url + "/v1/completions", {"model": MODEL, "prompt": "two", "n": 2})
        assert code == 429 and reply["error"]["code"] == "queue_full"
        m = s.wait_metrics(kiln__num_requests_waiting=1, kiln__num_requests_running=1)  # nothing left behind
        assert m["kiln:request_success_total{finished_reason=abort}"] == aborts  # refused whole: none admitted
        for st in streams:
            st.close()
        s.wait_metrics(kiln__num_requests_waiting=0, kiln__num_requests_running=0, kiln__kv_cache_usage_perc=0)
        assert complete(s, "after", max_tokens=2).usage.completion_tokens == 2  # admits again
    finally:
        s.stop()


def test_queue_time_ends_at_the_first_chunk_of_a_prompt_not_at_its_first_token():
    """A 160-token prompt in ten 16-token chunks on an idle server waits for nothing; its queue time
    was counted to the step that gave its first token, the tenth: nine chunks of prefill read as
    queueing."""
    s = ServerProcess("--max-model-len", "256", "--max-num-batched-tokens", "16")
    try:
        code, reply = post(s.url + "/v1/completions", {"model": MODEL, "prompt": list(range(1000, 1160)),
                                                       "max_tokens": 1})
        assert code == 200 and reply["usage"]["prompt_tokens"] == 160, reply
        m = s.metrics()
        queued, first = m["kiln:request_queue_time_seconds_sum"], m["kiln:time_to_first_token_seconds_sum"]
        assert m["kiln:request_queue_time_seconds_count"] == 1 and queued < first / 3, (queued, first)
    finally:
        s.stop()


def test_choices_are_admitted_as_one_against_the_queued_token_cap():
    """n choices of a 40-token prompt on an idle server with a 64-token cap: each choice alone
    would find the previous one waiting and be refused for ever; together they are admitted,
    as any request that finds nothing waiting is."""
    s = ServerProcess("--max-model-len", "256", "--max-num-queued-tokens", "64")
    try:
        prompt = list(range(1000, 1040))
        code, reply = post(s.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 2})
        assert code == 200 and len(reply["choices"]) == 2, reply
        code, reply = post(s.url + "/v1/completions", {"model": MODEL, "prompt": [prompt, prompt[:30]], "max_tokens": 2})
        assert code == 200 and len(reply["choices"]) == 2, reply
    finally:
        s.stop()


def test_choices_the_engine_refuses_leave_no_error_unread(tiny_llama_dir, caplog):
    """Choices refused by the engine, read together or after their client left while they were
    queued: every refusal is read (asyncio logged each one not read as an error with its
    traceback, n - 1 of them per refused request) and nothing stays behind."""
    import gc

    from kiln.engine import SamplingParams
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.config import Config
    from kiln.engine.llm_engine import LLMEngine
    from kiln.engine.metrics import ServerMetrics

    def refused(prefix: str, n: int) -> list:  # token ids past the vocabulary: the engine's ValueError
        return [(f"{prefix}-{i}", [10_000], SamplingParams(max_tokens=2)) for i in range(n)]

    async def run() -> AsyncEngine:
        core = LLMEngine(Config(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64,
                                kv_cache_memory=1 << 20))
        engine = AsyncEngine(core, ServerMetrics(MODEL), max_queue=8)
        engine.start()
        try:
            with pytest.raises(ValueError, match="prompt token ids"):
                await engine.submit_all(refused("whole", 3))
            entered, gate = threading.Event(), threading.Event()
            held = asyncio.ensure_future(engine.call(lambda: (entered.set(), gate.wait(60))))
            assert await asyncio.to_thread(entered.wait, 60)  # the engine thread is held: the choices queue
            gone = asyncio.ensure_future(engine.submit_all(refused("gone", 2)))
            while engine._commands.qsize() < 2:
                await asyncio.sleep(0.01)
            gone.cancel()  # the client left
            gate.set()
            await held
            await engine.call(lambda: None)  # after the refusals: their answers are in
            return engine
        finally:
            await engine.stop()

    engine = asyncio.run(run())
    gc.collect()
    assert "never retrieved" not in caplog.text, caplog.text
    assert not engine._streams and not engine.engine.has_unfinished_requests()


def test_sigterm_drains_in_flight_streams():
    s = ServerProcess("--max-model-len", "512", "--drain-timeout", "120")
    try:
        results: dict[int, list] = {}
        first = threading.Barrier(9)

        def consume(i: int) -> None:
            chunks = []
            stream = s.client.completions.create(model=MODEL, prompt=PROMPTS[i], temperature=0, max_tokens=64,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
            for n, c in enumerate(stream):
                chunks.append(c)
                if n == 0:
                    first.wait(timeout=300)
            results[i] = chunks

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        first.wait(timeout=300)  # every stream has its first chunk
        s.proc.send_signal(signal.SIGTERM)
        from kiln.local.testing import eventually
        eventually(lambda: get(s.url + "/ready")[0] == 503, "/ready 503 once draining", timeout=30, interval=0.05)
        code, reply = post(s.url + "/v1/completions", {"model": MODEL, "prompt": "late"})
        assert code == 503 and "draining" in reply["error"]["message"]
        for t in threads:
            t.join()
        assert s.proc.wait(timeout=120) == 0
        assert sorted(results) == list(range(8))
        for chunks in results.values():
            assert chunks[-1].usage.completion_tokens == 64
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    finally:
        s.stop()


def test_bad_cli_arguments_exit_nonzero(caplog, capsys):
    assert parse_size("4Gi") == 4 << 30 and parse_size("512Mi") == 512 << 20 and parse_size("1G") == 10**9
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--kv-cache-memory", "lots"])
    assert exc.value.code == 2 and "not a positive size" in capsys.readouterr().err
    assert cli_main(["serve", "--device", "nonsense"]) == 2
    assert "bad configuration" in caplog.text
    # A model that is not there is a bad configuration too, said before the port opens.
    assert cli_main(["serve", "--model", "/nonexistent/model.gguf", "--host", "127.0.0.1", "--port", "0"]) == 2
    assert "bad configuration: model '/nonexistent/model.gguf' not found" in caplog.text
    assert "listening on" not in caplog.text


def test_a_port_out_of_range_or_taken_is_one_error_line(caplog, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--port", "99999"])
    assert exc.value.code == 2 and "not a port number: 99999" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        # Both servers bind before they load anything, so this costs no model load.
        assert cli_main(["serve", "--host", "127.0.0.1", "--port", port]) == 1
        assert f"cannot listen on 127.0.0.1:{port}" in caplog.text
        assert cli_main(["router", "--endpoints", "127.0.0.1:9", "--host", "127.0.0.1", "--port", port]) == 1
        assert f"kiln router: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
        # Without --host both listen on every address, IPv4 included: taken there too.
        assert cli_main(["serve", "--port", port]) == 1
        assert f"cannot listen on *:{port}" in caplog.text
        assert cli_main(["router", "--endpoints", "127.0.0.1:9", "--port", port]) == 1
        assert f"kiln router: cannot listen on *:{port}" in capsys.readouterr().err
