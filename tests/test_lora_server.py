"""LoRA adapters through `kiln serve` (vLLM's flags and endpoints), driven by the openai client and raw
HTTP: each adapter answers under its name as the in-process engine does with it, and adapters are
loaded and unloaded while the server runs, with every bad request refused by name."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from kiln.engine.llm import LLM
from kiln.engine.lora_serving import add_lora_arguments, lora_module
from kiln.engine.sampling_params import SamplingParams
from kiln_process import REPO, refused_at_start
from lora_support import SMOLLM2, make_one_tensor_integer, write_adapter
from test_server import MODEL, ServerProcess, post

PROMPT = "The capital of France is"


def adapter_call(url: str, body: dict) -> tuple[int, str | dict]:
    """POST to an adapter endpoint: (status, the success line or the error JSON)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-loras")
    write_adapter(root / "sql", SMOLLM2, seed=11)
    write_adapter(root / "poet", SMOLLM2, seed=12, rank=4, alpha=32, targets=("q_proj", "v_proj", "down_proj"))
    return {"sql": root / "sql", "poet": root / "poet"}


@pytest.fixture(scope="module")
def server(folders):
    s = ServerProcess("--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory", "128Mi",
                      "--enable-lora", "--lora-modules", f"sql={folders['sql']}", "--max-loras", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(folders) -> dict[str | None, str]:
    """Greedy text of PROMPT from the in-process engine: base, and with each adapter."""
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", enable_lora=True, max_loras=2,
              lora_modules=tuple((name, str(path)) for name, path in folders.items()),
              kv_cache_memory=64 << 20, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    return {lora: llm.generate(PROMPT, greedy, lora=lora)[0].text for lora in (None, "sql", "poet")}


def test_adapters_are_listed_and_answer_under_their_name(server, folders, reference):
    cards = server.client.models.list().data
    assert [m.id for m in cards] == [MODEL, "sql"]
    assert cards[1].parent == MODEL and cards[1].root == str(folders["sql"])
    assert server.client.models.retrieve("sql").parent == MODEL
    assert len(set(reference.values())) == 3  # each adapter says something else
    for model, lora in ((MODEL, None), ("sql", "sql")):
        answer = server.client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=16)
        assert answer.model == model and answer.choices[0].text == reference[lora]
    chunks = list(server.client.completions.create(model="sql", prompt=PROMPT, temperature=0, max_tokens=16,
                                                   stream=True))
    assert {c.model for c in chunks} == {"sql"} and "".join(c.choices[0].text for c in chunks) == reference["sql"]
    chat = server.client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Hi"}],
                                                 temperature=0, max_tokens=4)
    assert chat.model == "sql"
    status, body = post(server.url + "/tokenize", {"model": "sql", "prompt": PROMPT})
    assert status == 200 and body["count"] > 0


