"""The engine end to end on the real SmolLM2-135M, checked against Hugging Face transformers
running the same GGUF weights in float32: greedy continuations token for token in mixed
batches, with chunked prefill, under preemption, and with prefix-cache hits; logprobs;
stop handling; streaming text; bad input."""
from __future__ import annotations

import copy
import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from kiln.engine import LLM, LLMEngine, SamplingParams
from kiln.engine.sequence import Sequence

NEW_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter "
    "who had three sons. The youngest son was",
    "List three primary colors:",
    "Water boils at",
    "In 1969, astronauts landed on the Moon. The mission was called Apollo 11 and its crew were Neil Armstrong,",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Translate "
    "this sentence into French, then explain the meaning of every word in detail:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The test machine is shared: two OpenMP threads fighting other processes for two cores
    # run ~20x slower than one. Speed is measured in bench/, not here.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def small_llm() -> LLM:
    """Chunked prefill forced to 16 tokens a step and a KV pool of 20 blocks (320 tokens)."""
    block_bytes = 2 * 30 * 3 * 64 * 16 * 4  # layers x kv heads x head_dim x block_size x fp32, K and V
    return LLM(dtype="float32", max_num_batched_tokens=16, kv_cache_memory=20 * block_bytes, max_model_len=256)


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    """transformers' SmolLM2 (dense float32 weights), the plain reference implementation: a copy
    of the session's, as `references` changes its generation config (a copy costs a second where
    a load from the GGUF costs over twenty)."""
    return copy.deepcopy(hf_smollm2[0])


