"""`kiln serve` options a vLLM command line carries: --api-key (Authorization: Bearer on every route
but the probes, /metrics and /openapi.json) and --chat-template (a file or the template itself,
replacing the model's), over real HTTP with the openai client; bad values stop the server at start
with exit code 2 and one line naming the problem."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request

import openai
import pytest
import torch

from kiln.engine import LLM, SamplingParams
from kiln.engine.sampling_defaults import sampling_defaults
from kiln_process import REPO, refused_at_start
from test_server import MODEL, ServerProcess, get, post

# A template no model ships: each message as "<<role>> content" (an assistant's calls with their
# arguments as JSON, as models' templates write them), then the assistant's opening, "as" a persona
# when the request's chat_template_kwargs name one.
TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}" \
           "{% for c in m.tool_calls or [] %}call {{ c.function.name }}({{ c.function.arguments | tojson }})" \
           "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}" \
           "{% if persona %} as {{ persona }}{% endif %}"
KEYS = ("tenant-a-key", "tenant-b-key")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess("--api-key", KEYS[0], "--api-key", KEYS[1], "--chat-template", str(template),
                           "--max-model-len", "256")
    yield server
    server.stop()


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_every_route_but_the_probes_needs_a_key(server):
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):  # kubelet and Prometheus carry no key
        assert get(server.url + path)[0] == 200, path
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
                       ("/tokenize", {"prompt": "Hi"}), ("/sleep", {})):
        code, reply = post(server.url + path, body)
        assert code == 401 and reply["error"]["code"] == "invalid_api_key", (path, reply)
    assert get(server.url + "/v1/models")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        client(server, "not-a-key").models.list()
    for key in KEYS:  # either tenant's key
        answer = client(server, key).completions.create(model=MODEL, prompt="The capital of France is",
                                                          max_tokens=4, temperature=0)
        assert answer.choices[0].text and answer.usage.completion_tokens == 4


def with_key(server: ServerProcess, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[0]}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_the_chat_template_flag_replaces_the_models(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids = with_key(server, "/tokenize", {"messages": messages})["tokens"]
    rendered = with_key(server, "/detokenize", {"tokens": ids})["prompt"]
    assert rendered == "<<system>> Be brief.\n<<user>> Hello there\n<<assistant>>"
    chat = client(server, KEYS[1]).chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert chat.usage.prompt_tokens == len(ids)  # the chat ran on the same rendering


def test_the_template_gets_call_arguments_as_objects_and_the_requests_variables(server):
    """OpenAI clients send a call's arguments as a JSON string; templates write `arguments | tojson`,
    so they must get the object, or the model reads its past calls as escaped strings."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12C"}]
    ids = with_key(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"persona": "a pirate"}})
    assert with_key(server, "/detokenize", {"tokens": ids["tokens"]})["prompt"] == (
        '<<user>> Weather?\n<<assistant>> call get_weather({"city": "Oslo"})\n<<tool>> 12C\n<<assistant>> as a pirate')
    chat = client(server, KEYS[1]).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, extra_body={"chat_template_kwargs": {"persona": "a pirate"}})
    assert chat.usage.prompt_tokens == len(ids["tokens"])
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set messages"):
        client(server, KEYS[1]).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, extra_body={"chat_template_kwargs": {"messages": []}})


def test_an_inline_template_has_its_escapes_decoded_as_vllm_does_and_a_file_is_read_verbatim(tmp_path):
    """A template typed on a command line holds `\\n` for a line break; it rendered as a backslash
    and an n (vLLM decodes them). A file's text is the template as written."""
    from kiln.engine.tokenizer import read_chat_template
    typed = r"{% for m in messages %}{{ m.content | replace('\d', 'é') }}\n{% endfor %}\u2192 \\ ok"
    assert read_chat_template(typed) == "{% for m in messages %}{{ m.content | replace('\\d', 'é') }}\n{% endfor %}→ \\ ok"
    assert read_chat_template("Ünïcode → {{ x }}") == "Ünïcode → {{ x }}"  # characters beyond Latin-1 stay
    written = tmp_path / "chat.jinja"
    written.write_text(typed)
    assert read_chat_template(str(written)) == typed