def test_unknown_model_names_what_is_served(server):
    status, body = post(server.url + "/v1/completions", {"model": "sq1", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "'smol', 'sql'" in body["error"]["message"]


def test_load_and_unload_while_serving(server, folders, reference):
    url = server.url
    assert adapter_call(url + "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(folders["poet"])}) == \
        (200, "Success: LoRA adapter 'poet' added successfully.")
    assert [m.id for m in server.client.models.list().data] == [MODEL, "sql", "poet"]
    answer = server.client.completions.create(model="poet", prompt=PROMPT, temperature=0, max_tokens=16)
    assert answer.choices[0].text == reference["poet"]
    # a long stream holds the adapter: unloaded at once for everyone else (as in vLLM), the stream
    # finishes with it and loses nothing; under steady traffic a refusal never let it go
    stream = server.client.completions.create(model="poet", prompt=PROMPT, temperature=0, max_tokens=200,
                                              stream=True, extra_body={"ignore_eos": True})
    texts: list[str] = []
    reader = threading.Thread(target=lambda: texts.extend(c.choices[0].text for c in stream))
    reader.start()
    server.wait_metrics(kiln__num_requests_running=1)
    assert adapter_call(url + "/v1/unload_lora_adapter", {"lora_name": "poet"}) == \
        (200, "Success: LoRA adapter 'poet' removed successfully.")
    # vLLM's lora_requests_info, as LoRA-aware gateways read it: the stream still runs with it
    info = [key for key in server.metrics() if key.startswith("kiln:lora_requests_info")]
    assert [m.id for m in server.client.models.list().data] == [MODEL, "sql"]
    assert post(url + "/v1/completions", {"model": "poet", "prompt": PROMPT, "max_tokens": 2})[0] == 404
    reader.join(120)
    assert info == ["kiln:lora_requests_info{max_lora=2,running_lora_adapters=poet,waiting_lora_adapters=}"]
    assert "".join(texts).startswith(reference["poet"]) and len(texts) >= 190
    assert "'poet' unloaded; the 1 request(s) using it finish with it first" in "".join(server.log)


def test_load_inplace_replaces_an_adapter_under_its_name(server, folders, reference):
    """vLLM's load_inplace: the name stays served throughout and answers with the new weights
    from then on; vLLM's unload takes its lora_int_id too."""
    url = server.url
    assert adapter_call(url + "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": str(folders["sql"]),
                                                        "load_inplace": False})[0] == 200
    try:
        for lora in ("poet", "sql"):
            assert adapter_call(url + "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": str(folders[lora]),
                                                                "load_inplace": True})[0] == 200
            answer = server.client.completions.create(model="swap", prompt=PROMPT, temperature=0, max_tokens=16)
            assert answer.choices[0].text == reference[lora]  # not the old adapter's cached prefix either
            assert server.client.models.retrieve("swap").root == str(folders[lora])
    finally:
        assert adapter_call(url + "/v1/unload_lora_adapter", {"lora_name": "swap", "lora_int_id": 1})[0] == 200
    assert [m.id for m in server.client.models.list().data] == [MODEL, "sql"]


def test_a_request_racing_the_unload_of_its_adapter_gets_a_404(server, folders):
    """The server checks a request's model, then the engine thread admits it: an unload queued
    between the two (the engine busy with a long step) must answer as for any model not served,
    not with a 400. Should the request reach the engine first instead, it finishes with the
    adapter: either order ends consistently."""
    url = server.url
    assert adapter_call(url + "/v1/load_lora_adapter", {"lora_name": "racer", "lora_path": str(folders["poet"])})[0] \
        == 200
    busy = [threading.Thread(target=post, args=(url + "/v1/completions", {
        "prompt": f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * 20, "max_tokens": 1}))
        for i in range(4)]  # distinct prompts: no prefix-cache hits, one long prefill step
    for thread in busy:
        thread.start()
    time.sleep(0.3)  # admitted: the engine is in their step
    unloaded: list = []
    unload = threading.Thread(target=lambda: unloaded.append(
        adapter_call(url + "/v1/unload_lora_adapter", {"lora_name": "racer"})))
    unload.start()
    time.sleep(0.05)  # queued behind the step, not run yet
    status, body = post(url + "/v1/completions", {"model": "racer", "prompt": PROMPT, "max_tokens": 2})
    unload.join(60)
    for thread in busy:
        thread.join(60)
    assert unloaded[0][0] == 200, unloaded
    # the unload ran first (the case this test is for on a 2-core machine), or the request did
    assert status == 404 and body["error"]["code"] == "model_not_found" or status == 200, body
    assert [m.id for m in server.client.models.list().data] == [MODEL, "sql"]


def test_max_cpu_loras_bounds_the_loaded_adapters_and_one_held_is_a_429(folders, reference):
    """--max-cpu-loras 1: both adapters are served, one loaded at a time, each answering as it does
    alone. While a stream holds the loaded one, a request for the other (which must be read again)
    and a load get a 429 with Retry-After; once the stream ends, the other answers."""
    s = ServerProcess("--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory", "128Mi", "--enable-lora",
                      "--max-cpu-loras", "1", "--lora-modules", *(f"{name}={path}" for name, path in folders.items()))
    try:
        assert [m.id for m in s.client.models.list().data] == [MODEL, "sql", "poet"]
        for lora in ("poet", "sql"):  # each read again in turn, the other unloaded for it
            answer = s.client.completions.create(model=lora, prompt=PROMPT, temperature=0, max_tokens=16)
            assert answer.choices[0].text == reference[lora]
        stream = s.client.completions.create(model="sql", prompt=PROMPT, temperature=0, max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True})
        texts: list[str] = []
        reader = threading.Thread(target=lambda: texts.extend(c.choices[0].text for c in stream))
        reader.start()
        s.wait_metrics(kiln__num_requests_running=1)
        with pytest.raises(openai.RateLimitError) as refused:
            s.client.completions.create(model="poet", prompt=PROMPT, max_tokens=2)
        assert refused.value.code == "lora_capacity" and refused.value.response.headers["Retry-After"] == "1"
        got, body = adapter_call(s.url + "/v1/load_lora_adapter",
                                 {"lora_name": "new", "lora_path": str(folders["poet"])})
        assert got == 429 and "all 1 loaded adapters (--max-cpu-loras) are in use" in body["error"]["message"], body
        reader.join(120)
        assert "".join(texts).startswith(reference["sql"]) and len(texts) >= 190
        answer = s.client.completions.create(model="poet", prompt=PROMPT, temperature=0, max_tokens=16)
        assert answer.choices[0].text == reference["poet"]
    finally:
        s.stop()


