"""GPU decode of Llama-shaped models with random weights (default: Llama 3 8B), four ways, in one run.

model_graphs / model_eager: Kiln's model forward alone, one decode step at a time (Triton attention
  over the paged cache, the logits of every row, greedy argmax). Batch metadata is advanced on the
  GPU, so scheduling and host work are left out: the model's ceiling, with the forward replayed from
  a captured CUDA graph (kiln.engine.kernels.cuda_graphs) and without.
engine_graphs / engine_eager: the engine API (kiln.engine.LLM, load_format="dummy") on random
  token-id prompts at 1, 16 and 64 concurrent sequences, enforce_eager False and True.
transformers: the peer, transformers' LlamaForCausalLM.generate (default dynamic cache, no
  torch.compile) on the same shape, dtype and prompt lengths.
profile: torch.profiler over a few eager model-level decode steps at batch 1; the kernels with the
  most device time are named under "top_costs".

Each decode step reads every weight once plus each sequence's KV, so a step takes at least
(weight bytes + KV bytes) / copy bandwidth; the bandwidth is measured in the same run. Speed does
not depend on weight values. A section that raises records its traceback and the rest still run;
the JSON is rewritten after every section, so a timeout keeps what finished. Needs CUDA; exits 2
without it.

    python bench/gpu_engine.py [--models 8b] [--graphs on off] [--sections ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from gpu_common import DTYPES, device_costs, machine, measure_peaks, require_cuda, write_results

DEVICE = "cuda"
BLOCK_SIZE = 16
VOCAB = 128256
PROFILE_STEPS = 5
SECTIONS = ("model", "engine", "transformers", "profile")
# Llama 3.2 1B and Llama 3.1 8B shapes.
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
Generate = Callable[[list[list[int]], int], int]  # (prompts, max new tokens) -> tokens generated


def weight_bytes(shape: str, itemsize: int) -> int:
    """Bytes of weights one decode step reads: all of them once; of an untied embedding table only B
    rows, so the vocab x hidden matrix counts once either way (as lm_head, or tied)."""
    s = SHAPES[shape]
    h, q, kv = s["hidden_size"], s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    layer = h * (q + 2 * kv) + q * h + 3 * h * s["intermediate_size"] + 2 * h  # qkv, o, gate/up/down, 2 norms
    return (s["num_hidden_layers"] * layer + h + VOCAB * h) * itemsize


def kv_bytes_per_token(shape: str, itemsize: int) -> int:
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * itemsize


def hf_config(shape: str, dtype: str) -> dict[str, Any]:
    """The config.json a Llama 3 checkpoint of this shape carries."""
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000, eos_token_id=128001,
                hidden_act="silu", torch_dtype=dtype, **SHAPES[shape])


def write_model_folder(folder: Path, shape: str, dtype: str) -> None:
    """config.json and a word-level tokenizer.json; no weights (the engine loads with load_format="dummy")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(shape, dtype), indent=2))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def build_model(shape: str, dtype: torch.dtype, device: str, max_positions: int, backend: str = "triton"):
    from kiln.engine.config import ModelConfig
    from kiln.engine.llama import LlamaForCausalLM
    from kiln.engine.loader import default_dtype, fill_random
    cfg = ModelConfig(vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                      max_position_embeddings=max_positions, attention_bias=False, bos_token_id=None,
                      **SHAPES[shape])
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(cfg, max_positions, attention_backend=backend).eval()
    fill_random(model, seed=0)
    return model, cfg


class DecodeBatch:
    """batch sequences of `context` cached tokens each, advanced one token per step on the device."""

    def __init__(self, model, cfg, batch: int, context: int, steps: int, dtype: torch.dtype, device: str):
        from kiln.engine.attention import Attention
        blocks = -(-(context + steps + 1) // BLOCK_SIZE)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        # Cache contents do not change the speed; zeros keep the values finite.
        self.kv = torch.zeros(2, len(layers), batch * blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                              dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv[0, i], self.kv[1, i]
        self.tables = torch.randperm(batch * blocks, device=device).view(batch, blocks).int()
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)  # before the step
        self.cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
        self.batch, self.max_len, self.max_blocks = batch, context + steps + 1, blocks
        self.host_len = context  # the longest context, tracked without a device sync

    def context(self):
        from kiln.engine.context import Context
        pos = self.seq_lens.long()
        slots = self.tables.gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1).long() * BLOCK_SIZE + pos % BLOCK_SIZE
        return pos, Context(cu_seqlens_q=self.cu, seq_lens=self.seq_lens + 1, max_seqlen_q=1,
                            max_seqlen_k=self.host_len + 1, slot_mapping=slots, block_tables=self.tables)

    def advance(self, next_ids: torch.Tensor) -> None:
        self.ids, self.seq_lens, self.host_len = next_ids, self.seq_lens + 1, self.host_len + 1


