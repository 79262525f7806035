"""Prompt logprobs and return_token_ids: what a canary gate needs to score teacher-forced greedy
agreement between two revisions. Engine figures are checked against one plain forward of the
whole prompt (the engine's own float32 model, no KV cache) across chunked prefill, prefix-cache
hits and preemption; over HTTP, a greedy request's returned ids are scored back on a server."""
from __future__ import annotations

import math

import pytest
import torch

from kiln.engine import LLM, SamplingParams
from kiln.engine import evaluate as ev
from kiln.engine.openai_responses import top_of
from kiln.engine.prompt_logprobs import entry, score_rows
from kiln.engine.sequence import Sequence
from test_engine_generate import one_thread  # noqa: F401 (an autouse fixture)
from test_model import forward_prefill
from test_server import MODEL, ServerProcess, post

BLOCK = 16
BLOCK_BYTES = 2 * 30 * 3 * 64 * BLOCK * 4  # SmolLM2: K and V x layers x kv heads x head_dim x tokens x fp32
PREFIX = "You are a careful assistant. Answer every question in one short, correct sentence. " * 2
TEXTS = [PREFIX + "Question: which planet in the solar system has the largest rings?",
         "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs, then count them.",
         "In 1969, astronauts landed on the Moon. The mission was called Apollo 11 and its crew were"]
# Float noise between the chunked, paged forward and the plain one (float32, logits of ~10).
TOL = 1e-3
QUANTIZATION = "int8"  # the other revision in the agreement test
AGREEMENT_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def add(a, b):"]
AGREEMENT_TOKENS = 24


@pytest.fixture(scope="module")
def llm() -> LLM:
    """16-token chunked prefill and a pool of 6 blocks (96 tokens): prompts span several chunks,
    and TEXTS at once preempt one another, one of them halfway through its prompt."""
    return LLM(dtype="float32", max_num_batched_tokens=16, kv_cache_memory=6 * BLOCK_BYTES, max_model_len=96)


def assert_matches_plain_forward(llm: LLM, ids: list[int], prompt_logprobs: list, k: int) -> None:
    """Every position's entry against one plain forward of the whole prompt."""
    logits = forward_prefill(llm.engine.runner.model, [ids])
    logprobs = logits.log_softmax(-1)
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry, row, token = prompt_logprobs[i], logits[i - 1], ids[i]
        assert next(iter(entry)) == token, f"position {i}: the prompt token comes first"
        assert len(entry) in (k, k + 1)
        for t, figures in entry.items():
            assert figures["logprob"] == pytest.approx(logprobs[i - 1, t].item(), abs=TOL)
            assert figures["decoded_token"] == llm.tokenizer.decode([t], skip_special_tokens=False)
        # 1 + the tokens with a greater logit; a token within float noise of the prompt token's may
        # land on either side of it.
        rank = entry[token]["rank"]
        assert 1 + int((row > row[token] + TOL).sum()) <= rank <= 1 + int((row > row[token] - TOL).sum()), i
        assert (rank == 1) == (token == int(row.argmax())), f"position {i}: argmax"
        if k:
            assert min(entry, key=lambda t: entry[t]["rank"]) == int(row.argmax())


def test_ranks_and_top_k_on_ties() -> None:
    logits = torch.tensor([[3.0, 1.0, 3.0, 0.0], [0.0, 2.0, 1.0, 2.0], [5.0, 4.0, 3.0, 2.0]])
    whole = score_rows(lambda h: h, logits, [2, 2, 3], 2, chunk=8)
    assert score_rows(lambda h: h, logits, [2, 2, 3], 2, chunk=2) == whole  # chunking changes nothing
    # Ties rank as greedy decoding picks: the lower id first (rank 1 is the token it emits).
    assert [s.rank for s in whole] == [2, 3, 4]
    assert [[r for _, _, r in s.top] for s in whole] == [[1, 2], [1, 2], [1, 2]]
    assert whole[2].logprob == pytest.approx(logits[2].log_softmax(-1)[3].item())
    assert score_rows(lambda h: h, logits, [0, 1, 2], 0, chunk=8)[0].top == []


def naive_rank(row: list[float], token: int) -> int:
    """1 + the tokens ordered before `token`, counted one by one: a greater logit, or an equal one at
    a lower id."""
    return 1 + sum(v > row[token] or (v == row[token] and t < token) for t, v in enumerate(row))