@pytest.fixture(scope="module")
def references(hf_model, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations (EOS ignored), one left-padded batch."""
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    hf_model.generation_config.eos_token_id = None  # like ignore_eos: always NEW_TOKENS tokens
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert out.shape[1] == width + NEW_TOKENS
    return out[:, width:].tolist()


def assert_matches(outputs, references: list[list[int]]) -> None:
    for i, (out, ref) in enumerate(zip(outputs, references)):
        assert out.token_ids == ref, f"prompt {i} diverges at token {next(j for j, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)}"
        assert out.finish_reason == "length"


def test_mixed_length_batch_matches_transformers(llm: LLM, prompt_ids, references) -> None:
    # Interleave long and short prompts so every step mixes lengths.
    outputs = llm.generate(prompt_ids, GREEDY)
    assert_matches(outputs, references)
    assert all(o.text == llm.tokenizer.decode(o.token_ids) for o in outputs)


def test_chunked_prefill_matches_transformers(small_llm: LLM, prompt_ids, references) -> None:
    assert max(map(len, prompt_ids)) > 2 * 16, "some prompt must need several chunks"
    before = small_llm.engine.stats().num_preemptions
    for i in range(0, len(prompt_ids), 2):  # two at a time: 20 blocks hold two, so no preemption here
        assert_matches(small_llm.generate(prompt_ids[i : i + 2], GREEDY), references[i : i + 2])
    assert small_llm.engine.stats().num_preemptions == before


def test_preemption_keeps_outputs(small_llm: LLM, prompt_ids, references) -> None:
    before = small_llm.engine.stats().num_preemptions
    assert_matches(small_llm.generate(prompt_ids, GREEDY), references)
    stats = small_llm.engine.stats()
    assert stats.num_preemptions > before
    assert stats.kv_cache_usage == 0.0  # everything handed back


def test_prefix_cache_hit_leaves_output_unchanged(llm: LLM) -> None:
    system = "You are a careful assistant. " * 20  # about 120 tokens: several full blocks
    first = system + "Question: name a fruit that is yellow."
    second = system + "Question: name a planet with rings."
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cold = llm.generate(second, params)[0]
    assert cold.num_cached_tokens == 0
    stats = llm.engine.stats()
    llm.generate(first, params)
    warm = llm.generate(second, params)[0]
    after = llm.engine.stats()
    assert after.prefix_cache_hits - stats.prefix_cache_hits >= 2 * 96
    assert warm.num_cached_tokens >= 96
    assert warm.token_ids == cold.token_ids


CHOICES_PROMPT = "You are a careful assistant. " * 12 + "Tell me something about the sea."


def _choices(salt: str) -> list[SamplingParams]:
    """A greedy choice and two seeded samplers, all in one cache_salt (a salt of its own: no sharing)."""
    return [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, cache_salt=salt),
            SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, cache_salt=salt),
            SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True, cache_salt=salt)]


def test_choices_admitted_together_share_their_prompt_and_keep_their_outputs(llm: LLM) -> None:
    """n=3 on one prompt: the three choices are admitted in one step. The second and third take
    the first one's full prompt blocks as it computes them, in the same forward: one copy of the
    prompt is held, not three; and each choice makes the tokens it makes alone, with nothing shared."""
    alone = [llm.generate(CHOICES_PROMPT, _choices(f"choices-alone-{i}")[i])[0].token_ids for i in range(3)]
    engine, bm = llm.engine, llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing else holds a block
    ids = [f"choice-{i}" for i in range(3)]
    for request_id, params in zip(ids, _choices("choices-together")):
        engine.add_request(request_id, CHOICES_PROMPT, params)
    first = {o.request_id: o for o in engine.step()}
    size, length = bm.block_size, engine.requests[ids[0]].num_prompt_tokens
    full, blocks = (length - 1) // size, bm.blocks_for(length)  # the last token is always computed
    assert full >= 4
    assert [first[i].num_cached_tokens for i in ids] == [0, full * size, full * size]
    assert bm.num_blocks - bm.num_free_blocks == blocks + 2 * (blocks - full)  # not 3 * blocks
    final = dict(first)
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step())
    assert [final[i].token_ids for i in ids] == alone


def test_a_forward_cut_short_takes_back_the_blocks_published_for_it(llm: LLM, monkeypatch) -> None:
    """Blocks are published as their step is scheduled, before its forward writes them. A step whose
    forward fails (Ctrl-C) must unpublish them, or the next request with the prompt takes K/V never
    written; and the choices admitted onto them must not count them as computed."""
    alone = [llm.generate(CHOICES_PROMPT, _choices(f"cut-short-alone-{i}")[i])[0].token_ids for i in range(3)]
    engine, bm = llm.engine, llm.engine.block_manager
    ids = [f"cut-short-{i}" for i in range(3)]
    for request_id, params in zip(ids, _choices("cut-short")):
        engine.add_request(request_id, CHOICES_PROMPT, params)

    def interrupted(batch):
        raise KeyboardInterrupt
    monkeypatch.setattr(engine.runner, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 3, 0.0)  # back in the queue
    probe = Sequence("probe", engine.requests[ids[0]].token_ids, _choices("cut-short")[0], 0)
    assert bm.match_prefix(probe) == []  # nothing of theirs published
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step())
    assert [final[i].token_ids for i in ids] == alone


def test_logprobs_match_model_log_softmax(llm: LLM, hf_model, prompt_ids) -> None:
    out = llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=6, logprobs=5))[0]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids[0] + out.token_ids])).logits[0].float()
    reference = logits.log_softmax(-1)[len(prompt_ids[0]) - 1 : -1]
    for step, entry in enumerate(out.logprobs):
        token = out.token_ids[step]
        assert entry["token_id"] == token
        assert entry["logprob"] == pytest.approx(reference[step, token].item(), abs=2e-3)
        top_ids = [t for t, _ in entry["top"]]
        assert len(top_ids) == 5 and top_ids[0] == token  # greedy picks the most likely
        torch.testing.assert_close(torch.tensor([v for _, v in entry["top"]]), reference[step, top_ids],
                                   atol=2e-3, rtol=0)


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Tell me a story about", params)[0]
    crowd = llm.generate(["Tell me a story about", "Another request", "And a third"],
                         [params, SamplingParams(temperature=1.0, max_tokens=16), SamplingParams(temperature=0.7)])[0]
    assert alone.token_ids == crowd.token_ids
    other = llm.generate("Tell me a story about", SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))[0]
    assert other.token_ids != alone.token_ids


def test_top_k_one_is_greedy(llm: LLM, prompt_ids, references) -> None:
    out = llm.generate([prompt_ids[3]], SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == references[3][:16]


def test_stop_strings_and_stop_tokens(llm: LLM, prompt_ids, references) -> None:
    ref_text = llm.tokenizer.decode(references[6])
    stop = ref_text[len(ref_text) // 3 : len(ref_text) // 3 + 4]
    out = llm.generate([prompt_ids[6]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == ref_text[: ref_text.index(stop)]
    stop_id = references[6][5]
    out = llm.generate([prompt_ids[6]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == references[6][: references[6].index(stop_id) + 1]
    out = llm.generate([prompt_ids[6]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert (out.finish_reason, out.token_ids) == ("length", references[6][:5])


def test_a_stop_string_met_before_min_tokens_stops_nothing_later(llm: LLM, prompt_ids, references) -> None:
    """A short stop string that came before min_tokens allowed stopping is past: only one that
    ends once stopping is allowed ends the request (a longer stop string beside it once made the
    search look back far enough to find the old one)."""
    ref_text = llm.tokenizer.decode(references[6])
    short = ref_text.strip()[0]  # a character the first tokens hold
    min_tokens = 6
    allowed_from = len(llm.tokenizer.decode(references[6][:min_tokens]))  # from token min_tokens + 1
    assert 0 <= ref_text.find(short) < allowed_from
    later = ref_text.find(short, allowed_from)
    for keep in (False, True):
        out = llm.generate([prompt_ids[6]], SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=min_tokens, ignore_eos=True,
            stop=[short, "a stop string this text never holds"], include_stop_str_in_output=keep))[0]
        end = len(ref_text) if later < 0 else later + (len(short) if keep else 0)
        assert out.text == ref_text[:end], (keep, out.text)
    # The text of token min_tokens itself as the stop string: min_tokens tokens come out whole.
    for count in (1, 3):
        before, upto = (llm.tokenizer.decode(references[6][:n]) for n in (count - 1, count))
        out = llm.generate([prompt_ids[6]], SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=count, ignore_eos=True,
            stop=[upto[len(before):]]))[0]
        assert len(out.token_ids) > count and out.text.startswith(upto), (count, out.text)


def test_an_interrupted_generate_leaves_nothing_behind_for_the_next_call(llm: LLM, prompt_ids, references,
                                                                         monkeypatch) -> None:
    """Ctrl-C (or an error) in the middle of LLM.generate: its requests are aborted, so the next
    call gets only its own outputs."""
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()
    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_ids[:4], SamplingParams(temperature=0.0, max_tokens=20))
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([prompt_ids[6]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in out] == [references[6][:5]]


def test_vllm_stop_options(llm: LLM, prompt_ids, references) -> None:
    """include_stop_str_in_output, min_tokens and skip_special_tokens as vLLM defines them."""
    ref_text = llm.tokenizer.decode(references[6])
    stop = ref_text[len(ref_text) // 3 : len(ref_text) // 3 + 4]
    kept = llm.generate([prompt_ids[6]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=[stop],
                                                        include_stop_str_in_output=True))[0]
    assert (kept.finish_reason, kept.text) == ("stop", ref_text[: ref_text.index(stop) + len(stop)])
    # A stop token (here the reference's 6th) cannot be drawn, and nothing stops, before min_tokens.
    stop_id = references[6][5]
    first = references[6].index(stop_id)
    held = llm.generate([prompt_ids[6]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=first + 3,
                                                        stop_token_ids=[stop_id], stop=[stop]))[0]
    assert held.token_ids[: first] == references[6][: first] and held.token_ids[first] != stop_id
    assert stop_id not in held.token_ids[: first + 3] and len(held.token_ids) > first + 3
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64))[0]
    special = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64, skip_special_tokens=False,
                                                include_stop_str_in_output=True))[0]
    assert plain.token_ids == special.token_ids and plain.token_ids[-1] in llm.tokenizer.eos_token_ids
    eos_text = llm.tokenizer.decode_token(plain.token_ids[-1])
    assert special.text == plain.text + eos_text and eos_text not in plain.text
    # min_tokens past the natural end: the answer goes on instead of ending at EOS.
    longer = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64, min_tokens=len(plain.token_ids) + 2))[0]
    assert longer.token_ids[: len(plain.token_ids) - 1] == plain.token_ids[:-1]
    assert len(longer.token_ids) > len(plain.token_ids) + 1


def test_eos_ends_a_chat_answer(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=64))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "Paris" in out.text


def test_streamed_text_adds_up(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["\n\n"])
    engine.add_request("stream", "Write the word 'café' and the Chinese word for water (水), then:", params)
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert "\ufffd" not in out.new_text  # no half UTF-8 characters
            pieces.append(out.new_text)
            final = out
    assert final is not None and final.finished
    assert "".join(pieces) == final.text
    assert "\n\n" not in final.text


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("to-abort", "Count to one hundred:", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_cache_usage == 0.0


def test_max_tokens_none_runs_to_the_end_of_the_context(tiny_llama_dir) -> None:
    # vLLM's offline None: as many tokens as max_model_len leaves after the prompt.
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=40)
    (out,) = llm.generate(["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 40


def test_bad_requests_are_refused(llm: LLM, small_llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", "", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        small_llm.generate([[1] * 300])
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("e", [10**7], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("hi", SamplingParams(top_p=1.5))
    engine.add_request("dup", "hi", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hi", SamplingParams())
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="not found"):
        LLM("no-such-model")


def kiln(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "generate", *args], capture_output=True,
                          input=stdin, timeout=300)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--system", "Be brief."], "--system needs --chat"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--model", "no-such-model"], "not found"),
        (["--prompt", "hi", "--temperature", "warm"], "invalid float"),
        (["--prompt", "hi", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
        (["--prompt", "hi", "--kv-cache-memory", "0"], "not a positive size"),
        # Beyond any address space: was a traceback and exit 1.
        (["--prompt", "hi", "--kv-cache-memory", str(2**50)], "GiB, kv_cache_memory) cannot be allocated on cpu"),
        (["--prompt", "hi", "--load-format", "zeros"], "invalid choice: 'zeros'"),
        (["--prompt", "hi", "--temperature", "nan"], "temperature must be a finite number"),
        (["--prompt", "hi", "--temperature", "inf"], "temperature must be a finite number"),
        (["--prompt", "hi", "--repetition-penalty", "nan"], "repetition_penalty must be a finite number"),
        (["--prompt", "hi", "--seed", str(2**64)], "seed must be an integer in [-2**63, 2**63 - 1]"),
        (["--prompt", "hi", "--json-schema", "{nope"], "--json-schema is not JSON"),
        (["--prompt", "hi", "--json-schema", "@/no/such/schema.json"], "--json-schema: cannot read /no/such/schema.json"),
        (["--prompt", "hi", "--regex", "a+", "--choice", "b"], "exactly one of"),
        (["--prompt", "hi", "--regex", "[a-"], "the regex does not compile"),
    ],
)
def test_cli_bad_input_exits_2(args: list[str], message: str) -> None:
    done = kiln(*args)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.parametrize("stdin, message", [(b"", "prompt is empty"),
                                            (b"caf\xe9", "the prompt on standard input is not UTF-8")])
def test_cli_bad_prompt_on_stdin_exits_2(stdin: bytes, message: str) -> None:
    done = kiln("--prompt", "-", stdin=stdin)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_cli_constrains_the_output_to_a_schema_file_or_choices(tmp_path) -> None:
    schema = {"type": "object", "properties": {"planet": {"enum": ["Mars", "Venus"]}, "moons": {"type": "integer"}},
              "required": ["planet", "moons"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    done = kiln("--prompt", "Name a planet and its moons.", "--chat", "--dtype", "float32",
                "--json-schema", f"@{tmp_path / 'schema.json'}")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["planet"] in ("Mars", "Venus") and isinstance(answer["moons"], int)
    done = kiln("--prompt", "Is the sky blue?", "--chat", "--dtype", "float32", "--choice", "yes", "--choice", "no")
    assert done.returncode == 0 and done.stdout.strip() in ("yes", "no"), done


def test_cli_reads_the_prompt_from_stdin(llm: LLM) -> None:
    prompt = "Write one line about the sea.\nKeep it short: "  # a newline a shell argument rarely carries
    done = kiln("--prompt", "-", "--max-tokens", "10", "--dtype", "float32", stdin=prompt.encode())
    assert done.returncode == 0, done.stderr
    expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0].text
    assert done.stdout.strip() == expected.strip()


def test_cli_generates(llm: LLM) -> None:
    done = kiln("--chat", "--prompt", "What is the capital of France?", "--max-tokens", "12", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    expected = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0.0, max_tokens=12))[0].text
    assert done.stdout.strip() == expected.strip()


def test_cli_chat_writes_bos_once(tmp_path, tiny_llama_dir) -> None:
    """The chat template writes BOS itself; a tokenizer that also adds one must not double it."""
    from tokenizers import AddedToken, Tokenizer, processors

    folder = tmp_path / "bos"
    shutil.copytree(tiny_llama_dir, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<s>", special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    chat = [{"role": "user", "content": "w5 w6"}]
    text = llm.tokenizer.apply_chat_template(chat)
    assert text.startswith("<s>") and llm.tokenizer.encode(text)[:2] == [1, 1]  # what went wrong
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [out] = llm.chat(chat, greedy)
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    done = kiln("--model", str(folder), "--chat", "--prompt", "w5 w6", "--max-tokens", "6", "--ignore-eos",
                "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == out.text.strip()


def test_cli_chat_template_refusal_is_one_line(tmp_path, tiny_llama_dir) -> None:
    folder = tmp_path / "no-system"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }} {% endfor %}")}))
    done = kiln("--model", str(folder), "--chat", "--system", "be brief", "--prompt", "w5", "--dtype", "float32")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("kiln generate: error: the model's chat template rejected "
                                                    "the messages: System role not supported")


def test_a_tokenizer_bigger_than_the_model_is_one_line(tmp_path, tiny_llama_dir) -> None:
    # Text whose ids pass the model's vocab_size reached the embedding: an IndexError traceback.
    from tokenizers import Tokenizer, models, pre_tokenizers
    folder = tmp_path / "big-tokenizer"
    shutil.copytree(tiny_llama_dir, folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(2 * vocab)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    done = kiln("--model", str(folder), "--prompt", f"w3 w{vocab + 5}", "--dtype", "float32", "--max-tokens", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"kiln generate: error: the tokenizer gave token ids [{vocab + 8}] that the model does not have (its "
        f"vocab_size is {vocab}): the tokenizer does not belong to this model")


def test_cli_ctrl_c_exits_130_without_a_traceback() -> None:
    # SIGINT restored to its default: a child of a non-interactive shell may inherit it ignored.
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "generate", "--prompt", "Once upon a time",
                             "--max-tokens", "4000", "--ignore-eos", "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.read(1)  # generating: the model is loaded and the first token is out
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()  # collected, or a zombie stays below this process for the tests after
    assert proc.returncode == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "kiln generate: interrupted"


def test_queued_outputs_do_not_each_copy_the_text_so_far() -> None:
    """Each RequestOutput kept the text made so far: a streaming client that stopped reading left
    every step's output queued, each with its own copy, O(length^2) in memory (30 MiB at 4000
    tokens). The text an output gives is still the one of its step."""
    import tracemalloc

    from kiln.engine.sequence import Sequence
    seq = Sequence("slow-reader", [1, 2, 3], SamplingParams(max_tokens=5000), 0)
    tracemalloc.start()
    outputs = []
    for _ in range(3000):
        seq.token_ids.append(7)
        seq.text += "word "
        outputs.append(LLMEngine._output(seq))
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert held < 4 << 20, f"{held / 2**20:.1f} MiB for 3000 queued outputs"  # copies: 22 MiB
    assert [outputs[k].text for k in (0, 999, 2999)] == ["word " * (k + 1) for k in (0, 999, 2999)]
    assert "".join(o.new_text for o in outputs) == outputs[-1].text