@pytest.mark.parametrize("args, env, message", [
    (["--chat-template", "no/such/template.jinja"], {}, "is neither a file nor a Jinja template"),
    (["--chat-template", "{% if %}"], {}, "the template does not compile"),
    # One line longer than a file name may be: a template, not an OSError.
    (["--chat-template", "{% if %}" + "{{ x }}" * 50], {}, "the template does not compile"),
    (["--chat-template", "{{ x }}\\"], {}, "a backslash escape in it is malformed"),  # a lone one at the end
    (["--seed", str(2**64)], {}, "seed must be in [0, 2**63 - 1]"),
    (["--drain-timeout", "nan"], {}, "--drain-timeout: must be > 0"),
    (["--api-key", ""], {}, "--api-key must not be empty"),
    (["--served-model-name", " "], {}, "--served-model-name must not be empty"),  # served as the model's name
    ([], {"KILN_API_KEYS": "# nobody"}, "$KILN_API_KEYS is set but holds no API key"),
    (["--model", "no/such/model"], {}, "model 'no/such/model' not found"),  # said before listening: exit 2
    # What a pod given GPUs runs (the operator asks for cuda): no usable GPU is a refusal, not a CPU engine.
    pytest.param(["--device", "cuda"], {}, "device 'cuda': this process sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")),
    (["--model", "docs"], {}, "docs: not a model folder: it holds no config.json"),
    (["--enable-lora", "--lora-modules", "sql=no/such/adapter"], {},
     "--lora-modules sql=no/such/adapter: not a PEFT adapter folder"),
    (["--speculative-config", '{"model": 123}'], {}, "model must be the draft's name, folder or .gguf, got 123"),
    (["--speculative-config", '{"model": "no/such/draft"}'], {},
     "--speculative-config: the draft model: model 'no/such/draft' not found"),
])
@pytest.mark.timeout(120)  # a check that no longer refuses would start a server in this process
def test_bad_values_stop_the_server_before_loading(args, env, message, monkeypatch, capsys, caplog):
    monkeypatch.chdir(REPO)  # "docs": a folder of this checkout
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert message in refused_at_start(args, capsys, caplog)


def test_a_bad_value_is_the_process_exit_code_and_its_last_line():
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", "--model", "no/such/model"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "model 'no/such/model' not found" in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_stop_while_the_model_loads_ends_the_server_cleanly():
    """SIGTERM (a pod deleted while it starts) before the model is loaded: exit 0 at once, not the
    abort (134) the interpreter gave on exit while the loading thread ran torch."""
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--dtype", "float32", "--quantization", "int8", "--quantization-cache", "off"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # bounded by the server's start: it logs "listening" before it loads
            seen.append(line)
            if "listening on" in line:
                break
        proc.terminate()
        rest, = proc.communicate(timeout=120)[1:]
    finally:
        proc.kill()
        proc.wait()  # collected, or a zombie stays below this process for the tests after
    assert proc.returncode == 0 and "stopped while loading" in rest, "".join(seen) + rest
    assert "listening on http://127.0.0.1:0 " not in seen[-1]  # --port 0: the port it got, not 0


def test_the_served_name_defaults_to_the_folders_whole_name():
    from kiln.engine.server import served_name
    assert served_name("models/SmolLM2-1.7B-Instruct") == "SmolLM2-1.7B-Instruct"  # dots are no suffix
    assert served_name("/srv/Qwen2.5-0.5B-Instruct/") == "Qwen2.5-0.5B-Instruct"
    assert served_name("/srv/ggufs/smollm2-135m.Q8_0.gguf") == "smollm2-135m.Q8_0"
    assert served_name("smollm2-135m") == "smollm2-135m"


