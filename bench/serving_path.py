"""Does the serving path (HTTP, tokenization, SSE, detokenization) stall Kiln's engine loop?

For each concurrency c: one `kiln serve` (prefix caching off, the CPU's fast dtype) gets c
streaming requests at once, each generating --output-tokens tokens (ignore_eos). Read from the
server: the engine thread's time in steps and between steps while requests were in flight
(/metrics kiln:engine_step_seconds, kiln:engine_gap_seconds), and the CPU seconds of the event-loop
thread (the main thread: HTTP, tokenizing, SSE) against the whole process (/proc/<pid>/task).
Then, with the server stopped, the same prompts through LLMEngine in this process, no HTTP: the
output tokens/s the engine makes alone (served / offline is what the serving path costs in all),
and the time its incremental detokenizer takes for those tokens (it runs inside the engine's steps).

    python bench/serving_path.py                 # c=16,32; bench/results/serving-path-<date>-<cpu kind>.json
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import time
import urllib.request
from pathlib import Path

from cpu_common import machine, write_result
from online import ServerUnderTest, prompt, run_load, served_dtype, served_gguf, start_kiln, summarize, versions


def counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    found = {}
    for name in ("engine_step_seconds", "engine_gap_seconds"):
        m = re.search(rf"^kiln:{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        found[name] = float(m.group(1)) if m else float("nan")
    return found


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the main thread and of the whole process."""
    tick = os.sysconf("SC_CLK_TCK")

    def of(stat: str) -> float:
        fields = Path(stat).read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    return {"main_thread": of(f"/proc/{pid}/task/{pid}/stat"), "process": of(f"/proc/{pid}/stat")}


def served(server: ServerUnderTest, c: int, tokens: int) -> dict:
    asyncio.run(run_load(server.url, {}, 2, 4, concurrency=2, first=10_000))  # warm-up
    before_m, before_cpu = counters(server.url), cpu_seconds(server.proc.pid)
    samples, wall = asyncio.run(run_load(server.url, {}, c, tokens, concurrency=c, first=100 * c))
    after_m, after_cpu = counters(server.url), cpu_seconds(server.proc.pid)
    step = after_m["engine_step_seconds"] - before_m["engine_step_seconds"]
    gap = after_m["engine_gap_seconds"] - before_m["engine_gap_seconds"]
    main = after_cpu["main_thread"] - before_cpu["main_thread"]
    total = after_cpu["process"] - before_cpu["process"]
    summary = summarize(samples, wall, tokens, ttft_slo=60.0, tpot_slo=60.0)
    return {"output_tokens_per_s": summary["output_tokens_per_s"], "wall_s": wall, "errors": summary["errors"],
            "engine_step_s": step, "engine_gap_s": gap, "gap_fraction": gap / max(step + gap, 1e-9),
            "event_loop_thread_cpu_s": main, "process_cpu_s": total,
            "event_loop_share_of_cpu": main / max(total, 1e-9)}


def offline(gguf: Path, dtype: str, c: int, tokens: int) -> dict:
    from kiln.engine import LLM, SamplingParams

    llm = LLM(str(gguf), dtype=dtype, enable_prefix_caching=False, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt(10_000 + i) for i in range(2)], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([prompt(100 * c + i) for i in range(c)], params)
    wall = time.perf_counter() - start
    # The engine thread detokenizes inside its steps: replay those token streams alone.
    from kiln.engine.tokenizer import IncrementalDetokenizer

    start = time.perf_counter()
    for o in outputs:
        detokenizer = IncrementalDetokenizer(llm.tokenizer, prompt_ids=o.prompt_token_ids)
        for token in o.token_ids:
            detokenizer.add([token])
    detok = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"output_tokens_per_s": tokens / wall, "wall_s": wall,
            "detokenize_us_per_token": detok / tokens * 1e6, "detokenize_share_of_wall": detok / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="16,32")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kiln-bench"))
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.dtype = served_dtype(args.dtype)
    gguf = served_gguf(args.dtype, None)
    record = {"machine": machine(), "dtype": args.dtype, "versions": versions(), "gguf": str(gguf),
              "output_tokens": args.output_tokens, "rows": []}
    levels = [int(c) for c in args.concurrency.split(",")]
    server = start_kiln(gguf, args)
    try:
        for c in levels:
            record["rows"].append({"concurrency": c, "served": served(server, c, args.output_tokens)})
            write_result("serving-path", record)  # partial runs count
    finally:
        server.stop()
    import torch

    torch.set_num_threads(args.threads)  # as the server's OMP_NUM_THREADS
    for row in record["rows"]:
        row["offline"] = offline(gguf, args.dtype, row["concurrency"], args.output_tokens)
        row["served_over_offline"] = row["served"]["output_tokens_per_s"] / row["offline"]["output_tokens_per_s"]
        s = row["served"]
        print(f"c={row['concurrency']}: served {s['output_tokens_per_s']:.1f} tok/s, offline "
              f"{row['offline']['output_tokens_per_s']:.1f} ({row['served_over_offline']:.2f}x); engine gaps "
              f"{s['gap_fraction']:.1%} of its loop; event-loop thread {s['event_loop_share_of_cpu']:.1%} of the "
              f"process's CPU; detokenizing {row['offline']['detokenize_us_per_token']:.0f} us/token = "
              f"{row['offline']['detokenize_share_of_wall']:.1%} of the offline wall", flush=True)
        write_result("serving-path", record)
    record["machine"]["load_average_end"] = os.getloadavg()
    print(f"wrote {write_result('serving-path', record)}")


if __name__ == "__main__":
    main()
