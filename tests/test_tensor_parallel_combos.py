"""Tensor parallelism (gloo on the CPU) combined with the rest of the engine: a TP engine gives the
TP=1 engine's tokens, text and finish reasons (logprobs within float32 tolerance) with prefix-cache
hits, preemption and chunked prefill in the same run; seeded sampling (top-p/k, min-p), penalties,
logit_bias, min_tokens, stop strings and stop tokens; logprobs and prompt logprobs; a request aborted
mid-generation; sleep and wake while idle; prompts at the max_model_len edge; n-gram and draft-model
speculation; structured outputs (SmolLM2, TP=3); Qwen2 (q/k/v biases, tied embeddings) with its one KV
head replicated on 4 ranks and a vocabulary that does not split evenly. An engine that fails to
start after its ranks did leaves none behind."""
from __future__ import annotations

import itertools

import pytest

from kiln.engine.llm import LLM
from kiln.engine.sampling_params import SamplingParams, StructuredOutputs
from kiln.engine.speculative import SpeculativeConfig

from test_tensor_parallel import TINY, TINY_PROMPTS, assert_no_ranks_left, greedy
from kiln_process import spawned_ranks
from tiny_models import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
_ids = itertools.count()
BLOCKS = 11  # a pool this small preempts the batches below: 5 prompts of 33..60 tokens, 40 new tokens each
SHARED = [3 + (j * 5) % 90 for j in range(40)]
# Four share a 33..40-token prefix (the last repeats the first whole): prefix-cache hits within a batch.
PROMPTS = [SHARED + [7, 8, 9], SHARED + [10, 11], SHARED[:33], [3 + (j * 7) % 90 for j in range(60)],
           SHARED + [7, 8, 9]]


def greedy_params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, "ignore_eos": True, **kw})


def sampled_params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.9, "max_tokens": 30, "ignore_eos": True, **kw})


