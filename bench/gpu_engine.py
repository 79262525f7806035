"""GPU decode throughput of Llama-shaped models with random weights, against the bandwidth bound.

Each decode step reads every weight once plus each sequence's KV, so a step takes at least
(weight bytes + KV bytes) / copy bandwidth; the bandwidth is measured in the same run.
A step here is what the engine's model runner does on a decode batch: Kiln's model forward
(Triton attention over the paged cache), the logits of every row, greedy argmax. Batch
metadata is advanced on the GPU, so scheduling and host work are left out: this is the
model's ceiling, not a serving figure. With --cuda-graphs (default) the forward replays a
captured graph (kiln.engine.kernels.cuda_graphs). Speed does not depend on weight values.
Needs CUDA; exits 2 without it.

    python bench/gpu_engine.py [--models 1b 8b] [--batch-sizes 1 16 64] [--context 1024]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from gpu_common import DTYPES, machine, measure_peaks, require_cuda, write_results

BLOCK_SIZE = 16
# Llama 3.2 1B and Llama 3.1 8B shapes.
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def build_model(shape: str, dtype: torch.dtype, device: str, max_positions: int, backend: str = "triton"):
    from kiln.engine.config import ModelConfig
    from kiln.engine.llama import LlamaForCausalLM
    from kiln.engine.loader import default_dtype
    cfg = ModelConfig(vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                      max_position_embeddings=max_positions, attention_bias=False, bos_token_id=None,
                      **SHAPES[shape])
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(cfg, max_positions, attention_backend=backend).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return model, cfg


def weight_bytes_per_step(model, cfg) -> int:
    """Every parameter is read once, except an untied embedding table (only B rows are)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        total -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return total


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
        self.max_len, self.max_blocks = context + steps + 1, blocks
        self.kv_bytes_per_token = 2 * len(layers) * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
        self.host_len = context  # the longest context, tracked without a device sync

    def context(self):
        from kiln.engine.context import Context
        pos = self.seq_lens.long()
        slots = self.tables.gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1).long() * BLOCK_SIZE + pos % BLOCK_SIZE
        return pos, Context(cu_seqlens_q=self.cu, seq_lens=self.seq_lens + 1, max_seqlen_q=1,
                            max_seqlen_k=self.host_len + 1, slot_mapping=slots, block_tables=self.tables)

    def advance(self, next_ids: torch.Tensor) -> None:
        self.ids, self.seq_lens, self.host_len = next_ids, self.seq_lens + 1, self.host_len + 1


def run_decode(model, cfg, batch: int, context: int, steps: int, dtype: torch.dtype, device: str,
               graphs: bool) -> dict:
    from kiln.engine.context import reset_context, set_context
    from kiln.engine.kernels.cuda_graphs import DecodeGraphs
    state = DecodeBatch(model, cfg, batch, context, steps + 3, dtype, device)
    runner = None
    if graphs:
        runner = DecodeGraphs(model.forward, [batch], state.max_blocks, state.max_len, device)
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

    with torch.inference_mode():
        for _ in range(3):  # warm-up: kernel compilation, allocator
            step()
        torch.cuda.synchronize()
        kv_tokens = batch * (state.host_len + 1 + state.host_len + steps) / 2  # mean context over the run
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - start) / steps
    return {"step_ms": step_s * 1e3, "tokens_per_s": batch / step_s, "mean_kv_bytes": kv_tokens * state.kv_bytes_per_token}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["1b", "8b"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=1024, help="tokens already cached per sequence")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per point")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/gpu-engine-<gpu>.json)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.context < 1 or args.steps < 1:
        parser.error("batch sizes, --context and --steps must be positive")
    require_cuda("bench/gpu_engine.py")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    peaks = measure_peaks(dtype)
    bw = peaks["copy_GBps"] * 1e9
    print(f"copy bandwidth {peaks['copy_GBps']:.0f} GB/s")
    results = []
    for shape in args.models:
        model, cfg = build_model(shape, dtype, "cuda", args.context + args.steps + 8)
        weights = weight_bytes_per_step(model, cfg)
        for batch in args.batch_sizes:
            r = run_decode(model, cfg, batch, args.context, args.steps, dtype, "cuda", args.cuda_graphs)
            bound_s = (weights + r["mean_kv_bytes"]) / bw
            r.update(model=shape, batch=batch, context=args.context, weight_bytes=weights,
                     bound_tokens_per_s=batch / bound_s, pct_of_bound=100 * bound_s * 1e3 / r["step_ms"],
                     cuda_graphs=args.cuda_graphs)
            results.append(r)
            print(f"{shape} batch {batch:3d}: {r['step_ms']:7.2f} ms/step {r['tokens_per_s']:9.0f} tok/s "
                  f"(bound {r['bound_tokens_per_s']:9.0f} tok/s, {r['pct_of_bound']:3.0f}% of it)")
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    write_results(args.out, "gpu-engine", {"machine": machine(), "dtype": args.dtype, "peaks": peaks,
                                           "workload": vars(args) | {"out": str(args.out)}, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
