"""Tensor parallelism: tokens/s at each TP size and the share of rank 0's time spent in collectives.

    python bench/tensor_parallel.py --device cpu --model smollm2-135m --tp 1 3      # gloo, this machine
    python bench/tensor_parallel.py --device cuda --model /models/llama-3-8b --tp 1 2 4   # NCCL, >= 4 GPUs

Each TP size runs in a fresh process (one torch.distributed group a process): a warm-up, then a
timed greedy run of --prompts prompts x --max-tokens tokens (nothing instrumented: tokens/s), then
the same run again with rank 0's all_reduce / all_gather timed (CUDA synchronised around each, so
that pass is slower; its share is the figure, not its speed). Rank 0's collective time includes
waiting for the slowest rank to arrive. Writes bench/results/tensor-parallel-<device>-<YYYYMMDD>-<cpu kind>.json
(cpu_common.write_result: the host CPU's kind, xeon, epyc, ..., with --device cuda too; -2, -3, ... before
.json for a later run of the day).
On two shared CPU cores TP cannot speed anything up: the CPU run records what the collectives cost.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_common import machine, write_result  # noqa: E402


def child(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from kiln.engine import LLM, SamplingParams

    if args.device == "cpu":
        torch.set_num_threads(args.threads)  # each rank takes rank 0's count
    llm = LLM(args.model, tensor_parallel_size=args.tp, device=args.device, dtype=args.dtype,
              max_model_len=1024, kv_cache_memory=256 << 20)
    prompts = [f"Write a long story about the number {i}." for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))

    def run() -> tuple[float, int]:
        start = time.perf_counter()
        tokens = sum(len(o.token_ids) for o in llm.generate(prompts, params))
        return time.perf_counter() - start, tokens

    seconds, tokens = run()
    record = {"tp": args.tp, "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}
    if args.tp == 1:
        return record
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    spent = {"all_reduce": [0.0, 0], "all_gather": [0.0, 0]}
    steps = [0]

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            sync()
            start = time.perf_counter()
            out = fn(*a, **kw)
            sync()
            spent[name][0] += time.perf_counter() - start
            spent[name][1] += 1
            return out
        return wrapper

    dist.all_reduce, dist.all_gather = timed("all_reduce", dist.all_reduce), timed("all_gather", dist.all_gather)
    runner_run = llm.engine.runner.run
    llm.engine.runner.run = lambda batch: (steps.__setitem__(0, steps[0] + 1), runner_run(batch))[1]
    seconds, _ = run()
    collective = sum(s for s, _ in spent.values())
    record["profiled"] = {
        "seconds": round(seconds, 3), "steps": steps[0],
        "step_ms": round(1e3 * seconds / steps[0], 2),
        "all_reduces_per_step": round(spent["all_reduce"][1] / steps[0], 1),
        "all_reduce_ms_per_step": round(1e3 * spent["all_reduce"][0] / steps[0], 2),
        "all_gather_ms_per_step": round(1e3 * spent["all_gather"][0] / steps[0], 2),
        "collective_share": round(collective / seconds, 3),
    }
    llm.close()
    return record


def _all_reduce_rank(rank: int, size: int, port: int, shapes: list, out) -> None:
    """One gloo rank timing bare all-reduces (no model): what the transport alone costs."""
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    timings = {}
    for rows, hidden in shapes:
        x = torch.randn(rows, hidden)
        for _ in range(10):
            dist.all_reduce(x)
        samples = []
        for _ in range(100):
            start = time.perf_counter()
            dist.all_reduce(x)
            samples.append(time.perf_counter() - start)
        timings[f"{rows}x{hidden}"] = round(1e6 * statistics.median(samples), 1)
    if rank == 0:
        out.put(timings)
    dist.destroy_process_group()


def bare_all_reduce_us(size: int, shapes: list) -> dict:
    """Median microseconds of one float32 all-reduce of each [rows, hidden] over `size` gloo ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_all_reduce_rank, args=(size, port, shapes, out), nprocs=size, start_method="spawn")
    return out.get()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads a rank (cpu)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.child:
        args.tp = args.tp[0]
        print(json.dumps(child(args)))
        return 0
    if args.device == "cuda":
        import torch
        if torch.cuda.device_count() < max(args.tp):
            print(f"tensor_parallel.py: TP up to {max(args.tp)} needs as many GPUs; "
                  f"{torch.cuda.device_count()} found", file=sys.stderr)
            return 2
    runs = []
    for tp in args.tp:
        cmd = [sys.executable, __file__, "--child", "--device", args.device, "--model", args.model, "--dtype", args.dtype,
               "--tp", str(tp), "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
               "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]))
    if args.device == "cpu":  # the transport alone, at SmolLM2's hidden size: a decode of 1 and of every prompt, a prefill chunk
        shapes = [(1, 576), (args.prompts, 576), (512, 576)]
        bare = {f"tp{tp}": bare_all_reduce_us(tp, shapes) for tp in args.tp if tp > 1}
        print(json.dumps({"bare_all_reduce_us": bare}))
    record = {"benchmark": "tensor-parallel", "device": args.device, "model": args.model, "dtype": args.dtype,
              "prompts": args.prompts, "max_tokens": args.max_tokens, "threads_per_rank": args.threads,
              "machine": machine(), "runs": runs}
    if args.device == "cpu":
        record["bare_all_reduce_us"] = bare
    if args.device == "cuda":
        import torch
        record["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"wrote {write_result(f'tensor-parallel-{args.device}', record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
