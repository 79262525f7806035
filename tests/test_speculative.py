"""N-gram speculative decoding: the proposer against hand-made histories, and the engine on the
real SmolLM2 (float32) with speculation against the same engine without it: the same tokens,
text and logprobs, in mixed batches, under preemption, with stops and limits, with prefix-cache
hits on blocks that accepted drafts filled; fewer steps where the text repeats; sampled requests'
drafts through the sampler's acceptance test (its distribution is tested in test_engine_sampler);
the server's flag and counters."""
from __future__ import annotations

import pytest

from kiln.engine import LLM, SamplingParams
from kiln.engine.sampling_params import StructuredOutputs
from kiln.engine.speculative import SpeculativeConfig, propose
from kiln_process import refused_at_start
from test_engine_generate import one_thread  # noqa: F401 (autouse: one torch thread, as there)
from test_server import ServerProcess, complete

REPEATING = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat after me: I like green apples and red cherries. Repeat after me: I like green apples",
]
PLAIN = ["Hello, my name is", "Water boils at"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM(dtype="float32", speculative=SpeculativeConfig(num_speculative_tokens=4))


def test_propose_takes_what_followed_the_latest_longest_match():
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    #           0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # "6 7" recurs at 1 and 5 (the 3-gram "2 6 7" does not): the latest, 5, is followed by 1 2 6.
    assert propose(history, config, room=10) == [1, 2, 6]
    assert propose(history, config, room=2) == [1, 2]  # room: max_tokens and the context
    assert propose(history, config, room=0) == []
    # The 3-gram "8 9 6" beats the 1-gram match of 6 alone.
    assert propose([8, 9, 6, 4, 4, 6, 3, 8, 9, 6], config, room=10) == [4, 4, 6]
    # Nothing recurs; a match at the very end offers what there is.
    assert propose([1, 2, 3, 4], config, room=5) == []
    assert propose([3, 3], config, room=5) == [3]
    assert propose([1, 2, 3, 1, 2], SpeculativeConfig(prompt_lookup_min=3), room=5) == []  # n=2 too short


@pytest.mark.parametrize("text,message", [
    ('{"method": "draft"}', "method 'draft' is not supported ('ngram', 'draft_model')"),
    ('{"method": "draft_model"}', "method 'draft_model' takes a model"),
    ('{"method": "ngram", "model": "smollm2-135m"}', "method 'draft_model' takes a model (the draft), and only it"),
    ("{nope", "not JSON"),
    ("[4]", "JSON object"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens must be a positive integer"),
    ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min (4) is more than"),
    ('{"lookahead": 2}', "unknown field(s) lookahead"),
    ('{"disable_by_batch_size": 0}', "disable_by_batch_size must be a positive integer"),
    # refused before the server listens, not after the target loaded
    ('{"model": "smollm2-135m", "quantization": "bogus"}', "quantization 'bogus' is not one of none, int8"),
    ('{"model": "smollm2-135m", "quantization": null}', "quantization None is not one of"),
    ('{"method": "ngram", "quantization": 7}', "quantization 7 is not one of"),
    ('{"method": "ngram", "quantization": "int8"}', "(the draft model's; ngram has none)"),
    pytest.param("[" * 100000 + "]" * 100000, "not JSON", id="nested past Python's recursion limit"),
])
def test_bad_speculative_config_says_why(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_json(text)


def test_one_given_lookup_bound_sets_the_other_as_vllm_does():
    assert SpeculativeConfig.from_json('{"prompt_lookup_max": 6}').prompt_lookup_min == 6
    assert SpeculativeConfig.from_json('{"prompt_lookup_min": 3}').prompt_lookup_max == 3


def steps_to_finish(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], int]:
    engine = llm.engine
    engine.add_request("count-steps", prompt, params)
    steps, out = 0, None
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            out = o
    return out.token_ids, steps


def test_same_tokens_in_fewer_steps(plain: LLM, spec: LLM):
    prompts = REPEATING + PLAIN
    expected = plain.generate(prompts, GREEDY)
    before = spec.engine.num_accepted_tokens
    got = spec.generate(prompts, GREEDY)
    for e, g in zip(expected, got):
        assert (g.token_ids, g.text, g.finish_reason) == (e.token_ids, e.text, e.finish_reason)
    assert spec.engine.num_accepted_tokens > before
    stats = spec.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    tokens, steps = steps_to_finish(spec, REPEATING[2], GREEDY)
    assert tokens == expected[2].token_ids and steps < GREEDY.max_tokens * 3 // 4, steps


def test_no_drafts_in_a_batch_above_disable_by_batch_size(plain: LLM):
    busy = LLM(dtype="float32", speculative=SpeculativeConfig(disable_by_batch_size=2))
    got = busy.generate(REPEATING, GREEDY)  # three at once: no drafts until one finishes
    assert busy.engine.num_draft_tokens == 0
    assert [g.token_ids for g in got] == [e.token_ids for e in plain.generate(REPEATING, GREEDY)]
    busy.generate(REPEATING[:2], GREEDY)
    assert busy.engine.num_accepted_tokens > 0


def test_stops_limits_and_logprobs_hold(plain: LLM, spec: LLM):
    text = plain.generate([REPEATING[0]], GREEDY)[0].text
    stop = text[20:24]
    cases = [SamplingParams(temperature=0.0, max_tokens=48, stop=[stop]),
             SamplingParams(temperature=0.0, max_tokens=48, stop=[stop], include_stop_str_in_output=True),
             SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # drafts cut to the budget
             SamplingParams(temperature=0.0, max_tokens=48, logprobs=2, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=48, min_tokens=10)]
    for params in cases:
        e, g = plain.generate(REPEATING, params), spec.generate(REPEATING, params)
        for a, b in zip(e, g):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), params
            if params.logprobs:
                assert [x["token_id"] for x in b.logprobs] == [x["token_id"] for x in a.logprobs]
                assert [x["logprob"] for x in b.logprobs] == pytest.approx([x["logprob"] for x in a.logprobs],
                                                                           abs=1e-4)
    # A context that ends first: drafts never run past max_model_len.
    short = LLM(dtype="float32", max_model_len=48, speculative=SpeculativeConfig())
    out = short.generate([REPEATING[2]], SamplingParams(temperature=0.0, max_tokens=47 - 20, ignore_eos=True))[0]
    ref = plain.generate([REPEATING[2]], SamplingParams(temperature=0.0, max_tokens=len(out.token_ids),
                                                        ignore_eos=True))[0]
    assert out.token_ids == ref.token_ids and len(out.prompt_token_ids) + len(out.token_ids) <= 48


def test_sampled_and_penalized_requests_share_the_batch(plain: LLM, spec: LLM):
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=48, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=48, ignore_eos=True)]
    engine = spec.engine
    for i, p in enumerate(params):
        engine.add_request(f"mixed-{i}", REPEATING[i], p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [len(done[f"mixed-{i}"].token_ids) for i in range(3)] == [48, 48, 48]
    # The greedy ones are exactly what plain decoding gives (the sampled one draws otherwise).
    for i in range(2):
        assert done[f"mixed-{i}"].token_ids == plain.generate([REPEATING[i]], params[i])[0].token_ids


def test_sampled_requests_check_drafts_through_the_sampler(plain: LLM, spec: LLM):
    # Temperature 1e-3 samples (above the greedy cut-off) from a distribution all but one-hot:
    # drafts reach the sampler's acceptance test and the output is the greedy one.
    cold = SamplingParams(temperature=1e-3, seed=1, max_tokens=48, ignore_eos=True)
    before = spec.engine.num_accepted_tokens
    got = spec.generate(REPEATING, cold)
    assert spec.engine.num_accepted_tokens - before > 20
    assert [g.token_ids for g in got] == [e.token_ids for e in plain.generate(REPEATING, GREEDY)]
    # Hot: drafts are still accepted, at the model's own probabilities.
    before = spec.engine.num_accepted_tokens
    hot = spec.generate(REPEATING, SamplingParams(temperature=0.8, seed=2, max_tokens=48, ignore_eos=True))
    assert [len(h.token_ids) for h in hot] == [48] * 3 and spec.engine.num_accepted_tokens > before


def test_seeded_sampling_speculates_to_the_same_text_as_plain_decoding(plain: LLM):
    """A seeded request's draw at each output position depends on the seed and the position alone,
    and a draft is kept when that draw is the draft: so its text is plain decoding's, however many
    drafts it checked, whatever ran beside it (here drafting stops and starts with the batch size,
    disable_by_batch_size=2) and through preemption."""
    # The first ends early: drafting starts once two are left.
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=n, ignore_eos=True) for seed, n in
              ((1, 10), (2, 40), (3, 40))]
    alone = [plain.generate([prompt], p)[0].token_ids for prompt, p in zip(REPEATING, params)]
    spec = LLM(dtype="float32", speculative=SpeculativeConfig(disable_by_batch_size=2))
    assert [g.token_ids for g in spec.generate(REPEATING, params)] == alone
    assert spec.engine.num_accepted_tokens > 0
    block_bytes = 2 * 30 * 3 * 64 * 16 * 4  # a float32 block of SmolLM2, K and V
    tight = LLM(dtype="float32", kv_cache_memory=6 * block_bytes, max_model_len=96, speculative=SpeculativeConfig())
    assert [g.token_ids for g in tight.generate(REPEATING, params)] == alone
    assert tight.engine.stats().num_preemptions > 0 and tight.engine.num_accepted_tokens > 0