def decode_step(model, state: DecodeBatch, graphs: bool) -> Callable[[], None]:
    """One decode step of the whole batch, as the model runner does it (call under inference_mode)."""
    from kiln.engine.context import reset_context, set_context
    from kiln.engine.kernels.cuda_graphs import DecodeGraphs
    runner = None
    if graphs:
        runner = DecodeGraphs(model.forward, [state.batch], state.max_blocks, state.max_len, DEVICE)
        runner.capture()

    def step() -> None:
        pos, ctx = state.context()
        if runner is not None:
            hidden = runner.run(state.ids, pos, ctx)
        else:
            set_context(ctx)
            hidden = model(state.ids, pos)
            reset_context()
        state.advance(model.compute_logits(hidden).argmax(-1))
    return step


def model_points(args: argparse.Namespace, shape: str, graphs: bool, bw: float) -> list[dict]:
    dtype = DTYPES[args.dtype]
    model, cfg = build_model(shape, dtype, DEVICE, args.context + args.steps + 8)
    weights, kv_token = weight_bytes(shape, dtype.itemsize), kv_bytes_per_token(shape, dtype.itemsize)
    points = []
    for batch in args.batch_sizes:
        state = DecodeBatch(model, cfg, batch, args.context, args.steps + 3, dtype, DEVICE)
        with torch.inference_mode():
            step = decode_step(model, state, graphs)
            for _ in range(3):  # warm-up: kernel compilation, allocator
                step()
            torch.cuda.synchronize()
            mean_kv = batch * (state.host_len + 1 + state.host_len + args.steps) / 2 * kv_token  # mean context
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            step_s = (time.perf_counter() - start) / args.steps
        bound_s = (weights + mean_kv) / bw
        points.append(dict(model=shape, batch=batch, context=args.context, cuda_graphs=graphs, step_ms=step_s * 1e3,
                           tokens_per_s=batch / step_s, bound_tokens_per_s=batch / bound_s,
                           pct_of_bound=100 * bound_s / step_s))
        p = points[-1]
        print(f"model {shape} {'graphs' if graphs else 'eager '} batch {batch:3d}: {p['step_ms']:7.2f} ms/step "
              f"{p['tokens_per_s']:8.0f} tok/s ({p['pct_of_bound']:3.0f}% of the {p['bound_tokens_per_s']:.0f} bound)")
        del state, step  # before the next point's cache is allocated
    return points


def timed_generate(generate: Generate, args: argparse.Namespace, concurrency: int, seed: int) -> dict:
    """A warm-up, then a 1-token and a (1+N)-token run, each on fresh random prompts (no prefix-cache
    hits); their difference is N decode steps with the prefill taken out."""
    gen = torch.Generator().manual_seed(seed)

    def run(max_tokens: int) -> tuple[int, float]:
        prompts = torch.randint(10, 128000, (concurrency, args.prompt_len), generator=gen).tolist()
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = generate(prompts, max_tokens)
        torch.cuda.synchronize()
        return tokens, time.perf_counter() - start

    run(1 + args.new_tokens)  # same shapes as timed: Triton compiles, allocator grows
    first_tokens, first_s = run(1)
    tokens, total_s = run(1 + args.new_tokens)
    return dict(concurrency=concurrency, prompt_len=args.prompt_len, max_tokens=1 + args.new_tokens,
                output_tokens=tokens, wall_s=total_s, first_token_s=first_s, output_tokens_per_s=tokens / total_s,
                decode_tokens_per_s=(tokens - first_tokens) / (total_s - first_s))


