"""N-gram speculative decoding at batch 1: Kiln with and without it, and transformers' prompt
lookup decoding (`generate(prompt_lookup_num_tokens=k)`) with and without it as the peer, on the
same SmolLM2 weights in the same dtype, in one run; and Kiln with a draft model (the same
weights in int4: what a draft as costly as its target gives, acceptance and speed).

Two kinds of chat prompt, greedy, each to its own end of turn (at most --max-tokens): answers
that copy from the prompt (edit this code, fix this text, reformat this list: what prompt
lookup is for) and open answers (little to copy: what speculation costs when it misses).
Metric: generated tokens / wall time per kind; the ratios compare each with its own plain run
and Kiln with transformers. Every generated token counts; how many answers equal the plain run's
is reported beside the ratio (batched verification may round differently: an answer that
differs is a different token stream, so read the ratio with that count).
Then what speculation costs a busy batch: the first 32 requests of the mixed workload
(../shared/bench, EOS ignored) at once through Kiln plain and speculating (transformers' lookup
runs at batch 1 only, so Kiln alone).

    .venv/bin/python bench/speculative.py   # writes bench/results/speculative-<date>-<cpu kind>.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from cpu_common import write_result
from offline import WORKLOAD, load_transformers, machine_info
from online import served_dtype

CODE = '''def total(items):
    result = 0
    for item in items:
        result = result + item.price * item.quantity
    return result


def average(items):
    if len(items) == 0:
        return 0
    return total(items) / len(items)
'''
COPYING = [
    f"Add a docstring to each function below and write the whole code out again.\n\n{CODE}",
    "Correct the spelling in this text and write it out in full: 'The comittee recieved the the report on "
    "tuesday and agred to publish it seperately from the anual acounts, wich are due in Febuary.'",
    "Turn this list into a JSON array of objects with the keys name and age: Alice 31, Bob 27, Carol 45, "
    "Dave 38, Eve 29, Frank 52, Grace 33.",
    f"Rename the variable result to subtotal in this code and write it out again.\n\n{CODE}",
]
OPEN = [
    "Write a short story about a lighthouse keeper.",
    "Explain how vaccines train the immune system.",
    "What should I pack for a week of hiking in the mountains?",
    "Describe the water cycle to a ten-year-old.",
]


def run_kiln(llm, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    from kiln.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start, outputs = time.perf_counter(), []
    for prompt in prompts:  # batch 1: one request at a time
        outputs.append(llm.chat([{"role": "user", "content": prompt}], params)[0].token_ids)
    return time.perf_counter() - start, outputs


def run_transformers(model, tokenizer, prompts: list[str], max_tokens: int, lookup: int | None) -> tuple[float, int]:
    start, generated = time.perf_counter(), 0
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=tokenizer.eos_token_ids, pad_token_id=0, **extra)
        generated += out.shape[1] - ids.shape[1]
    return time.perf_counter() - start, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step, both sides")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args()
    from kiln.engine import LLM
    from kiln.engine.speculative import SpeculativeConfig

    dtype = served_dtype(args.dtype)
    plain = LLM(dtype=dtype, gguf_dequantize=True)
    spec = LLM(dtype=dtype, gguf_dequantize=True, speculative=SpeculativeConfig(num_speculative_tokens=args.k))
    # A draft model: the same weights in int4 (round to nearest), as cheap a draft as this model has.
    draft = LLM(dtype=dtype, gguf_dequantize=True, speculative=SpeculativeConfig(
        method="draft_model", model="smollm2-135m", quantization="int4-rtn", num_speculative_tokens=args.k))
    model = load_transformers(dtype)
    tokenizer = plain.tokenizer
    for llm in (plain, spec, draft):  # warm-up
        run_kiln(llm, OPEN[:1], 8)
    result = {"dtype": dtype, "k": args.k, "max_tokens": args.max_tokens, "machine": machine_info(), "kinds": {}}
    print(json.dumps(result["machine"]), flush=True)
    for kind, prompts in (("copying", COPYING), ("open", OPEN)):
        plain_s, plain_out = run_kiln(plain, prompts, args.max_tokens)
        accepted, drafted = spec.engine.num_accepted_tokens, spec.engine.num_draft_tokens
        spec_s, spec_out = run_kiln(spec, prompts, args.max_tokens)
        accepted, drafted = spec.engine.num_accepted_tokens - accepted, spec.engine.num_draft_tokens - drafted
        draft_accepted, draft_drafted = draft.engine.num_accepted_tokens, draft.engine.num_draft_tokens
        draft_s, draft_out = run_kiln(draft, prompts, args.max_tokens)
        draft_accepted = draft.engine.num_accepted_tokens - draft_accepted
        draft_drafted = draft.engine.num_draft_tokens - draft_drafted
        tokens = sum(map(len, plain_out))
        hf_s, hf_tokens = run_transformers(model, tokenizer, prompts, args.max_tokens, None)
        hfl_s, hfl_tokens = run_transformers(model, tokenizer, prompts, args.max_tokens, args.k)
        row = {
            "kiln_tokens": tokens, "kiln_plain_tok_s": round(tokens / plain_s, 1),
            "kiln_spec_tok_s": round(sum(map(len, spec_out)) / spec_s, 1),
            "kiln_spec_same_tokens": sum(a == b for a, b in zip(plain_out, spec_out)), "prompts": len(prompts),
            "acceptance": round(accepted / max(drafted, 1), 3), "drafted": drafted,
            "transformers_tokens": hf_tokens, "transformers_plain_tok_s": round(hf_tokens / hf_s, 1),
            "transformers_lookup_tok_s": round(hfl_tokens / hfl_s, 1),
            "kiln_draft_model_tok_s": round(sum(map(len, draft_out)) / draft_s, 1),
            "draft_model_acceptance": round(draft_accepted / max(draft_drafted, 1), 3),
            "kiln_draft_model_same_tokens": sum(a == b for a, b in zip(plain_out, draft_out)),
        }
        row["kiln_draft_model_over_plain"] = round(row["kiln_draft_model_tok_s"] / row["kiln_plain_tok_s"], 2)
        row["kiln_spec_over_plain"] = round(row["kiln_spec_tok_s"] / row["kiln_plain_tok_s"], 2)
        row["transformers_lookup_over_plain"] = round(row["transformers_lookup_tok_s"] / row["transformers_plain_tok_s"], 2)
        row["kiln_spec_over_transformers_lookup"] = round(row["kiln_spec_tok_s"] / row["transformers_lookup_tok_s"], 2)
        result["kinds"][kind] = row
        print(f"{kind}: kiln {row['kiln_plain_tok_s']} -> {row['kiln_spec_tok_s']} tok/s "
              f"({row['kiln_spec_over_plain']}x, acceptance {row['acceptance']:.0%}, "
              f"{row['kiln_spec_same_tokens']}/{len(prompts)} answers identical); transformers "
              f"{row['transformers_plain_tok_s']} -> {row['transformers_lookup_tok_s']} tok/s "
              f"({row['transformers_lookup_over_plain']}x); kiln/transformers with lookup "
              f"{row['kiln_spec_over_transformers_lookup']}x; int4 draft model {row['kiln_draft_model_tok_s']} tok/s "
              f"({row['kiln_draft_model_over_plain']}x plain, acceptance {row['draft_model_acceptance']:.0%}, "
              f"{row['kiln_draft_model_same_tokens']}/{len(prompts)} identical)", flush=True)
    result["step_ms"] = step_costs(plain, spec)
    print(f"median step: 1 row {result['step_ms']['one_row']} ms, 1 + {args.k} drafts "
          f"{result['step_ms']['with_drafts']} ms", flush=True)
    result["batch32"] = run_batch(plain, spec)
    print(f"32 at once: kiln {result['batch32']['plain_tok_s']} -> {result['batch32']['spec_tok_s']} tok/s "
          f"({result['batch32']['spec_over_plain']}x)", flush=True)
    print(f"wrote {write_result('speculative', result)}")


def step_costs(plain, spec) -> dict:
    """Median engine step of one sequence decoding, plain and checking drafts (a text that
    repeats, so nearly every step has its full k): what a step of 1 + k rows costs."""
    from kiln.engine import SamplingParams

    medians = {}
    for name, llm in (("one_row", plain), ("with_drafts", spec)):
        engine, times = llm.engine, []
        engine.add_request("steps", "The quick brown fox jumps over the lazy dog. " * 12,
                           SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        medians[name] = round(sorted(times[2:])[len(times[2:]) // 2] * 1000, 1)  # past the prefill
    return medians


def run_batch(plain, spec) -> dict:
    from kiln.engine import SamplingParams

    requests = json.loads(WORKLOAD.read_text())["requests"][:32]
    params = [SamplingParams(temperature=0.0, max_tokens=r["out_len"], ignore_eos=True) for r in requests]
    row = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        start = time.perf_counter()
        outputs = llm.generate([r["prompt_ids"] for r in requests], params)
        row[f"{name}_tok_s"] = round(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start), 1)
    row["spec_over_plain"] = round(row["spec_tok_s"] / row["plain_tok_s"], 2)
    return row


if __name__ == "__main__":
    main()
