"""GPU kernel benchmark: each Triton kernel against its torch reference and a torch peer.

Each op is timed twice (gpu_common): eagerly (do_bench medians: small kernels there mostly
show the host's launch cost) and under a CUDA graph over copies of its inputs spanning 4x the
L2 (device time, reads from HBM), as decode runs in the engine. The machine's ceilings (copy
bandwidth, matmul FLOP/s) are measured in the same run; each kernel reports achieved GB/s
(bytes it must move / graph time) and TFLOP/s against them; speedups compare graph times. Peers: torch SDPA (flash / memory-efficient) on the
same K/V made contiguous for attention, cuBLAS on 16-bit weights for the quantized GEMMs,
F.rms_norm for the norm. The run ends with the issue's goals (GOALS), each met or not.
Needs CUDA; exits 2 without it.

    python bench/kernels.py [--dtype bfloat16] [--quick] [--kernels KERNEL ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from gpu_common import DTYPES, copies_for, graph_ms, machine, measure_peaks, median_ms, require_cuda, write_results


@dataclass
class Case:
    kernel: str
    shape: dict
    bytes: int  # the least memory traffic the op needs
    flops: int
    make: Callable[[], dict[str, Callable[[], object]]]  # fresh inputs -> the impls over them, "triton" first
    graphed: tuple[str, ...] = ("triton",)  # impls also timed under a CUDA graph (those that never sync)

    @cached_property
    def impls(self) -> dict[str, Callable[[], object]]:
        """Made on first use, so that cases left out by --kernels allocate nothing."""
        return self.make()

    def input_copies(self) -> list[dict[str, Callable[[], object]]]:
        """The impls over copies of the inputs spanning 4x the L2 (gpu_common.copies_for), the
        first this case's own: what graph_ms cycles through so that every call reads HBM."""
        return [self.impls] + [self.make() for _ in range(copies_for(self.bytes) - 1)]