def with_bound(point: dict, shape: str, itemsize: int, bw: float, new_tokens: int) -> dict:
    """The decode bound at this concurrency: weights plus every sequence's KV at the mean context."""
    c = point["concurrency"]
    step_bytes = weight_bytes(shape, itemsize) + c * (point["prompt_len"] + new_tokens / 2) * kv_bytes_per_token(
        shape, itemsize)
    point["decode_bound_tokens_per_s"] = c * bw / step_bytes
    point["decode_pct_of_bound"] = 100 * point["decode_tokens_per_s"] / point["decode_bound_tokens_per_s"]
    return point


def report(label: str, p: dict) -> None:
    bound = f" ({p['decode_pct_of_bound']:3.0f}% of the bound)" if "decode_pct_of_bound" in p else ""
    print(f"{label} c={p['concurrency']:3d}: decode {p['decode_tokens_per_s']:8.0f} tok/s{bound}, "
          f"end to end {p['output_tokens_per_s']:8.0f} tok/s, first token {p['first_token_s'] * 1e3:6.1f} ms")


def engine_points(args: argparse.Namespace, shape: str, graphs: bool, folder: Path, bw: float) -> list[dict]:
    from kiln.engine import LLM, SamplingParams
    write_model_folder(folder, shape, args.dtype)
    llm = LLM(str(folder), dtype=args.dtype, device=DEVICE, load_format="dummy", enforce_eager=not graphs,
              gpu_memory_utilization=0.5, max_model_len=args.prompt_len + args.new_tokens + BLOCK_SIZE,
              max_num_seqs=max(64, *args.concurrency))

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return sum(len(o.token_ids) for o in llm.generate(prompts, params))

    points = []
    for c in args.concurrency:
        p = with_bound(timed_generate(generate, args, c, seed=c), shape, DTYPES[args.dtype].itemsize, bw,
                       args.new_tokens)
        points.append(p | {"model": shape, "cuda_graphs": graphs})
        report(f"engine {shape} {'graphs' if graphs else 'eager '}", p)
    return points


def transformers_points(args: argparse.Namespace, shape: str) -> dict:
    import transformers
    from kiln.engine.loader import default_dtype, fill_random
    cfg = {k: v for k, v in hf_config(shape, args.dtype).items()
           if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device(DEVICE), default_dtype(DTYPES[args.dtype]):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    fill_random(model, seed=0)

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        ids = torch.tensor(prompts, device=DEVICE)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=cfg["eos_token_id"])
        return out[:, ids.shape[1]:].numel()

    points = []
    for c in args.hf_concurrency:
        points.append(timed_generate(generate, args, c, seed=c) | {"model": shape})
        report(f"transformers {shape}", points[-1])
    return {"transformers": transformers.__version__, "cache": "dynamic",
            "attn_implementation": getattr(model.config, "_attn_implementation", None), "points": points}


def profile_step(args: argparse.Namespace, shape: str) -> dict:
    """A few eager batch-1 decode steps under torch.profiler, kernels ranked by device time."""
    from torch.profiler import ProfilerActivity, profile
    dtype = DTYPES[args.dtype]
    model, cfg = build_model(shape, dtype, DEVICE, args.context + PROFILE_STEPS + 8)
    state = DecodeBatch(model, cfg, 1, args.context, PROFILE_STEPS + 3, dtype, DEVICE)
    with torch.inference_mode():
        step = decode_step(model, state, graphs=False)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(PROFILE_STEPS):
                step()
            torch.cuda.synchronize()
            wall_s = time.perf_counter() - start
    costs = device_costs(prof.key_averages(), PROFILE_STEPS)
    # The profiler slows the host side, so the wall time here overstates the launch gaps.
    costs |= dict(model=shape, batch=1, context=args.context, cuda_graphs=False, steps=PROFILE_STEPS,
                  wall_ms_per_step_profiled=wall_s * 1e3 / PROFILE_STEPS)
    for k in costs["kernels"][:5]:
        print(f"profile {shape}: {100 * k['share']:5.1f}% {k['ms_per_step']:7.3f} ms/step {k['name'][:100]}")
    return costs


