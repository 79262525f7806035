"""Speculative decoding with a draft model on the real SmolLM2 (float32): the draft is the same
model quantized to int4 (round to nearest), which guesses well but not always, and the output is
token for token what the target alone gives, with stops, limits, logprobs, constraints, sampled
neighbours, preemption, prefix-cache hits and sleep; the same model as its own draft accepts
every guess; a tensor-parallel target checks a whole draft's guesses on rank 0; a draft of another
vocabulary is refused; the server's flag."""
from __future__ import annotations

import json

import jsonschema
import pytest

from kiln.engine import LLM, SamplingParams
from kiln.engine.sampling_params import StructuredOutputs
from kiln.engine.speculative import SpeculativeConfig
from test_engine_generate import one_thread  # noqa: F401 (autouse: one torch thread, as there)
from test_server import ServerProcess, complete
from test_speculative import GREEDY, PLAIN, REPEATING, plain  # noqa: F401 (plain: a fixture)
from test_tensor_parallel import TINY, TINY_PROMPTS, greedy
from tiny_models import write_tiny_model

INT4_DRAFT = SpeculativeConfig(method="draft_model", model="smollm2-135m", quantization="int4-rtn",
                               num_speculative_tokens=3)


@pytest.fixture(scope="module")
def drafted() -> LLM:
    return LLM(dtype="float32", speculative=INT4_DRAFT)


def test_the_targets_tokens_from_an_int4_draft(plain: LLM, drafted: LLM):
    prompts = REPEATING + PLAIN
    text = plain.generate([REPEATING[0]], GREEDY)[0].text
    cases = [GREEDY, SamplingParams(temperature=0.0, max_tokens=48, stop=[text[20:24]]),
             SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),  # placeholders cut to the budget
             SamplingParams(temperature=0.0, max_tokens=32, logprobs=2, ignore_eos=True)]
    for params in cases:
        before = drafted.engine.stats()
        got, expected = drafted.generate(prompts, params), plain.generate(prompts, params)
        for g, e in zip(got, expected):
            assert (g.token_ids, g.text, g.finish_reason) == (e.token_ids, e.text, e.finish_reason), params
            if params.logprobs:
                assert [x["logprob"] for x in g.logprobs] == pytest.approx([x["logprob"] for x in e.logprobs], abs=1e-4)
        after = drafted.engine.stats()
        drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        if params.max_tokens > 5:  # the int4 draft guesses well, not perfectly
            assert 0.2 * drafts < accepted < drafts, (accepted, drafts)


def test_the_same_model_as_its_own_draft_accepts_every_guess(plain: LLM):
    own = LLM(dtype="float32", speculative=SpeculativeConfig(method="draft_model", model="smollm2-135m",
                                                             num_speculative_tokens=4))
    got = own.generate(PLAIN + REPEATING[:1], GREEDY)
    stats = own.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 60
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert [g.token_ids for g in got] == [e.token_ids for e in plain.generate(PLAIN + REPEATING[:1], GREEDY)]
    # Both pools are one budget: the pair holds fewer blocks than the target alone would.
    assert own.engine.runner.num_blocks < plain.engine.runner.num_blocks
    assert own.engine.drafter.runner.num_blocks == own.engine.runner.num_blocks


def test_sampled_penalized_and_constrained_neighbours(plain: LLM, drafted: LLM):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    params = [GREEDY, SamplingParams(temperature=0.9, seed=3, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=48, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputs(json=schema))]
    prompts = [REPEATING[0], REPEATING[1], REPEATING[2], "The biggest city of France, as JSON:"]
    got = drafted.generate(prompts, params)
    assert [len(g.token_ids) for g in got[:3]] == [48, 48, 48]
    for i in (0, 2, 3):
        assert got[i].token_ids == plain.generate([prompts[i]], params[i])[0].token_ids
    jsonschema.validate(json.loads(got[3].text), schema)


def test_preemption_prefix_hits_and_sleep(plain: LLM):
    block_bytes = 2 * 30 * 3 * 64 * 16 * 4  # a float32 block of SmolLM2, K and V; the draft's is the same
    tight = LLM(dtype="float32", kv_cache_memory=2 * 14 * block_bytes, max_model_len=192, speculative=INT4_DRAFT)
    prompts = REPEATING + PLAIN
    expected = [e.token_ids for e in plain.generate(prompts, GREEDY)]
    assert [g.token_ids for g in tight.generate(prompts, GREEDY)] == expected
    engine = tight.engine
    assert engine.stats().num_preemptions > 0 and engine.num_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # A follow-up whose prefix is cached: the draft catches its own cache up over it.
    first = tight.generate([REPEATING[1]], GREEDY)[0]
    hits = engine.stats().prefix_cache_hits
    follow = first.prompt_token_ids + first.token_ids[:-1]
    assert tight.generate([follow], GREEDY)[0].token_ids == plain.generate([follow], GREEDY)[0].token_ids
    assert engine.stats().prefix_cache_hits > hits
    engine.sleep()  # both pools go
    assert engine.stats().kv_cache_bytes == 0
    assert tight.generate(prompts[:2], GREEDY)[0].token_ids == expected[0]  # woken by the request