@pytest.mark.parametrize("seed", range(10))
def test_ranks_and_top_k_match_a_naive_count(seed: int) -> None:
    """The top k are the first k tokens in rank order, ranked 1..k, ties across the k-th included:
    torch's topk picked any of the tied tokens there, a higher id then ranked k + 1 and top_of
    dropped it (fewer alternatives than asked)."""
    gen, vocab = torch.Generator().manual_seed(seed), 12
    logits = torch.randint(0, 4, (6, vocab), generator=gen).float()  # four values: ties everywhere
    logits[0] = torch.randn(vocab, generator=gen)  # a row without ties
    logits[1] = 1.0  # all tied
    targets = torch.randint(0, vocab, (6,), generator=gen).tolist()
    for k in (0, 1, 3, 5, vocab - 1, vocab):
        for row, s in zip(logits.tolist(), score_rows(lambda h: h, logits, targets, k, chunk=4)):
            assert s.rank == naive_rank(row, s.token_id)
            expected = sorted(range(vocab), key=lambda t: naive_rank(row, t))[:k]
            assert [(t, r) for t, _, r in s.top] == [(t, naive_rank(row, t)) for t in expected]
            assert [r for _, _, r in s.top] == list(range(1, k + 1))
            assert [lp for _, lp, _ in s.top] == pytest.approx(torch.tensor(row).log_softmax(-1)[expected].tolist())
            for n in range(k + 1):  # what a request asking n of the k gets
                kept = top_of(entry(s, str), s.token_id, n)
                assert set(kept) == set(expected[:n]) | {s.token_id}


def test_non_finite_logits_give_finite_figures() -> None:
    """An overflowed row (NaN, inf) scores like sampling sees it, never NaN: JSON carries no NaN."""
    logits = torch.tensor([[float("nan"), 1.0, float("inf"), 0.0], [float("nan")] * 4, [1.0, 2.0, 3.0, 4.0]])
    scored = score_rows(lambda h: h, logits, [1, 0, 3], 2, chunk=8)
    figures = [s.logprob for s in scored] + [lp for s in scored for _, lp, _ in s.top]
    assert all(math.isfinite(f) for f in figures), figures
    assert scored[0].top[0][0] == 2  # +inf is the most likely token, NaN the least
    # A NaN target ranks last, in an all-NaN row too: a variant that outputs NaN agrees with nothing.
    assert [s.rank for s in score_rows(lambda h: h, logits, [0, 0, 3], 0, chunk=8)] == [4, 4, 1]
    assert scored[2].logprob == pytest.approx(logits[2].log_softmax(-1)[3].item())  # finite rows unchanged
    # A row all +inf (an overflow) or all equal (dead weights): one token, greedy's, ranks first.
    broken = torch.tensor([[float("inf")] * 4, [0.5] * 4])
    assert [[s.rank for s in score_rows(lambda h: h, broken, [t, t], 0, chunk=8)] for t in range(4)] == \
        [[1, 1], [2, 2], [3, 3], [4, 4]]


def test_chunked_prefill_matches_plain_forward(llm: LLM) -> None:
    ids = llm.tokenizer.encode(TEXTS[0])
    assert len(ids) > 2 * BLOCK, "the prompt must span several prefill chunks"
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))[0]
    assert_matches_plain_forward(llm, ids, out.prompt_logprobs, 3)
    assert out.prompt_token_ids == ids


def test_prefix_cache_hit_still_scores_every_position(llm: LLM) -> None:
    ids = llm.tokenizer.encode(TEXTS[0])
    llm.generate(PREFIX + "Question: what is two plus two?", SamplingParams(temperature=0.0, max_tokens=2))
    probe = Sequence("probe", ids, SamplingParams(), 0)
    assert len(llm.engine.block_manager.match_prefix(probe)) >= 2, "the shared prefix must be cached"
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    assert_matches_plain_forward(llm, ids, out.prompt_logprobs, 0)


def test_preemption_records_each_position_once(llm: LLM, monkeypatch) -> None:
    scheduler = llm.engine.scheduler
    preempted_mid_prompt = []  # per preemption: were some prompt positions still unscored?

    def preempt(seq: Sequence, preempt=scheduler._preempt) -> None:
        preempted_mid_prompt.append(len(seq.prompt_logprobs) < seq.num_prompt_tokens)
        preempt(seq)

    monkeypatch.setattr(scheduler, "_preempt", preempt)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1))
    assert any(preempted_mid_prompt), "some request must be preempted before its prompt is all scored"
    for ids, out in zip(prompts, outs):
        assert_matches_plain_forward(llm, ids, out.prompt_logprobs, 1)


def test_bad_prompt_logprobs_refused() -> None:
    for bad in (-1, 21, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


# ---------------------------------------------------------------------------------------------
# Over HTTP: a greedy request's returned ids, scored back with prompt_logprobs=0.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized_server(variant_cache):
    s = ServerProcess("--quantization", QUANTIZATION, "--quantization-cache", str(variant_cache),
                      "--max-model-len", "256")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def quantized_llm(variant_cache) -> LLM:
    """The server's model in process (the same cached variant), for the reference forward."""
    return LLM(dtype="float32", quantization=QUANTIZATION, quantization_cache=str(variant_cache), max_model_len=256)


def completion(server: ServerProcess, prompt: str | list[int], **fields) -> dict:
    code, body = post(server.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0, **fields})
    assert code == 200, body
    return body["choices"][0]