def run_section(results: dict, key: str, fn: Callable[[], Any], save: Callable[[], Any]) -> None:
    """Run one section; an exception is stored as its traceback. Memory is freed and the file saved after."""
    print(f"== {key}", flush=True)
    start = time.perf_counter()
    try:
        results[key] = {"result": fn()}
    except Exception:
        results[key] = {"error": traceback.format_exc()}
        print(results[key]["error"], file=sys.stderr, flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    results[key] |= {"seconds": time.perf_counter() - start,
                     "memory_allocated_GiB_after": torch.cuda.memory_allocated() / 2 ** 30}
    save()


def summarize(found: dict) -> None:
    """Kiln/transformers ratios at each concurrency, and the profile's top three costs."""
    peer = {p["concurrency"]: p for p in found.get("transformers", {}).get("result", {}).get("points", [])}
    ratios = []
    for key in ("engine_graphs", "engine_eager"):
        for p in found.get(key, {}).get("result", []):
            if p["concurrency"] in peer:
                hf = peer[p["concurrency"]]
                ratios.append(dict(concurrency=p["concurrency"], cuda_graphs=p["cuda_graphs"],
                                   decode_x=p["decode_tokens_per_s"] / hf["decode_tokens_per_s"],
                                   end_to_end_x=p["output_tokens_per_s"] / hf["output_tokens_per_s"]))
                print(f"kiln {'graphs' if p['cuda_graphs'] else 'eager '} / transformers c={p['concurrency']:3d}: "
                      f"decode {ratios[-1]['decode_x']:5.2f}x, end to end {ratios[-1]['end_to_end_x']:5.2f}x")
    found["kiln_over_transformers"] = ratios
    kernels = found.get("profile", {}).get("result", {}).get("kernels", [])
    found["top_costs"] = kernels[:3]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["8b"])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--graphs", nargs="+", choices=["on", "off"], default=["on", "off"],
                        help="CUDA graphs for the model and engine sections (engine: enforce_eager=False/True)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64], help="model section")
    parser.add_argument("--context", type=int, default=1024, help="model and profile: tokens cached per sequence")
    parser.add_argument("--steps", type=int, default=64, help="model: timed decode steps per point")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64], help="engine: sequences at once")
    parser.add_argument("--hf-concurrency", nargs="+", type=int, default=[1, 16, 64], help="transformers")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128, help="decode tokens timed after the first")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/gpu-engine-<gpu>.json)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    sizes = args.batch_sizes + args.concurrency + args.hf_concurrency
    if min(sizes) < 1 or min(args.context, args.steps, args.prompt_len, args.new_tokens) < 1:
        parser.error("batch sizes, concurrencies, --context, --steps, --prompt-len and --new-tokens must be positive")
    require_cuda("bench/gpu_engine.py")
    torch.manual_seed(0)
    peaks = measure_peaks(DTYPES[args.dtype])
    bw = peaks["copy_GBps"] * 1e9
    print(f"copy bandwidth {peaks['copy_GBps']:.0f} GB/s")
    itemsize = DTYPES[args.dtype].itemsize
    payload: dict[str, Any] = {"machine": machine(), "dtype": args.dtype, "peaks": peaks,
                               "workload": vars(args) | {"out": str(args.out)}}
    modes = [mode == "on" for mode in args.graphs]

    def save() -> None:
        write_results(args.out, "gpu-engine", payload)

    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.models:
            found = payload[shape] = {"weight_bytes": weight_bytes(shape, itemsize),
                                      "kv_bytes_per_token": kv_bytes_per_token(shape, itemsize)}
            folder = Path(tmp) / shape
            sections: list[tuple[str, Callable[[], Any]]] = []
            if "model" in args.sections:
                sections += [(f"model_{'graphs' if g else 'eager'}", lambda g=g: model_points(args, shape, g, bw))
                             for g in modes]
            if "profile" in args.sections:  # before the long sections: a timeout keeps it
                sections.append(("profile", lambda: profile_step(args, shape)))
            if "engine" in args.sections:
                sections += [(f"engine_{'graphs' if g else 'eager'}",
                              lambda g=g: engine_points(args, shape, g, folder, bw)) for g in modes]
            if "transformers" in args.sections:
                sections.append(("transformers", lambda: transformers_points(args, shape)))
            for key, fn in sections:
                run_section(found, key, fn, save)
            summarize(found)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