@pytest.mark.parametrize("path, body, status, message, param", [
    ("load", {"lora_name": "sql", "lora_path": "/nonexistent"}, 400, "already loaded", "lora_name"),
    ("load", {"lora_name": "new", "lora_path": "/nonexistent"}, 400, "must hold adapter_config.json", "lora_path"),
    ("load", {"lora_name": "new", "lora_path": "/" + "x" * 300}, 400, "must hold adapter_config.json", "lora_path"),
    ("load", {"lora_name": MODEL, "lora_path": "/nonexistent"}, 400, "the served model's name", "lora_name"),
    ("load", {"lora_name": "new"}, 400, "lora_path", None),
    ("load", {"lora_name": "", "lora_path": "/x"}, 400, "lora_name", None),
    ("load", {"lora_name": "sql", "lora_path": "/nonexistent", "load_inplace": True}, 400,
     "must hold adapter_config.json", "lora_path"),  # the adapter it would replace goes on serving
    ("unload", {"lora_name": "nobody"}, 404, "no LoRA adapter named 'nobody'", "lora_name"),
    ("unload", {"lora_name": "nobody", "lora_int_id": 3}, 404, "no LoRA adapter named 'nobody'", "lora_name"),
    ("unload", {"lora_name": "sql", "extra": 1}, 400, "extra", None),
])
def test_bad_adapter_requests_are_refused_by_name(server, path, body, status, message, param):
    got, answer = adapter_call(f"{server.url}/v1/{path}_lora_adapter", body)
    assert got == status and message in answer["error"]["message"], answer
    assert param is None or answer["error"]["param"] == param
    assert [m.id for m in server.client.models.list().data] == [MODEL, "sql"]  # nothing changed


@pytest.mark.parametrize("args, message", [
    (["--lora-modules", "sql=/x"], "need enable_lora (--enable-lora)"),
    (["--enable-lora", "--lora-modules", "smollm2-135m=/x"], "is the served model's name"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "a given more than once"),
    (["--enable-lora", "--lora-modules", "noequals"], "expected name=path"),
    (["--enable-lora", "--max-loras", "0"], "max_loras must be a positive integer"),
    (["--enable-lora", "--max-lora-rank", "-1"], "max_lora_rank must be a positive integer"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras (2) must be at least max_loras (4)"),
])
@pytest.mark.timeout(120)  # a check that no longer refuses would start a server in this process
def test_bad_lora_flags_stop_the_server_before_loading(args, message, capsys, caplog):
    assert message in refused_at_start(args, capsys, caplog)


def test_an_adapter_that_cannot_load_fails_the_start(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8, "use_dora": true}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", "--enable-lora", "--lora-modules",
                           f"d={tmp_path}", "--max-model-len", "64", "--kv-cache-memory", "16Mi", "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "DoRA are not supported" in done.stderr, done.stderr[-2000:]


def test_an_adapter_with_integer_weights_is_refused_by_name(server, tmp_path):
    """PEFT writes float weights; integers cast to the model's dtype would serve an adapter nobody trained."""
    write_adapter(tmp_path / "ints", SMOLLM2, seed=13, rank=4)
    key = make_one_tensor_integer(tmp_path / "ints")
    got, answer = adapter_call(f"{server.url}/v1/load_lora_adapter",
                               {"lora_name": "ints", "lora_path": str(tmp_path / "ints")})
    assert got == 400 and answer["error"]["param"] == "lora_path", answer
    assert f"tensor {key!r} in {tmp_path / 'ints' / 'adapter_model.safetensors'} is torch.int8, not a floating-point " \
        "type" in answer["error"]["message"], answer
    assert [m.id for m in server.client.models.list().data] == [MODEL, "sql"]  # nothing changed
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", "--enable-lora", "--lora-modules",
                           f"ints={tmp_path / 'ints'}", "--max-model-len", "64", "--kv-cache-memory", "16Mi",
                           "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and f"tensor {key!r}" in done.stderr and "not a floating-point type" in done.stderr, \
        done.stderr[-2000:]


def test_lora_modules_take_name_path_and_vllm_json():
    assert lora_module("sql=/loras/sql") == ("sql", "/loras/sql")
    assert lora_module("a=/p=q") == ("a", "/p=q")  # the first '=' splits
    assert lora_module('{"name": "sql", "path": "/loras/sql", "base_model_name": "x"}') == ("sql", "/loras/sql")
    for bad in ("=/x", "sql=", '{"name": "sql"}', '{"name": 1, "path": "/x"}', "{not json"):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)


def test_lora_modules_given_twice_add_up():
    """Each --lora-modules adds its adapters: a second flag must not drop the first one's."""
    parser = argparse.ArgumentParser()
    add_lora_arguments(parser)
    args = parser.parse_args(["--lora-modules", "a=/x", "--lora-modules", "b=/y", "c=/z"])
    assert args.lora_modules == [("a", "/x"), ("b", "/y"), ("c", "/z")]
    assert parser.parse_args([]).lora_modules == []