def _with_generation_config(source, folder, **values):
    """A copy of the model folder source whose generation_config.json also holds values."""
    shutil.copytree(source, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**(json.loads(path.read_text()) if path.is_file() else {}), **values}))
    return folder


def test_the_models_generation_config_gives_the_defaults_a_request_leaves_out(tiny_llama_dir, tmp_path):
    folder = _with_generation_config(tiny_llama_dir, tmp_path / "model", temperature=0.0, top_p=0.5,
                                     max_new_tokens=5, repetition_penalty=1.1)
    messages = [{"role": "user", "content": "w5 w6 w7"}]

    def chats(s: ServerProcess, **fields) -> list:
        return [s.client.chat.completions.create(model=MODEL, messages=messages, seed=seed,
                                                 extra_body={"ignore_eos": True}, **fields) for seed in range(3)]

    s = ServerProcess("--model", str(folder), "--max-model-len", "64", "--speculative-config", '{"method": "ngram"}')
    try:
        log = "".join(s.log)
        assert "the model's sampling defaults (auto): temperature=0.0, top_p=0.5, repetition_penalty=1.1, " \
               "max_tokens=5" in log and "repetition_penalty=1.1 turns speculative decoding off" in log
        greedy = chats(s)  # temperature 0 from the file: the seed changes nothing
        assert {(c.choices[0].message.content, c.usage.completion_tokens, c.choices[0].finish_reason)
                for c in greedy} == {(chats(s, temperature=0.0, max_tokens=5)[0].choices[0].message.content,
                                      5, "length")}
        hot = chats(s, temperature=1.0, top_p=1.0, max_tokens=8)  # what a request names wins
        assert len({c.choices[0].message.content for c in hot}) > 1
        assert s.client.completions.create(model=MODEL, prompt="w1", extra_body={"ignore_eos": True}) \
            .usage.completion_tokens == 16  # as vLLM: max_new_tokens bounds chats; completions keep 16
        # A response tells the sampling settings it ran with (it said temperature 1.0, top_p 1.0);
        # max_output_tokens is echoed as sent (none), as OpenAI does, though the file's 5 cut it.
        told = s.client.responses.create(model=MODEL, input="w5 w6 w7")
        assert (told.temperature, told.top_p, told.max_output_tokens) == (0.0, 0.5, None)
        assert told.status == "incomplete" and told.usage.output_tokens == 5
    finally:
        s.stop()
    with LLM(str(folder), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory=4 << 20) as llm:
        offline = llm.generate([[5, 6, 7]] * 2)  # generate() without params: the model's defaults too
        spelled = llm.generate([5, 6, 7], SamplingParams(temperature=0.0, top_p=0.5, max_tokens=5,
                                                         repetition_penalty=1.1))[0]
    assert [o.token_ids for o in offline] == [spelled.token_ids] * 2 and len(spelled.token_ids) <= 5
    s = ServerProcess("--model", str(folder), "--max-model-len", "64", "--generation-config", "vllm")
    try:
        plain = chats(s)  # the API's defaults: temperature 1, up to the end of the context
        assert len({c.choices[0].message.content for c in plain}) > 1
        assert all(c.usage.completion_tokens == 64 - c.usage.prompt_tokens for c in plain)
    finally:
        s.stop()


@pytest.mark.timeout(120)  # a check that no longer refuses would start a server in this process
def test_a_bad_generation_config_stops_the_server_before_loading(tiny_llama_dir, tmp_path, capsys, caplog):
    hot = _with_generation_config(tiny_llama_dir, tmp_path / "hot", temperature=5, top_k="many")
    for args, message in [
            (["--model", str(hot)], f"{hot / 'generation_config.json'}: temperature: Input should be less than or "
                                    "equal to 2; top_k: Input should be a valid integer"),
            (["--generation-config", str(tmp_path)], f"--generation-config {tmp_path}: no generation_config.json")]:
        assert message in refused_at_start(args, capsys, caplog)
    # Ignored, it does not matter what it holds.
    assert sampling_defaults("vllm", hot) == {} and sampling_defaults("auto", tmp_path) == {}