# Each group runs as one batch, on both engines.
CASES = {
    "greedy": [(p, greedy_params()) for p in PROMPTS],
    "seeded": [(PROMPTS[0], sampled_params(seed=1)), (PROMPTS[1], sampled_params(seed=2, top_p=0.8)),
               (PROMPTS[2], sampled_params(seed=3, top_k=10)), (PROMPTS[3], sampled_params(seed=4, min_p=0.1)),
               (PROMPTS[4], sampled_params(seed=1))],
    "penalties": [(PROMPTS[0], sampled_params(seed=5, repetition_penalty=1.3)),
                  (PROMPTS[1], greedy_params(presence_penalty=1.5, frequency_penalty=0.7)),
                  (PROMPTS[2], greedy_params(logit_bias={5: 100.0, 6: 50.0})),
                  (PROMPTS[3], greedy_params(logit_bias={t: -100.0 for t in range(3, 50)}))],
    "stops": [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, min_tokens=10)),
              (PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, stop=["w3"], include_stop_str_in_output=True)),
              (PROMPTS[2], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[10, 20, 37])),
              (PROMPTS[3], sampled_params(seed=9, min_tokens=20, max_tokens=25))],
    "logprobs": [(PROMPTS[0], greedy_params(logprobs=5, prompt_logprobs=3, max_tokens=8)),
                 (PROMPTS[1], sampled_params(seed=3, logprobs=2, max_tokens=8)),
                 (PROMPTS[4], greedy_params(logprobs=5, prompt_logprobs=0, max_tokens=8))],
}


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams]], abort: dict[int, int] | None = None) -> list:
    """Each request's final output (None if aborted), all in one engine's batches; abort: request
    index -> the step after which it is aborted."""
    engine, ids = llm.engine, [f"combo-{next(_ids)}" for _ in requests]
    for request_id, (prompt, params) in zip(ids, requests):
        engine.add_request(request_id, prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
        for i, step in (abort or {}).items():
            if step == steps:
                engine.abort_request(ids[i])
    return [done.get(i) for i in ids]


def assert_same(got: list, want: list) -> None:
    """Tokens, text and finish reason equal; every logprob within float32 tolerance."""
    def seen(outputs: list) -> list:
        return [o and (o.token_ids, o.text, o.finish_reason) for o in outputs]
    assert seen(got) == seen(want)
    for g, w in zip(got, want):
        if w is None:
            continue
        for a, b in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
            assert [lp for _, lp in a["top"]] == pytest.approx([lp for _, lp in b["top"]], abs=1e-4)
        for a, b in zip(g.prompt_logprobs or [], w.prompt_logprobs or [], strict=True):
            assert (a or {}).keys() == (b or {}).keys()
            assert [e["logprob"] for e in (a or {}).values()] == \
                pytest.approx([e["logprob"] for e in (b or {}).values()], abs=1e-4)


def pool(tp: int) -> dict:
    """Settings with a pool of BLOCKS blocks on every rank: a tiny Llama block is 2 layers x K, V x 2 KV
    heads x 16 tokens x 16 dims x 4 bytes, and each of 2 ranks holds one of the KV heads."""
    return dict(TINY, kv_cache_memory=BLOCKS * 8192 // tp, max_model_len=128)


def test_tp2_matches_tp1_through_preemption_prefix_hits_sampling_aborts_sleep_and_the_length_limit(tiny_llama_dir):
    reference = LLM(str(tiny_llama_dir), **pool(1))
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **pool(2))
    try:
        assert llm.engine.runner.num_blocks == reference.engine.runner.num_blocks == BLOCKS  # the same preemptions
        for name, requests in CASES.items():
            assert_same(run(llm, requests), run(reference, requests))
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        # The stops and penalties did something: not every request ran to its length.
        assert {o.finish_reason for o in run(llm, CASES["stops"])} == {"stop", "length"}

        # Two requests aborted mid-generation free their blocks; the others and the next batch are TP 1's.
        aborted = run(llm, CASES["greedy"], abort={1: 5, 3: 12})
        assert [o is None for o in aborted] == [False, True, False, True, False]
        assert_same(aborted, run(reference, CASES["greedy"], abort={1: 5, 3: 12}))
        assert_same(run(llm, CASES["seeded"]), run(reference, CASES["seeded"]))

        # Asleep while idle (every rank's pool released), then woken by hand or by a request.
        llm.engine.sleep()
        llm.engine.wake_up()
        assert_same(run(llm, CASES["penalties"]), run(reference, CASES["penalties"]))
        llm.engine.sleep()
        assert_same(run(llm, CASES["greedy"]), run(reference, CASES["greedy"]))

        # max_model_len 128: a 127-token prompt gets its one token; 128 is refused, and the engine goes on.
        at_limit = [([5 + j % 3 for j in range(127)], greedy_params(max_tokens=5))]
        assert_same(run(llm, at_limit), run(reference, at_limit))
        assert len(run(llm, at_limit)[0].token_ids) == 1
        with pytest.raises(ValueError, match="prompt has 128 tokens, the context length .* is 128"):
            llm.engine.add_request("too-long", [5] * 128, greedy_params())
        assert_same(run(llm, CASES["stops"]), run(reference, CASES["stops"]))
    finally:
        assert_no_ranks_left(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_at_tp2_keeps_tp1s_sampled_and_penalized_text(tiny_llama_dir, method):
    """Drafts (n-grams, or the model itself whole on rank 0) are checked by both ranks; seeded
    sampling, penalties, logit_bias, stop tokens and logprobs see TP 1's logits."""
    looping = [3 + j % 7 for j in range(30)]
    requests = [(looping, greedy_params(logprobs=3)), (PROMPTS[3], sampled_params(seed=11, top_k=20)),
                (looping[:11], sampled_params(seed=12, top_p=0.9, min_p=0.05)),
                ([9, 8, 7] * 6, greedy_params(repetition_penalty=1.2, min_tokens=5, stop_token_ids=[40])),
                (looping, greedy_params(prompt_logprobs=2, logit_bias={10: 3.0}))]
    want = run(LLM(str(tiny_llama_dir), **TINY), requests)
    spec = SpeculativeConfig(method=method, model=str(tiny_llama_dir) if method == "draft_model" else None,
                             num_speculative_tokens=3)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, speculative=spec, **TINY)
    try:
        assert_same(run(llm, requests), want)
        assert llm.engine.num_accepted_tokens > 0
    finally:
        assert_no_ranks_left(llm)


def test_qwen2_at_tp4_replicates_its_kv_head_and_pads_an_uneven_tied_vocabulary(tmp_path):
    # 97 tokens: 25 a rank, the last rank's slice padded; the tied lm_head is the padded embedding.
    folder = write_tiny_model("qwen2", tmp_path / "qwen2-97", vocab_size=97)
    prompts = TINY_PROMPTS + [[96, 95, 96, 1]]
    want = greedy(LLM(str(folder), **TINY), prompts)
    llm = LLM(str(folder), tensor_parallel_size=4, **TINY)
    try:
        assert greedy(llm, prompts) == want
        assert llm.engine.runner.model.inner.model.embed_tokens.weight.shape[0] == 25
    finally:
        assert_no_ranks_left(llm)


def test_an_engine_that_fails_after_its_ranks_started_stops_them(tiny_llama_dir):
    # The pool check runs once the ranks hold their pools: 2 blocks of 16 tokens a rank, 64 wanted.
    with pytest.raises(ValueError, match="the KV cache holds 32 tokens .* less than max_model_len=64"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **dict(TINY, kv_cache_memory=2 * 4096, max_model_len=64))
    assert not spawned_ranks()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TINY)  # the process's group is free again
    assert_no_ranks_left(llm)


def test_smollm2_tp3_structured_outputs_with_ngram_speculation_equal_tp1(smollm2_path):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}

    def structured(**kw: object) -> SamplingParams:
        return SamplingParams(**{"temperature": 0, "max_tokens": 24, **kw})
    params = [structured(structured_outputs=StructuredOutputs(json=schema)),
              structured(temperature=0.8, seed=3, structured_outputs=StructuredOutputs(json=schema)),
              structured(temperature=0.7, seed=5, structured_outputs=StructuredOutputs(regex=r"[A-Z][a-z]+ [0-9]{2}")),
              structured(temperature=1.0, seed=9,
                         structured_outputs=StructuredOutputs(choice=["red", "green", "blue"])),
              structured(temperature=0.9, seed=1, top_p=0.9, top_k=40, stop=[".", "\n"], logprobs=2)]
    ask = [[{"role": "user", "content": "Give a person as JSON."}]] * len(params)
    kw = dict(dtype="float32", device="cpu", kv_cache_memory=64 << 20, max_model_len=256)
    want = LLM(str(smollm2_path), **kw).chat(ask, params)
    assert want[0].text.startswith("{") and want[3].text in ("red", "green", "blue")
    llm = LLM(str(smollm2_path), tensor_parallel_size=3, speculative=SpeculativeConfig(), **kw)
    try:
        assert_same(llm.chat(ask, params), want)
    finally:
        assert_no_ranks_left(llm)
