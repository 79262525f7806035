"""Offline mixed workload: Kiln's LLM.generate vs transformers' generate, same run, same weights,
same dtype: the one this CPU is fast in (kiln.engine.dtype_choice: bf16 with AVX512_BF16/AMX, else
float32), or --dtype.

The 64 requests of ../shared/bench/mixed_workload_seed0.json (beside the repository: prompt token
ids and an output length each, EOS ignored) go through Kiln in one call, and through transformers in static
left-padded batches of 8 and of 32 (each batch runs to its longest output; the better of the
two counts). Metric: useful output tokens (the requested lengths) / wall time.

    .venv/bin/python bench/offline.py            # full run, writes bench/results/offline-<date>-<cpu kind>.json
    .venv/bin/python bench/offline.py --quick    # first 16 requests, batch 8 only, no results file
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from cpu_common import REPO, WORKLOAD, ceilings, machine, write_result
from online import served_dtype



def machine_info() -> dict:
    import transformers

    # machine() has python, torch and the kiln commit (cpu_common.versions).
    return {**machine(), "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__}


def run_kiln(requests: list[dict], profile: bool, dtype: str) -> dict:
    from kiln.engine import LLM, SamplingParams

    llm = LLM(dtype=dtype, gguf_dequantize=True)  # plain weights of `dtype`, as transformers runs them
    llm.generate([requests[0]["prompt_ids"]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=r["out_len"], ignore_eos=True) for r in requests]
    prompts = [r["prompt_ids"] for r in requests]
    profiler = None
    if profile:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.start()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if profiler:
        profiler.stop()
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    assert [len(o.token_ids) for o in outputs] == [r["out_len"] for r in requests]
    stats = llm.engine.stats()
    return {"seconds": round(elapsed, 2), "num_preemptions": stats.num_preemptions,
            "max_num_seqs": llm.engine.config.max_num_seqs,
            "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens}


def run_transformers(requests: list[dict], batch_size: int, model) -> dict:
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r["prompt_ids"]) for r in batch)
        ids = torch.tensor([[0] * (width - len(r["prompt_ids"])) + r["prompt_ids"] for r in batch])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r["prompt_ids"]) for r in batch])[:, None]).long()
        longest = max(r["out_len"] for r in batch)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + longest
        generated += len(batch) * longest
    return {"batch_size": batch_size, "seconds": round(time.perf_counter() - start, 2), "generated_tokens": generated}


def load_transformers(dtype: str):
    from transformers import AutoModelForCausalLM, GgufConfig

    from kiln.engine.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    # Unpacked into plain weights of `dtype`, as Kiln serves them (left packed, transformers would run
    # float32 dequant kernels instead: a different, slower peer).
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype),
                                                 quantization_config=GgufConfig(dequantize=True)).eval()
    assert model.model.layers[0].mlp.down_proj.weight.dtype == getattr(torch, dtype)
    model.generation_config.eos_token_id = None  # like ignore_eos
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="first 16 requests, transformers batch 8 only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's table for Kiln's run")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="both sides' dtype (auto: the one this CPU is fast in)")
    args = parser.parse_args()
    dtype = served_dtype(args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = json.loads(WORKLOAD.read_text())
    requests = workload["requests"][:16] if args.quick else workload["requests"]
    batch_sizes = [8] if args.quick else args.batch_sizes
    useful = sum(r["out_len"] for r in requests)
    result = {"workload": str(WORKLOAD.relative_to(REPO.parent)), "num_requests": len(requests),
              "useful_output_tokens": useful, "prompt_tokens": sum(len(r["prompt_ids"]) for r in requests),
              "dtype": dtype, "machine": machine_info(), "ceilings": ceilings(dtype)}
    print(json.dumps(result["machine"]), json.dumps(result["ceilings"]), flush=True)

    kiln = run_kiln(requests, args.profile, dtype)
    kiln["useful_tokens_per_s"] = round(useful / kiln["seconds"], 1)
    result["kiln"] = kiln
    print(f"kiln: {useful} useful tokens in {kiln['seconds']} s = {kiln['useful_tokens_per_s']} tok/s", flush=True)
    if not args.quick:  # a run cut off during the (slower) transformers part still counts
        write_result("offline", result)
    if not args.skip_transformers:
        model = load_transformers(dtype)
        runs = []
        for bs in batch_sizes:
            run = run_transformers(requests, bs, model)
            run["useful_tokens_per_s"] = round(useful / run["seconds"], 1)
            run["useful_fraction"] = round(useful / run["generated_tokens"], 3)
            runs.append(run)
            print(f"transformers batch {bs}: {run['seconds']} s = {run['useful_tokens_per_s']} useful tok/s "
                  f"({run['useful_fraction']:.0%} of generated tokens useful)", flush=True)
        best = max(runs, key=lambda r: r["useful_tokens_per_s"])
        result["transformers"] = {"runs": runs, "best_useful_tokens_per_s": best["useful_tokens_per_s"]}
        result["ratio_kiln_over_transformers"] = round(kiln["useful_tokens_per_s"] / best["useful_tokens_per_s"], 2)
        print(f"ratio kiln / transformers (best batch {best['batch_size']}): {result['ratio_kiln_over_transformers']}x")
    result["machine"]["load_average_end"] = os.getloadavg()
    if not args.quick:
        print(f"wrote {write_result('offline', result)}")


if __name__ == "__main__":
    main()