def paged_kv(batch: int, ctx: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
             block_size: int = 16) -> dict:
    """A randomly scattered paged cache holding `ctx` tokens for each of `batch` sequences."""
    blocks = -(-ctx // block_size)
    tables = torch.randperm(batch * blocks, device=device).view(batch, blocks).int()
    shape = (batch * blocks, block_size, num_kv_heads, head_dim)
    return dict(k_cache=torch.randn(shape, dtype=dtype, device=device),
                v_cache=torch.randn(shape, dtype=dtype, device=device), block_tables=tables)


def attention_args(batch: int, q_len: int, ctx: int, dtype: torch.dtype, device: str,
                   heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> dict:
    """paged_attention's arguments: `batch` sequences of `ctx` tokens, the last `q_len` new."""
    kv = paged_kv(batch, ctx, kv_heads, head_dim, dtype, device)
    q = torch.randn(batch * q_len, heads, head_dim, dtype=dtype, device=device)
    return dict(q=q, **kv, cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len,
                seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device), scale=head_dim ** -0.5,
                max_seqlen_q=q_len, max_seqlen_k=ctx)


def attention_case(batch: int, q_len: int, ctx: int, dtype: torch.dtype, device: str,
                   heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> Case:
    from kiln.engine import attention as torch_backend
    from kiln.engine.kernels.paged_attention import default_num_splits, paged_attention
    split = default_num_splits(batch, kv_heads, q_len, ctx, torch.device(device), heads // kv_heads, head_dim) > 1
    peer = q_len == ctx or q_len == 1

    def make() -> dict[str, Callable[[], object]]:
        args = attention_args(batch, q_len, ctx, dtype, device, heads, kv_heads, head_dim)
        impls = {"triton": lambda: paged_attention(**args)}
        if split:
            impls["triton_nosplit"] = lambda: paged_attention(**args, num_splits=1)
        impls["torch_ref"] = lambda: torch_backend.paged_attention(**args)
        if peer:
            # Peer: SDPA over the same K/V gathered contiguous (no paging), causal with the new tokens at the end.
            k, v = (args[name][args["block_tables"].long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
                    for name in ("k_cache", "v_cache"))
            qs = args["q"].view(batch, q_len, heads, head_dim).transpose(1, 2)
            impls["sdpa"] = lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=q_len > 1, enable_gqa=True)
        return impls

    visible = sum(ctx - q_len + i + 1 for i in range(q_len))  # keys each query sees, causal
    item = dtype.itemsize
    return Case("paged_attention", {"batch": batch, "q_len": q_len, "ctx": ctx, "heads": heads,
                                    "kv_heads": kv_heads, "head_dim": head_dim},
                bytes=2 * batch * ctx * kv_heads * head_dim * item + 2 * batch * q_len * heads * head_dim * item,
                flops=4 * batch * visible * heads * head_dim, make=make,
                graphed=("triton",) + (("triton_nosplit",) if split else ()) + (("sdpa",) if peer else ()))


def kv_store_case(tokens: int, dtype: torch.dtype, device: str, kv_heads: int = 8, head_dim: int = 128) -> Case:
    from kiln.engine import attention as torch_backend
    from kiln.engine.kernels.kv_store import store_kvcache

    def make() -> dict[str, Callable[[], object]]:
        kv = paged_kv(1, tokens, kv_heads, head_dim, dtype, device)
        k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device)
        args = (k, torch.randn_like(k), kv["k_cache"], kv["v_cache"], torch.randperm(tokens, device=device))
        return {"triton": lambda: store_kvcache(*args), "torch_ref": lambda: torch_backend.store_kvcache(*args)}

    return Case("store_kvcache", {"tokens": tokens, "kv_heads": kv_heads, "head_dim": head_dim},
                bytes=4 * tokens * kv_heads * head_dim * dtype.itemsize, flops=0, make=make)


def rms_norm_case(tokens: int, hidden: int, dtype: torch.dtype, device: str) -> Case:
    from kiln.engine.kernels.norm_rope import rms_norm, rms_norm_ref

    def make() -> dict[str, Callable[[], object]]:
        x, res = (torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(2))
        w = torch.randn(hidden, dtype=dtype, device=device)
        return {"triton": lambda: rms_norm(x, w, 1e-5, res), "torch_ref": lambda: rms_norm_ref(x, w, 1e-5, res),
                "F.rms_norm": lambda: F.rms_norm(x + res, (hidden,), w, 1e-5)}

    return Case("rms_norm+residual", {"tokens": tokens, "hidden": hidden},
                bytes=4 * tokens * hidden * dtype.itemsize, flops=0, make=make, graphed=("triton", "F.rms_norm"))


def rope_case(tokens: int, dtype: torch.dtype, device: str, heads: int = 32, kv_heads: int = 8,
              head_dim: int = 128) -> Case:
    """RoPE alone; beside it, the engine's fused RoPE + K/V store and the two kernels it replaces."""
    from kiln.engine.kernels.kv_store import store_kvcache
    from kiln.engine.kernels.norm_rope import cos_sin_cache, rope, rope_ref, rope_store

    def make() -> dict[str, Callable[[], object]]:
        inv_freq = 1.0 / 500000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
        cache = cos_sin_cache(inv_freq, 8192)
        pos = torch.randint(0, 8192, (tokens,), device=device)
        q = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
        kv = paged_kv(1, tokens, kv_heads, head_dim, dtype, device)
        slots = torch.randperm(tokens, device=device)

        def rope_then_store() -> None:
            q_out, k_out = rope(pos, q, k, cache)
            store_kvcache(k_out, v, kv["k_cache"], kv["v_cache"], slots)

        return {"triton": lambda: rope(pos, q, k, cache), "torch_ref": lambda: rope_ref(pos, q, k, cache),
                "triton_rope_store": lambda: rope_store(pos, q, k, v, cache, kv["k_cache"], kv["v_cache"], slots),
                "triton_rope_then_store": rope_then_store}

    return Case("rope", {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim},
                bytes=2 * tokens * (heads + kv_heads) * head_dim * dtype.itemsize + tokens * head_dim * 4, flops=0,
                make=make, graphed=("triton", "triton_rope_store", "triton_rope_then_store"))


def silu_mul_case(tokens: int, inter: int, dtype: torch.dtype, device: str) -> Case:
    """The MLP's activation: one kernel vs torch's silu then mul."""
    from kiln.engine.kernels.activation import silu_mul, silu_mul_ref

    def make() -> dict[str, Callable[[], object]]:
        gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
        return {"triton": lambda: silu_mul(gate_up), "torch": lambda: silu_mul_ref(gate_up)}

    return Case("silu_mul", {"tokens": tokens, "intermediate": inter}, bytes=3 * tokens * inter * dtype.itemsize,
                flops=0, make=make, graphed=("triton", "torch"))


def gemm_case(bits: int, m: int, n: int, k: int, dtype: torch.dtype, device: str, group_size: int = 128) -> Case:
    from kiln.engine.kernels import quant_gemm as qg

    def make() -> dict[str, Callable[[], object]]:
        w = torch.randn(n, k, dtype=dtype, device=device) * 0.02
        x = torch.randn(m, k, dtype=dtype, device=device)
        if bits == 8:
            args: tuple = (x, *qg.quantize_w8(w))
            kernel, ref = qg.w8a16_gemm, qg.w8a16_gemm_ref
        else:
            args = (x, *qg.quantize_w4(w, group_size), group_size)
            kernel, ref = qg.w4a16_gemm, qg.w4a16_gemm_ref
        return {"triton": lambda: kernel(*args), "torch_ref": lambda: ref(*args), "cublas_16bit": lambda: F.linear(x, w)}

    scale_bytes = n * dtype.itemsize if bits == 8 else n * k // group_size * (dtype.itemsize + 1)
    return Case(f"w{bits}a16_gemm", {"m": m, "n": n, "k": k, **({"group": group_size} if bits == 4 else {})},
                bytes=n * k * bits // 8 + scale_bytes + (m * k + m * n) * dtype.itemsize, flops=2 * m * n * k,
                make=make, graphed=("triton", "cublas_16bit"))


def gemv_case(n: int, k: int, dtype: torch.dtype, device: str) -> Case:
    """Batch-1 decode's GEMM on 16-bit weights: Kiln's GEMV kernel (its tuned config, else the defaults)
    vs cuBLAS; "linear" is what the engine calls (the kernel where tuned, else cuBLAS)."""
    from kiln.engine.kernels import quant_gemm as qg, tuned

    def make() -> dict[str, Callable[[], object]]:
        w = torch.randn(n, k, dtype=dtype, device=device) * 0.02
        x = torch.randn(1, k, dtype=dtype, device=device)
        return {"triton": lambda: qg.gemv(x, w, tuned.lookup("gemv", f"n{n}-k{k}", w.device)),
                "cublas_16bit": lambda: F.linear(x, w), "linear": lambda: qg.linear(x, w)}

    return Case("gemv_16bit", {"m": 1, "n": n, "k": k}, bytes=(n * k + k + n) * dtype.itemsize, flops=2 * n * k,
                make=make, graphed=("triton", "cublas_16bit"))


KERNELS = ["paged_attention", "store_kvcache", "rope", "silu_mul", "rms_norm+residual", "w8a16_gemm", "w4a16_gemm",
           "gemv_16bit"]  # each Case's kernel name, for --kernels
GEMM_SHAPES = [(4096, 14336), (14336, 4096), (4096, 4096)]  # (N, K): Llama-3-8B's down, up/gate, o
# (N, K) of Llama-3-8B's batch-1 decode GEMMs as Kiln fuses them: qkv, o, gate_up, down, lm_head
GEMV_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def cases(dtype: torch.dtype, quick: bool, device: str = "cuda") -> Iterator[Case]:
    """Built lazily: each case's tensors are freed before the next is made. Decode at batch 64
    (the bandwidth goal; 16k contexts hold 4.3 GB of bf16 K/V) and batch 1 (split-KV)."""
    for ctx in [4096] if quick else [1024, 4096, 16384]:
        yield attention_case(64, 1, ctx, dtype, device)
    for ctx in [4096] if quick else [1024, 16384]:
        yield attention_case(1, 1, ctx, dtype, device)
    yield attention_case(4, 1024, 1024, dtype, device)  # fresh prefill
    yield attention_case(4, 512, 2048, dtype, device)  # chunked prefill over a cached prefix
    for t in (64, 4096):
        yield kv_store_case(t, dtype, device)
        yield rope_case(t, dtype, device)
        yield silu_mul_case(t, 14336, dtype, device)
    for t in [4096] if quick else [4096, 16384]:
        yield rms_norm_case(t, 4096, dtype, device)
    for bits in (8, 4):
        for m in (1, 16) if quick else (1, 16, 64, 256):
            for n, k in GEMM_SHAPES[:1] if quick else GEMM_SHAPES:
                yield gemm_case(bits, m, n, k, dtype, device)
    for n, k in GEMV_SHAPES[:2] if quick else GEMV_SHAPES:
        yield gemv_case(n, k, dtype, device)


def measure(case: Case, peaks: dict[str, float]) -> dict:
    """Eager do_bench times for every impl; graph times (no launch cost, inputs rotated past the L2)
    for the graphed ones. Rates and speedups use the graph times: decode runs under CUDA graphs."""
    eager = {name: median_ms(fn) for name, fn in case.impls.items()}
    sets = case.input_copies()
    graphed: dict[str, float] = {}
    for name in case.graphed:
        try:
            graphed[name] = graph_ms([impls[name] for impls in sets])
        except Exception as error:  # a failed capture loses one figure, not the run
            print(f"  {case.kernel} {case.shape} {name}: no graph time ({str(error)[:200]})")
    del sets
    times = graphed if "triton" in graphed else eager  # rates from graph times where there are some
    ms = times["triton"]
    gbps, tflops = case.bytes / ms / 1e6, case.flops / ms / 1e9
    return {"kernel": case.kernel, "shape": case.shape, "ms": eager, "graph_ms": graphed, "bytes": case.bytes,
            "flops": case.flops, "GBps": gbps, "TFLOPs": tflops, "pct_copy_bw": 100 * gbps / peaks["copy_GBps"],
            "pct_matmul": 100 * tflops / peaks["matmul_TFLOPs"], "timed": "graph" if times is graphed else "eager",
            "speedup": {name: t / ms for name, t in times.items() if name != "triton"},
            "eager_speedup": {name: t / eager["triton"] for name, t in eager.items() if name != "triton"}}


# The goals: (title, kernel, shape filter, value of a result, target).
GOALS = [
    ("decode attention batch 64: % of copy bandwidth", "paged_attention",
     lambda s: s["batch"] == 64 and s["q_len"] == 1, lambda r: r["pct_copy_bw"], 70),
    ("fused add+RMSNorm: % of copy bandwidth", "rms_norm+residual", lambda s: True, lambda r: r["pct_copy_bw"], 80),
    ("W4A16 M=1: speedup vs cuBLAS bf16", "w4a16_gemm", lambda s: s["m"] == 1,
     lambda r: r["speedup"].get("cublas_16bit"), 2.5),  # None if cuBLAS's capture failed
]


def goals(results: list[dict]) -> list[dict]:
    """Each goal's rows that have a value (a peer whose capture failed leaves none: the run goes on)."""
    found = [(title, r["shape"], value(r), target) for title, kernel, wanted, value, target in GOALS
             for r in results if r["kernel"] == kernel and wanted(r["shape"])]
    return [{"goal": title, "shape": shape, "value": round(v, 3), "target": target, "met": v >= target}
            for title, shape, v, target in found if v is not None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="activation dtype")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/kernels-<gpu>.json)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, metavar="KERNEL",
                        help=f"only these kernels' cases (of {', '.join(KERNELS)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    require_cuda("bench/kernels.py")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    peaks = measure_peaks(dtype)
    print(f"peaks: copy {peaks['copy_GBps']:.0f} GB/s, {args.dtype} matmul {peaks['matmul_TFLOPs']:.0f} TFLOP/s")
    results = []
    with torch.inference_mode():
        for case in cases(dtype, args.quick):
            if args.kernels and case.kernel not in args.kernels:
                continue
            r = measure(case, peaks)
            results.append(r)
            others = " ".join(f"{name} x{s:.2f}" for name, s in r["speedup"].items())
            print(f"{case.kernel:18s} {str(case.shape):70s} {r['graph_ms'].get('triton', math.nan):8.4f} ms "
                  f"(eager {r['ms']['triton']:8.4f}) {r['GBps']:7.0f} GB/s "
                  f"({r['pct_copy_bw']:3.0f}%) {r['TFLOPs']:6.1f} TFLOP/s ({r['pct_matmul']:3.0f}%)  "
                  f"triton is faster than: {others}")
            del case
            torch.cuda.empty_cache()
    met = goals(results)
    print("goals:")
    for g in met:
        print(f"  {'met    ' if g['met'] else 'NOT met'} {g['goal']} {g['shape']}: {g['value']:.2f} (goal {g['target']})")
    write_results(args.out, "kernels", {"machine": machine(), "dtype": args.dtype, "peaks": peaks,
                                        "note": "ms: eager do_bench medians; graph_ms: device time per call under a CUDA graph over "
                                                "input copies spanning 4x the L2. speedup = peer graph_ms / triton "
                                                "graph_ms (eager_speedup from ms); GB/s from the bytes the op must "
                                                "move over graph_ms",
                                        "results": results, "goals": met})
    return 0


if __name__ == "__main__":
    sys.exit(main())
