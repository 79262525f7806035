"""Top-k/top-p filtering on the CPU at 64 concurrent requests, on SmolLM2-135M's real logits: Kiln's
sampler.filter_logits (each row's best 256 tokens first, wider only for the rows whose top-p mass
reaches past them) against a whole-row sort of the vocabulary (the sampler before, and the usual
torch way). The logits are those of 64 prompts of the shared workload decoding 40 tokens at
temperature 1; each setting divides them by its temperature. Prints ms a step of 64 rows, the
ratio, and the share of rows the first width settles; writes bench/results/top-p-<date>-<cpu>.json.

    .venv/bin/python bench/top_p.py [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from cpu_common import WORKLOAD, machine, write_result

SETTINGS = [(0.8, 0.95), (1.0, 0.9), (1.0, 0.95), (1.0, 0.99)]  # (temperature, top_p)


def captured_logits(rows: int, steps: int) -> list[torch.Tensor]:
    """The logits the engine's sampler saw, one [rows, vocab] tensor a decode step."""
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.sampler import Sampler

    seen: list[torch.Tensor] = []
    sample = Sampler.__call__

    def capture(self, logits, seqs, drafts=None):
        if logits.shape[0] == rows:
            seen.append(logits.clone())
        return sample(self, logits, seqs, drafts)

    Sampler.__call__ = capture
    try:
        llm = LLM("smollm2-135m", dtype="float32", max_model_len=512)
        prompts = [r["prompt_ids"][:100] for r in json.loads(WORKLOAD.read_text())["requests"][:rows]]
        llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=steps, seed=1))
    finally:
        Sampler.__call__ = sample
    return seen


def whole_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ranked, order = logits.sort(dim=-1, descending=True)
    probs = ranked.softmax(dim=-1)
    cut = probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)
    return torch.empty_like(logits).scatter_(1, order, ranked.masked_fill(cut, float("-inf")))


def ms_a_step(fn, steps: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for logits in steps:
        fn(logits)
    return 1e3 * (time.perf_counter() - start) / len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from kiln.engine.sampler import CANDIDATES, filter_logits

    steps = captured_logits(64, 40)
    torch.set_num_threads(args.threads)
    record = {"machine": machine(), "torch_threads": args.threads, "torch": torch.__version__, "rows": 64,
              "steps": len(steps), "vocab": steps[0].shape[-1], "candidates": list(CANDIDATES), "settings": []}
    none, zeros = torch.zeros(64, dtype=torch.long), torch.zeros(64)
    for temperature, p in SETTINGS:
        top_p = torch.full((64,), p)
        scaled = [logits / temperature for logits in steps]
        kiln = ms_a_step(lambda x: filter_logits(x, none, top_p, zeros), scaled)
        peer = ms_a_step(lambda x: whole_sort(x, top_p), scaled)
        within = sum(int((x.softmax(-1).topk(CANDIDATES[0]).values.sum(-1) >= p).sum()) for x in scaled)
        setting = {"temperature": temperature, "top_p": p, "kiln_ms": round(kiln, 2), "whole_sort_ms": round(peer, 2),
                   "speedup": round(peer / kiln, 2),
                   "rows_settled_by_first_width": round(within / (64 * len(steps)), 3)}
        record["settings"].append(setting)
        print(json.dumps(setting), flush=True)
    print(f"wrote {write_result('top-p', record)}")


if __name__ == "__main__":
    main()
