"""Structured outputs at batch 1: what a JSON schema's token mask costs Kiln, and Kiln against
transformers `generate` with the same llguidance matcher as a LogitsProcessor (the way
guidance and outlines constrain transformers), on the same SmolLM2 weights in the same dtype.

Each chat prompt asks for JSON that its schema describes; both sides decode greedily under the
schema to its end, and the answers are checked with the jsonschema validator and compared.
Kiln also decodes each prompt unconstrained for as many tokens (EOS ignored): the ratio of the
two is the mask's cost per token (computing it on the CPU and masking the logits); and under the
schema with n-gram speculation (k = 4), which JSON's repeated keys feed.

    .venv/bin/python bench/structured.py   # writes bench/results/structured-<date>-<cpu kind>.json
"""
from __future__ import annotations

import argparse
import json
import time

import jsonschema
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from cpu_common import write_result
from offline import load_transformers, machine_info
from online import served_dtype

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "languages": {"type": "array", "items": {"enum": ["English", "French", "German", "Spanish"]}}},
    "required": ["name", "age", "languages"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "customer": {"type": "string"},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "product": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["product", "quantity", "price"]}},
    "paid": {"type": "boolean"}}, "required": ["customer", "items", "paid"]}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
    "required": ["title", "date", "attendees"]}
CASES = [
    ("Describe a person who speaks two languages, as JSON.", PERSON),
    ("Write an order for three things from a grocery shop as JSON.", ORDER),
    ("Plan a team meeting next week and give it as JSON with its attendees.", EVENT),
    ("Give me a JSON record of a famous scientist.", PERSON),
]


class GrammarMask(LogitsProcessor):
    """transformers' side: feed the matcher the last token, then mask to what it allows."""

    def __init__(self, matcher, prompt_len: int) -> None:
        self.matcher, self.prompt_len = matcher, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from kiln.engine.structured_output import allowed_tokens

        if input_ids.shape[1] > self.prompt_len:
            self.matcher.consume_token(int(input_ids[0, -1]))
        return scores.masked_fill(~allowed_tokens([self.matcher.compute_bitmask()], scores.shape[1]), float("-inf"))


def run_kiln(llm, spec, max_tokens: int) -> dict:
    from kiln.engine import SamplingParams
    from kiln.engine.sampling_params import StructuredOutputs

    tokens = spec_tokens = constrained_s = plain_s = spec_s = 0
    answers, spec_answers = [], []
    for prompt, schema in CASES:
        chat = [{"role": "user", "content": prompt}]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputs(json=schema))
        start = time.perf_counter()
        out = llm.chat(chat, params)[0]
        constrained_s += time.perf_counter() - start
        start = time.perf_counter()
        llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=len(out.token_ids), ignore_eos=True))
        plain_s += time.perf_counter() - start
        start = time.perf_counter()
        spec_out = spec.chat(chat, params)[0]
        spec_s += time.perf_counter() - start
        tokens += len(out.token_ids)
        spec_tokens += len(spec_out.token_ids)
        answers.append(out.text)
        spec_answers.append(spec_out.text)
    return {"tokens": tokens, "constrained_tok_s": round(tokens / constrained_s, 1),
            "plain_tok_s": round(tokens / plain_s, 1), "speculative_tok_s": round(spec_tokens / spec_s, 1),
            "speculative_same_answers": sum(a == b for a, b in zip(answers, spec_answers)), "answers": answers}


def run_transformers(model, llm, max_tokens: int) -> dict:
    from kiln.engine.sampling_params import StructuredOutputs

    tokenizer, tokens, elapsed, answers = llm.tokenizer, 0, 0.0, []
    for prompt, schema in CASES:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        matcher = llm.engine.grammars.matcher(StructuredOutputs(json=schema))
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=tokenizer.eos_token_ids, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([GrammarMask(matcher, ids.shape[1])]))
        elapsed += time.perf_counter() - start
        new = out[0, ids.shape[1]:].tolist()
        new = new[:-1] if new and new[-1] in tokenizer.eos_token_ids else new  # Kiln stops without EOS
        tokens += len(new)
        answers.append(tokenizer.decode(new))
    return {"tokens": tokens, "constrained_tok_s": round(tokens / elapsed, 1), "answers": answers}


def valid(answers: list[str]) -> int:
    count = 0
    for answer, (_, schema) in zip(answers, CASES):
        try:
            jsonschema.validate(json.loads(answer), schema)
            count += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args()
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.sampling_params import StructuredOutputs
    from kiln.engine.speculative import SpeculativeConfig

    dtype = served_dtype(args.dtype)
    llm = LLM(dtype=dtype, gguf_dequantize=True)
    spec = LLM(dtype=dtype, gguf_dequantize=True, speculative=SpeculativeConfig(num_speculative_tokens=4))
    model = load_transformers(dtype)
    model.generation_config.eos_token_id = llm.tokenizer.eos_token_ids
    # Warm-up, llguidance's vocabulary view included (built on the first constrained request).
    for engine in (llm, spec):
        engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(
            temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputs(json=PERSON)))
    result = {"dtype": dtype, "max_tokens": args.max_tokens, "machine": machine_info(), "cases": len(CASES)}
    print(json.dumps(result["machine"]), flush=True)
    kiln = run_kiln(llm, spec, args.max_tokens)
    peer = run_transformers(model, llm, args.max_tokens)
    result.update({
        "kiln": {k: v for k, v in kiln.items() if k != "answers"}, "transformers": {k: v for k, v in peer.items()
                                                                                   if k != "answers"},
        "kiln_valid": valid(kiln["answers"]), "transformers_valid": valid(peer["answers"]),
        "same_answers": sum(a == b for a, b in zip(kiln["answers"], peer["answers"])),
        "kiln_mask_cost": round(kiln["plain_tok_s"] / kiln["constrained_tok_s"], 2),
        "kiln_over_transformers": round(kiln["constrained_tok_s"] / peer["constrained_tok_s"], 2),
        "kiln_speculative_over_transformers": round(kiln["speculative_tok_s"] / peer["constrained_tok_s"], 2),
    })
    print(f"kiln: {kiln['constrained_tok_s']} tok/s under the schema, {kiln['plain_tok_s']} without "
          f"({result['kiln_mask_cost']}x the time per token); transformers + llguidance {peer['constrained_tok_s']} "
          f"tok/s; kiln/transformers {result['kiln_over_transformers']}x; valid JSON {result['kiln_valid']}/"
          f"{len(CASES)} vs {result['transformers_valid']}/{len(CASES)}, {result['same_answers']} answers identical",
          flush=True)
    print(f"kiln with n-gram speculation under the schema: {kiln['speculative_tok_s']} tok/s "
          f"({result['kiln_speculative_over_transformers']}x transformers; {kiln['speculative_same_answers']}/"
          f"{len(CASES)} answers as without it)", flush=True)
    print(f"wrote {write_result('structured', result)}")


if __name__ == "__main__":
    main()