def test_a_tensor_parallel_target_checks_a_whole_drafts_guesses(tiny_llama_dir):
    want = greedy(LLM(str(tiny_llama_dir), **TINY), TINY_PROMPTS)
    # Its own int4 variant as the draft: whole on rank 0, its pool as many blocks as every rank's
    # (each rank's budget pays for the draft's blocks, or the ranks' pools would differ and not start).
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY, speculative=SpeculativeConfig(
        method="draft_model", model=str(tiny_llama_dir), quantization="int4-rtn", num_speculative_tokens=3))
    try:
        assert llm.engine.drafter.runner.num_blocks == llm.engine.runner.num_blocks
        assert greedy(llm, TINY_PROMPTS) == want
        assert llm.engine.num_accepted_tokens > 0
    finally:
        llm.close()


def test_drafts_never_starve_another_requests_token(tiny_llama_dir):
    """Eight requests, a step of 16 tokens and 4 guesses each: the first four requests' drafts
    took the whole step, and the last ones waited up to 22 steps for a token. Now every running
    request makes a token every step, and the tokens are the target's own."""
    prompts = [[3 + (i * 7 + j) % 90 for j in range(2)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = dict(TINY, max_num_batched_tokens=16, max_num_seqs=8)
    want = [o.token_ids for o in LLM(str(tiny_llama_dir), **small).generate(prompts, params)]
    llm = LLM(str(tiny_llama_dir), **small, speculative=SpeculativeConfig(
        method="draft_model", model=str(tiny_llama_dir), num_speculative_tokens=4))
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    produced: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step, silent = 0, []
    while engine.has_unfinished_requests():
        step += 1
        outputs = {o.request_id: o for o in engine.step()}
        for rid, tokens in produced.items():
            if rid in outputs and outputs[rid].new_token_ids:
                tokens[:] = outputs[rid].token_ids
            elif len(tokens) < params.max_tokens:
                silent.append((step, rid))
    assert not silent, f"(step, request) without a token: {silent[:10]}"
    assert [produced[str(i)] for i in range(len(prompts))] == want
    assert engine.num_accepted_tokens > 0


def test_the_drafts_catch_up_runs_in_steps_of_the_budget(tiny_llama_dir, monkeypatch):
    """Sixteen requests share a 400-token prefix the target serves from its prefix cache: the
    draft caught all of them up in one forward of thousands of tokens, far beyond the 32-token step the
    GPU pool was sized for. Now no draft forward exceeds the budget, and the tokens are the target's."""
    from kiln.engine.model_runner import ModelRunner
    shared = [3 + (j * 7) % 90 for j in range(400)]
    prompts = [shared + [10 + i, 11 + i] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    small = dict(TINY, max_num_seqs=16, kv_cache_memory=1 << 24, max_model_len=512)
    want = [o.token_ids for o in LLM(str(tiny_llama_dir), **small).generate(prompts, params)]
    llm = LLM(str(tiny_llama_dir), **small, speculative=SpeculativeConfig(
        method="draft_model", model=str(tiny_llama_dir), num_speculative_tokens=4))
    llm.generate([shared + [5]], params)  # the prefix in the target's cache
    forwards: list[int] = []
    last_logits = ModelRunner.last_logits
    monkeypatch.setattr(ModelRunner, "last_logits",
                        lambda runner, spans: forwards.append(sum(e - s for _, s, e in spans)) or last_logits(runner, spans))
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert forwards and max(forwards) <= TINY["max_num_batched_tokens"], forwards


def test_a_draft_must_share_the_vocabulary(tmp_path):
    tiny = write_tiny_model("llama", tmp_path / "tiny")
    with pytest.raises(ValueError, match="the draft model .*tiny': max_model_len 8192 exceeds the model's maximum"):
        LLM(dtype="float32", speculative=SpeculativeConfig(method="draft_model", model=str(tiny)))
    with pytest.raises(ValueError, match="a vocabulary of 96 tokens, the target 49152"):
        LLM(dtype="float32", max_model_len=256, speculative=SpeculativeConfig(method="draft_model", model=str(tiny)))
    with pytest.raises(ValueError, match="the draft model 'no-such-draft': .*not found"):
        LLM(dtype="float32", speculative=SpeculativeConfig(method="draft_model", model="no-such-draft"))


def test_server_flag():
    server = ServerProcess("--speculative-config", json.dumps({"model": "smollm2-135m", "quantization": "int4-rtn",
                                                               "num_speculative_tokens": 3}))
    try:
        assert "speculative decoding: draft model smollm2-135m" in "".join(server.log)
        out = complete(server, REPEATING[0], max_tokens=24, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 24
        m = server.metrics()
        assert 0 < m["kiln:spec_decode_num_accepted_tokens_total"] < m["kiln:spec_decode_num_draft_tokens_total"]
    finally:
        server.stop()
