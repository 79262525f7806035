"""Per-step overhead of the engine on the CPU: LLM.generate throughput where the fixed cost of a step
(metadata, per-layer host syncs, norms, output copies) weighs most: batch-1 decode, a batch of 16
decodes, and the first 8 requests of the shared mixed workload (outputs capped at 64 tokens, so a
run fits a shared machine). Same weights, the dtype `auto` picks for this CPU (or --dtype), greedy,
EOS ignored. Best of --repeats runs per case, by tokens per CPU-second of this process (with
--threads 1 the figure a loaded machine disturbs least) beside wall tokens/s; run labels
alternately (before, after, before, ...) so that both see the same load.

    .venv/bin/python bench/per_step.py --label before    # adds a "before" entry to today's results
    .venv/bin/python bench/per_step.py --label after     # and an "after" one, in the same file

--host measures the engine's host side instead: the tests' tiny random Llama (one layer, hidden 64)
at SmolLM2's vocabulary and with its tokenizer, so the forward is a minor share and the sampler,
scheduler, input preparation and output processing are what a step costs. 1, 16 and 64 concurrent
requests of 64 new tokens each, greedy and sampled (temperature 0.8, top-p 0.95); each step's CPU time
split by part (timed wrappers, not cProfile, which inflates Python time). Written to
host-overhead-<date>.json, with the after/before ratios once both labels are there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from cpu_common import REPO, RESULTS, WORKLOAD, machine

HOST_CONCURRENCY = (1, 16, 64)
HOST_NEW_TOKENS = 64
HOST_SUFFIXES = tuple(f"_c{c}" for c in HOST_CONCURRENCY)


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


def write_host_model(folder: Path) -> Path:
    """The tests' tiny random Llama, one layer, at SmolLM2's 49152-token vocabulary (the sampler's
    cost scales with it) and with SmolLM2's byte-level BPE tokenizer (detokenizing real merges)."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import write_tiny_model

    from kiln.engine.gguf_loader import build_gguf_tokenizer, open_gguf
    from kiln.engine.loader import resolve_model_path

    write_tiny_model("llama", folder, vocab_size=49152, num_hidden_layers=1)
    build_gguf_tokenizer(open_gguf(resolve_model_path("smollm2-135m")).metadata, "smollm2").save(
        str(folder / "tokenizer.json"))
    return folder


class StepParts:
    """CPU seconds of this process spent in each part of LLMEngine.step, by wrapping the engine's
    methods on the instances (restore() takes the wrappers off). CPU time, as tokens_per_cpu_s:
    the neighbours on a shared machine stretch the wall time, not (much) this process's cycles."""

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = {}
        self.wrapped: list[tuple[object, str, object]] = []  # (instance, name, its own attribute or None)
        runner, scheduler = engine.runner, engine.scheduler
        for part, obj, names in (("step", engine, ["step"]),
                                 ("scheduler", scheduler, ["schedule", "complete_step", "finish"]),
                                 ("prepare", runner, ["prepare"]), ("forward", runner, ["_forward"]),
                                 ("forward", runner.model, ["compute_logits"]), ("sampler", runner, ["sampler"]),
                                 ("output", engine, ["_check_stop", "_output"])):
            for name in names:
                self.wrapped.append((obj, name, vars(obj).get(name)))
                setattr(obj, name, self._timed(part, getattr(obj, name)))

    def _timed(self, part: str, fn: Callable) -> Callable:
        def timed_fn(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.process_time() - start
        return timed_fn

    def restore(self) -> None:
        for obj, name, own in self.wrapped:
            if own is None:  # a method of the class: the instance's wrapper goes
                delattr(obj, name)
            else:  # an attribute (the runner's sampler)
                setattr(obj, name, own)

    def per_step_ms(self, steps: int) -> dict[str, float]:
        """ms per step by part; "other": the rest of step() (run()'s own loops, appending tokens)."""
        ms = {part: 1e3 * s / steps for part, s in self.seconds.items()}
        ms["other"] = ms["step"] - sum(v for part, v in ms.items() if part != "step")
        # The Python bookkeeping around the forward and the sampler, whose vocabulary-sized work
        # here is the CPU's (on a GPU, the device's)
        ms["bookkeeping"] = ms["step"] - ms["forward"] - ms["sampler"]
        return {part: round(v, 3) for part, v in ms.items()}


def host_case(llm, concurrency: int, sampled: bool, repeats: int) -> dict:
    """Best of `repeats` generate() runs (by CPU ms per step) of `concurrency` requests, split by part."""
    from kiln.engine import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=HOST_NEW_TOKENS, ignore_eos=True) if sampled \
        else SamplingParams(temperature=0.0, max_tokens=HOST_NEW_TOKENS, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 100 for j in range(16)] for i in range(concurrency)]
    best = None
    for _ in range(repeats):
        parts = StepParts(llm.engine)
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            outputs = llm.generate(prompts, params)
        finally:
            parts.restore()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        assert all(len(o.token_ids) == HOST_NEW_TOKENS for o in outputs)
        steps = HOST_NEW_TOKENS  # one prefill step (that samples the first token), then decodes
        run = {"ms_per_step": round(1e3 * cpu_seconds / steps, 3), "wall_ms_per_step": round(1e3 * seconds / steps, 3),
               "parts_ms_per_step": parts.per_step_ms(steps)}
        if best is None or run["ms_per_step"] < best["ms_per_step"]:
            best = run
    return best


def host_main(args: argparse.Namespace) -> None:
    from kiln.engine import LLM

    record = {"machine": machine(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "model": "tests/tiny_models llama, 1 layer, hidden 64, vocab 49152, SmolLM2 tokenizer",
              "new_tokens": HOST_NEW_TOKENS}
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(write_host_model(Path(tmp))), dtype="float32", max_model_len=256,
                  max_num_seqs=max(HOST_CONCURRENCY))
    llm.generate([[5, 6, 7]], None)  # warm-up
    for sampled in (False, True):
        for concurrency in HOST_CONCURRENCY:
            name = f"{'sampled' if sampled else 'greedy'}_c{concurrency}"
            record[name] = host_case(llm, concurrency, sampled, args.repeats)
            print(name, json.dumps(record[name]), flush=True)
    record["load_average_end"] = os.getloadavg()
    path = RESULTS / f"host-overhead-{time.strftime('%Y%m%d', time.gmtime())}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[args.label] = record
    if "before" in results and "after" in results:
        results["after_over_before"] = {name: {
            "ms_per_step": round(results["after"][name]["ms_per_step"] / results["before"][name]["ms_per_step"], 3),
            "bookkeeping": round(results["after"][name]["parts_ms_per_step"]["bookkeeping"]
                                 / results["before"][name]["parts_ms_per_step"]["bookkeeping"], 3)}
            for name in results["before"] if name.endswith(HOST_SUFFIXES)}
        print("after/before ms per step:", json.dumps(results["after_over_before"]))
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path} [{args.label}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the entry's name in the results file, e.g. before/after")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per case")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--host", action="store_true", help="the host-side case (see above) instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.host:
        return host_main(args)
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
