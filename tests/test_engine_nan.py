"""A model that yields NaN logits (a poisoned weight, as an overflow or a bad checkpoint would
give): its requests finish with valid tokens and finite logprobs, a clean request in the same
batch is untouched, and the engine keeps stepping. Real SmolLM2 in float32, one embedding row
set to NaN (its head is tied, so that token's logit is NaN for every request too)."""
from __future__ import annotations

import math

import torch

from kiln.engine import Config, LLMEngine, SamplingParams

CLEAN = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    final = {}
    for _ in range(100):  # bounded: 4 tokens each take a handful of steps
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests():
            return final
    raise AssertionError(f"requests never finished: {set(requests) - set(final)}")


def test_nan_logits_finish_with_valid_tokens_and_spare_the_batch() -> None:
    engine = LLMEngine(Config(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory=32 << 20))
    vocab = engine.model_config.vocab_size
    reference = run(engine, {"reference": (CLEAN, GREEDY)})["reference"].token_ids
    poison = engine.tokenizer.encode(" banana", add_special_tokens=False)
    assert len(poison) == 1 and poison[0] not in reference, (poison, reference)
    model = engine.runner.model
    assert model.lm_head is None  # tied: the NaN row is also the NaN logit of " banana"
    with torch.no_grad():
        model.model.embed_tokens.weight[poison[0]] = float("nan")

    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, logprobs=2, seed=0, ignore_eos=True)
    outs = run(engine, {
        "clean": (CLEAN, GREEDY),  # one NaN logit per step (the poisoned token's)
        "poisoned-greedy": ("I like to eat a banana every", GREEDY),  # every logit NaN after the prompt
        "poisoned-sampled": ("A ripe banana is", sampled),
    })
    for request_id, out in outs.items():
        print(request_id, out.finish_reason, out.token_ids, repr(out.text))
        assert out.finish_reason == "length" and len(out.token_ids) == 4
        assert all(0 <= t < vocab for t in out.token_ids)
    assert outs["clean"].token_ids == reference  # never the NaN token, nothing leaked from neighbours
    logprobs = [lp for entry in outs["poisoned-sampled"].logprobs for lp in [entry["logprob"]] + [v for _, v in entry["top"]]]
    assert logprobs and all(math.isfinite(lp) for lp in logprobs)
    # The engine still serves: a fresh clean request (no prefix shared with a poisoned one) is exact.
    assert run(engine, {"after": (CLEAN, GREEDY)})["after"].token_ids == reference
