"""Per-step overhead of the engine on the CPU: LLM.generate throughput where the fixed cost of a step
(metadata, per-layer host syncs, norms, output copies) weighs most: batch-1 decode, a batch of 16
decodes, and the first 8 requests of the shared mixed workload (outputs capped at 64 tokens, so a
run fits a shared machine). Same weights, the dtype `auto` picks for this CPU (or --dtype), greedy,
EOS ignored. Best of --repeats runs per case, by tokens per CPU-second of this process (with
--threads 1 the figure a loaded machine disturbs least) beside wall tokens/s; run labels
alternately (before, after, before, ...) so that both see the same load.

    .venv/bin/python bench/per_step.py --label before    # adds a "before" entry to today's results
    .venv/bin/python bench/per_step.py --label after     # and an "after" one, in the same file
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from cpu_common import RESULTS, machine

WORKLOAD = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "mixed_workload_seed0.json"


def timed(llm, prompts: list[list[int]], out_lens: list[int]) -> dict:
    from kiln.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    assert [len(o.token_ids) for o in outputs] == out_lens
    # CPU time is what a shared machine disturbs least: other processes stretch the wall time,
    # not (much) the cycles this one spends.
    return {"seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 3), "output_tokens": sum(out_lens),
            "tokens_per_s": round(sum(out_lens) / seconds, 1),
            "tokens_per_cpu_s": round(sum(out_lens) / cpu_seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the entry's name in the results file, e.g. before/after")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per case")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kiln.engine import LLM, SamplingParams

    record = {"machine": machine(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    llm = LLM(dtype=args.dtype, max_model_len=1024)
    record["dtype"] = str(llm.engine.config.torch_dtype).removeprefix("torch.")
    record["attention_backend"] = llm.engine.config.resolved_attention_backend
    requests = json.loads(WORKLOAD.read_text())["requests"][:16]
    base = requests[0]["prompt_ids"]
    llm.generate([base[:8]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    cases = {
        "decode_batch1": ([base[:64]], [64]),
        "decode_batch16": ([r["prompt_ids"][:128] for r in requests], [32] * 16),
        "mixed8": ([r["prompt_ids"] for r in requests[:8]], [min(r["out_len"], 64) for r in requests[:8]]),
    }
    for name, (prompts, out_lens) in cases.items():
        runs = [timed(llm, prompts, out_lens) for _ in range(args.repeats)]
        record[name] = max(runs, key=lambda r: r["tokens_per_cpu_s"]) | {
            "all_tokens_per_s": [r["tokens_per_s"] for r in runs],
            "all_tokens_per_cpu_s": [r["tokens_per_cpu_s"] for r in runs]}
        print(name, json.dumps(record[name]), flush=True)
    record["load_average_end"] = os.getloadavg()
    path = RESULTS / f"per-step-{time.strftime('%Y%m%d', time.gmtime())}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[args.label] = record
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path} [{args.label}]")


if __name__ == "__main__":
    main()