def test_preemption_drops_drafts_and_keeps_outputs(plain: LLM):
    block_bytes = 2 * 30 * 3 * 64 * 16 * 4  # a float32 block of SmolLM2, K and V
    tight = LLM(dtype="float32", kv_cache_memory=12 * block_bytes, max_model_len=192,
                speculative=SpeculativeConfig())
    prompts = REPEATING + PLAIN
    got = tight.generate(prompts, GREEDY)
    assert tight.engine.stats().num_preemptions > 0
    assert tight.engine.block_manager.num_free_blocks == tight.engine.block_manager.num_blocks
    assert [g.token_ids for g in got] == [e.token_ids for e in plain.generate(prompts, GREEDY)]


def test_a_constrained_output_whose_drafts_complete_it_and_end_it_stops_cleanly(plain: LLM, spec: LLM):
    """The drafts after 'ant' are the rest of the word and the end of turn, as the earlier answer
    had them: the grammar completes inside the drafts and takes the end-of-turn into no history.
    Rolling the matcher back by every draft undid one of the output's own tokens, and the request
    ended in 'error' with the text cut at 'ant'."""
    word = "antidisestablishment"
    prompt = (f"<|im_start|>user\nSay a long word<|im_end|>\n<|im_start|>assistant\n{word}<|im_end|>\n"
              "<|im_start|>user\nSay it again<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputs(choice=[word, word.title()]))
    got, expected = spec.generate([prompt], params)[0], plain.generate([prompt], params)[0]
    assert (got.text, got.finish_reason, got.token_ids) == (expected.text, "stop", expected.token_ids) \
        and got.text.lower() == word, (got.text, got.finish_reason, got.error)


def test_prefix_hits_on_blocks_that_accepted_drafts_filled(plain: LLM, spec: LLM):
    first = spec.generate([REPEATING[1]], GREEDY)[0]
    hits = spec.engine.stats().prefix_cache_hits
    # The whole first exchange as the prompt: its decoded blocks (drafts in them) come from the cache.
    follow = first.prompt_token_ids + first.token_ids[:-1]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    again = spec.generate([follow], params)[0]
    assert spec.engine.stats().prefix_cache_hits - hits > len(first.prompt_token_ids)
    assert again.token_ids == plain.generate([follow], params)[0].token_ids


@pytest.mark.timeout(600)  # its refusal runs in this process: a check that no longer refuses would start a server here
def test_server_flag_and_counters(capsys, caplog):
    said = refused_at_start(["--speculative-config", '{"method": "draft"}'], capsys, caplog)
    assert "method 'draft' is not supported" in said
    server = ServerProcess("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        assert "speculative decoding: n-gram lookup" in "".join(server.log)
        out = complete(server, REPEATING[2], max_tokens=32, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 32
        m = server.metrics()
        accepted, drafted = (m["kiln:spec_decode_num_accepted_tokens_total"],
                             m["kiln:spec_decode_num_draft_tokens_total"])
        assert 0 < accepted <= drafted
    finally:
        server.stop()