def agreement_over_http(server: ServerProcess, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """What the canary gate computes: score prompt + continuation on the server, then the share of
    continuation positions where the server's argmax (rank 1) is the continuation's token."""
    agree = total = 0
    for prompt, continuation in zip(prompts, continuations):
        scored = completion(server, prompt + continuation, max_tokens=1, prompt_logprobs=0)["prompt_logprobs"]
        for token, scores in zip(continuation, scored[len(prompt):]):
            agree += scores[str(token)]["rank"] == 1
            total += 1
    return agree / total


def test_greedy_tokens_scored_back_agree_fully(quantized_server, quantized_llm) -> None:
    prompt = AGREEMENT_PROMPTS[1]
    choice = completion(quantized_server, prompt, max_tokens=AGREEMENT_TOKENS, ignore_eos=True, return_token_ids=True)
    assert choice["prompt_token_ids"] == quantized_llm.tokenizer.encode(prompt)
    assert len(choice["token_ids"]) == AGREEMENT_TOKENS
    assert quantized_llm.tokenizer.decode(choice["token_ids"]) == choice["text"]
    assert agreement_over_http(quantized_server, [choice["prompt_token_ids"]], [choice["token_ids"]]) == 1.0


def test_agreement_across_revisions_matches_eval_definition(llm, quantized_server, quantized_llm) -> None:
    """Float greedy tokens scored by the quantized server: the same figure as kiln eval's
    greedy_agreement over the quantized model's plain forward."""
    outs = llm.generate(AGREEMENT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS,
                                                          ignore_eos=True))
    prompts, continuations = [o.prompt_token_ids for o in outs], [o.token_ids for o in outs]
    logits = ev.Scorer(quantized_llm.engine.runner.model).logits([p + c for p, c in zip(prompts, continuations)])
    predicted = [lg[len(p) - 1:-1].argmax(-1).tolist() for lg, p in zip(logits, prompts)]
    expected = ev.greedy_agreement(continuations, predicted)
    assert 0.5 < expected < 1.0, "the revisions should disagree somewhere, or the test shows little"
    assert agreement_over_http(quantized_server, prompts, continuations) == expected


def test_stream_carries_prompt_fields_first_then_each_chunks_ids(quantized_server) -> None:
    extensions = {"return_token_ids": True, "prompt_logprobs": 1}
    full = completion(quantized_server, AGREEMENT_PROMPTS[0], max_tokens=8, **extensions)
    assert len(full["prompt_logprobs"]) == len(full["prompt_token_ids"]) and full["prompt_logprobs"][0] is None
    chunks = [c.choices[0].model_extra for c in quantized_server.client.completions.create(
        model=MODEL, prompt=AGREEMENT_PROMPTS[0], temperature=0, max_tokens=8, stream=True, extra_body=extensions)]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert chunks[0]["prompt_logprobs"] == full["prompt_logprobs"]
    assert not any("prompt_token_ids" in c or "prompt_logprobs" in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == full["token_ids"]


def test_chat_returns_the_templated_prompt_ids(quantized_server, quantized_llm) -> None:
    tokenizer = quantized_llm.tokenizer
    request = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "temperature": 0, "max_tokens": 12, "return_token_ids": True}
    code, body = post(quantized_server.url + "/v1/chat/completions", request)
    assert code == 200, body
    choice = body["choices"][0]
    templated = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True)
    assert choice["prompt_token_ids"] == tokenizer.encode(templated, add_special_tokens=False)
    assert tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    chunks = [c.choices[0].model_extra for c in quantized_server.client.chat.completions.create(
        **{k: v for k, v in request.items() if k != "return_token_ids"}, stream=True,
        extra_body={"return_token_ids": True})]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]  # with the role, before any token
    assert [t for c in chunks for t in c.get("token_ids", [])] == choice["token_ids"]


CHAT = [{"role": "user", "content": "x"}]
BAD = [
    ("prompt_logprobs above 20", "/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, None),
    ("negative prompt_logprobs", "/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, None),
    ("prompt_logprobs on chat", "/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 0},
     "unsupported_parameter"),
]


@pytest.mark.parametrize("name,path,fields,code", BAD, ids=[b[0] for b in BAD])
def test_bad_prompt_logprobs_get_400(quantized_server, name, path, fields, code) -> None:
    status, reply = post(quantized_server.url + path, {"model": MODEL, **fields})
    assert status == 400, reply
    assert reply["error"]["param"] == "prompt_logprobs" and reply["error"]["code"] == code


def test_prompt_logprobs_over_every_choice_are_bounded() -> None:
    """Each choice scores its prompt and answers with its own copy: n=128 of an 8k-token prompt at
    prompt_logprobs 20 came to GiBs of Python objects. Past MAX_SCORED_ENTRIES it is a 400."""
    from kiln.engine.api_errors import APIError
    from kiln.engine.openai_serving import MAX_SCORED_ENTRIES, check_scored
    check_scored(8192 * 24 * 21)  # 24 choices of 8k tokens at 20 alternatives
    with pytest.raises(APIError) as refused:
        check_scored(8192 * 128 * 21)
    assert refused.value.status == 400 and refused.value.param == "prompt_logprobs"
    assert str(MAX_SCORED_ENTRIES) in refused.value.message
