"""The fused CPU paged-attention op (kiln.engine.cpu_attention) against the torch path it replaces
(kiln.engine.attention: gather each sequence's K/V padded to the longest context, then SDPA).

One attention layer of SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64, block 16),
random K/V in a shuffled block pool: decode at batch 1/16/64 with contexts 128-2048, and a
chunked-prefill step (a 16/64/256-token chunk over a 1024-token cached prefix beside 15 decodes),
with the op alone and as shipped (chunks over cpu_attention.SDPA_ABOVE tokens go to SDPA).
Times are the median of repeated calls after a warm-up. The torch path is timed with its
per-step plan already built (the engine builds it once per step for all 30 layers), so its
figure is the per-layer cost; the op's includes its own per-call metadata checks.
Then, unless --no-engine, the engine end to end: 16 greedy requests of 128 prompt + 64 output
tokens through LLM.generate with each backend.

    .venv/bin/python bench/cpu_attention.py                  # -> bench/results/cpu-attention-<date>-<cpu kind>.json
    .venv/bin/python bench/cpu_attention.py --dtype float32 --no-engine
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cpu_common import machine, write_result  # noqa: E402
from kiln.engine import cpu_attention  # noqa: E402
from kiln.engine.attention import plan_paged_attention, run_paged_attention  # noqa: E402
from test_cpu_attention import make_batch  # noqa: E402  (the tests' random paged batch)

HQ, HKV, BLOCK = 9, 3, 16  # SmolLM2-135M; head_dim 64 is make_batch's


def timed(fn, budget_s: float = 0.4) -> float:
    """Median seconds of one call, over as many calls as fit the budget (at least 5)."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    times = []
    for _ in range(max(5, min(200, int(budget_s / once)))):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def layer_case(name: str, shape: list[tuple[int, int]], dtype: torch.dtype, **options: int) -> dict:
    batch = make_batch(shape, BLOCK, dtype, hq=HQ, hkv=HKV)
    plan = plan_paged_attention(batch["cu_seqlens_q"], batch["seq_lens"], batch["block_tables"], BLOCK)
    op = timed(lambda: cpu_attention.paged_attention(**batch, **options))
    ref = timed(lambda: run_paged_attention(batch["q"], batch["k_cache"], batch["v_cache"], plan, batch["scale"]))
    err = (cpu_attention.paged_attention(**batch, **options).float()
           - run_paged_attention(batch["q"], batch["k_cache"], batch["v_cache"], plan, batch["scale"]).float())
    row = {"case": name, "kiln_op_us": round(op * 1e6, 1), "torch_path_us": round(ref * 1e6, 1),
           "speedup": round(ref / op, 2), "max_abs_diff": float(err.abs().max())}
    print(f"{name:<44} kiln op {op * 1e6:9.1f} us   torch path {ref * 1e6:9.1f} us   ratio {ref / op:5.2f}x")
    return row


def engine_case(backend: str, dtype: str) -> dict:
    from kiln.engine import LLM, SamplingParams
    llm = LLM(dtype=dtype, attention_backend=backend, max_model_len=512)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (128,), generator=gen).tolist() for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"engine {backend:<6} 16 x (128 prompt + 64 output) {seconds:6.2f} s   {tokens / seconds:7.1f} output tok/s")
    return {"backend": backend, "seconds": round(seconds, 3), "output_tokens_per_s": round(tokens / seconds, 1),
            "tokens": [o.token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-engine", action="store_true", help="only the per-layer attention timings")
    args = parser.parse_args()
    if not cpu_attention.available():
        sys.exit(f"the CPU op did not build: {cpu_attention.unavailable_reason()}")
    dtype = getattr(torch, args.dtype)
    print(f"one attention layer, {args.dtype}, {HQ} query / {HKV} KV heads, block {BLOCK}, "
          f"{torch.get_num_threads()} threads; ratio = torch path / kiln op")
    rows = [layer_case(f"decode batch {b:>2}, context {c:>4}", [(1, c)] * b, dtype)
            for b in (1, 16, 64) for c in (128, 512, 2048)]
    rows.append(layer_case("mixed decode batch 16, ctx 1..2048", [(1, 128 * (i + 1)) for i in range(16)], dtype))
    # Prefill chunks: the op alone, and as shipped (chunks over SDPA_ABOVE tokens go to SDPA).
    for chunk in (16, 64, 256):
        shape = [(chunk, 1024 + chunk)] + [(1, 1024)] * 15
        rows.append(layer_case(f"chunk {chunk} over 1024 + 15 decodes, op alone", shape, dtype, sdpa_above=1 << 30))
        rows.append(layer_case(f"chunk {chunk} over 1024 + 15 decodes, shipped", shape, dtype))
    record = {"machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "dtype": args.dtype, "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": 64, "block_size": BLOCK},
              "layer": rows}
    if not args.no_engine:
        engine = [engine_case(backend, args.dtype) for backend in ("torch", "cpu")]
        # In bf16 the two paths round differently (SDPA in bf16, the op in fp32), so near-tied greedy
        # picks may flip and the continuations part; tests/test_cpu_attention.py checks fp32 exactly.
        pairs = list(zip(engine[0].pop("tokens"), engine[1].pop("tokens")))
        same = sum(a == b for a, b in pairs)
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs)
        ratio = engine[1]["output_tokens_per_s"] / engine[0]["output_tokens_per_s"]
        print(f"engine: kiln op / torch path throughput {ratio:.2f}x; identical continuations {same}/{len(pairs)}, "
              f"common prefix {prefix}/{64 * len(pairs)} tokens")
        record["engine"] = {"runs": engine, "speedup": round(ratio, 2), "identical_continuations": same,
                            "common_prefix_tokens": prefix, "tokens": 64 * len(pairs)}
    suffix = "" if args.dtype == "bfloat16" else "-fp32"
    print("wrote", write_result(f"cpu-attention{suffix}", record))


if __name__ == "__main__":
    main()
